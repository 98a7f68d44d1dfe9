//! The ledger: every budget counter, rate state, concurrency slot, run and reservation, and
//! the operations that change them. Pure: every operation takes `now` from the caller (the
//! store's clock) and either applies completely or changes nothing.
//!
//! The memory and sqlite stores hold one `Ledger` each; the Redis store implements the same
//! operations as server-side scripts and is held to the same answers by the conformance suite.
//!
//! One [`Ledger`] struct (here), its operations in one module per concept:
//! - what it holds: `model` (counters, runs, reservations), `messages` (what operations take
//!   and answer), `refusal` and `error`, `records` (the durable form: entities, records,
//!   restore) and `stats` (running totals, the summary);
//! - what it does: `runs` (admit, heartbeat, finish), `steps` (reserve a step), `resolve`
//!   (commit, release, unknown), `budgets` (which counters, whether an amount fits, hold and
//!   charge), `expire` (the clock, leases, purges, the sweep), `idempotency`, `sessions`,
//!   `operator` (cutoff, adjustments), `presence` (replicas), `queries` (reads),
//!   `invariants` and `outbox` (the usage history each call makes, when asked).
//!
//! Imports go one way: the operations use the "holds" modules, never each other (they call
//! each other's methods on `Ledger`); those use nothing above them. The ledger uses
//! [`crate::admission`] for the decision, and nothing in the crate below it uses the ledger.

mod budgets;
mod error;
mod expire;
mod idempotency;
mod invariants;
mod messages;
mod model;
mod operator;
mod outbox;
mod presence;
mod queries;
mod records;
mod refusal;
mod resolve;
mod runs;
mod sessions;
mod stats;
mod steps;
#[cfg(test)]
mod tests;

pub use crate::admission::{HELD_RETRY_AFTER_S, LIFETIME_RETRY_AFTER_S};
pub use budgets::budget_message;
pub use error::LedgerError;
pub use messages::{
    Adjustment, Applied, Heartbeat, IdempotencyKey, IdempotencyRecord, IdempotentOutcome, RateLeft,
    Resolution, Resolved, RunAdmitted, RunEnded, RunRequest, SessionGrant, Settlement, StepKind,
    StepRequest, StepReserved, Summary, UsageLine,
};
pub use model::{
    Counter, CounterKey, Reservation, ReservationId, ReservationKind, ReservationState, Run, RunId,
    RunState, RunTally,
};
pub use outbox::HISTORY_OUTBOX_MAX;
pub use records::{Entity, Record, RecordRef};
pub use refusal::{Refusal, RefusalCode};

use crate::replicas::ReplicaTable;
use crate::scope::ScopeKey;
use crate::window::UnixMs;
use stats::Stats;
use std::collections::BTreeSet;

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

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Timer {
    Lease(RunId),
    Purge(RunId),
    Idempotency(String),
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
    /// The usage history not yet taken by the store (`None`: the ledger keeps no history;
    /// not persisted). See `outbox`.
    history: Option<outbox::Outbox>,
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
    replicas: ReplicaTable,
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

    fn answer<T>(&self, value: T, changed: bool) -> Applied<T> {
        Applied {
            value,
            seq: self.seq,
            changed,
        }
    }
}
