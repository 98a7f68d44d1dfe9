//! One enum of every store operation and one of every answer, so that a store can be a small
//! trait with one method, and the memory and sqlite stores can apply commands to a [`Ledger`]
//! without knowing them one by one.

use crate::ledger::{
    Adjustment, Applied, Counter, CounterKey, Heartbeat, IdempotencyKey, Ledger, LedgerError,
    Refusal, Reservation, ReservationId, ReservationState, Resolution, Resolved, RunAdmitted,
    RunEnded, RunId, RunRequest, SessionGrant, StepRequest, StepReserved, Summary, UsageLine,
};
use crate::replicas::ReplicaSeen;
use crate::scope::{IpScope, Policy, ScopeKey, ScopeKind};
use crate::window::UnixMs;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    AdmitRun {
        req: RunRequest,
        idem: Option<IdempotencyKey>,
    },
    ReserveStep {
        req: StepRequest,
        idem: Option<IdempotencyKey>,
    },
    Resolve {
        step: ReservationId,
        how: Resolution,
    },
    Heartbeat {
        run: RunId,
    },
    Finish {
        run: RunId,
    },
    /// With `dry`, only asks: would a creation be admitted now, and under pressure? Nothing
    /// is applied (what a creation that follows must do is decided on that answer: refuse
    /// early, or ask for a challenge, before a challenge is spent).
    CreateSession {
        ips: Vec<IpScope>,
        dry: bool,
    },
    Usage {
        scopes: Vec<(ScopeKey, u64)>,
    },
    SetCutoff {
        engaged: bool,
        reason: String,
    },
    Adjust {
        scope: ScopeKey,
        /// The scope's limit factor (an address prefix wider than the configured one is
        /// limited at this multiple; 1 otherwise), as in [`Command::Usage`].
        factor: u64,
        amount: i64,
        /// A key that makes the adjustment apply once (an operator's retry after a timeout
        /// repeats, never doubles it), remembered for [`ADJUSTMENT_KEY_TTL_MS`].
        ///
        /// [`ADJUSTMENT_KEY_TTL_MS`]: crate::ADJUSTMENT_KEY_TTL_MS
        once: Option<String>,
    },
    Summary,
    Reservations {
        state: Option<ReservationState>,
        limit: usize,
    },
    TopCounters {
        kind: Option<ScopeKind>,
        top: usize,
    },
    /// Marks `key` used for `ttl_ms`; answers whether this call was the first (single-use
    /// tokens such as solved challenges).
    ConsumeOnce {
        key: String,
        ttl_ms: u64,
    },
    Sweep,
    /// Publishes this replica's policy fingerprint, seen now (the store's clock), and
    /// answers every live replica's ([`crate::replicas`]). Not part of the ledger: it
    /// changes no record and no `ledger_seq`.
    Announce {
        replica: String,
        fingerprint: String,
    },
    /// Every live replica and its policy fingerprint.
    Replicas,
}

impl Command {
    /// Whether the answer must be durable before it is given: anything that lets paid work
    /// start or changes limits. Resolutions and lease renewals may be answered before they
    /// are durable: losing one only errs towards charging more (the hold expires and is
    /// charged in full).
    pub fn needs_durability(&self) -> bool {
        matches!(
            self,
            Command::AdmitRun { .. }
                | Command::ReserveStep { .. }
                | Command::CreateSession { dry: false, .. }
                | Command::SetCutoff { .. }
                | Command::Adjust { .. }
                | Command::ConsumeOnce { .. }
        )
    }

    /// Whether the answer `reply` (to a command that does not need durability itself) must
    /// still be durable before it is given: a commit above its reservation (an overrun).
    /// Losing it would charge only the reserved amount, less than the usage the caller was
    /// told was charged, and reopen a scope the overrun closed. A repeat of it too (a
    /// client's retry): its answer must not leave before the first commit is on disk, which
    /// a store that writes behind its answers may not have done yet.
    pub fn reply_needs_durability(reply: &Reply) -> bool {
        matches!(reply, Reply::Resolved(a) if a.value.overrun)
    }

    /// Whether the command only reads.
    pub fn is_read(&self) -> bool {
        matches!(
            self,
            Command::Usage { .. }
                | Command::Summary
                | Command::Reservations { .. }
                | Command::TopCounters { .. }
                | Command::Replicas
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Run(Applied<Result<RunAdmitted, Refusal>>),
    Step(Applied<Result<StepReserved, Refusal>>),
    Resolved(Applied<Resolved>),
    Heartbeat(Applied<Heartbeat>),
    Finished(Applied<RunEnded>),
    Session(Applied<Result<SessionGrant, Refusal>>),
    Usage(Vec<UsageLine>),
    Cutoff(Applied<bool>),
    Adjusted(Applied<Adjustment>),
    Summary(Summary),
    Reservations(Vec<Reservation>),
    TopCounters(Vec<(CounterKey, Counter)>),
    Swept(Applied<usize>),
    Consumed(Applied<bool>),
    /// Live replicas, by id.
    Replicas(Vec<ReplicaSeen>),
}

impl Ledger {
    /// Applies one command at `now`.
    pub fn apply(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        cmd: &Command,
    ) -> Result<Reply, LedgerError> {
        Ok(match cmd {
            Command::AdmitRun { req, idem } => {
                Reply::Run(self.admit_run(policy, now, req, idem.as_ref())?)
            }
            Command::ReserveStep { req, idem } => {
                Reply::Step(self.reserve_step(policy, now, req, idem.as_ref())?)
            }
            Command::Resolve { step, how } => {
                Reply::Resolved(self.resolve(policy, now, step, *how)?)
            }
            Command::Heartbeat { run } => Reply::Heartbeat(self.heartbeat(policy, now, run)?),
            Command::Finish { run } => Reply::Finished(self.finish(policy, now, run)?),
            Command::CreateSession { ips, dry } => {
                Reply::Session(self.create_session(policy, now, ips, *dry)?)
            }
            Command::Usage { scopes } => Reply::Usage(self.usage(policy, now, scopes)),
            Command::SetCutoff { engaged, reason } => {
                Reply::Cutoff(self.set_cutoff(now, *engaged, reason))
            }
            Command::Adjust {
                scope,
                factor,
                amount,
                once,
            } => Reply::Adjusted(self.adjust(
                policy,
                now,
                scope,
                *factor,
                *amount,
                once.as_deref(),
            )?),
            Command::Summary => Reply::Summary(self.summary(now)),
            Command::Reservations { state, limit } => {
                Reply::Reservations(self.reservations(*state, *limit))
            }
            Command::TopCounters { kind, top } => {
                Reply::TopCounters(self.top_counters(*kind, *top))
            }
            Command::Sweep => Reply::Swept(self.sweep(now)),
            Command::ConsumeOnce { key, ttl_ms } => {
                Reply::Consumed(self.consume_once(now, key, *ttl_ms)?)
            }
            Command::Announce {
                replica,
                fingerprint,
            } => Reply::Replicas(self.announce(now, replica, fingerprint)?),
            Command::Replicas => Reply::Replicas(self.replicas_live(now)),
        })
    }
}
