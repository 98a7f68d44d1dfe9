//! The ledger: every budget counter, rate state, concurrency slot, run and reservation, and
//! the operations that change them. Pure: every operation takes `now` from the caller (the
//! store's clock) and either applies completely or changes nothing.
//!
//! The memory and sqlite stores hold one `Ledger` each; the Redis store implements the same
//! operations as server-side scripts and is held to the same answers by the conformance suite.

use crate::admission::{BudgetRefusal, BudgetView, Shortfall};
use crate::money::{Micros, ModelPrice, TokenUsage, ToolPrice, MICROS_MAX};
use crate::scope::{IpScope, Policy, ReservationMode, RunBounds, ScopeKey, ScopeKind, ScopePolicy};
use crate::window::{UnixMs, Window, WindowId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::collections::HashMap as StdHashMap;

/// The ledger's maps hash with foldhash: several times faster than SipHash on these short
/// keys. Some keys hold client-chosen text (a conversation id from the operator's backend,
/// an address prefix), so flooding one bucket would slow the applier (never admit more:
/// every call past `store.timeout_ms` is refused). foldhash is "minimally DoS-resistant":
/// its seed is random per process and per map, and colliding keys cannot be computed
/// without it; no answer shows a hash value or a map's iteration order.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// How long an adjustment's key (`Command::Adjust { once }`) is remembered.
pub const ADJUSTMENT_KEY_TTL_MS: u64 = 86_400_000;

/// What a refusal says while the spending cutoff is engaged (the reason is the operator's).
pub const CUTOFF_MESSAGE: &str = "spending is paused by the operator; nothing new is admitted";

/// Terminal records (finished runs and their reservations) are kept this long after the run
/// ends, so that a retried commit, release or finish still gets its first answer. Short on
/// purpose: at 20,000 steps/s a minute of records is already over a million; a retry later
/// than this gets `not_found`, never a second charge.
pub const RECORD_RETENTION_MS: u64 = 60_000;
/// Idempotency keys are remembered at least this long (and at least one lease TTL, as the
/// SPEC requires).
pub const IDEMPOTENCY_RETENTION_MS: u64 = 120_000;
/// Upper bound on runs plus reservations plus idempotency records held at once. Past it,
/// nothing new is admitted (the store answers as unavailable): memory is a budget too.
pub const LEDGER_RECORDS_MAX: usize = 2_000_000;
/// Longest id (run, step, session, conversation, address prefix, idempotency key) accepted.
pub const ID_BYTES_MAX: usize = 128;
/// `Retry-After` for a lifetime budget, which never resets.
pub const LIFETIME_RETRY_AFTER_S: u64 = 86_400;
/// `Retry-After` of a budget refused only by the holds of calls in flight (`budget_held`):
/// used spend alone would admit the call. A counter does not know when its holds end (each
/// ends with its own call, at the latest when its run's lease runs out, `store.lease_ttl_s`,
/// at least 1 s), and most end within one upstream call; so the shortest wait the header can
/// say, never longer than a lease. A retry refused again costs one store call and no rate
/// quota (a refused admission does not move the rate's state).
pub const HELD_RETRY_AFTER_S: u64 = 1;
/// Idle rate state and counters of long-ended windows are dropped at most this often.
pub const COMPACT_EVERY_MS: u64 = 30_000;
/// Expired timers processed by one call; the rest wait for the next call or the sweeper.
pub const EXPIRIES_PER_CALL_MAX: usize = 256;
/// Expired timers processed by one sweep at most: a backlog (after a long downtime, up to
/// [`LEDGER_RECORDS_MAX`]) is worked off over several sweeps instead of stalling the store's
/// writer on one. Until then the held amounts stay counted (conservative).
pub const SWEEP_EXPIRIES_MAX: usize = 8192;
/// Address prefixes one request is limited by at most (the client's prefix and the wider
/// IPv6 ones); `ledger.lua` holds the same bound.
pub const IP_SCOPES_MAX: usize = 4;
const _: () = assert!(
    IP_SCOPES_MAX == 4,
    "the refusal's text and ledger.lua say four"
);

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RunId(pub String);

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReservationId(pub String);

/// The counter of one scope in one window.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CounterKey {
    pub scope: ScopeKey,
    pub window: WindowId,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    /// The limit in force the last time this counter was touched.
    pub limit: Micros,
    pub used: Micros,
    pub reserved: Micros,
    /// Observed usage went above the limit: nothing more is admitted in this window.
    pub overrun: bool,
    /// Net operator adjustments (micros, signed), for reconciliation.
    pub adjusted: i64,
}

impl Counter {
    /// Room left for new holds; zero once overrun.
    pub fn remaining(&self) -> Micros {
        if self.overrun {
            return Micros::ZERO;
        }
        self.limit
            .saturating_sub(self.used)
            .saturating_sub(self.reserved)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationState {
    Held,
    Committed,
    Released,
    Unknown,
    Expired,
}

impl ReservationState {
    pub fn name(self) -> &'static str {
        match self {
            ReservationState::Held => "held",
            ReservationState::Committed => "committed",
            ReservationState::Released => "released",
            ReservationState::Unknown => "unknown",
            ReservationState::Expired => "expired",
        }
    }
    pub fn parse(s: &str) -> Option<ReservationState> {
        Some(match s {
            "held" => ReservationState::Held,
            "committed" => ReservationState::Committed,
            "released" => ReservationState::Released,
            "unknown" => ReservationState::Unknown,
            "expired" => ReservationState::Expired,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationKind {
    Model {
        model: String,
        price: ModelPrice,
        retry: bool,
    },
    Tool {
        tool: String,
        price: ToolPrice,
        units: u64,
    },
    /// The whole-run hold of `whole_run` mode.
    RunHold,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub id: ReservationId,
    pub run_id: RunId,
    pub kind: ReservationKind,
    pub amount: Micros,
    pub counters: Vec<CounterKey>,
    pub state: ReservationState,
    pub charged: Micros,
    pub created: UnixMs,
    pub resolved_at: Option<UnixMs>,
    pub max_output_tokens: Option<u64>,
    pub overrun: bool,
    /// Committed with a tool result above its run's `max_tool_result_bytes` (kept so that a
    /// repeated commit answers what the first one did).
    pub result_too_large: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Active,
    Finished,
    Expired,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    pub id: RunId,
    pub session: String,
    pub conversation: String,
    pub ips: Vec<IpScope>,
    pub created: UnixMs,
    pub deadline: UnixMs,
    pub lease_until: UnixMs,
    pub rounds: u32,
    pub tool_calls: u32,
    pub retries: u32,
    pub state: RunState,
    pub ended_at: Option<UnixMs>,
    /// Concurrency slots held while active.
    pub slots: Vec<ScopeKey>,
    pub hold: Option<ReservationId>,
    pub bounds: RunBounds,
    pub mode: ReservationMode,
}

impl Run {
    fn scope_keys(&self) -> Vec<(ScopeKey, u64)> {
        run_scopes(&self.session, &self.ips, &self.conversation)
    }
    fn counter_key(&self) -> CounterKey {
        CounterKey {
            scope: ScopeKey::new(ScopeKind::Run, self.id.0.clone()),
            window: Window::Lifetime.at(UnixMs(0)),
        }
    }
}

fn run_scopes(session: &str, ips: &[IpScope], conversation: &str) -> Vec<(ScopeKey, u64)> {
    let mut v = Vec::with_capacity(3 + ips.len());
    v.push((ScopeKey::global(), 1));
    for ip in ips {
        v.push((
            ScopeKey::new(ScopeKind::Ip, ip.prefix.clone()),
            ip.factor.max(1),
        ));
    }
    v.push((ScopeKey::new(ScopeKind::Session, session), 1));
    v.push((ScopeKey::new(ScopeKind::Conversation, conversation), 1));
    v
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCode {
    RateLimited,
    ConcurrencyLimited,
    BudgetExhausted,
    RunBoundExceeded,
    PayloadTooLarge,
    ContextTooLarge,
    CutoffEngaged,
    /// Used spend alone would admit the call; the holds of calls in flight refuse it: a
    /// short wait, not a spent budget. (Last: stored refusals name their code by position.)
    BudgetHeld,
}

impl RefusalCode {
    pub fn name(self) -> &'static str {
        match self {
            RefusalCode::RateLimited => "rate_limited",
            RefusalCode::ConcurrencyLimited => "concurrency_limited",
            RefusalCode::BudgetExhausted => "budget_exhausted",
            RefusalCode::RunBoundExceeded => "run_bound_exceeded",
            RefusalCode::PayloadTooLarge => "payload_too_large",
            RefusalCode::ContextTooLarge => "context_too_large",
            RefusalCode::CutoffEngaged => "cutoff_engaged",
            RefusalCode::BudgetHeld => "budget_held",
        }
    }
}

/// A business refusal: a value, not an error. Says which scope refused and when to retry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub code: RefusalCode,
    pub scope: Option<ScopeKind>,
    pub retry_after_s: Option<u64>,
    pub message: String,
}

impl Refusal {
    fn new(code: RefusalCode, scope: Option<ScopeKind>, message: impl Into<String>) -> Refusal {
        Refusal {
            code,
            scope,
            retry_after_s: None,
            message: message.into(),
        }
    }
    fn retry_after(mut self, s: u64) -> Refusal {
        self.retry_after_s = Some(s.max(1));
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("{0} not found")]
    NotFound(String),
    #[error("reservation is already {state:?} (charged {charged}); this transition is refused")]
    Closed {
        state: ReservationState,
        charged: Micros,
    },
    #[error("run is {0:?}")]
    RunClosed(RunState),
    #[error("idempotency key reused with a different request")]
    IdempotencyConflict,
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("ledger is full ({0} records); nothing new is admitted")]
    Full(usize),
}

/// An answer and the ledger sequence number after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied<T> {
    pub value: T,
    /// The ledger's sequence number after this call; it grows with every change.
    pub seq: u64,
    /// Whether this call changed the ledger.
    pub changed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyKey {
    /// Namespaced key (e.g. `run:KEY` or `step:RUN:KEY`).
    pub key: String,
    /// A digest of the request body; a different body under the same key is a conflict.
    pub fingerprint: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRequest {
    pub run_id: RunId,
    pub session: String,
    pub ips: Vec<IpScope>,
    pub conversation: String,
    pub input_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunAdmitted {
    pub run_id: RunId,
    pub deadline: UnixMs,
    pub reserved: Micros,
    pub bounds: RunBounds,
    /// The request-rate scope with the least quota left after this admission (`None` when no
    /// scope of the run has a rate). Computed from the rate state the admission wrote.
    pub rate_left: Option<RateLeft>,
    /// The refusal a limit in dry-run would have given (the first, in the order enforcement
    /// checks: rates, concurrency, budgets); `None` when every limit passed.
    pub dry_run: Option<Refusal>,
}

/// What one request-rate (GCRA) scope has left right after an admission (see [`Rate::left`]).
///
/// Among the run's rate scopes (global, each address prefix, session, conversation) the one
/// with the least `remaining` is reported; on a tie the one with the longer `reset_s`, then
/// the first in that order.
///
/// [`Rate::left`]: crate::rate::Rate::left
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLeft {
    pub scope: ScopeKind,
    /// How many more runs this scope would admit right now (the burst left).
    pub remaining: u64,
    /// Seconds until this scope regains one more unit of quota, rounded up (at least 1).
    pub reset_s: u64,
}

impl RateLeft {
    /// Keeps the tighter of `self` and `other` (less remaining; on a tie the longer reset;
    /// on a full tie `self`).
    fn tighter(self, other: RateLeft) -> RateLeft {
        if (other.remaining, std::cmp::Reverse(other.reset_s))
            < (self.remaining, std::cmp::Reverse(self.reset_s))
        {
            other
        } else {
            self
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepKind {
    Model {
        model: String,
        price: ModelPrice,
        prompt_tokens: u64,
        /// Requested output bound; `None` means "the run's bound".
        max_output_tokens: Option<u64>,
        retry: bool,
    },
    Tool {
        tool: String,
        price: ToolPrice,
        units: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRequest {
    pub run_id: RunId,
    pub step_id: ReservationId,
    pub kind: StepKind,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepReserved {
    pub step_id: ReservationId,
    pub reserved: Micros,
    pub max_output_tokens: Option<u64>,
    /// The output bound was shrunk to fit the remaining budget (`run.shrink_to_fit`).
    pub shrunk: bool,
    /// The refusal a budget in dry-run would have given; `None` when every budget passed.
    pub dry_run: Option<Refusal>,
}

/// What a commit reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Settlement {
    Tokens(TokenUsage),
    /// Units a tool consumed (a charge of per_call + per_unit × units).
    Units(u64),
    /// A tool's result size; the charge is what was reserved.
    ResultBytes(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolved {
    pub state: ReservationState,
    pub charged: Micros,
    pub reserved: Micros,
    pub overrun: bool,
    /// The answer repeats an earlier resolution (idempotent retry).
    pub repeated: bool,
    /// A tool result above `max_tool_result_bytes`: charged, but must not be fed back.
    pub result_too_large: bool,
}

/// What an adjustment answers: the scope's budgets after it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Adjustment {
    pub lines: Vec<UsageLine>,
    /// The key was used before: nothing was applied this time.
    pub repeated: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunEnded {
    pub state: RunState,
    pub charged: Micros,
    pub steps: u32,
    pub repeated: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub lease_until: UnixMs,
    pub deadline: UnixMs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionGrant {
    /// Session creation is busier than half its allowance: adaptive challenges apply.
    pub pressure: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageLine {
    pub scope: ScopeKey,
    pub window: WindowId,
    pub limit: Micros,
    pub used: Micros,
    pub reserved: Micros,
    pub overrun: bool,
    pub resets_at: Option<UnixMs>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub seq: u64,
    pub cutoff: Option<String>,
    pub runs_active: u64,
    pub reservations: StdHashMap<String, u64>,
    pub held_micros: Micros,
    pub charged_micros: Micros,
    pub overruns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IdempotentOutcome {
    Run(Result<RunAdmitted, Refusal>),
    Step(Result<StepReserved, Refusal>),
    /// A single-use token was consumed.
    Used,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    pub key: String,
    pub fingerprint: String,
    pub outcome: IdempotentOutcome,
    pub expires: UnixMs,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Timer {
    Lease(RunId),
    Purge(RunId),
    Idempotency(String),
}

/// A record that changed and must be written by a durable store.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Entity {
    Meta,
    Counter(CounterKey),
    Rate(String),
    Run(RunId),
    Reservation(ReservationId),
    Idempotency(String),
}

/// The durable form of one entity (what a store writes and reads back).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    Meta {
        seq: u64,
        cutoff: Option<String>,
        clock: UnixMs,
    },
    Counter(CounterKey, Counter),
    Rate(String, u64),
    Run(Run),
    Reservation(Reservation),
    Idempotency(IdempotencyRecord),
}

/// A [`Record`] borrowed from the ledger, for writing without cloning: the same variants in
/// the same order with the same fields, so that it serializes to exactly the bytes of the
/// owned record (a store decodes what it wrote as a [`Record`]).
#[derive(Clone, Copy, Debug, Serialize)]
pub enum RecordRef<'a> {
    Meta {
        seq: u64,
        cutoff: &'a Option<String>,
        clock: UnixMs,
    },
    Counter(&'a CounterKey, &'a Counter),
    Rate(&'a String, u64),
    Run(&'a Run),
    Reservation(&'a Reservation),
    Idempotency(&'a IdempotencyRecord),
}

impl Entity {
    /// A stable text key for the entity, unique across kinds.
    pub fn storage_key(&self) -> String {
        let mut key = String::new();
        self.write_storage_key(&mut key);
        key
    }

    /// Appends [`Entity::storage_key`] to `out` (no allocation of its own).
    pub fn write_storage_key(&self, out: &mut String) {
        use std::fmt::Write;
        match self {
            Entity::Meta => out.push('m'),
            Entity::Counter(k) => {
                // Writing into a String cannot fail.
                let _ = write!(
                    out,
                    "c|{}|{}|{}",
                    k.scope,
                    k.window.window.name(),
                    k.window.index
                );
            }
            Entity::Rate(k) => {
                out.push_str("g|");
                out.push_str(k);
            }
            Entity::Run(id) => {
                out.push_str("r|");
                out.push_str(&id.0);
            }
            Entity::Reservation(id) => {
                out.push_str("s|");
                out.push_str(&id.0);
            }
            Entity::Idempotency(k) => {
                out.push_str("i|");
                out.push_str(k);
            }
        }
    }
}

impl Record {
    pub fn entity(&self) -> Entity {
        match self {
            Record::Meta { .. } => Entity::Meta,
            Record::Counter(k, _) => Entity::Counter(k.clone()),
            Record::Rate(k, _) => Entity::Rate(k.clone()),
            Record::Run(r) => Entity::Run(r.id.clone()),
            Record::Reservation(r) => Entity::Reservation(r.id.clone()),
            Record::Idempotency(r) => Entity::Idempotency(r.key.clone()),
        }
    }
}

/// Running totals behind [`Ledger::summary`], kept as records change so a summary (read by
/// `/metrics`, the dashboard and the alert checker) never scans the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Stats {
    by_state: [u64; 5],
    held: u64,
    charged: u64,
    overruns: u64,
    runs_active: u64,
}

fn state_index(s: ReservationState) -> usize {
    match s {
        ReservationState::Held => 0,
        ReservationState::Committed => 1,
        ReservationState::Released => 2,
        ReservationState::Unknown => 3,
        ReservationState::Expired => 4,
    }
}

const STATES: [ReservationState; 5] = [
    ReservationState::Held,
    ReservationState::Committed,
    ReservationState::Released,
    ReservationState::Unknown,
    ReservationState::Expired,
];

impl Stats {
    /// Adds (`add`) or removes a reservation's share of the totals.
    fn count(&mut self, r: &Reservation, add: bool) {
        let step = |v: &mut u64, by: u64| {
            *v = if add {
                v.saturating_add(by)
            } else {
                v.saturating_sub(by)
            };
        };
        step(&mut self.by_state[state_index(r.state)], 1);
        if r.kind == ReservationKind::RunHold {
            return;
        }
        if r.state == ReservationState::Held {
            step(&mut self.held, r.amount.0);
        }
        step(&mut self.charged, r.charged.0);
        step(&mut self.overruns, u64::from(r.overrun));
    }
}

/// The whole ledger state of a deployment.
#[derive(Debug, Default)]
pub struct Ledger {
    seq: u64,
    cutoff: Option<String>,
    clock: UnixMs,
    counters: HashMap<CounterKey, Counter>,
    rates: HashMap<String, u64>,
    slots: HashMap<ScopeKey, u32>,
    runs: HashMap<RunId, Run>,
    /// Each run's step reservations (not persisted: rebuilt on restore from the
    /// reservations, each of which names its run). Kept out of the run's record so that the
    /// record a step rewrites stays the same size however many steps the run took.
    run_steps: HashMap<RunId, Vec<ReservationId>>,
    reservations: HashMap<ReservationId, Reservation>,
    idempotency: HashMap<String, IdempotencyRecord>,
    timers: BTreeSet<(UnixMs, Timer)>,
    track_changes: bool,
    dirty: HashSet<Entity>,
    /// When idle rate state was last dropped (not persisted).
    compacted: Option<UnixMs>,
    /// Budget counters of calendar windows (global ones excepted) by the end of their window,
    /// so that a sweep finds the stale ones without a scan (not persisted; rebuilt on
    /// restore).
    ending: BTreeSet<(UnixMs, CounterKey)>,
    /// Derived totals (not persisted; recomputed on restore).
    stats: Stats,
    /// Replicas and their policy fingerprints (presence, not ledger: not persisted, no
    /// `ledger_seq`; see [`crate::replicas`]).
    replicas: crate::replicas::ReplicaTable,
}

/// When a counter becomes stale (droppable by a sweep once it holds nothing): its window's
/// end plus `RECORD_RETENTION_MS`; never for global counters and lifetime windows.
fn stale_from(key: &CounterKey) -> Option<UnixMs> {
    if key.scope.kind == ScopeKind::Global {
        return None;
    }
    Some(key.window.resets_at()?.plus_ms(RECORD_RETENTION_MS))
}

fn check_id(what: &str, id: &str) -> Result<(), LedgerError> {
    if id.is_empty() || id.len() > ID_BYTES_MAX {
        return Err(LedgerError::Invalid(format!(
            "{what} must be 1 to {ID_BYTES_MAX} bytes"
        )));
    }
    Ok(())
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// A ledger that records which entities each call changed (for durable stores).
    pub fn with_change_tracking() -> Ledger {
        Ledger {
            track_changes: true,
            ..Ledger::default()
        }
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    pub fn cutoff(&self) -> Option<&str> {
        self.cutoff.as_deref()
    }

    /// The entities changed since the last call (read each with [`Ledger::record_ref`]).
    pub fn take_dirty(&mut self) -> Vec<Entity> {
        self.dirty.drain().collect()
    }

    /// The current record of an entity, borrowed (`None`: it does not exist).
    pub fn record_ref(&self, e: &Entity) -> Option<RecordRef<'_>> {
        Some(match e {
            Entity::Meta => RecordRef::Meta {
                seq: self.seq,
                cutoff: &self.cutoff,
                clock: self.clock,
            },
            Entity::Counter(k) => {
                let (k, c) = self.counters.get_key_value(k)?;
                RecordRef::Counter(k, c)
            }
            Entity::Rate(k) => {
                let (k, t) = self.rates.get_key_value(k)?;
                RecordRef::Rate(k, *t)
            }
            Entity::Run(id) => RecordRef::Run(self.runs.get(id)?),
            Entity::Reservation(id) => RecordRef::Reservation(self.reservations.get(id)?),
            Entity::Idempotency(k) => RecordRef::Idempotency(self.idempotency.get(k)?),
        })
    }

    /// Forgets pending changes (after the store reloaded from disk).
    pub fn clear_changes(&mut self) {
        self.dirty.clear();
    }

    pub fn record(&self, e: &Entity) -> Option<Record> {
        Some(match e {
            Entity::Meta => Record::Meta {
                seq: self.seq,
                cutoff: self.cutoff.clone(),
                clock: self.clock,
            },
            Entity::Counter(k) => Record::Counter(k.clone(), *self.counters.get(k)?),
            Entity::Rate(k) => Record::Rate(k.clone(), *self.rates.get(k)?),
            Entity::Run(id) => Record::Run(self.runs.get(id)?.clone()),
            Entity::Reservation(id) => Record::Reservation(self.reservations.get(id)?.clone()),
            Entity::Idempotency(k) => Record::Idempotency(self.idempotency.get(k)?.clone()),
        })
    }

    /// Rebuilds a ledger from its records (derived indexes are recomputed).
    pub fn restore(records: impl IntoIterator<Item = Record>, track_changes: bool) -> Ledger {
        let mut l = Ledger {
            track_changes,
            ..Ledger::default()
        };
        for r in records {
            match r {
                Record::Meta { seq, cutoff, clock } => {
                    l.seq = seq;
                    l.cutoff = cutoff;
                    l.clock = clock;
                }
                Record::Counter(k, c) => {
                    if let Some(end) = stale_from(&k) {
                        l.ending.insert((end, k.clone()));
                    }
                    l.counters.insert(k, c);
                }
                Record::Rate(k, t) => {
                    l.rates.insert(k, t);
                }
                Record::Run(run) => {
                    l.runs.insert(run.id.clone(), run);
                }
                Record::Reservation(res) => {
                    l.reservations.insert(res.id.clone(), res);
                }
                Record::Idempotency(rec) => {
                    l.timers
                        .insert((rec.expires, Timer::Idempotency(rec.key.clone())));
                    l.idempotency.insert(rec.key.clone(), rec);
                }
            }
        }
        let mut stats = Stats::default();
        let mut steps: Vec<(&RunId, UnixMs, &ReservationId)> = Vec::new();
        for r in l.reservations.values() {
            stats.count(r, true);
            if r.kind != ReservationKind::RunHold && l.runs.contains_key(&r.run_id) {
                steps.push((&r.run_id, r.created, &r.id));
            }
        }
        // In the order they were taken (as far as the clock tells; the order is not used).
        steps.sort_unstable();
        for (run, _, id) in steps {
            l.run_steps.entry(run.clone()).or_default().push(id.clone());
        }
        stats.runs_active = l
            .runs
            .values()
            .filter(|r| r.state == RunState::Active)
            .count() as u64;
        l.stats = stats;
        for run in l.runs.values() {
            match run.state {
                RunState::Active => {
                    l.timers
                        .insert((run.lease_until, Timer::Lease(run.id.clone())));
                    for s in &run.slots {
                        *l.slots.entry(s.clone()).or_insert(0) += 1;
                    }
                }
                RunState::Finished | RunState::Expired => {
                    let at = run
                        .ended_at
                        .unwrap_or(run.created)
                        .plus_ms(RECORD_RETENTION_MS);
                    l.timers.insert((at, Timer::Purge(run.id.clone())));
                }
            }
        }
        l
    }

    /// Every record, for a full snapshot.
    pub fn records(&self) -> Vec<Record> {
        let mut v = vec![self.record(&Entity::Meta).unwrap_or(Record::Meta {
            seq: self.seq,
            cutoff: None,
            clock: self.clock,
        })];
        v.extend(
            self.counters
                .iter()
                .map(|(k, c)| Record::Counter(k.clone(), *c)),
        );
        v.extend(self.rates.iter().map(|(k, t)| Record::Rate(k.clone(), *t)));
        v.extend(self.runs.values().cloned().map(Record::Run));
        v.extend(self.reservations.values().cloned().map(Record::Reservation));
        v.extend(self.idempotency.values().cloned().map(Record::Idempotency));
        v
    }

    fn touch(&mut self, e: Entity) {
        if self.track_changes {
            self.dirty.insert(e);
        }
    }

    fn bump(&mut self) -> u64 {
        self.seq += 1;
        self.touch(Entity::Meta);
        self.seq
    }

    fn records_held(&self) -> usize {
        self.runs.len() + self.reservations.len() + self.idempotency.len()
    }

    /// Moves the clock forward (never back: a clock that steps back is held at the last value)
    /// and processes due expiries. Returns the effective `now`.
    fn advance(&mut self, now: UnixMs) -> (UnixMs, bool) {
        let now = now.max(self.clock);
        if now != self.clock {
            self.clock = now;
            self.touch(Entity::Meta);
        }
        let changed = self.expire_due(now, EXPIRIES_PER_CALL_MAX) > 0;
        (now, changed)
    }

    /// [`Ledger::advance`], then the run the call is about: its lease may have run out behind
    /// more due timers than one call processes (`EXPIRIES_PER_CALL_MAX`); it expires now,
    /// before the call looks at it, so no call acts on a run whose lease is over (I6), whatever
    /// the backlog and whenever the sweeper last ran.
    fn advance_for(&mut self, now: UnixMs, run_id: &RunId) -> (UnixMs, bool) {
        let (now, changed) = self.advance(now);
        (now, self.lapse(run_id, now) || changed)
    }

    /// Expires `run_id` when it is active and its lease is over; whether it did.
    fn lapse(&mut self, run_id: &RunId, now: UnixMs) -> bool {
        let lapsed = self
            .runs
            .get(run_id)
            .is_some_and(|r| r.state == RunState::Active && r.lease_until <= now);
        if lapsed {
            self.end_run(run_id, now, RunState::Expired);
            self.bump();
        }
        lapsed
    }

    /// Processes up to `max` due timers: expires runs whose lease ran out (charging their held
    /// reservations in full and freeing their slots), purges old records.
    fn expire_due(&mut self, now: UnixMs, max: usize) -> usize {
        let mut done = 0;
        while done < max {
            let Some((at, _)) = self.timers.first() else {
                break;
            };
            if *at > now {
                break;
            }
            let Some((_, timer)) = self.timers.pop_first() else {
                break;
            };
            match timer {
                Timer::Lease(run_id) => {
                    if self
                        .runs
                        .get(&run_id)
                        .is_some_and(|r| r.state == RunState::Active)
                    {
                        self.end_run(&run_id, now, RunState::Expired);
                        self.bump();
                        done += 1;
                    }
                }
                // Dropping records is a change of the ledger too: `ledger_seq` moves with it.
                Timer::Purge(run_id) => {
                    self.purge_run(&run_id);
                    self.bump();
                    done += 1;
                }
                Timer::Idempotency(key) => {
                    if self.idempotency.get(&key).is_some_and(|r| r.expires <= now) {
                        self.idempotency.remove(&key);
                        self.touch(Entity::Idempotency(key));
                        self.bump();
                        done += 1;
                    }
                }
            }
        }
        done
    }

    /// Runs due expiries (at most [`SWEEP_EXPIRIES_MAX`]) and drops idle rate state and
    /// counters of long-ended windows.
    /// Called periodically by the store's sweeper; idempotent. Returns whether anything changed.
    pub fn sweep(&mut self, now: UnixMs) -> Applied<usize> {
        // Not `advance`: it would process (up to a batch of) the due timers itself and leave
        // none for the count below.
        let now = now.max(self.clock);
        if now != self.clock {
            self.clock = now;
            self.touch(Entity::Meta);
        }
        let mut n = self.expire_due(now, SWEEP_EXPIRIES_MAX);
        // Counters of windows that ended more than RECORD_RETENTION_MS ago and hold nothing.
        let mut stale = Vec::new();
        for (end, key) in &self.ending {
            if *end > now {
                break;
            }
            if self
                .counters
                .get(key)
                .is_none_or(|c| c.reserved == Micros::ZERO)
            {
                stale.push((*end, key.clone()));
            }
        }
        for (end, key) in stale {
            self.ending.remove(&(end, key.clone()));
            if self.counters.remove(&key).is_some() {
                n += 1;
                self.touch(Entity::Counter(key));
            }
        }
        // Dropping idle rate state scans every rate: at most once per COMPACT_EVERY_MS, so a
        // frequent sweeper does not stall the store (idle state decides nothing: dropping it
        // early or late changes no answer).
        if self
            .compacted
            .is_some_and(|c| now.0 < c.0.saturating_add(COMPACT_EVERY_MS))
        {
            return Applied {
                value: n,
                seq: self.seq,
                changed: n > 0,
            };
        }
        self.compacted = Some(now);
        let now_us = now.0.saturating_mul(1000);
        let idle: Vec<String> = self
            .rates
            .iter()
            .filter(|(_, t)| **t <= now_us)
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            self.rates.remove(&k);
            self.touch(Entity::Rate(k));
        }
        Applied {
            value: n,
            seq: self.seq,
            changed: n > 0,
        }
    }

    fn insert_reservation(&mut self, r: Reservation) {
        self.stats.count(&r, true);
        if let Some(old) = self.reservations.insert(r.id.clone(), r) {
            debug_assert!(false, "reservation ids are unique");
            self.stats.count(&old, false);
        }
    }

    fn purge_run(&mut self, run_id: &RunId) {
        let Some(run) = self.runs.remove(run_id) else {
            return;
        };
        debug_assert!(run.state != RunState::Active, "only ended runs are purged");
        let steps = self.run_steps.remove(run_id).unwrap_or_default();
        for s in steps.iter().chain(run.hold.iter()) {
            if let Some(r) = self.reservations.remove(s) {
                self.stats.count(&r, false);
            }
            self.touch(Entity::Reservation(s.clone()));
        }
        let ck = run.counter_key();
        self.counters.remove(&ck);
        self.touch(Entity::Counter(ck));
        self.touch(Entity::Run(run_id.clone()));
    }

    fn counter_mut(&mut self, key: &CounterKey, limit: Micros) -> &mut Counter {
        if self.track_changes {
            self.dirty.insert(Entity::Counter(key.clone()));
        }
        let ending = &mut self.ending;
        let c = self.counters.entry(key.clone()).or_insert_with(|| {
            if let Some(end) = stale_from(key) {
                ending.insert((end, key.clone()));
            }
            Counter::default()
        });
        c.limit = limit;
        c
    }

    /// The budget counters (and their limits) a request from these scopes touches at `now`.
    fn budget_counters(
        policy: &Policy,
        scopes: &[(ScopeKey, u64)],
        now: UnixMs,
    ) -> Vec<(CounterKey, Micros)> {
        let mut v = Vec::new();
        for (scope, factor) in scopes {
            let Some(p) = policy.for_kind(scope.kind) else {
                continue;
            };
            for b in &p.scaled(*factor).budgets {
                v.push((
                    CounterKey {
                        scope: scope.clone(),
                        window: b.window.at(now),
                    },
                    b.amount,
                ));
            }
        }
        v
    }

    fn counter_view(&self, key: &CounterKey, limit: Micros) -> Counter {
        let mut c = self.counters.get(key).copied().unwrap_or_default();
        c.limit = limit;
        c
    }

    /// Checks that `amount` fits every counter. `Err`: the enforced counter that it does not
    /// fit that frees last (see [`crate::admission::decide`]), and why. `Ok(Some(_))`: every enforced counter fits, and this is the
    /// first counter in dry-run that it does not (see [`ScopePolicy::dry_run`]).
    fn check_budgets(
        &self,
        policy: &Policy,
        counters: &[(CounterKey, Micros)],
        amount: Micros,
        now: UnixMs,
    ) -> Result<Option<Refusal>, Refusal> {
        let check = |dry: bool| -> Result<(), Refusal> {
            let picked: Vec<&(CounterKey, Micros)> = counters
                .iter()
                .filter(|(key, _)| policy.dry_run(key.scope.kind) == dry)
                .collect();
            let views: Vec<BudgetView> = picked
                .iter()
                .map(|(key, limit)| {
                    let c = self.counters.get(key).copied().unwrap_or_default();
                    BudgetView::of(key.scope.kind, &c, *limit, key.window.resets_at())
                })
                .collect();
            crate::admission::decide(&views, amount, now).map_err(|r| {
                let (key, limit) = picked[r.index];
                budget_refusal(key, &self.counter_view(key, *limit), r)
            })
        };
        check(false)?;
        Ok(check(true).err())
    }

    fn hold(&mut self, policy: &Policy, counters: &[(CounterKey, Micros)], amount: Micros) {
        for (key, limit) in counters {
            let dry = policy.dry_run(key.scope.kind);
            let c = self.counter_mut(key, *limit);
            c.reserved = c.reserved.add_capped(amount);
            if c.used.0 + c.reserved.0 > c.limit.0 {
                // Only a limit in dry-run admits past itself; it is then overrun (and I1's
                // exception), so that it reports every later request as refused.
                debug_assert!(dry, "I1: admission must keep used + reserved <= limit");
                if dry {
                    c.overrun = true;
                }
            }
        }
    }

    /// Moves a reservation to a terminal state, charging `charged` to each of its counters.
    fn settle(
        &mut self,
        id: &ReservationId,
        state: ReservationState,
        charged: Micros,
        now: UnixMs,
    ) {
        let Some(res) = self.reservations.get_mut(id) else {
            return;
        };
        debug_assert_eq!(
            res.state,
            ReservationState::Held,
            "I2: settle only a held reservation"
        );
        debug_assert!(state != ReservationState::Held);
        self.stats.count(res, false);
        res.state = state;
        res.charged = charged;
        res.resolved_at = Some(now);
        res.overrun = charged > res.amount;
        self.stats.count(res, true);
        let (amount, keys) = (res.amount, res.counters.clone());
        self.touch(Entity::Reservation(id.clone()));
        for key in keys {
            let limit = self.counters.get(&key).map(|c| c.limit).unwrap_or_default();
            let c = self.counter_mut(&key, limit);
            c.reserved = c.reserved.saturating_sub(amount);
            c.used = c.used.add_capped(charged);
            if c.used > c.limit {
                c.overrun = true;
            }
        }
    }

    /// `whole_run`: after a step's overrun, the run's hold grows to what the run was charged
    /// when that is more, so that its scopes count the overrun at once (as `per_step` charges
    /// it to them at commit), not only when the run ends. Held beyond a scope's limit, it is
    /// an overrun there: the scope admits nothing more until its window resets.
    fn grow_run_hold(&mut self, run_id: &RunId) {
        let Some(run) = self.runs.get(run_id) else {
            return;
        };
        let Some(hold_id) = run.hold.clone() else {
            return;
        };
        let run_used = self
            .counters
            .get(&run.counter_key())
            .map(|c| c.used)
            .unwrap_or_default();
        let Some(hold) = self.reservations.get_mut(&hold_id) else {
            return;
        };
        if hold.state != ReservationState::Held || run_used <= hold.amount {
            return;
        }
        let delta = Micros(run_used.0 - hold.amount.0);
        // (a hold is not counted in the stats' held sum: nothing to recount)
        hold.amount = run_used;
        let keys = hold.counters.clone();
        self.touch(Entity::Reservation(hold_id));
        for key in keys {
            let limit = self.counters.get(&key).map(|c| c.limit).unwrap_or_default();
            let c = self.counter_mut(&key, limit);
            c.reserved = c.reserved.add_capped(delta);
            if c.used.add_capped(c.reserved) > c.limit {
                c.overrun = true;
            }
        }
    }

    fn renew(&mut self, run_id: &RunId, now: UnixMs, ttl_ms: u64) -> Option<UnixMs> {
        let run = self.runs.get_mut(run_id)?;
        if run.state != RunState::Active {
            return None;
        }
        let new = now
            .plus_ms(ttl_ms)
            .min(run.deadline)
            .max(run.lease_until.min(run.deadline));
        if new != run.lease_until {
            self.timers
                .remove(&(run.lease_until, Timer::Lease(run_id.clone())));
            run.lease_until = new;
            self.timers.insert((new, Timer::Lease(run_id.clone())));
            self.touch(Entity::Run(run_id.clone()));
        }
        Some(new)
    }

    /// Ends a run: held steps become `unknown` (finish) or `expired` (lease ran out), both
    /// charged in full; the whole-run hold is reconciled; slots are freed.
    fn end_run(&mut self, run_id: &RunId, now: UnixMs, end: RunState) {
        let Some(run) = self.runs.get(run_id) else {
            return;
        };
        debug_assert_eq!(run.state, RunState::Active);
        let (hold, slots) = (run.hold.clone(), run.slots.clone());
        let steps = self.run_steps.get(run_id).cloned().unwrap_or_default();
        let lease_until = run.lease_until;
        let step_end = if end == RunState::Expired {
            ReservationState::Expired
        } else {
            ReservationState::Unknown
        };
        for s in &steps {
            if self
                .reservations
                .get(s)
                .is_some_and(|r| r.state == ReservationState::Held)
            {
                let amount = self
                    .reservations
                    .get(s)
                    .map(|r| r.amount)
                    .unwrap_or_default();
                self.settle(s, step_end, amount, now);
            }
        }
        if let Some(h) = &hold {
            let run_used = self
                .runs
                .get(run_id)
                .map(|r| r.counter_key())
                .and_then(|k| self.counters.get(&k).map(|c| c.used));
            let amount = self
                .reservations
                .get(h)
                .map(|r| r.amount)
                .unwrap_or_default();
            let run_used = run_used.unwrap_or_default();
            if end == RunState::Expired {
                self.settle(h, ReservationState::Expired, amount.max(run_used), now);
            } else {
                self.settle(h, ReservationState::Committed, run_used, now);
            }
        }
        for s in &slots {
            if let Some(n) = self.slots.get_mut(s) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.slots.remove(s);
                }
            }
        }
        self.timers
            .remove(&(lease_until, Timer::Lease(run_id.clone())));
        self.timers.insert((
            now.plus_ms(RECORD_RETENTION_MS),
            Timer::Purge(run_id.clone()),
        ));
        if let Some(run) = self.runs.get_mut(run_id) {
            debug_assert_eq!(run.state, RunState::Active);
            run.state = end;
            self.stats.runs_active = self.stats.runs_active.saturating_sub(1);
            run.ended_at = Some(now);
        }
        self.touch(Entity::Run(run_id.clone()));
    }

    fn remember(
        &mut self,
        idem: Option<&IdempotencyKey>,
        outcome: IdempotentOutcome,
        now: UnixMs,
        ttl_ms: u64,
    ) {
        let Some(k) = idem else { return };
        let expires = now.plus_ms(IDEMPOTENCY_RETENTION_MS.max(ttl_ms));
        self.idempotency.insert(
            k.key.clone(),
            IdempotencyRecord {
                key: k.key.clone(),
                fingerprint: k.fingerprint.clone(),
                outcome,
                expires,
            },
        );
        self.timers
            .insert((expires, Timer::Idempotency(k.key.clone())));
        self.touch(Entity::Idempotency(k.key.clone()));
    }

    fn recall(
        &self,
        idem: Option<&IdempotencyKey>,
    ) -> Result<Option<IdempotentOutcome>, LedgerError> {
        let Some(k) = idem else { return Ok(None) };
        check_id("idempotency key", &k.key)?;
        match self.idempotency.get(&k.key) {
            None => Ok(None),
            Some(r) if r.fingerprint == k.fingerprint => Ok(Some(r.outcome.clone())),
            Some(_) => Err(LedgerError::IdempotencyConflict),
        }
    }

    fn answer<T>(&self, value: T, changed: bool) -> Applied<T> {
        Applied {
            value,
            seq: self.seq,
            changed,
        }
    }

    /// Ends an admission: remembers the outcome under its idempotency key, and moves the
    /// sequence number when anything changed (a grant, a remembered refusal, or expiries).
    fn conclude<T>(
        &mut self,
        outcome: Result<T, Refusal>,
        remembered: Option<IdempotentOutcome>,
        idem: Option<&IdempotencyKey>,
        now: UnixMs,
        ttl_ms: u64,
        swept: bool,
    ) -> Applied<Result<T, Refusal>> {
        if let Some(o) = remembered {
            self.remember(idem, o, now, ttl_ms);
        }
        let changed = swept || outcome.is_ok() || idem.is_some();
        if changed {
            self.bump();
        }
        self.answer(outcome, changed)
    }

    /// The refusal every admission gets while the spending cutoff is engaged. The operator's
    /// reason stays with the operator (summary, dashboard): refused guests see a fixed text.
    fn cutoff_refusal(&self) -> Option<Refusal> {
        self.cutoff.as_ref().map(|_| {
            Refusal::new(
                RefusalCode::CutoffEngaged,
                Some(ScopeKind::Global),
                CUTOFF_MESSAGE.to_string(),
            )
            .retry_after(60)
        })
    }

    /// Admits a run: checks rate, concurrency and budgets of every scope, and applies all of
    /// them or none. In `whole_run` mode the run's cost bound is reserved here.
    pub fn admit_run(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        req: &RunRequest,
        idem: Option<&IdempotencyKey>,
    ) -> Result<Applied<Result<RunAdmitted, Refusal>>, LedgerError> {
        let (now, swept) = self.advance(now);
        match self.recall(idem)? {
            Some(IdempotentOutcome::Run(o)) => return Ok(self.answer(o, swept)),
            Some(_) => return Err(LedgerError::IdempotencyConflict),
            None => {}
        }
        check_id("run id", &req.run_id.0)?;
        check_id("session", &req.session)?;
        check_id("conversation", &req.conversation)?;
        if req.ips.is_empty() || req.ips.len() > IP_SCOPES_MAX {
            return Err(LedgerError::Invalid("one to four address prefixes".into()));
        }
        for (i, ip) in req.ips.iter().enumerate() {
            check_id("address prefix", &ip.prefix)?;
            // The same prefix twice would be checked once but held twice (I1).
            if req.ips[..i].iter().any(|o| o.prefix == ip.prefix) {
                return Err(LedgerError::Invalid(
                    "address prefixes must be distinct".into(),
                ));
            }
        }
        if self.runs.contains_key(&req.run_id) {
            return Err(LedgerError::Invalid("run id already exists".into()));
        }
        if self.records_held() >= LEDGER_RECORDS_MAX {
            return Err(LedgerError::Full(LEDGER_RECORDS_MAX));
        }
        let outcome = match self.decide_run(policy, now, req) {
            Err(refusal) => Err(refusal),
            Ok(plan) => Ok(self.apply_run(policy, now, req, plan)),
        };
        let remembered = idem.map(|_| IdempotentOutcome::Run(outcome.clone()));
        Ok(self.conclude(outcome, remembered, idem, now, policy.lease_ttl_ms, swept))
    }

    fn decide_run(
        &self,
        policy: &Policy,
        now: UnixMs,
        req: &RunRequest,
    ) -> Result<RunPlan, Refusal> {
        if let Some(refusal) = self.cutoff_refusal() {
            return Err(refusal);
        }
        let bounds = policy.run;
        if req.input_bytes > bounds.max_input_bytes {
            return Err(Refusal::new(
                RefusalCode::PayloadTooLarge,
                Some(ScopeKind::Run),
                format!(
                    "input of {} bytes is over the limit of {} bytes",
                    req.input_bytes, bounds.max_input_bytes
                ),
            ));
        }
        let scopes = run_scopes(&req.session, &req.ips, &req.conversation);
        // Rates: every scope with a rate, computed but not yet applied.
        let now_us = now.0.saturating_mul(1000);
        let mut tats = Vec::new();
        let mut rate_left: Option<RateLeft> = None;
        // The first refusal of a limit in dry-run (see `ScopePolicy::dry_run`).
        let mut dry_run: Option<Refusal> = None;
        for (scope, factor) in &scopes {
            let Some(p) = policy.for_kind(scope.kind) else {
                continue;
            };
            let Some(rate) = p.rate.map(|r| r.scaled(*factor)) else {
                continue;
            };
            let key = format!("run|{scope}");
            let tat = self.rates.get(&key).copied().unwrap_or(0);
            match rate.check(tat, now_us) {
                Ok(new_tat) => {
                    let (remaining, reset_s) = rate.left(new_tat, now_us);
                    let left = RateLeft {
                        scope: scope.kind,
                        remaining,
                        reset_s,
                    };
                    rate_left = Some(rate_left.map_or(left, |l| l.tighter(left)));
                    tats.push((key, new_tat));
                }
                Err(wait_us) => {
                    let refusal = Refusal::new(
                        RefusalCode::RateLimited,
                        Some(scope.kind),
                        format!("{} request rate exceeded", scope.kind.name()),
                    )
                    .retry_after(wait_us.div_ceil(1_000_000));
                    if !p.dry_run {
                        return Err(refusal);
                    }
                    // The rate's state stays: a refused request would not have moved it.
                    dry_run.get_or_insert(refusal);
                }
            }
        }
        // Concurrency.
        let mut slots = Vec::new();
        for (scope, factor) in &scopes {
            let Some(p) = policy.for_kind(scope.kind) else {
                continue;
            };
            let Some(cap) = p.scaled(*factor).concurrency else {
                continue;
            };
            let held = self.slots.get(scope).copied().unwrap_or(0);
            if held >= cap {
                let refusal = Refusal::new(
                    RefusalCode::ConcurrencyLimited,
                    Some(scope.kind),
                    format!(
                        "{} already has {held} active run(s) (limit {cap})",
                        scope.kind.name()
                    ),
                )
                .retry_after(1);
                if !p.dry_run {
                    return Err(refusal);
                }
                dry_run.get_or_insert(refusal);
            }
            slots.push(scope.clone());
        }
        // Budgets: whole_run reserves the run's cost bound; per_step needs some room left.
        let counters = Self::budget_counters(policy, &scopes, now);
        let hold = match policy.mode {
            ReservationMode::WholeRun => bounds.max_cost,
            ReservationMode::PerStep => Micros(1),
        };
        if let Some(refusal) = self.check_budgets(policy, &counters, hold, now)? {
            dry_run.get_or_insert(refusal);
        }
        Ok(RunPlan {
            tats,
            rate_left,
            slots,
            counters,
            dry_run,
        })
    }

    fn apply_run(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        req: &RunRequest,
        plan: RunPlan,
    ) -> RunAdmitted {
        let bounds = policy.run;
        for (k, t) in plan.tats {
            self.rates.insert(k.clone(), t);
            self.touch(Entity::Rate(k));
        }
        for s in &plan.slots {
            *self.slots.entry(s.clone()).or_insert(0) += 1;
        }
        let deadline = now.plus_ms(bounds.max_seconds.saturating_mul(1000));
        let lease_until = now.plus_ms(policy.lease_ttl_ms).min(deadline);
        let mut run = Run {
            id: req.run_id.clone(),
            session: req.session.clone(),
            conversation: req.conversation.clone(),
            ips: req.ips.clone(),
            created: now,
            deadline,
            lease_until,
            rounds: 0,
            tool_calls: 0,
            retries: 0,
            state: RunState::Active,
            ended_at: None,
            slots: plan.slots,
            hold: None,
            bounds,
            mode: policy.mode,
        };
        let mut reserved = Micros::ZERO;
        if policy.mode == ReservationMode::WholeRun {
            let id = ReservationId(format!("{}.hold", req.run_id.0));
            self.hold(policy, &plan.counters, bounds.max_cost);
            reserved = bounds.max_cost;
            self.insert_reservation(Reservation {
                id: id.clone(),
                run_id: req.run_id.clone(),
                kind: ReservationKind::RunHold,
                amount: bounds.max_cost,
                counters: plan.counters.into_iter().map(|(k, _)| k).collect(),
                state: ReservationState::Held,
                charged: Micros::ZERO,
                created: now,
                resolved_at: None,
                max_output_tokens: None,
                overrun: false,
                result_too_large: false,
            });
            self.touch(Entity::Reservation(id.clone()));
            run.hold = Some(id);
        }
        self.timers
            .insert((lease_until, Timer::Lease(req.run_id.clone())));
        self.runs.insert(req.run_id.clone(), run);
        self.stats.runs_active += 1;
        self.touch(Entity::Run(req.run_id.clone()));
        RunAdmitted {
            run_id: req.run_id.clone(),
            deadline,
            reserved,
            bounds,
            rate_left: plan.rate_left,
            dry_run: plan.dry_run,
        }
    }

    /// Reserves one paid step of a run against every scope (per_step) or against the run's
    /// hold (whole_run), after checking the run's bounds.
    pub fn reserve_step(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        req: &StepRequest,
        idem: Option<&IdempotencyKey>,
    ) -> Result<Applied<Result<StepReserved, Refusal>>, LedgerError> {
        let (now, swept) = self.advance_for(now, &req.run_id);
        match self.recall(idem)? {
            Some(IdempotentOutcome::Step(o)) => return Ok(self.answer(o, swept)),
            Some(_) => return Err(LedgerError::IdempotencyConflict),
            None => {}
        }
        check_id("step id", &req.step_id.0)?;
        if self.reservations.contains_key(&req.step_id) {
            return Err(LedgerError::Invalid("step id already exists".into()));
        }
        let run = self
            .runs
            .get(&req.run_id)
            .ok_or_else(|| LedgerError::NotFound(format!("run {}", req.run_id.0)))?;
        if self.records_held() >= LEDGER_RECORDS_MAX {
            return Err(LedgerError::Full(LEDGER_RECORDS_MAX));
        }
        let outcome = match self.decide_step(policy, now, run, req) {
            Err(refusal) => Err(refusal),
            Ok(plan) => Ok(self.apply_step(policy, now, req, plan)),
        };
        let remembered = idem.map(|_| IdempotentOutcome::Step(outcome.clone()));
        Ok(self.conclude(outcome, remembered, idem, now, policy.lease_ttl_ms, swept))
    }

    fn decide_step(
        &self,
        policy: &Policy,
        now: UnixMs,
        run: &Run,
        req: &StepRequest,
    ) -> Result<StepPlan, Refusal> {
        let bound =
            |msg: String| Refusal::new(RefusalCode::RunBoundExceeded, Some(ScopeKind::Run), msg);
        match run.state {
            RunState::Active => {}
            RunState::Finished => return Err(bound("run is finished".into())),
            RunState::Expired => return Err(bound("run deadline or lease has passed".into())),
        }
        if now >= run.deadline {
            return Err(bound("run deadline has passed".into()));
        }
        if let Some(refusal) = self.cutoff_refusal() {
            return Err(refusal);
        }
        let b = run.bounds;
        let (amount, max_out, counter_kind) = match &req.kind {
            StepKind::Model {
                price,
                prompt_tokens,
                max_output_tokens,
                retry,
                ..
            } => {
                if *retry && run.retries >= b.max_retries {
                    return Err(bound(format!(
                        "run already used its {} retries",
                        b.max_retries
                    )));
                }
                if !*retry && run.rounds >= b.max_model_rounds {
                    return Err(bound(format!(
                        "run already used its {} model rounds",
                        b.max_model_rounds
                    )));
                }
                if *prompt_tokens > b.max_context_tokens {
                    return Err(Refusal::new(
                        RefusalCode::ContextTooLarge,
                        Some(ScopeKind::Run),
                        format!(
                            "prompt of {prompt_tokens} tokens is over the context limit of {} tokens",
                            b.max_context_tokens
                        ),
                    ));
                }
                let out = max_output_tokens
                    .unwrap_or(b.max_output_tokens)
                    .min(b.max_output_tokens);
                (
                    price.bound(*prompt_tokens, out),
                    Some(out),
                    StepCounter::Model(*retry),
                )
            }
            StepKind::Tool { price, units, .. } => {
                if run.tool_calls >= b.max_tool_calls {
                    return Err(bound(format!(
                        "run already used its {} tool calls",
                        b.max_tool_calls
                    )));
                }
                (price.cost(*units), None, StepCounter::Tool)
            }
        };
        // The run's own cost bound first: a step it can never fit is refused as over the
        // run's bound (400), not as a spent scope budget to retry after its window.
        let run_counter = (run.counter_key(), b.max_cost);
        let counters = match run.mode {
            ReservationMode::PerStep => {
                let mut c = vec![run_counter];
                c.extend(Self::budget_counters(policy, &run.scope_keys(), now));
                c
            }
            ReservationMode::WholeRun => vec![run_counter],
        };
        match self.check_budgets(policy, &counters, amount, now) {
            Ok(dry_run) => Ok(StepPlan {
                amount,
                max_out,
                shrunk: false,
                counters,
                counter_kind,
                dry_run,
            }),
            Err(refusal) => {
                // shrink_to_fit: lower the output bound to what the tightest counter allows.
                if let (
                    true,
                    StepKind::Model {
                        price,
                        prompt_tokens,
                        ..
                    },
                ) = (b.shrink_to_fit, &req.kind)
                {
                    // Only enforced limits bound the output (a limit in dry-run never refuses).
                    let room = counters
                        .iter()
                        .filter(|(k, _)| !policy.dry_run(k.scope.kind))
                        .map(|(k, l)| self.counter_view(k, *l).remaining())
                        .min()
                        .unwrap_or_default();
                    if let Some(fit) = price.max_output_within(*prompt_tokens, room) {
                        let fit = fit.min(max_out.unwrap_or(0));
                        if fit >= b.min_output_tokens {
                            let amount = price.bound(*prompt_tokens, fit);
                            let dry_run = self.check_budgets(policy, &counters, amount, now)?;
                            return Ok(StepPlan {
                                amount,
                                max_out: Some(fit),
                                shrunk: true,
                                counters,
                                counter_kind,
                                dry_run,
                            });
                        }
                    }
                }
                let mut refusal = refusal;
                // (a run bound its own steps in flight hold is a wait: `budget_held`)
                if refusal.scope == Some(ScopeKind::Run)
                    && refusal.code == RefusalCode::BudgetExhausted
                {
                    refusal.code = RefusalCode::RunBoundExceeded;
                    refusal.message = format!("run cost bound of {} reached", b.max_cost);
                    refusal.retry_after_s = None;
                }
                Err(refusal)
            }
        }
    }

    fn apply_step(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        req: &StepRequest,
        plan: StepPlan,
    ) -> StepReserved {
        self.hold(policy, &plan.counters, plan.amount);
        let kind = match &req.kind {
            StepKind::Model {
                model,
                price,
                retry,
                ..
            } => ReservationKind::Model {
                model: model.clone(),
                price: *price,
                retry: *retry,
            },
            StepKind::Tool { tool, price, units } => ReservationKind::Tool {
                tool: tool.clone(),
                price: *price,
                units: *units,
            },
        };
        self.insert_reservation(Reservation {
            id: req.step_id.clone(),
            run_id: req.run_id.clone(),
            kind,
            amount: plan.amount,
            counters: plan.counters.into_iter().map(|(k, _)| k).collect(),
            state: ReservationState::Held,
            charged: Micros::ZERO,
            created: now,
            resolved_at: None,
            max_output_tokens: plan.max_out,
            overrun: false,
            result_too_large: false,
        });
        self.touch(Entity::Reservation(req.step_id.clone()));
        if let Some(run) = self.runs.get_mut(&req.run_id) {
            match plan.counter_kind {
                StepCounter::Model(true) => run.retries += 1,
                StepCounter::Model(false) => run.rounds += 1,
                StepCounter::Tool => run.tool_calls += 1,
            }
            self.run_steps
                .entry(req.run_id.clone())
                .or_default()
                .push(req.step_id.clone());
        }
        self.touch(Entity::Run(req.run_id.clone()));
        self.renew(&req.run_id, now, policy.lease_ttl_ms);
        StepReserved {
            step_id: req.step_id.clone(),
            reserved: plan.amount,
            max_output_tokens: plan.max_out,
            shrunk: plan.shrunk,
            dry_run: plan.dry_run,
        }
    }

    /// Resolves a held step. `Commit` charges observed usage (above the hold: an overrun,
    /// charged in full); `Release` charges nothing; `Unknown` charges the hold in full.
    /// A repeat of the same transition returns the first outcome; a different transition on a
    /// resolved reservation is refused with its state and charge.
    pub fn resolve(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        step_id: &ReservationId,
        how: Resolution,
    ) -> Result<Applied<Resolved>, LedgerError> {
        let (now, mut swept) = self.advance(now);
        // (the run's id is cloned only when its lease is over, not on every commit)
        let lapsed = self.reservations.get(step_id).and_then(|r| {
            self.runs
                .get(&r.run_id)
                .filter(|run| run.state == RunState::Active && run.lease_until <= now)
                .map(|_| r.run_id.clone())
        });
        if let Some(run_id) = lapsed {
            swept |= self.lapse(&run_id, now);
        }
        let res = self
            .reservations
            .get(step_id)
            .filter(|r| r.kind != ReservationKind::RunHold)
            .ok_or_else(|| LedgerError::NotFound(format!("step {}", step_id.0)))?;
        if res.state != ReservationState::Held {
            let same = matches!(
                (res.state, how),
                (ReservationState::Committed, Resolution::Commit(_))
                    | (ReservationState::Released, Resolution::Release)
                    | (ReservationState::Unknown, Resolution::Unknown)
            );
            if !same {
                return Err(LedgerError::Closed {
                    state: res.state,
                    charged: res.charged,
                });
            }
            let value = Resolved {
                state: res.state,
                charged: res.charged,
                reserved: res.amount,
                overrun: res.overrun,
                repeated: true,
                result_too_large: res.result_too_large,
            };
            return Ok(self.answer(value, swept));
        }
        let (state, charged) = match how {
            Resolution::Commit(s) => (ReservationState::Committed, charge_of(res, s)?),
            Resolution::Release => (ReservationState::Released, Micros::ZERO),
            Resolution::Unknown => (ReservationState::Unknown, res.amount),
        };
        let (run_id, amount) = (res.run_id.clone(), res.amount);
        let too_large = match how {
            Resolution::Commit(Settlement::ResultBytes(b)) => self
                .runs
                .get(&run_id)
                .is_some_and(|r| b > r.bounds.max_tool_result_bytes),
            _ => false,
        };
        self.settle(step_id, state, charged, now);
        if charged > amount {
            self.grow_run_hold(&run_id);
        }
        if too_large {
            if let Some(res) = self.reservations.get_mut(step_id) {
                res.result_too_large = true;
            }
        }
        self.renew(&run_id, now, policy.lease_ttl_ms);
        self.bump();
        let value = Resolved {
            state,
            charged,
            reserved: amount,
            overrun: charged > amount,
            repeated: false,
            result_too_large: too_large,
        };
        Ok(self.answer(value, true))
    }

    /// Extends a run's lease (and so its reservations' and slots') by one TTL, never past
    /// its deadline.
    pub fn heartbeat(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        run_id: &RunId,
    ) -> Result<Applied<Heartbeat>, LedgerError> {
        let (now, swept) = self.advance_for(now, run_id);
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| LedgerError::NotFound(format!("run {}", run_id.0)))?;
        if run.state != RunState::Active {
            return Err(LedgerError::RunClosed(run.state));
        }
        let before = run.lease_until;
        let lease_until = self
            .renew(run_id, now, policy.lease_ttl_ms)
            .unwrap_or(before);
        let deadline = self
            .runs
            .get(run_id)
            .map(|r| r.deadline)
            .unwrap_or(lease_until);
        let changed = swept || lease_until != before;
        if changed {
            self.bump();
        }
        Ok(self.answer(
            Heartbeat {
                lease_until,
                deadline,
            },
            changed,
        ))
    }

    /// Ends a run: held steps are charged in full as `unknown`, the whole-run hold is
    /// reconciled, slots are freed. Idempotent: a run already ended (finished, or expired
    /// with its lease) is answered as it ended, `repeated`.
    pub fn finish(
        &mut self,
        _policy: &Policy,
        now: UnixMs,
        run_id: &RunId,
    ) -> Result<Applied<RunEnded>, LedgerError> {
        let (now, swept) = self.advance_for(now, run_id);
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| LedgerError::NotFound(format!("run {}", run_id.0)))?;
        // A run that expired was ended by its lease: finishing it again repeats that end, with
        // what it was charged, so the caller learns the run's cost whichever came first.
        let repeated = run.state != RunState::Active;
        if !repeated {
            self.end_run(run_id, now, RunState::Finished);
            self.bump();
        }
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| LedgerError::NotFound(format!("run {}", run_id.0)))?;
        let charged = self.run_charged(run);
        let value = RunEnded {
            state: run.state,
            charged,
            steps: self.steps_of(run_id).len() as u32,
            repeated,
        };
        Ok(self.answer(value, swept || !repeated))
    }

    /// A run's step reservations (its whole-run hold is not one).
    fn steps_of(&self, run_id: &RunId) -> &[ReservationId] {
        self.run_steps.get(run_id).map_or(&[], Vec::as_slice)
    }

    fn run_charged(&self, run: &Run) -> Micros {
        self.steps_of(&run.id)
            .iter()
            .filter_map(|s| self.reservations.get(s))
            .fold(Micros::ZERO, |a, r| a.add_capped(r.charged))
    }

    /// Rate-limits guest session creation per address prefix and globally. `dry`: answers
    /// what a creation would, applying nothing.
    pub fn create_session(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        ips: &[IpScope],
        dry: bool,
    ) -> Result<Applied<Result<SessionGrant, Refusal>>, LedgerError> {
        let (now, swept) = self.advance(now);
        let now_us = now.0.saturating_mul(1000);
        let mut tats = Vec::new();
        let mut pressure = false;
        let mut checks: Vec<(String, crate::Rate, ScopeKind)> = Vec::new();
        if let Some(r) = policy.session_create_per_ip {
            for ip in ips {
                check_id("address prefix", &ip.prefix)?;
                checks.push((
                    format!("create|ip:{}", ip.prefix),
                    r.scaled(ip.factor.max(1)),
                    ScopeKind::Ip,
                ));
            }
        }
        if let Some(r) = policy.session_create_global {
            checks.push(("create|global".to_string(), r, ScopeKind::Global));
        }
        for (key, rate, kind) in checks {
            let tat = self.rates.get(&key).copied().unwrap_or(0);
            match rate.check(tat, now_us) {
                Ok(t) => {
                    // Pressure: more than half the burst is in use.
                    let half = rate.interval_us().saturating_mul(rate.burst.max(1)) / 2;
                    if t.saturating_sub(now_us) > half {
                        pressure = true;
                    }
                    tats.push((key, t));
                }
                Err(wait) => {
                    let r = Refusal::new(
                        RefusalCode::RateLimited,
                        Some(kind),
                        format!("session creation rate exceeded ({})", kind.name()),
                    )
                    .retry_after(wait.div_ceil(1_000_000));
                    if swept {
                        self.bump();
                    }
                    return Ok(self.answer(Err(r), swept));
                }
            }
        }
        if dry {
            if swept {
                self.bump();
            }
            return Ok(self.answer(Ok(SessionGrant { pressure }), swept));
        }
        for (k, t) in tats {
            self.rates.insert(k.clone(), t);
            self.touch(Entity::Rate(k));
        }
        self.bump();
        Ok(self.answer(Ok(SessionGrant { pressure }), true))
    }

    /// Marks `key` as used for `ttl_ms`; true only for the first call.
    pub fn consume_once(
        &mut self,
        now: UnixMs,
        key: &str,
        ttl_ms: u64,
    ) -> Result<Applied<bool>, LedgerError> {
        let (now, swept) = self.advance(now);
        check_id("single-use key", key)?;
        let key = format!("once:{key}");
        if self.idempotency.contains_key(&key) {
            return Ok(self.answer(false, swept));
        }
        self.mark_used(key, String::new(), now.plus_ms(ttl_ms))?;
        self.bump();
        Ok(self.answer(true, true))
    }

    /// Records single-use `key` (with what it was used for) until `expires`.
    fn mark_used(
        &mut self,
        key: String,
        fingerprint: String,
        expires: UnixMs,
    ) -> Result<(), LedgerError> {
        if self.records_held() >= LEDGER_RECORDS_MAX {
            return Err(LedgerError::Full(LEDGER_RECORDS_MAX));
        }
        self.idempotency.insert(
            key.clone(),
            IdempotencyRecord {
                key: key.clone(),
                fingerprint,
                outcome: IdempotentOutcome::Used,
                expires,
            },
        );
        self.timers
            .insert((expires, Timer::Idempotency(key.clone())));
        self.touch(Entity::Idempotency(key));
        Ok(())
    }

    /// Every budget counter that applies to these scopes in the current windows.
    pub fn usage(
        &self,
        policy: &Policy,
        now: UnixMs,
        scopes: &[(ScopeKey, u64)],
    ) -> Vec<UsageLine> {
        let now = now.max(self.clock);
        Self::budget_counters(policy, scopes, now)
            .into_iter()
            .map(|(k, limit)| {
                let c = self.counter_view(&k, limit);
                UsageLine {
                    resets_at: k.window.resets_at(),
                    scope: k.scope,
                    window: k.window,
                    limit,
                    used: c.used,
                    reserved: c.reserved,
                    overrun: c.overrun,
                }
            })
            .collect()
    }

    /// The scope list of a request, in the order usage is reported.
    pub fn request_scopes(
        session: &str,
        ips: &[IpScope],
        conversation: Option<&str>,
    ) -> Vec<(ScopeKey, u64)> {
        let mut v = run_scopes(session, ips, conversation.unwrap_or(""));
        if conversation.is_none() {
            v.pop();
        }
        v
    }

    /// Records a replica's policy fingerprint as seen at `now` (never before the ledger's
    /// clock) and answers every live replica. Changes no record and no sequence number.
    pub fn announce(
        &mut self,
        now: UnixMs,
        replica: &str,
        fingerprint: &str,
    ) -> Result<Vec<crate::replicas::ReplicaSeen>, LedgerError> {
        self.replicas
            .announce(now.max(self.clock), replica, fingerprint)
    }

    /// Every replica live at `now` (never before the ledger's clock).
    pub fn replicas_live(&self, now: UnixMs) -> Vec<crate::replicas::ReplicaSeen> {
        self.replicas.live(now.max(self.clock))
    }

    pub fn set_cutoff(&mut self, now: UnixMs, engaged: bool, reason: &str) -> Applied<bool> {
        let (_, swept) = self.advance(now);
        let new = engaged.then(|| reason.to_string());
        let changed = new != self.cutoff;
        self.cutoff = new;
        if changed || swept {
            self.bump();
        }
        self.answer(engaged, changed || swept)
    }

    /// Charges (positive) or credits (negative) a scope's current windows. A credit never
    /// takes `used` below zero.
    pub fn adjust(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        scope: &ScopeKey,
        factor: u64,
        amount: i64,
        once: Option<&str>,
    ) -> Result<Applied<Adjustment>, LedgerError> {
        let (now, swept) = self.advance(now);
        if scope.kind == ScopeKind::Run {
            return Err(LedgerError::Invalid(
                "adjust a run through its steps".into(),
            ));
        }
        // The scope's limits as its admissions see them: a wider address prefix is limited at
        // `factor` times the configured amounts.
        let scopes = [(scope.clone(), factor.max(1))];
        let counters = Self::budget_counters(policy, &scopes, now);
        if counters.is_empty() {
            return Err(LedgerError::Invalid(format!(
                "no budget applies to {scope}"
            )));
        }
        if let Some(once) = once {
            check_id("adjustment key", once)?;
            let key = format!("once:adjust:{once}");
            let fingerprint = format!("{scope}|{factor}|{amount}");
            if let Some(r) = self.idempotency.get(&key) {
                if r.fingerprint != fingerprint {
                    return Err(LedgerError::IdempotencyConflict);
                }
                let value = Adjustment {
                    lines: self.usage(policy, now, &scopes),
                    repeated: true,
                };
                if swept {
                    self.bump();
                }
                return Ok(self.answer(value, swept));
            }
            self.mark_used(key, fingerprint, now.plus_ms(ADJUSTMENT_KEY_TTL_MS))?;
        }
        for (key, limit) in &counters {
            let c = self.counter_mut(key, *limit);
            let before = c.used;
            if amount >= 0 {
                c.used = c.used.add_capped(Micros(amount.unsigned_abs()));
            } else {
                let credit = Micros(amount.unsigned_abs()).min(c.used);
                c.used = c.used.saturating_sub(credit);
            }
            // What was applied (a credit stops at zero, a charge at MICROS_MAX), so that
            // used = charges + adjustments holds (I2).
            let delta = i128::from(c.used.0) - i128::from(before.0);
            c.adjusted = c
                .adjusted
                .saturating_add(i64::try_from(delta).unwrap_or(i64::MAX));
            // A charge on top of what is held may take the scope past its limit (I1's
            // exception, as an overrun): it is closed for the rest of its window.
            if c.used.add_capped(c.reserved) > c.limit {
                c.overrun = true;
            }
        }
        self.bump();
        let value = Adjustment {
            lines: self.usage(policy, now, &scopes),
            repeated: false,
        };
        Ok(self.answer(value, true))
    }

    /// Totals of the ledger, from running counts (O(1)).
    pub fn summary(&self, now: UnixMs) -> Summary {
        let _ = now;
        let st = &self.stats;
        let mut reservations = StdHashMap::new();
        for state in STATES {
            let n = st.by_state[state_index(state)];
            if n > 0 {
                reservations.insert(state.name().to_string(), n);
            }
        }
        debug_assert!(
            self.summary_matches_scan(st),
            "running totals drifted from the records"
        );
        Summary {
            seq: self.seq,
            cutoff: self.cutoff.clone(),
            runs_active: st.runs_active,
            reservations,
            held_micros: Micros(st.held.min(MICROS_MAX.0)),
            charged_micros: Micros(st.charged.min(MICROS_MAX.0)),
            overruns: st.overruns,
        }
    }

    /// Recomputes the totals by scanning (debug builds check the running ones against it on
    /// ledgers small enough to scan).
    fn summary_matches_scan(&self, st: &Stats) -> bool {
        if self.reservations.len() > 10_000 {
            return true;
        }
        let mut scan = Stats::default();
        for r in self.reservations.values() {
            scan.count(r, true);
        }
        scan.runs_active = self
            .runs
            .values()
            .filter(|r| r.state == RunState::Active)
            .count() as u64;
        scan == *st
    }

    pub fn reservations(&self, state: Option<ReservationState>, limit: usize) -> Vec<Reservation> {
        let mut v: Vec<&Reservation> = self
            .reservations
            .values()
            .filter(|r| state.is_none_or(|s| r.state == s))
            .collect();
        // (the newest `limit` in O(n), not a sort of every reservation: a dashboard listing
        // runs on the store's writer, between admissions)
        first_in_order(&mut v, limit, |a, b| {
            b.created.cmp(&a.created).then_with(|| a.id.cmp(&b.id))
        });
        v.into_iter().take(limit).cloned().collect()
    }

    pub fn reservation(&self, id: &ReservationId) -> Option<&Reservation> {
        self.reservations.get(id)
    }

    pub fn run(&self, id: &RunId) -> Option<&Run> {
        self.runs.get(id)
    }

    /// The counters of one scope kind with the most used, for the current windows and all.
    pub fn top_counters(&self, kind: Option<ScopeKind>, top: usize) -> Vec<(CounterKey, Counter)> {
        let mut v: Vec<(&CounterKey, &Counter)> = self
            .counters
            .iter()
            .filter(|(k, _)| kind.is_none_or(|kd| k.scope.kind == kd))
            .collect();
        let order = |a: &(&CounterKey, &Counter), b: &(&CounterKey, &Counter)| {
            (b.1.used.add_capped(b.1.reserved))
                .cmp(&a.1.used.add_capped(a.1.reserved))
                .then_with(|| a.0.cmp(b.0))
        };
        first_in_order(&mut v, top, order);
        v.into_iter()
            .take(top)
            .map(|(k, c)| (k.clone(), *c))
            .collect()
    }

    pub fn counter(&self, key: &CounterKey) -> Option<Counter> {
        self.counters.get(key).copied()
    }

    /// Checks I1 and I2 over the whole ledger; returns the first violation found. Used by
    /// tests and debug assertions; O(size of the ledger).
    pub fn check_invariants(&self) -> Result<(), String> {
        // Each run's list of steps holds exactly its step reservations, each once.
        let mut listed = 0usize;
        for (run_id, steps) in &self.run_steps {
            if !self.runs.contains_key(run_id) {
                return Err(format!(
                    "steps are listed for run {}, which does not exist",
                    run_id.0
                ));
            }
            let mut seen: HashSet<&ReservationId> = HashSet::default();
            for s in steps {
                let is_step = self
                    .reservations
                    .get(s)
                    .is_some_and(|r| r.run_id == *run_id && r.kind != ReservationKind::RunHold);
                if !is_step {
                    return Err(format!(
                        "run {} lists {}, not one of its steps",
                        run_id.0, s.0
                    ));
                }
                if !seen.insert(s) {
                    return Err(format!("run {} lists {} twice", run_id.0, s.0));
                }
            }
            listed += steps.len();
        }
        let steps = self
            .reservations
            .values()
            .filter(|r| r.kind != ReservationKind::RunHold && self.runs.contains_key(&r.run_id))
            .count();
        if listed != steps {
            return Err(format!(
                "{listed} steps are listed among runs, {steps} exist"
            ));
        }
        // Per counter: charged, held, and whether an overrun was charged to it (an overrun
        // may take used + reserved past the limit while used is still within it).
        let mut sums: HashMap<&CounterKey, (u64, u64, bool)> = HashMap::default();
        for r in self.reservations.values() {
            for k in &r.counters {
                let e = sums.entry(k).or_default();
                if r.state == ReservationState::Held {
                    e.1 += r.amount.0;
                } else {
                    e.0 += r.charged.0;
                }
                e.2 |= r.overrun;
            }
            let terminal_ok = match r.state {
                ReservationState::Held | ReservationState::Committed => true,
                ReservationState::Released => r.charged == Micros::ZERO,
                ReservationState::Unknown | ReservationState::Expired => r.charged >= r.amount,
            };
            if !terminal_ok {
                return Err(format!(
                    "reservation {:?} in {:?} charged {}",
                    r.id, r.state, r.charged
                ));
            }
        }
        for (k, c) in &self.counters {
            let (charged, held, overran) = sums.get(k).copied().unwrap_or_default();
            if !c.overrun && !overran && c.used.0 + c.reserved.0 > c.limit.0 {
                return Err(format!("I1 violated on {k:?}: {c:?}"));
            }
            if c.reserved.0 != held {
                return Err(format!(
                    "reserved on {k:?} is {} but held reservations sum to {held}",
                    c.reserved
                ));
            }
            // (a counter saturated at MICROS_MAX no longer adds up)
            let expect = i128::from(charged) + i128::from(c.adjusted);
            if c.used < MICROS_MAX && i128::from(c.used.0) != expect {
                return Err(format!(
                    "I2: used on {k:?} is {} but charges sum to {charged} and adjustments to {}",
                    c.used, c.adjusted
                ));
            }
        }
        Ok(())
    }
}

/// How to resolve a held step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    Commit(Settlement),
    Release,
    Unknown,
}

fn charge_of(res: &Reservation, s: Settlement) -> Result<Micros, LedgerError> {
    match (&res.kind, s) {
        (ReservationKind::Model { price, .. }, Settlement::Tokens(u)) => Ok(price.charge(&u)),
        (ReservationKind::Tool { price, .. }, Settlement::Units(n)) => Ok(price.cost(n)),
        (ReservationKind::Tool { .. }, Settlement::ResultBytes(_)) => Ok(res.amount),
        (ReservationKind::Model { .. }, _) => Err(LedgerError::Invalid(
            "a model step commits with \"usage\"".into(),
        )),
        (ReservationKind::Tool { .. }, Settlement::Tokens(_)) => Err(LedgerError::Invalid(
            "a tool step commits with \"units\" or \"result_bytes\"".into(),
        )),
        (ReservationKind::RunHold, _) => Err(LedgerError::Invalid("not a step".into())),
    }
}

/// The refusal of the budget `r` names (counter `c` under `key`).
fn budget_refusal(key: &CounterKey, c: &Counter, r: BudgetRefusal) -> Refusal {
    let (code, state) = match r.shortfall {
        Shortfall::Spent => (RefusalCode::BudgetExhausted, "is spent"),
        Shortfall::Held => (RefusalCode::BudgetHeld, "is held by calls in flight"),
    };
    Refusal::new(
        code,
        Some(key.scope.kind),
        budget_message(key.scope.kind, &key.window, state, c),
    )
    .retry_after(r.retry_after_s)
}

/// The text of a budget refusal (`state`: "is spent", "is held by calls in flight"); the
/// Redis store writes the same from the script's fields.
pub fn budget_message(kind: ScopeKind, window: &WindowId, state: &str, c: &Counter) -> String {
    format!(
        "{} budget for {window} {state} ({} used, {} reserved of {})",
        kind.name(),
        c.used,
        c.reserved,
        c.limit
    )
}

struct RunPlan {
    tats: Vec<(String, u64)>,
    rate_left: Option<RateLeft>,
    slots: Vec<ScopeKey>,
    counters: Vec<(CounterKey, Micros)>,
    dry_run: Option<Refusal>,
}

#[derive(Clone, Copy)]
enum StepCounter {
    Model(bool),
    Tool,
}

struct StepPlan {
    amount: Micros,
    max_out: Option<u64>,
    shrunk: bool,
    counters: Vec<(CounterKey, Micros)>,
    counter_kind: StepCounter,
    dry_run: Option<Refusal>,
}

// Unused import guard for ScopePolicy in docs.
#[allow(dead_code)]
fn _policy_type_check(_: &ScopePolicy) {}

/// Leaves in `v` its first `n` elements in `order`, sorted: the selection in linear time,
/// then only those sorted (the ledger may hold millions of counters, and this runs on a
/// store's one writer).
fn first_in_order<T>(v: &mut Vec<T>, n: usize, order: impl Fn(&T, &T) -> std::cmp::Ordering) {
    if n < v.len() {
        if n == 0 {
            v.clear();
            return;
        }
        v.select_nth_unstable_by(n - 1, &order);
        v.truncate(n);
    }
    v.sort_by(&order);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::Rate;
    use crate::scope::Budget;

    /// Storage keys are stable (a store finds its rows by them): one of each kind, spelled out.
    #[test]
    fn storage_keys_are_spelled_as_stored() {
        let day = Window::Day.at(UnixMs(86_400_000 * 3));
        let counter = |kind, id: &str| {
            Entity::Counter(CounterKey {
                scope: ScopeKey::new(kind, id),
                window: day,
            })
        };
        let cases = [
            (Entity::Meta, "m"),
            (counter(ScopeKind::Global, ""), "c|global|day|3"),
            (counter(ScopeKind::Session, "s1"), "c|session:s1|day|3"),
            (
                counter(ScopeKind::Ip, "10.0.0.0/24"),
                "c|ip:10.0.0.0/24|day|3",
            ),
            (Entity::Rate("rate|x".into()), "g|rate|x"),
            (Entity::Run(RunId("run-1".into())), "r|run-1"),
            (
                Entity::Reservation(ReservationId("stp-1".into())),
                "s|stp-1",
            ),
            (Entity::Idempotency("k".into()), "i|k"),
        ];
        for (entity, key) in cases {
            assert_eq!(entity.storage_key(), key);
            let mut out = String::from("prefix/");
            entity.write_storage_key(&mut out);
            assert_eq!(out, format!("prefix/{key}"));
        }
    }

    #[test]
    fn first_in_order_selects_and_sorts() {
        let desc = |a: &u32, b: &u32| b.cmp(a);
        let all: Vec<u32> = (0..1000).map(|i| (i * 7919) % 1000).collect();
        for n in [0, 1, 2, 10, 999, 1000, 5000] {
            let mut v = all.clone();
            first_in_order(&mut v, n, desc);
            let mut want = all.clone();
            want.sort_by(desc);
            want.truncate(n);
            assert_eq!(v, want, "n = {n}");
        }
    }

    fn policy() -> Policy {
        let rate = |count, burst| {
            Some(Rate {
                count,
                period_ms: 60_000,
                burst,
            })
        };
        let mut p = Policy::default();
        p.global.rate = rate(600, 100);
        p.ip.rate = rate(60, 10);
        p.session.rate = rate(6, 3);
        p.global.concurrency = None;
        p.ip.concurrency = None;
        p.session.concurrency = None;
        p.conversation.concurrency = None;
        p
    }

    fn req(run: &str, conversation: &str) -> RunRequest {
        RunRequest {
            run_id: RunId(run.into()),
            session: "s1".into(),
            ips: vec![IpScope {
                prefix: "192.0.2.1".into(),
                factor: 1,
            }],
            conversation: conversation.into(),
            input_bytes: 10,
        }
    }

    fn admit(l: &mut Ledger, p: &Policy, now: UnixMs, run: &str) -> Result<RunAdmitted, Refusal> {
        l.admit_run(p, now, &req(run, run), None)
            .expect("valid request")
            .value
    }

    /// A run's steps are not in its record: a ledger restored from its records lists them
    /// again from the reservations, so a finish after a restart settles every held step.
    #[test]
    fn a_restored_ledger_lists_each_runs_steps() {
        let p = policy();
        let mut l = Ledger::new();
        let now = UnixMs(1_000);
        let tool = |run: &str, step: &str| StepRequest {
            run_id: RunId(run.into()),
            step_id: ReservationId(step.into()),
            kind: StepKind::Tool {
                tool: "t".into(),
                price: ToolPrice {
                    per_call: Micros(10),
                    per_unit: Micros(0),
                },
                units: 1,
            },
        };
        for (run, steps) in [("a", 3), ("b", 1), ("c", 0)] {
            admit(&mut l, &p, now, run).expect("admitted");
            for i in 0..steps {
                let r = l.reserve_step(&p, now, &tool(run, &format!("{run}.{i}")), None);
                r.expect("valid").value.expect("reserved");
            }
        }
        l.check_invariants().expect("invariants");
        let mut restored = Ledger::restore(l.records(), false);
        restored
            .check_invariants()
            .expect("invariants after restore");
        for (run, steps) in [("a", 3), ("b", 1), ("c", 0)] {
            let ended = restored
                .finish(&p, now, &RunId(run.into()))
                .expect("finish");
            assert_eq!(ended.value.steps, steps, "run {run}");
            assert_eq!(
                ended.value.charged,
                Micros(10 * u64::from(steps)),
                "run {run}"
            );
        }
        assert!(restored
            .reservations(None, 100)
            .iter()
            .all(|r| r.state == ReservationState::Unknown));
        restored
            .check_invariants()
            .expect("invariants after finish");
    }

    /// A backlog of expiries larger than one sweep's bound is worked off over several sweeps.
    #[test]
    fn a_sweep_expires_a_bounded_number() {
        let mut p = policy();
        for sp in [
            &mut p.global,
            &mut p.ip,
            &mut p.session,
            &mut p.conversation,
        ] {
            sp.rate = None;
            sp.budgets.clear();
        }
        let mut l = Ledger::new();
        let runs = SWEEP_EXPIRIES_MAX + 10;
        for i in 0..runs {
            admit(&mut l, &p, UnixMs(1_000), &format!("r{i}")).expect("admitted");
        }
        let later = UnixMs(1_000 + p.lease_ttl_ms + 1);
        let first = l.sweep(later).value;
        assert!(first >= SWEEP_EXPIRIES_MAX, "{first}");
        let active = |l: &Ledger| {
            l.runs
                .values()
                .filter(|r| r.state == RunState::Active)
                .count()
        };
        assert_eq!(active(&l), 10, "one sweep expired exactly its bound");
        l.sweep(later);
        assert_eq!(active(&l), 0);
    }

    #[test]
    fn admission_reports_the_tightest_rate_scope() {
        let p = policy();
        let mut l = Ledger::new();
        let now = UnixMs(1_700_000_000_000);
        let mut seen = Vec::new();
        for run in ["r1", "r2", "r3"] {
            let a = admit(&mut l, &p, now, run).expect("within burst");
            seen.push(a.rate_left.expect("session has a rate"));
        }
        // Session: 6/minute (one unit per 10 s), burst 3.
        let left = |remaining| RateLeft {
            scope: ScopeKind::Session,
            remaining,
            reset_s: 10,
        };
        assert_eq!(seen, [left(2), left(1), left(0)]);
        let refused = admit(&mut l, &p, now, "r4").expect_err("burst spent");
        assert_eq!(refused.code, RefusalCode::RateLimited);
        assert_eq!(refused.retry_after_s, Some(10));
        // 2.5 s later: 7.5 s until the next unit, rounded up.
        let later = UnixMs(now.0 + 12_500);
        let a = admit(&mut l, &p, later, "r5").expect("one unit regained");
        assert_eq!(
            a.rate_left,
            Some(RateLeft {
                scope: ScopeKind::Session,
                remaining: 0,
                reset_s: 8,
            })
        );
    }

    #[test]
    fn admission_without_rates_reports_none_and_ties_take_the_longer_reset() {
        let mut p = policy();
        p.global.rate = None;
        p.ip.rate = None;
        p.session.rate = None;
        let mut l = Ledger::new();
        let now = UnixMs(1_700_000_000_000);
        let a = admit(&mut l, &p, now, "r1").expect("admitted");
        assert_eq!(a.rate_left, None);
        // Same burst left on ip and session; the ip's unit comes back later.
        p.ip.rate = Some(Rate {
            count: 1,
            period_ms: 60_000,
            burst: 2,
        });
        p.session.rate = Some(Rate {
            count: 2,
            period_ms: 60_000,
            burst: 2,
        });
        let a = admit(&mut l, &p, now, "r2").expect("admitted");
        assert_eq!(
            a.rate_left,
            Some(RateLeft {
                scope: ScopeKind::Ip,
                remaining: 1,
                reset_s: 60,
            })
        );
    }

    /// An operator's adjustment sees a wider address prefix's scaled limit (a credit does not
    /// close it as overrun), and records what it applied (a credit stops at zero), so that
    /// used = charges + adjustments holds (I2).
    #[test]
    fn adjustments_keep_the_scaled_limit_and_record_what_they_applied() {
        let mut p = policy();
        p.ip.budgets = vec![Budget {
            amount: Micros(1_000_000),
            window: Window::Day,
        }];
        let now = UnixMs(1_700_000_000_000);
        let wide = ScopeKey::new(ScopeKind::Ip, "2001:db8::/48");
        let mut l = Ledger::new();
        // The /48 has spent 2.00 of its 16 × 1.00.
        let charged = l
            .adjust(&p, now, &wide, 16, 2_000_000, None)
            .expect("charge");
        assert_eq!(charged.value.lines[0].limit, Micros(16_000_000));
        let credited = l.adjust(&p, now, &wide, 16, -1, None).expect("credit");
        let line = &credited.value.lines[0];
        assert_eq!(
            (line.limit, line.used, line.overrun),
            (Micros(16_000_000), Micros(1_999_999), false)
        );
        let mut r = req("r1", "c1");
        r.ips.push(IpScope {
            prefix: wide.id.clone(),
            factor: 16,
        });
        let admitted = l.admit_run(&p, now, &r, None).expect("valid").value;
        assert!(admitted.is_ok(), "the /48 still has room: {admitted:?}");

        // A credit larger than what was used takes it to zero and records only that.
        let session = ScopeKey::new(ScopeKind::Session, "s9");
        p.session.budgets = p.ip.budgets.clone();
        l.adjust(&p, now, &session, 1, 300, None).expect("charge");
        let line = l
            .adjust(&p, now, &session, 1, -1_000, None)
            .expect("credit")
            .value
            .lines[0]
            .clone();
        assert_eq!(line.used, Micros(0));
        let counter = l
            .counters
            .iter()
            .find(|(k, _)| k.scope == session)
            .map(|(_, c)| *c)
            .expect("counter");
        assert_eq!(counter.adjusted, 0, "+300 then -300 applied");
        l.check_invariants().expect("I1 and I2 hold");
    }
}
