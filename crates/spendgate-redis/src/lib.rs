//! spendgate's `redis` store: every ledger operation is one atomic server-side Lua script.
//!
//! # Design
//!
//! * **One function, one operation per call.** `ledger.lua` is a transcription of
//!   `spendgate_core::Ledger`: the same checks in the same order, the same answers, the same
//!   `ledger_seq` arithmetic (inside the function). It is a Redis function library (Redis 7:
//!   `FUNCTION LOAD`, called with `FCALL`), so its ~80 helpers are defined once at load rather
//!   than on every call, and the parsed policy is cached by policy string. The library name
//!   carries a digest of the code, so replicas of different versions each call their own.
//!   When Redis answers "Function not found" (flushed, restarted empty) the library is loaded
//!   again and the call re-run, which is safe because the function did not run. No other
//!   failure is retried: an answer that was lost leaves the outcome unknown, and a
//!   reservation made that way stays held until it expires and is charged in full (I3).
//!   Read-only operations call the same code registered `no-writes`. `execute_many` sends
//!   its commands in one call (`batch`): one round trip, one epoch check, each command still
//!   applied on its own and its changes written before the next starts. Per call, the meta hash
//!   is read once (two fields: the epoch and everything else packed) and written once,
//!   records (runs, reservations, counters) are read once (several in one `MGET` where the
//!   keys are known: a step's run and counters) and written together in one `MSET` at the end
//!   of the command, and the top indexes only rewritten when a counter's score moves.
//! * **Storage, shaped by what a call costs.** Script time goes mostly to the number of
//!   `redis.call`s, the number of fields they move (each one a string made and parsed) and
//!   the Lua tables built, so records are strings packed with `struct` (numbers as doubles,
//!   exact below 2^53; cheaper to read and write than msgpack): a run is one record holding
//!   its counters of steps, its lifetime counter,
//!   its step ids with their charged sum and held count (finish reads no step) and, packed
//!   apart, its immutable part (parsed only by a step); a reservation is one record; a budget
//!   counter is one record. Run records are cached per call and written once at its end.
//!   Indexes: top counters per scope kind and reservations per state (listings of all kinds
//!   or states merge them, the decoder sorts and truncates); timers in one sorted set, with a
//!   lower bound of its first score kept in meta so that most calls do not read it; a lease
//!   renewal does not move its run's timer (the timer stays at or before the lease, and is
//!   put at the lease when it comes due early). Global counters are listed from a set rather
//!   than ranked (they are few). The epoch is part of the meta hash.
//! * **One clock.** With [`ClockSource::Server`] the script reads the Redis server's `TIME`,
//!   so replicas with skewed clocks agree on windows, GCRA and leases. Window ids (including
//!   UTC calendar months) are computed inside the script with the same civil-date arithmetic
//!   as `spendgate_core::window`, so no boundary retry dance is needed. As in the core, the
//!   clock is held at the largest value seen (`meta.clock`) and never goes back.
//! * **Keys.** Every key is `{prefix}:...`: one hash tag per deployment (Redis Cluster safe;
//!   the prefix may not contain braces). Outside identifiers (run, step, session,
//!   conversation, address prefix, idempotency key) appear in key names after the base and a
//!   fixed part: the hash tag is the first `{...}`, the base's, so an identifier cannot move a
//!   key to another slot. `KEYS[1]` is the `{prefix}` base;
//!   the script derives the other keys of that same slot.
//! * **Exact integers.** Every amount, timestamp and TAT is an integer below 2^53 (exact in a
//!   Lua double); numbers are formatted with `%d`, never with Lua's 14-digit `tostring`.
//!   Price × tokens products (u128 in the core) are computed exactly by splitting counts into
//!   10^6 limbs, saturating at [`MICROS_MAX`] like the core. [`RedisStore::open`] refuses a
//!   policy with a figure above 2^53 - 1.
//! * **Check before writing.** An operation decides completely before its first write; the
//!   only writes that may precede a refusal are due expiries, which the core applies first
//!   too. Loops are bounded: 256 expiries per call (per sweep too), bounded listings.
//! * **Redis as a ledger.** `ready()` fails unless the node is a primary and
//!   `maxmemory-policy` is `noeviction`
//!   (admissions are refused too); it logs a warning when AOF is off or `appendfsync` is not
//!   `always`. A ledger id and an epoch (fields of the meta hash `{prefix}:meta`) are written
//!   when a ledger is created ([`RedisStore::init`], `spendgate store init`; never by a
//!   replica), and the ledger id is pinned in every replica's config
//!   ([`RedisOptions::ledger_id`]): a store refuses a Redis whose ledger id is missing (it came
//!   back empty, or was re-made by a build without ids) or another. Each store remembers the
//!   epoch id and the highest `ledger_seq` it has seen, and keeps them in a witness file on its
//!   own disk ([`witness`], written at most every [`WITNESS_EVERY`], off the request path,
//!   and loaded at start); a script that finds the epoch missing (Redis came back empty),
//!   different (re-initialised) or the seq lower (restored from an old snapshot) refuses, and
//!   the store answers [`StoreError::Unavailable`]. A rollback of the pinned ledger reopens
//!   only by [`RedisStore::accept_reset`] (with the operator's consent), which writes a new
//!   epoch that every store adopts when it is newer than the one it knows; an emptied prefix
//!   never reopens: only a new ledger ([`InitMode::NewLedger`]), with a new id to pin, starts
//!   there. A detected rollback is marked in the meta hash, so every store refuses, not only
//!   the one that saw it.
//!
//! Limitations, documented rather than hidden: operator adjustments are summed in a double
//! (`Counter::adjusted` is exact while it stays below 2^53 in magnitude); a sweep processes at
//! most 256 expiries, 1024 idle rates and 1024 stale counters per call (the core: `SWEEP_EXPIRIES_MAX` expiries and all the rest);
//! listings return at most 100 000 entries.

pub mod history;
pub mod plant;
mod protocol;
pub mod witness;

use protocol::{Call, Item};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use sha2::{Digest, Sha256};
use spendgate_core::{
    Command, Policy, Rate, Reply, ReservationMode, ScopeKind, EXPIRIES_PER_CALL_MAX,
    IDEMPOTENCY_RETENTION_MS, ID_BYTES_MAX, LEDGER_RECORDS_MAX, MICROS_MAX, RECORD_RETENTION_MS,
};
use spendgate_store::{Clock, Store, StoreError};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use protocol::LISTING_MAX;
pub use witness::{Mark, WitnessError, WitnessFile, WITNESS_EVERY};

/// The ledger script, with the shebang of the writing copy.
const SCRIPT_BODY: &str = include_str!("ledger.lua");
/// How often admissions re-check the server's configuration (eviction policy, persistence).
const HEALTH_EVERY: Duration = Duration::from_secs(5);
/// The lowest seq a store accepts once it detected a rollback: nothing, until a reset.
const LATCHED_MIN_SEQ: &str = "9007199254740992";
/// Longest accepted key prefix.
const PREFIX_BYTES_MAX: usize = 64;
/// Cluster redirections (`MOVED`) one call follows at most.
const REDIRECTS_MAX: usize = 2;
/// A connection to `store.url`'s node that timed out or answered as a node that cannot serve
/// (read-only, loading) is checked against a new one (the name resolved again) at most this
/// often, and replaced when the new one reaches a primary: redis-rs reconnects only on a
/// dropped connection, so a half-open one (a host gone without a reset, a name or address
/// moved to a new primary) would otherwise fail every call until the kernel gives up on it,
/// many minutes later.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);
/// Attempts of one call when the epoch changed under it by an accepted reset.
const EPOCH_ATTEMPTS: usize = 3;

/// Where `now` comes from.
#[derive(Clone)]
pub enum ClockSource {
    /// Redis `TIME`, read inside each script (production).
    Server,
    /// Test only: `now` comes from this clock and is passed to the scripts as an argument
    /// (the conformance suite drives time by hand).
    Manual(Arc<dyn Clock>),
}

impl fmt::Debug for ClockSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClockSource::Server => f.write_str("Server"),
            ClockSource::Manual(c) => write!(f, "Manual({:?})", c.now()),
        }
    }
}

#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// `redis://host:port/db`
    pub url: String,
    /// Key prefix of this deployment (`store.prefix`): letters, digits, `_ . : -`.
    pub prefix: String,
    /// `store.timeout_ms`: past it a call answers unavailable, unless `slow_grace` extends it.
    pub timeout: Duration,
    /// `store.slow_grace_ms`: how much longer than `timeout` a call may wait for its answer
    /// (one slow call under load). The store's own bounds (connect, response, each call) are
    /// `timeout + slow_grace`; the server's `Timed` cuts calls at `timeout` alone once Redis
    /// did not answer within that (see `spendgate_store::Timed`). `Duration::ZERO`: no grace.
    pub slow_grace: Duration,
    pub clock: ClockSource,
    /// `store.ledger_id`: the ledger this store belongs to, as `spendgate store init` printed
    /// it. Required by [`RedisStore::open`] (a Redis whose ledger id is missing or another is
    /// refused); for [`RedisStore::init`] the pin the operator's config holds, if any.
    pub ledger_id: Option<String>,
    /// `store.witness_path`: the file that keeps this store's high-water mark across restarts
    /// ([`witness`]); `None`: none (a rollback seen by no running store then goes unseen).
    pub witness: Option<PathBuf>,
}

#[derive(Debug, Default)]
struct EpochState {
    /// The epoch id this store works under; `None` until first contact.
    id: Option<String>,
    /// The highest `ledger_seq` seen under that epoch.
    min_seq: u64,
    /// A rollback was detected: refuse until the epoch changes by an accepted reset.
    latched: bool,
    /// When that epoch was written (Redis clock, ms): a reset is adopted only when it is
    /// newer, so a Redis restored from a backup holding an older accepted reset is refused.
    at: u64,
    /// The Redis's ledger id was read and is the pinned one (first contact). Until then a
    /// witness may have set `id`, `min_seq` and `at`.
    checked: bool,
}

#[derive(Debug, Default)]
struct Health {
    /// When, and on which node ([`SlotConn::generation`]).
    checked: Option<(Instant, u64)>,
    fault: Option<String>,
    warned: Option<String>,
}

/// A store's witness ([`witness`]): records the store's high-water mark (the ledger, the
/// epoch and the highest `ledger_seq` it saw) in its file, from a task of the store's own
/// every [`WITNESS_EVERY`] when it moved, and on [`Witness::flush`] (a clean shutdown). The
/// request path only updates the mark in memory.
#[derive(Clone)]
pub struct Witness {
    file: Arc<WitnessFile>,
    state: Arc<Mutex<EpochState>>,
    ledger: String,
    /// The last mark written (or found covered) by this store.
    written: Arc<Mutex<Option<Mark>>>,
    writes: Arc<AtomicU64>,
}

impl fmt::Debug for Witness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Witness")
            .field("path", &self.file.path())
            .finish_non_exhaustive()
    }
}

impl Witness {
    /// The mark to record: once the Redis's ledger was checked, and an epoch known.
    fn mark(&self) -> Option<Mark> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !st.checked {
            return None;
        }
        Some(Mark {
            ledger: self.ledger.clone(),
            epoch: st.id.clone()?,
            epoch_at: st.at,
            seq: st.min_seq,
        })
    }

    /// Writes the mark now if it moved since the last write (on a blocking thread).
    pub async fn flush(&self) -> Result<(), WitnessError> {
        let Some(mark) = self.mark() else {
            return Ok(());
        };
        if self
            .written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            == Some(&mark)
        {
            return Ok(());
        }
        let (file, m) = (self.file.clone(), mark.clone());
        let wrote = tokio::task::spawn_blocking(move || file.record(&m))
            .await
            .map_err(|e| WitnessError::Io {
                path: self.file.path().to_path_buf(),
                what: "its writer stopped",
                source: std::io::Error::other(e.to_string()),
            })??;
        if wrote {
            self.writes.fetch_add(1, Ordering::Relaxed);
        }
        *self.written.lock().unwrap_or_else(|p| p.into_inner()) = Some(mark);
        Ok(())
    }

    /// How many times this store wrote the file.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Flushes every [`WITNESS_EVERY`]; a failed write is logged (once per distinct error)
    /// and tried again at the next tick: the ledger is Redis, and admissions go on, but a
    /// witness that stops advancing guards less.
    async fn run(self) {
        let mut tick = tokio::time::interval(WITNESS_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing: Option<String> = None;
        loop {
            tick.tick().await;
            match self.flush().await {
                Ok(()) => {
                    if failing.take().is_some() {
                        tracing::info!(witness = %self.file.path().display(), "witness written again");
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    if failing.as_ref() != Some(&msg) {
                        tracing::error!(error = %msg, "cannot write the witness: a rollback of Redis would not be seen after a restart");
                        failing = Some(msg);
                    }
                }
            }
        }
    }
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The Redis ledger backend. Cheap to share behind an `Arc`; one multiplexed connection
/// (reconnected automatically by [`ConnectionManager`]) to the node that serves the
/// deployment ([`SlotConn`]).
pub struct RedisStore {
    opts: RedisOptions,
    base: String,
    /// The pinned ledger id ([`RedisOptions::ledger_id`]).
    ledger: String,
    policy_arg: String,
    /// The policy, to rebuild `policy_arg` when the history stream's cap is set.
    policy: Policy,
    conn: Arc<SlotConn>,
    lib: Arc<Library>,
    epoch: Arc<Mutex<EpochState>>,
    health: tokio::sync::Mutex<Health>,
    refreshing: AtomicBool,
    witness: Option<Witness>,
    /// Writes the witness every [`WITNESS_EVERY`]; stopped when the store is dropped.
    _witness_task: Option<AbortOnDrop>,
    history: history::HistoryState,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("base", &self.base)
            .field("timeout", &self.opts.timeout)
            .finish_non_exhaustive()
    }
}

/// The ledger as a Redis function library: its name carries a digest of the code, so
/// replicas running different versions each call their own.
#[derive(Debug)]
struct Library {
    code: String,
    /// The function that may write.
    write: String,
    /// The same code registered `no-writes`, for the read-only operations.
    read: String,
}

fn library() -> Library {
    let body = plant::script(SCRIPT_BODY);
    let digest = Sha256::digest(body.as_bytes());
    let name = format!("spendgate_{}", hex::encode(&digest[..8]));
    Library {
        code: format!("#!lua name={name}\n{}", body.replace("SPENDGATE_FN", &name)),
        read: format!("{name}_ro"),
        write: name,
    }
}

/// `FCALL` on one node, loading the library first when that node does not have it (the
/// function did not run, so running it now is not a retry of an unknown outcome).
async fn fcall_on(
    conn: &mut ConnectionManager,
    lib: &Library,
    read: bool,
    base: &str,
    argv: &[&str],
) -> Result<redis::Value, redis::RedisError> {
    let build = || {
        let mut c = redis::cmd("FCALL");
        c.arg(if read { &lib.read } else { &lib.write })
            .arg(1)
            .arg(base)
            .arg(argv);
        c
    };
    match build().query_async::<redis::Value>(conn).await {
        Err(e) if e.to_string().contains("Function not found") => {
            let loaded = redis::cmd("FUNCTION")
                .arg("LOAD")
                .arg(&lib.code)
                .query_async::<redis::Value>(conn)
                .await;
            match loaded {
                Ok(_) => {}
                // Another replica loaded it meanwhile.
                Err(e) if e.to_string().contains("already exists") => {}
                Err(e) => return Err(e),
            }
            build().query_async::<redis::Value>(conn).await
        }
        other => other,
    }
}

/// `FCALL` on the node that serves the deployment's slot, following a cluster's `MOVED`
/// answers (at most [`REDIRECTS_MAX`] per call): a `MOVED` says the script did not run, so
/// running it on the named node is not a retry of an unknown outcome. `ASK` is not followed:
/// while a slot moves, the script's one declared key (the bare hash tag, never a key of its
/// own) is missing on the old node, so every call gets `ASK`; followed, the script would run
/// on the new node over a ledger only partly moved there. Refused instead (fail closed)
/// until the move completes and the old node answers `MOVED`.
async fn fcall(
    slot: &Arc<SlotConn>,
    lib: &Library,
    read: bool,
    base: &str,
    argv: &[&str],
    timeout: Duration,
) -> Result<Item, StoreError> {
    fcall_patient(slot, lib, read, base, argv, timeout, Duration::ZERO).await
}

/// [`fcall`], waiting up to `timeout + grace` for the answer (`store.slow_grace_ms`).
async fn fcall_patient(
    slot: &Arc<SlotConn>,
    lib: &Library,
    read: bool,
    base: &str,
    argv: &[&str],
    timeout: Duration,
    grace: Duration,
) -> Result<Item, StoreError> {
    // Shorter than the caller's own bound (`store.timeout_ms` + grace), so that a timeout is
    // seen here, where it can replace the connection.
    let bound = timeout + grace;
    let answer_within = bound - bound / 10;
    for _ in 0..=REDIRECTS_MAX {
        let node = slot.current();
        let mut conn = node.conn.clone();
        // A caller that stops waiting (the server's `Timed` cuts calls at `timeout` while
        // Redis is not answering) has the connection checked as a timeout here would.
        let mut unanswered = Unanswered {
            slot,
            node: &node,
            since: Instant::now(),
            after: timeout - timeout / 10,
            armed: true,
        };
        let answer =
            tokio::time::timeout(answer_within, fcall_on(&mut conn, lib, read, base, argv)).await;
        unanswered.armed = false;
        let Ok(answer) = answer else {
            slot.failed(&node);
            return Err(StoreError::Timeout(bound));
        };
        match answer {
            Ok(v) => return Item::from_value(v),
            Err(e) if e.code() == Some("MOVED") => {
                let Some((addr, _slot)) = e.redirect_node() else {
                    return Err(map_redis_error(e, timeout));
                };
                slot.moved(&node, addr)?;
            }
            Err(e) => {
                if node_unusable(&e) {
                    slot.failed(&node);
                }
                return Err(map_redis_error(e, timeout));
            }
        }
    }
    Err(unavailable(format!(
        "redis cluster redirected one call more than {REDIRECTS_MAX} times (slots moving?)"
    )))
}

/// Dropped while `armed`, after waiting at least `after`: the call was abandoned by its caller
/// without an answer, which checks the connection as a timeout does ([`SlotConn::failed`]).
struct Unanswered<'a> {
    slot: &'a Arc<SlotConn>,
    node: &'a Arc<Node>,
    since: Instant,
    after: Duration,
    armed: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.armed && self.since.elapsed() >= self.after {
            self.slot.failed(self.node);
        }
    }
}

/// Whether an error says that the node may no longer serve the deployment: no answer at all
/// (connection refused or dropped, a timeout, anything but a reply of the server), or a reply
/// of a node that is down, loading or no longer a primary. After such an error from a node the
/// store was redirected to, the next call asks `store.url`'s node again.
fn node_unusable(e: &redis::RedisError) -> bool {
    e.is_timeout()
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.code(),
            None | Some("CLUSTERDOWN" | "MASTERDOWN" | "LOADING" | "READONLY")
        )
}

/// One node of Redis: the one `store.url` names, or the one a Redis Cluster redirected the
/// store to.
struct Node {
    /// `host:port` of a node the cluster redirected to; `None`: the configured node.
    redirected_to: Option<String>,
    /// The host it is reached at (what an empty host in its own `MOVED` answers means).
    host: String,
    conn: ConnectionManager,
}

impl Node {
    /// The node `store.url` names.
    fn configured(info: &redis::ConnectionInfo, timeout: Duration) -> Result<Node, StoreError> {
        let host = match info.addr() {
            redis::ConnectionAddr::Tcp(host, _) | redis::ConnectionAddr::TcpTls { host, .. } => {
                host.clone()
            }
            _ => String::new(),
        };
        Ok(Node {
            redirected_to: None,
            host,
            conn: connection(info.clone(), timeout)?,
        })
    }
}

/// The `host` and `port` of a `MOVED` answer's endpoint (`host:port`, `[v6]:port`). An empty
/// host means the host of the connection that got the answer (`current`); `?` means the node
/// has no endpoint to give (`cluster-preferred-endpoint-type unknown-endpoint`).
fn redirect_target(addr: &str, current: &str) -> Result<(String, u16), StoreError> {
    let bad = || {
        unavailable(format!(
            "redis cluster redirected to {addr:?}, not a host:port"
        ))
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host {
        "?" => Err(bad()),
        "" if current.is_empty() => Err(bad()),
        "" => Ok((current.to_string(), port)),
        h => Ok((h.to_string(), port)),
    }
}

/// The connection to the node that serves the deployment: every key of a deployment carries
/// its hash tag, so one cluster slot, and one node, holds them all. Starts on the configured
/// node; a `MOVED` answer switches it to the node named; a failed connection to a node it was
/// redirected to switches it back to the configured node, which redirects it again to
/// whichever node serves the slot then (after a failover or a resharding).
struct SlotConn {
    info: redis::ConnectionInfo,
    /// The connections' own bounds: `store.timeout_ms` + `store.slow_grace_ms`.
    timeout: Duration,
    node: Mutex<Arc<Node>>,
    /// When the configured node's connection was last replaced ([`RECONNECT_EVERY`]).
    reconnected: Mutex<Option<Instant>>,
    /// Bumped at every switch, so that the server checks (eviction policy, persistence) run
    /// again on the new node.
    generation: AtomicU64,
}

impl SlotConn {
    fn open(opts: &RedisOptions) -> Result<SlotConn, StoreError> {
        let info = redis::IntoConnectionInfo::into_connection_info(opts.url.as_str())
            .map_err(|e| unavailable(format!("store.url is not a usable redis url: {e}")))?;
        let timeout = opts.timeout + opts.slow_grace;
        let node = Node::configured(&info, timeout)?;
        Ok(SlotConn {
            info,
            timeout,
            node: Mutex::new(Arc::new(node)),
            reconnected: Mutex::new(None),
            generation: AtomicU64::new(0),
        })
    }

    fn current(&self) -> Arc<Node> {
        self.node.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn switch(&self, from: &Arc<Node>, to: Node) {
        let mut node = self.node.lock().unwrap_or_else(|p| p.into_inner());
        // Another call may have switched already; its switch stands.
        if Arc::ptr_eq(&node, from) {
            tracing::warn!(
                from = from.redirected_to.as_deref().unwrap_or("store.url"),
                to = to.redirected_to.as_deref().unwrap_or("store.url"),
                "redis: the ledger's node changed"
            );
            *node = Arc::new(to);
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// `MOVED` from `from`: `addr` (`host:port`) serves the slot now.
    fn moved(&self, from: &Arc<Node>, addr: &str) -> Result<(), StoreError> {
        let (host, port) = redirect_target(addr, &from.host)?;
        let resolved = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let to = match self.info.addr() {
            redis::ConnectionAddr::Tcp(..) => redis::ConnectionAddr::Tcp(host.clone(), port),
            redis::ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => redis::ConnectionAddr::TcpTls {
                host: host.clone(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => {
                return Err(unavailable(format!(
                    "redis cluster redirected to {addr} but store.url is not a TCP address"
                )))
            }
        };
        let conn = connection(self.info.clone().set_addr(to), self.timeout)?;
        self.switch(
            from,
            Node {
                redirected_to: Some(resolved),
                host,
                conn,
            },
        );
        Ok(())
    }

    /// The connection to `from` failed or timed out: when it was a redirection, the next call
    /// goes to the configured node again. When it was the configured node, a new connection
    /// to it (the name resolved again) is tried in the background, at most every
    /// [`RECONNECT_EVERY`], and replaces this one only if it answers: a connection that is
    /// half-open, or to a node that no longer serves, is replaced; one to a Redis that is
    /// only slow or paused is kept (it answers again as soon as Redis does).
    fn failed(self: &Arc<Self>, from: &Arc<Node>) {
        if from.redirected_to.is_some() {
            match Node::configured(&self.info, self.timeout) {
                Ok(node) => self.switch(from, node),
                Err(e) => tracing::warn!(error = %e, "redis: cannot reconnect to store.url"),
            }
            return;
        }
        {
            let mut last = self.reconnected.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| t.elapsed() < RECONNECT_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        // (also called when a call is dropped: outside a runtime, e.g. at its shutdown, the
        // check is skipped)
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (slot, from) = (self.clone(), from.clone());
        runtime.spawn(async move {
            let node = match Node::configured(&slot.info, slot.timeout) {
                Ok(node) => node,
                Err(e) => {
                    tracing::warn!(error = %e, "redis: cannot reconnect to store.url");
                    return;
                }
            };
            let mut conn = node.conn.clone();
            let role = redis::cmd("ROLE");
            let probe = role.query_async::<redis::Value>(&mut conn);
            let primary = match tokio::time::timeout(slot.timeout, probe).await {
                Ok(Ok(redis::Value::Array(v))) => {
                    matches!(v.first(), Some(redis::Value::BulkString(b)) if b == b"master")
                }
                _ => false,
            };
            if primary {
                slot.switch(&from, node);
            }
        });
    }
}

fn unavailable(msg: impl Into<String>) -> StoreError {
    StoreError::Unavailable(msg.into())
}

fn check_prefix(prefix: &str) -> Result<String, StoreError> {
    let ok = !prefix.is_empty()
        && prefix.len() <= PREFIX_BYTES_MAX
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b));
    if !ok {
        return Err(unavailable(format!(
            "store.prefix {prefix:?} must be 1 to {PREFIX_BYTES_MAX} letters, digits, '_', '.', ':' or '-'"
        )));
    }
    Ok(format!("{{{prefix}}}"))
}

/// The policy as the script reads it (see `parse_policy` in ledger.lua). Refuses figures the
/// script could not represent exactly.
/// The script's policy argument: words the script reads in this order.
struct Out(Vec<String>);
impl Out {
    fn word(&mut self, w: &str) {
        self.0.push(w.to_string());
    }
    fn num(&mut self, v: u64, what: &str) -> Result<(), StoreError> {
        if v > MICROS_MAX.0 {
            return Err(unavailable(format!(
                "{what} = {v} is above 2^53 - 1, which the redis store cannot keep exact"
            )));
        }
        self.0.push(v.to_string());
        Ok(())
    }
    fn rate(&mut self, r: &Option<Rate>, what: &str) -> Result<(), StoreError> {
        let Some(r) = r else {
            self.word("0");
            return Ok(());
        };
        // The script computes with period * 1000 and interval * burst: keep them exact too.
        let tolerance = r.interval_us().saturating_mul(r.burst.max(1));
        if r.period_ms.saturating_mul(1000) > MICROS_MAX.0 || tolerance > MICROS_MAX.0 {
            return Err(unavailable(format!(
                "{what} is too large for the redis store"
            )));
        }
        self.word("1");
        self.num(r.count, what)?;
        self.num(r.period_ms, what)?;
        self.num(r.burst, what)
    }

    /// One scope kind's limits, each with whether it is in dry-run (the scope's flag or its
    /// own).
    fn scope(
        &mut self,
        sp: &spendgate_core::ScopePolicy,
        kind: ScopeKind,
    ) -> Result<(), StoreError> {
        let what = format!("limits.{}", kind.name());
        let flag = |on: bool| if on { "1" } else { "0" };
        self.num(sp.budgets.len() as u64, &what)?;
        for b in &sp.budgets {
            self.word(b.window.name());
            self.num(b.amount.0, &what)?;
            self.word(flag(sp.budget_dry(b.window)));
        }
        self.rate(&sp.rate, &what)?;
        self.word(flag(sp.rate_dry()));
        match sp.concurrency {
            None => self.word("0"),
            Some(c) => {
                self.word("1");
                self.num(u64::from(c), &what)?;
            }
        }
        self.word(flag(sp.concurrency_dry()));
        Ok(())
    }
}

fn policy_arg(p: &Policy, history_cap: u64) -> Result<String, StoreError> {
    let mut out = Out(Vec::new());
    for (v, what) in [
        (RECORD_RETENTION_MS, "RECORD_RETENTION_MS"),
        (IDEMPOTENCY_RETENTION_MS, "IDEMPOTENCY_RETENTION_MS"),
        (LEDGER_RECORDS_MAX as u64, "LEDGER_RECORDS_MAX"),
        (EXPIRIES_PER_CALL_MAX as u64, "EXPIRIES_PER_CALL_MAX"),
        (ID_BYTES_MAX as u64, "ID_BYTES_MAX"),
    ] {
        out.num(v, what)?;
    }
    for kind in [
        ScopeKind::Global,
        ScopeKind::Ip,
        ScopeKind::Session,
        ScopeKind::Conversation,
    ] {
        let sp = p
            .for_kind(kind)
            .ok_or_else(|| unavailable("policy has no limits for a scope kind"))?;
        out.scope(sp, kind)?;
    }
    let b = &p.run;
    for (v, what) in [
        (b.max_input_bytes, "run.max_input_bytes"),
        (b.max_context_tokens, "run.max_context_tokens"),
        (b.max_output_tokens, "run.max_output_tokens"),
        (b.max_tool_result_bytes, "run.max_tool_result_bytes"),
        (u64::from(b.max_model_rounds), "run.max_model_rounds"),
        (u64::from(b.max_tool_calls), "run.max_tool_calls"),
        (u64::from(b.max_retries), "run.max_retries"),
        (b.max_seconds, "run.max_seconds"),
        (b.max_cost.0, "run.max_cost"),
        (u64::from(b.shrink_to_fit), "run.shrink_to_fit"),
        (b.min_output_tokens, "run.min_output_tokens"),
    ] {
        out.num(v, what)?;
    }
    if b.max_seconds.saturating_mul(1000) > MICROS_MAX.0 {
        return Err(unavailable(
            "run.max_seconds is too large for the redis store",
        ));
    }
    out.word(match p.mode {
        ReservationMode::PerStep => "per_step",
        ReservationMode::WholeRun => "whole_run",
    });
    out.num(p.lease_ttl_ms, "store.lease_ttl")?;
    out.rate(&p.session_create_per_ip, "sessions.create_rate_per_ip")?;
    out.rate(&p.session_create_global, "sessions.create_rate_global")?;
    out.num(history_cap, "history.stream_max_len")?;
    Ok(out.0.join(" "))
}

/// The layout of what the ledger script stores (keys, packed records, meta fields). Every
/// epoch id starts with it, so a deployment whose data was written in another layout is
/// refused rather than misread. Bump it with any change of the stored layout.
pub const LEDGER_FORMAT: &str = "f8";

/// The script's `now` argument: empty for the Redis server's clock.
fn now_arg(clock: &ClockSource) -> String {
    match clock {
        ClockSource::Server => String::new(),
        ClockSource::Manual(c) => c.now().0.to_string(),
    }
}

/// A ledger id: [`LEDGER_ID_PREFIX`] and 32 lowercase hex digits (128 bits).
pub const LEDGER_ID_PREFIX: &str = "lg-";
const LEDGER_ID_HEX: usize = 32;

/// Whether `id` is a ledger id as `spendgate store init` makes them.
pub fn is_ledger_id(id: &str) -> bool {
    id.strip_prefix(LEDGER_ID_PREFIX).is_some_and(|h| {
        h.len() == LEDGER_ID_HEX && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// A fresh ledger id: the time, the process, a counter and the OS's randomness (through the
/// std hasher's random keys), hashed. Unique, not secret.
fn new_ledger_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = Sha256::new();
    h.update(b"ledger");
    h.update(new_epoch_id(prefix).as_bytes());
    for _ in 0..2 {
        let mut r = std::collections::hash_map::RandomState::new().build_hasher();
        r.write_u64(0);
        h.update(r.finish().to_le_bytes());
    }
    let id = format!(
        "{LEDGER_ID_PREFIX}{}",
        hex::encode(&h.finalize()[..LEDGER_ID_HEX / 2])
    );
    debug_assert!(is_ledger_id(&id));
    id
}

/// What `spendgate store init` is asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitMode {
    /// The routine command (a deploy pipeline may run it every time): creates a ledger only on
    /// an empty prefix when no ledger is pinned; with a pin, succeeds only where the pinned
    /// ledger is, and changes nothing.
    Routine,
    /// `--new-ledger`: the operator said that a new ledger, with new budgets, is intended. A
    /// new id (never the pinned one) on an emptied prefix, or over another ledger (whose data
    /// is kept: spend already recorded there still counts).
    NewLedger,
}

/// What `spendgate store init` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Initialised {
    /// A new ledger. `kept_data`: it was made over data the prefix held (another ledger).
    Created { ledger: String, kept_data: bool },
    /// The prefix holds the pinned ledger: nothing changed.
    Pinned { ledger: String },
    /// No ledger is pinned and the prefix holds this one: nothing changed.
    Found { ledger: String },
    /// No ledger is pinned and the prefix held a ledger made by a build before ledger ids:
    /// it now has this id (its data and epoch unchanged).
    Adopted { ledger: String },
}

impl Initialised {
    /// The ledger id to pin.
    pub fn ledger(&self) -> &str {
        match self {
            Initialised::Created { ledger, .. }
            | Initialised::Pinned { ledger }
            | Initialised::Found { ledger }
            | Initialised::Adopted { ledger } => ledger,
        }
    }
}

/// Whether the operator consented to reopening a rolled-back ledger
/// (`store accept-reset --accept-rollback`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RollbackConsent {
    NotGiven,
    Given,
}

/// Why an operator's ledger command (`store init`, `store accept-reset`) changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(
        "store.ledger_id {0:?} is not a ledger id (`lg-` and 32 hex digits, as `spendgate \
         store init` prints it)"
    )]
    BadPin(String),
    #[error(
        "store.ledger_id is not set: replicas of a redis store are pinned to their ledger. \
         Run `spendgate store init` once and pin the id it prints ([store] ledger_id)"
    )]
    NotPinned,
    #[error(
        "store.prefix {prefix:?} holds no ledger, but the config pins ledger {pinned}: Redis lost \
         that ledger's data (restarted empty, flushed, or pointed at another Redis). Nothing \
         was changed, and replicas stay closed. Restore Redis's data (AOF or RDB files) if you \
         have them. Only if a new ledger with new budgets (spend starting again from zero) is \
         intended, run `spendgate store init --new-ledger` and pin the new id it prints"
    )]
    Lost { prefix: String, pinned: String },
    #[error(
        "store.prefix {prefix:?} holds {}, not ledger {pinned} that the config pins: nothing was \
         changed. If that is the ledger you mean, pin its id; if store.url or store.prefix is \
         wrong, fix it; to start a new ledger here, run `spendgate store init --new-ledger` \
         and pin the new id it prints",
        match found { Some(l) => format!("ledger {l}"), None => "a ledger without an id (made by an older build, or re-made after a loss by one)".to_string() }
    )]
    OtherLedger {
        prefix: String,
        pinned: String,
        found: Option<String>,
    },
    #[error(
        "store.prefix {prefix:?} holds ledger keys but no ledger record (its meta key was \
         deleted or lost): not a ledger that can be trusted or reopened. Use a new \
         store.prefix (or delete this prefix's keys), then `spendgate store init --new-ledger`"
    )]
    Partial { prefix: String },
    #[error(
        "store.prefix {prefix:?} holds the pinned ledger {pinned}, intact: --new-ledger starts a \
         new ledger only where the pinned one is lost or another is found; nothing was changed \
         (to start from zero budgets, use a new store.prefix)"
    )]
    Intact { prefix: String, pinned: String },
    #[error(
        "store.prefix {prefix:?} holds the pinned ledger {pinned} at ledger_seq {seq}{}. Replicas \
         reopen on what Redis holds now only with `spendgate store accept-reset \
         --accept-rollback`: run it once you have checked that this is the ledger to keep (a \
         rollback forgets the spend recorded after the snapshot Redis reloaded); nothing was \
         changed",
        if *marked { ", marked rolled back by a replica that had seen a higher one" } else { " (not marked rolled back)" }
    )]
    RollbackNotAccepted {
        prefix: String,
        pinned: String,
        seq: u64,
        marked: bool,
    },
    #[error("store.prefix {prefix:?} changed while this command ran (another operator command?): nothing was changed; run it again")]
    Changed { prefix: String },
}

/// What a prefix holds, as the operator's commands read it.
enum Held {
    /// No key at all.
    Empty,
    /// Ledger keys without an epoch.
    Partial,
    Ledger {
        epoch: String,
        kind: String,
        seq: u64,
        /// `None`: made by a build before ledger ids.
        ledger: Option<String>,
    },
}

/// The operator's ledger commands (`store init`, `store accept-reset`): a connection of their
/// own, a fresh epoch id, and one clock reading for all their calls.
struct EpochWriter {
    base: String,
    conn: Arc<SlotConn>,
    lib: Library,
    id: String,
    now: String,
    timeout: Duration,
}

impl EpochWriter {
    fn open(opts: &RedisOptions) -> Result<EpochWriter, StoreError> {
        Ok(EpochWriter {
            base: check_prefix(&opts.prefix)?,
            conn: Arc::new(SlotConn::open(opts)?),
            lib: library(),
            id: new_epoch_id(&opts.prefix),
            now: now_arg(&opts.clock),
            timeout: opts.timeout,
        })
    }

    /// `op` with its arguments.
    async fn call(&self, op: &str, args: &[&str]) -> Result<Item, StoreError> {
        let mut argv = vec![op, self.now.as_str(), "", "0", ""];
        argv.extend(args);
        fcall(
            &self.conn,
            &self.lib,
            false,
            &self.base,
            &argv,
            self.timeout,
        )
        .await
    }

    /// What the prefix holds; a ledger of another data layout is refused.
    async fn held(&self, prefix: &str) -> Result<Held, StoreError> {
        let item = self.call("epoch_init", &[]).await?;
        let mut f = protocol::Fields::new(item.list()?);
        if f.s()? != "OK" {
            let _missing = f.s()?;
            return Ok(if f.s()? == "1" {
                Held::Partial
            } else {
                Held::Empty
            });
        }
        let epoch = f.s()?;
        check_format(&epoch, prefix)?;
        let kind = f.s()?;
        let seq = f.u()?;
        let _at = f.u()?;
        let ledger = Some(f.s()?).filter(|l| !l.is_empty());
        Ok(Held::Ledger {
            epoch,
            kind,
            seq,
            ledger,
        })
    }

    /// Writes a ledger id (`adopt`: onto the ledger there; `new`: with a new epoch) where
    /// the prefix still holds `expected` epoch (`""`: still empty).
    async fn create(
        &self,
        ledger: &str,
        expected: &str,
        adopt: bool,
        prefix: &str,
    ) -> Result<(), IdentityError> {
        let mode = if adopt { "adopt" } else { "new" };
        let item = self
            .call("ledger_create", &[&self.id, ledger, expected, mode])
            .await?;
        match item.list()?.first().map(Item::str) {
            Some(Ok("OK")) => Ok(()),
            _ => Err(IdentityError::Changed {
                prefix: prefix.to_string(),
            }),
        }
    }

    /// Bounds the whole command: at least 5 s (an operator's one-off, not an admission).
    async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, IdentityError>>,
    ) -> Result<T, IdentityError> {
        tokio::time::timeout(self.timeout.max(Duration::from_secs(5)), fut)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
    }
}

/// The pin of `opts`, checked; `None` when there is none.
fn pin_of(opts: &RedisOptions) -> Result<Option<&str>, IdentityError> {
    match opts.ledger_id.as_deref() {
        None => Ok(None),
        Some(p) if is_ledger_id(p) => Ok(Some(p)),
        Some(p) => Err(IdentityError::BadPin(p.to_string())),
    }
}

/// Refuses an epoch written by a build with another stored layout ([`LEDGER_FORMAT`]).
fn check_format(epoch: &str, prefix: &str) -> Result<(), StoreError> {
    match epoch.split_once('-') {
        Some((format, _)) if format == LEDGER_FORMAT => Ok(()),
        _ => Err(unavailable(format!(
            "the ledger under prefix {prefix:?} was written by a spendgate build with another \
             data layout (epoch {epoch:?}; this build reads layout {LEDGER_FORMAT}); it cannot be \
             read safely: use a new store.prefix, or delete that prefix's keys; then run `spendgate \
             store init`"
        ))),
    }
}

/// A fresh epoch id: [`LEDGER_FORMAT`], then unique per call (time, process, counter), not
/// secret.
fn new_epoch_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut h = Sha256::new();
    h.update(nanos.to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    h.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.update(prefix.as_bytes());
    format!("{LEDGER_FORMAT}-{}", hex::encode(&h.finalize()[..16]))
}

fn connection(
    info: redis::ConnectionInfo,
    timeout: Duration,
) -> Result<ConnectionManager, StoreError> {
    let client = redis::Client::open(info)
        .map_err(|e| unavailable(format!("store.url is not a usable redis url: {e}")))?;
    // Timeouts from store.timeout_ms (redis 1.x would default to 1 s / 500 ms); a short
    // reconnect backoff so that service resumes soon after Redis returns.
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_millis(250));
    client
        .get_connection_manager_lazy(config)
        .map_err(|e| unavailable(format!("redis: {e}")))
}

fn map_redis_error(e: redis::RedisError, timeout: Duration) -> StoreError {
    if e.is_timeout() {
        return StoreError::Timeout(timeout);
    }
    let what = match e.code() {
        Some("BUSY") => "redis is busy running a script",
        Some("READONLY") => "redis is a read-only replica",
        Some("OOM") => "redis is out of memory",
        Some("LOADING") => "redis is loading its data",
        Some("MASTERDOWN") => "redis master is down",
        Some("ASK") | Some("TRYAGAIN") => "redis cluster is moving the ledger's slot",
        Some("CLUSTERDOWN") => "redis cluster is down",
        _ if e.is_io_error() || e.is_connection_dropped() => "redis connection failed",
        _ => "redis error",
    };
    unavailable(format!("{what}: {e}"))
}

fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

impl RedisStore {
    /// Opens the store. Does not fail because Redis is down: calls answer unavailable until
    /// it is reachable, and `ready()` says whether it is. Fails on an unusable url, prefix or
    /// policy, a missing or malformed [`RedisOptions::ledger_id`], and a witness file that
    /// cannot be used or guards another ledger. Loads the witness (the store then refuses a
    /// Redis older than it) and starts writing it.
    pub async fn open(opts: RedisOptions, policy: Policy) -> Result<RedisStore, StoreError> {
        let base = check_prefix(&opts.prefix)?;
        let ledger = match pin_of(&opts) {
            Ok(Some(l)) => l.to_string(),
            Ok(None) => return Err(unavailable(IdentityError::NotPinned.to_string())),
            Err(e) => return Err(unavailable(e.to_string())),
        };
        let policy_arg = policy_arg(&policy, history::STREAM_MAX_LEN_DEFAULT)?;
        let conn = Arc::new(SlotConn::open(&opts)?);
        let mut state = EpochState::default();
        let file = match &opts.witness {
            None => None,
            Some(path) => {
                let file = WitnessFile::open(path).map_err(|e| unavailable(e.to_string()))?;
                match file.read().map_err(|e| unavailable(e.to_string()))? {
                    Some(mark) if mark.ledger != ledger => {
                        return Err(unavailable(
                            WitnessError::OtherLedger {
                                path: path.clone(),
                                found: mark.ledger,
                                pinned: ledger,
                            }
                            .to_string(),
                        ))
                    }
                    Some(mark) => {
                        tracing::info!(
                            witness = %path.display(), epoch = %mark.epoch, ledger_seq = mark.seq,
                            "witness loaded: a Redis below this mark is refused"
                        );
                        state.id = Some(mark.epoch.clone());
                        state.min_seq = mark.seq;
                        state.at = mark.epoch_at;
                    }
                    None => tracing::info!(
                        witness = %path.display(),
                        "no witness yet: starting one from what Redis holds"
                    ),
                }
                Some(Arc::new(file))
            }
        };
        let epoch = Arc::new(Mutex::new(state));
        let witness = file.map(|file| Witness {
            file,
            state: epoch.clone(),
            ledger: ledger.clone(),
            written: Arc::new(Mutex::new(None)),
            writes: Arc::new(AtomicU64::new(0)),
        });
        let task = witness
            .as_ref()
            .map(|w| AbortOnDrop(tokio::spawn(w.clone().run())));
        let store = RedisStore {
            base,
            ledger,
            policy_arg,
            policy,
            conn,
            lib: Arc::new(library()),
            epoch,
            health: tokio::sync::Mutex::new(Health::default()),
            refreshing: AtomicBool::new(false),
            witness,
            _witness_task: task,
            history: history::HistoryState::default(),
            opts,
        };
        if let Err(e) = store.ready().await {
            tracing::warn!(error = %e, prefix = %store.opts.prefix, "redis store not ready yet");
        }
        Ok(store)
    }

    /// This store's witness, to flush at a clean shutdown; `None` without one.
    pub fn witness(&self) -> Option<Witness> {
        self.witness.clone()
    }

    /// `spendgate store accept-reset`: acknowledges that the pinned ledger rolled back (Redis
    /// reloaded an older snapshot, or a replica that lagged took over), and reopens it on what
    /// Redis holds now: writes a new epoch, which every store adopts (and writes to its
    /// witness) when it is newer than the one it knows. Never reopens an emptied prefix, a
    /// ledger without an id or another ledger. Without `consent` it changes nothing and
    /// says what it found ([`IdentityError::RollbackNotAccepted`]). Returns the `ledger_seq`
    /// the ledger holds now.
    pub async fn accept_reset(
        opts: &RedisOptions,
        consent: RollbackConsent,
    ) -> Result<u64, IdentityError> {
        let pinned = pin_of(opts)?.ok_or(IdentityError::NotPinned)?.to_string();
        let prefix = opts.prefix.clone();
        let w = EpochWriter::open(opts)?;
        let seq = w
            .bounded(async {
                match w.held(&prefix).await? {
                    Held::Empty => Err(IdentityError::Lost {
                        prefix: prefix.clone(),
                        pinned: pinned.clone(),
                    }),
                    Held::Partial => Err(IdentityError::Partial {
                        prefix: prefix.clone(),
                    }),
                    Held::Ledger { ledger, .. } if ledger.as_deref() != Some(pinned.as_str()) => {
                        Err(IdentityError::OtherLedger {
                            prefix: prefix.clone(),
                            pinned: pinned.clone(),
                            found: ledger,
                        })
                    }
                    Held::Ledger { kind, seq, .. } if consent == RollbackConsent::NotGiven => {
                        Err(IdentityError::RollbackNotAccepted {
                            prefix: prefix.clone(),
                            pinned: pinned.clone(),
                            seq,
                            marked: kind == "rolled_back",
                        })
                    }
                    Held::Ledger { .. } => {
                        let item = w.call("epoch_reset", &[&w.id, &pinned]).await?;
                        let mut f = protocol::Fields::new(item.list()?);
                        match f.s()?.as_str() {
                            "OK" => {
                                let (_id, _kind) = (f.s()?, f.s()?);
                                Ok(f.u()?)
                            }
                            _ => Err(IdentityError::Changed {
                                prefix: prefix.clone(),
                            }),
                        }
                    }
                }
            })
            .await?;
        tracing::warn!(prefix = %opts.prefix, ledger = %pinned, epoch = %w.id, ledger_seq = seq, "rollback accepted: replicas resume with what Redis holds now");
        Ok(seq)
    }

    /// `spendgate store init`: creates a ledger (an id and a first epoch), or checks that the
    /// prefix holds the pinned one. Replicas never do this themselves: a Redis that came back
    /// empty looks exactly like a new deployment, and a replica that started on it would
    /// reopen every spent budget. See [`InitMode`] for what each mode may do; every refusal
    /// changes nothing.
    pub async fn init(opts: &RedisOptions, mode: InitMode) -> Result<Initialised, IdentityError> {
        let pinned = pin_of(opts)?.map(str::to_string);
        let prefix = opts.prefix.clone();
        let w = EpochWriter::open(opts)?;
        let fresh = || loop {
            let id = new_ledger_id(&prefix);
            if Some(&id) != pinned.as_ref() {
                return id;
            }
        };
        let done = w
            .bounded(async {
                let held = w.held(&prefix).await?;
                let new_ledger = mode == InitMode::NewLedger;
                let (expected, found) = match held {
                    Held::Partial => {
                        return Err(IdentityError::Partial {
                            prefix: prefix.clone(),
                        })
                    }
                    Held::Empty => match &pinned {
                        Some(p) if !new_ledger => {
                            return Err(IdentityError::Lost {
                                prefix: prefix.clone(),
                                pinned: p.clone(),
                            })
                        }
                        _ => {
                            let ledger = fresh();
                            w.create(&ledger, "", false, &prefix).await?;
                            return Ok(Initialised::Created {
                                ledger,
                                kept_data: false,
                            });
                        }
                    },
                    Held::Ledger { epoch, ledger, .. } => (epoch, ledger),
                };
                match (&pinned, found, new_ledger) {
                    (None, Some(ledger), false) => Ok(Initialised::Found { ledger }),
                    (None, None, false) => {
                        let ledger = fresh();
                        w.create(&ledger, &expected, true, &prefix).await?;
                        Ok(Initialised::Adopted { ledger })
                    }
                    (Some(p), Some(ledger), false) if *p == ledger => {
                        Ok(Initialised::Pinned { ledger })
                    }
                    (Some(p), Some(ledger), true) if *p == ledger => Err(IdentityError::Intact {
                        prefix: prefix.clone(),
                        pinned: ledger,
                    }),
                    (Some(p), found, false) => Err(IdentityError::OtherLedger {
                        prefix: prefix.clone(),
                        pinned: p.clone(),
                        found,
                    }),
                    (_, _, true) => {
                        let ledger = fresh();
                        w.create(&ledger, &expected, false, &prefix).await?;
                        Ok(Initialised::Created {
                            ledger,
                            kept_data: true,
                        })
                    }
                }
            })
            .await?;
        match &done {
            Initialised::Created { ledger, kept_data } => {
                tracing::warn!(prefix = %opts.prefix, %ledger, kept_data, "ledger created")
            }
            Initialised::Adopted { ledger } => {
                tracing::warn!(prefix = %opts.prefix, %ledger, "ledger given an id")
            }
            Initialised::Pinned { .. } | Initialised::Found { .. } => {}
        }
        Ok(done)
    }

    fn now_arg(&self) -> String {
        now_arg(&self.opts.clock)
    }

    async fn eval(&self, read: bool, argv: &[&str]) -> Result<Item, StoreError> {
        fcall_patient(
            &self.conn,
            &self.lib,
            read,
            &self.base,
            argv,
            self.opts.timeout,
            self.opts.slow_grace,
        )
        .await
    }

    /// The longest one call waits: `store.timeout_ms` + `store.slow_grace_ms`.
    fn bound(&self) -> Duration {
        self.opts.timeout + self.opts.slow_grace
    }

    /// The epoch id and lowest acceptable seq for a call. On first contact reads the ledger
    /// id and the epoch: a Redis without the pinned ledger is refused; the epoch and seq are
    /// adopted unless a witness set them (then the calls themselves compare them).
    async fn epoch_args(&self) -> Result<(String, String), StoreError> {
        let args = |st: &EpochState| {
            let min = if st.latched {
                LATCHED_MIN_SEQ.to_string()
            } else {
                st.min_seq.to_string()
            };
            st.id.clone().map(|id| (id, min))
        };
        {
            let st = self.epoch.lock().unwrap_or_else(|p| p.into_inner());
            if st.checked {
                if let Some(a) = args(&st) {
                    return Ok(a);
                }
            }
        }
        let now = self.now_arg();
        let item = self.eval(true, &["epoch_init", &now, "", "0", ""]).await?;
        let mut f = protocol::Fields::new(item.list()?);
        if f.s()? != "OK" {
            return Err(self.lost());
        }
        let id = f.s()?;
        check_format(&id, &self.opts.prefix)?;
        let _kind = f.s()?;
        let seq = f.u()?;
        let at = f.u()?;
        self.check_ledger(&f.s()?)?;
        let mut st = self.epoch.lock().unwrap_or_else(|p| p.into_inner());
        if !st.checked {
            if st.id.is_none() {
                st.id = Some(id);
                st.min_seq = seq;
                st.latched = false;
                st.at = at;
            }
            st.checked = true;
        }
        args(&st).ok_or_else(|| unavailable("redis store: no epoch after first contact"))
    }

    /// The refusal of a prefix that holds no ledger.
    fn lost(&self) -> StoreError {
        unavailable(format!(
            "no ledger under store.prefix {:?} (the pinned ledger is {}): Redis lost its data \
             (restarted empty, flushed?) or store.url/prefix point elsewhere; refusing. Restore \
             Redis's data if you have it; only `spendgate store init --new-ledger` (a new \
             ledger with new budgets, and a new pin) starts over",
            self.opts.prefix, self.ledger
        ))
    }

    /// Refuses a Redis whose ledger id (`found`, `""`: none) is not the pinned one.
    fn check_ledger(&self, found: &str) -> Result<(), StoreError> {
        if found == self.ledger {
            return Ok(());
        }
        let what = if found.is_empty() {
            "a ledger without an id (made by an older build, or re-made after a loss by one)"
                .to_string()
        } else {
            format!("ledger {found}")
        };
        Err(unavailable(format!(
            "store.prefix {:?} holds {what}, not ledger {} that store.ledger_id pins: refusing \
             (if the ledger there is the one to use, pin its id; `spendgate store init` says \
             which it is)",
            self.opts.prefix, self.ledger
        )))
    }

    /// Runs one script call; handles store-level refusals (epoch, rollback).
    async fn call(&self, call: &Call) -> Result<Vec<Item>, StoreError> {
        self.call_argv(call.read, call.op, &call.args).await
    }

    /// Runs one script call of `op` (or a "batch", whose answer lists each command's answer).
    async fn call_argv(
        &self,
        read: bool,
        op: &str,
        args: &[String],
    ) -> Result<Vec<Item>, StoreError> {
        for _ in 0..EPOCH_ATTEMPTS {
            let (epoch, min_seq) = self.epoch_args().await?;
            let now = self.now_arg();
            let mut argv: Vec<&str> = vec![op, &now, &epoch, &min_seq, &self.policy_arg];
            argv.extend(args.iter().map(String::as_str));
            let item = self.eval(read, &argv).await?;
            let items = match item {
                Item::List(items) => items,
                Item::Str(s) => return Err(unavailable(format!("redis store: answer {s:?}"))),
            };
            if let Some(Item::List(_)) = items.first() {
                // A batch's answers, each `["OK" | "E", seq, ...]`.
                let mut highest = 0;
                for answer in &items {
                    let mut f = protocol::Fields::new(answer.list()?);
                    match f.s()?.as_str() {
                        "OK" | "E" => highest = highest.max(f.u()?),
                        other => {
                            return Err(unavailable(format!(
                                "redis store: answer tag {other:?} in a batch"
                            )))
                        }
                    }
                }
                let mut st = self.epoch.lock().unwrap_or_else(|p| p.into_inner());
                if st.id.as_deref() == Some(epoch.as_str()) {
                    st.min_seq = st.min_seq.max(highest);
                }
                return Ok(items);
            }
            let mut f = protocol::Fields::new(&items);
            match f.s()?.as_str() {
                "OK" | "E" => {
                    let seq = f.u()?;
                    let mut st = self.epoch.lock().unwrap_or_else(|p| p.into_inner());
                    if st.id.as_deref() == Some(epoch.as_str()) {
                        st.min_seq = st.min_seq.max(seq);
                    }
                    return Ok(items);
                }
                "X" => match f.s()?.as_str() {
                    "epoch_missing" => return Err(self.lost()),
                    "epoch_changed" => {
                        let id = f.s()?;
                        let kind = f.s()?;
                        let at = f.u()?;
                        let ledger = f.s()?;
                        let known_at = self.epoch.lock().unwrap_or_else(|p| p.into_inner()).at;
                        self.check_ledger(&ledger)?;
                        if at <= known_at {
                            return Err(unavailable(format!(
                                "ledger epoch went back to {id} ({kind}), older than the \
                                     epoch this replica knows: Redis restored from an old \
                                     snapshot or backup? refusing until `spendgate store \
                                     accept-reset --accept-rollback`"
                            )));
                        }
                        if kind != "reset" {
                            return Err(unavailable(
                                "ledger epoch changed: the ledger was re-initialised \
                                     without an accepted reset; refusing",
                            ));
                        }
                        check_format(&id, &self.opts.prefix)?;
                        tracing::warn!(epoch = %id, "adopting a ledger reset accepted by an operator");
                        let mut st = self.epoch.lock().unwrap_or_else(|p| p.into_inner());
                        st.id = Some(id);
                        st.min_seq = 0;
                        st.latched = false;
                        st.at = at;
                    }
                    "rolled_back" => {
                        let seq = f.u()?;
                        let mut st = self.epoch.lock().unwrap_or_else(|p| p.into_inner());
                        let seen = st.min_seq;
                        st.latched = true;
                        return Err(unavailable(format!(
                            "ledger rolled back (ledger_seq {seq} is below {seen}, seen before): \
                             Redis restarted from an old snapshot? refusing until \
                             `spendgate store accept-reset --accept-rollback`"
                        )));
                    }
                    other => return Err(unavailable(format!("redis store refused: {other}"))),
                },
                other => return Err(unavailable(format!("redis store: answer tag {other:?}"))),
            }
        }
        Err(unavailable("ledger epoch keeps changing"))
    }

    /// PING, eviction policy, persistence warnings. Cached for admissions.
    async fn check_server(&self) -> Result<(), StoreError> {
        let t = self.bound();
        let generation = self.conn.generation();
        let mut conn = self.conn.current().conn.clone();
        let map = |e| map_redis_error(e, t);
        redis::cmd("PING")
            .query_async::<redis::Value>(&mut conn)
            .await
            .map_err(map)?;
        // (several sections in one INFO: Redis 7 and Valkey)
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .arg("persistence")
            .arg("replication")
            .query_async(&mut conn)
            .await
            .map_err(map)?;
        let fsync = redis::cmd("CONFIG")
            .arg("GET")
            .arg("appendfsync")
            .query_async::<Vec<String>>(&mut conn)
            .await
            .ok()
            .and_then(|v| v.get(1).cloned());
        let policy = info_field(&info, "maxmemory_policy").unwrap_or("unknown");
        let role = info_field(&info, "role").unwrap_or("unknown");
        let fault = if policy != "noeviction" {
            Some(format!(
                "redis maxmemory-policy is {policy}: Redis may evict ledger keys and forget \
                 spending; set maxmemory-policy to noeviction"
            ))
        } else if role != "master" {
            Some(format!(
                "the redis node is a {role}, not a primary: it cannot record spending; point \
                 store.url at the primary"
            ))
        } else {
            None
        };
        let aof = info_field(&info, "aof_enabled") == Some("1");
        let warning = match (aof, fsync.as_deref()) {
            (false, _) => Some(
                "redis AOF is off: a Redis restart loses acknowledged ledger writes (spend and \
                 holds); the epoch check will then close the service until an operator \
                 accepts the reset"
                    .to_string(),
            ),
            (true, Some("always")) => None,
            (true, Some(other)) => Some(format!(
                "redis appendfsync is {other}, not always: a crash can lose the last \
                 acknowledged ledger writes"
            )),
            (true, None) => Some(
                "cannot read redis appendfsync (CONFIG disabled?): persistence of every \
                 acknowledged ledger write is not verified"
                    .to_string(),
            ),
        };
        let mut h = self.health.lock().await;
        if warning != h.warned {
            if let Some(w) = &warning {
                tracing::warn!(prefix = %self.opts.prefix, "{w}");
            }
            h.warned = warning;
        }
        if let Some(f) = &fault {
            if h.fault.as_ref() != Some(f) {
                tracing::error!(prefix = %self.opts.prefix, "{f}");
            }
        }
        h.fault = fault.clone();
        h.checked = Some((Instant::now(), generation));
        match fault {
            Some(f) => Err(unavailable(f)),
            None => Ok(()),
        }
    }

    /// The cached server check, refreshed every few seconds by one caller at a time (the
    /// others go on with the last result meanwhile).
    async fn healthy(&self) -> Result<(), StoreError> {
        {
            let h = self.health.lock().await;
            if let Some((at, generation)) = h.checked {
                let fresh = at.elapsed() < HEALTH_EVERY && generation == self.conn.generation();
                if fresh || self.refreshing.swap(true, Ordering::AcqRel) {
                    return match &h.fault {
                        Some(f) => Err(unavailable(f.clone())),
                        None => Ok(()),
                    };
                }
            }
        }
        /// Clears the flag even when the check is cancelled by the call's timeout.
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _done = Done(&self.refreshing);
        self.check_server().await
    }

    /// Several commands in one script call (`batch`): each applied on its own, in order, as
    /// `execute` would, and answered on its own. When a command needs durability and the
    /// server check fails, each command goes alone instead (those that need no durability
    /// still apply, as with separate calls).
    async fn execute_many_inner(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let n = cmds.len();
        if cmds.iter().any(Command::needs_durability) && self.healthy().await.is_err() {
            let mut out = Vec::with_capacity(n);
            for cmd in cmds {
                out.push(self.execute_inner(cmd).await);
            }
            return out;
        }
        let calls: Vec<Call> = cmds.iter().map(protocol::encode).collect();
        let read = calls.iter().all(|c| c.read);
        let mut args = Vec::new();
        for c in &calls {
            args.push(c.op.to_string());
            args.push(c.args.len().to_string());
            args.extend(c.args.iter().cloned());
        }
        let items = match self.call_argv(read, "batch", &args).await {
            Ok(items) => items,
            Err(e) => return vec![Err(e); n],
        };
        if items.len() != n {
            return vec![
                Err(unavailable(format!(
                    "redis store: {} answers to a batch of {n}",
                    items.len()
                )));
                n
            ];
        }
        cmds.iter()
            .zip(&items)
            .map(|(cmd, item)| protocol::decode(cmd, item.list()?))
            .collect()
    }

    async fn execute_inner(&self, cmd: Command) -> Result<Reply, StoreError> {
        if cmd.needs_durability() {
            self.healthy().await?;
        }
        let call = protocol::encode(&cmd);
        let items = self.call(&call).await?;
        protocol::decode(&cmd, &items)
    }

    async fn ready_inner(&self) -> Result<(), StoreError> {
        self.check_server().await?;
        let generation = self.conn.generation();
        let items = self
            .call(&Call {
                read: true,
                op: "check",
                args: vec![],
            })
            .await?;
        match items.first().map(Item::str) {
            Some(Ok("OK")) => {}
            _ => return Err(unavailable("redis store: unexpected readiness answer")),
        }
        // A cluster redirected the script: check the node that serves the deployment.
        if self.conn.generation() != generation {
            self.check_server().await?;
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Store for RedisStore {
    async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
        let bound = self.bound();
        tokio::time::timeout(bound, self.execute_inner(cmd))
            .await
            .map_err(|_| StoreError::Timeout(bound))?
    }

    async fn execute_many(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let n = cmds.len();
        if n <= 1 {
            let mut out = Vec::with_capacity(n);
            for cmd in cmds {
                out.push(self.execute(cmd).await);
            }
            return out;
        }
        let bound = self.bound();
        match tokio::time::timeout(bound, self.execute_many_inner(cmds)).await {
            Ok(answers) => answers,
            Err(_) => vec![Err(StoreError::Timeout(bound)); n],
        }
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let bound = self.bound();
        tokio::time::timeout(bound, self.ready_inner())
            .await
            .map_err(|_| StoreError::Timeout(bound))?
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn history(&self) -> Option<Arc<dyn spendgate_store::HistoryReader>> {
        Some(history::store_history(self))
    }

    fn tap_history(&self, tap: Arc<dyn spendgate_store::HistoryTap>) {
        history::store_tap(self, tap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_targets() {
        let t = |addr: &str| redirect_target(addr, "10.0.0.5").map_err(|e| e.to_string());
        assert_eq!(t("10.0.0.7:6380"), Ok(("10.0.0.7".into(), 6380)));
        assert_eq!(
            t("redis-2.internal:6379"),
            Ok(("redis-2.internal".into(), 6379))
        );
        assert_eq!(t("[fd00::7]:6380"), Ok(("fd00::7".into(), 6380)));
        assert_eq!(t(":6381"), Ok(("10.0.0.5".into(), 6381)));
        for bad in ["?:6379", "nohost", "10.0.0.7:port", "10.0.0.7:70000"] {
            assert!(t(bad).is_err(), "{bad}");
        }
        assert!(redirect_target(":6381", "").is_err());
    }

    #[test]
    fn prefixes_cannot_inject_hash_tags() {
        assert_eq!(check_prefix("spendgate").expect("valid"), "{spendgate}");
        for bad in ["", "a{b", "a}b", "a b", &"x".repeat(65)] {
            assert!(check_prefix(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn default_policy_encodes() {
        let s = policy_arg(&Policy::default(), history::STREAM_MAX_LEN_DEFAULT)
            .expect("default policy fits");
        let core = format!(
            "{RECORD_RETENTION_MS} {IDEMPOTENCY_RETENTION_MS} {LEDGER_RECORDS_MAX} {EXPIRIES_PER_CALL_MAX} {ID_BYTES_MAX} "
        );
        let rest = s.strip_prefix(&core).expect("core constants first");
        assert!(rest.starts_with("2 day 50000000 0 month 1000000000 0 1 100 1000 20 0 1 64 0 "));
        assert!(s.contains(" per_step 30000 1 10 3600000 10 1 600 60000 600"));
    }

    #[test]
    fn ledger_ids_are_fresh_and_well_formed() {
        let a = new_ledger_id("p");
        let b = new_ledger_id("p");
        assert!(is_ledger_id(&a) && is_ledger_id(&b), "{a} {b}");
        assert_ne!(a, b);
        for bad in [
            "",
            "lg-",
            "lg-0123",
            &a.to_uppercase(),
            &format!("{a}0"),
            &a[1..],
        ] {
            assert!(!is_ledger_id(bad), "{bad:?}");
        }
    }

    fn witness_at(path: &std::path::Path, state: &Arc<Mutex<EpochState>>) -> Witness {
        Witness {
            file: Arc::new(WitnessFile::open(path).expect("witness file")),
            state: state.clone(),
            ledger: "lg-0123456789abcdef0123456789abcdef".into(),
            written: Arc::new(Mutex::new(None)),
            writes: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The request path advances the mark as fast as it likes; the file is written at most
    /// every `WITNESS_EVERY`, and a stalled disk (the file's lock held elsewhere) never holds
    /// up the request path, which only touches memory.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_witness_is_written_at_a_bounded_pace_off_the_request_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w");
        let state = Arc::new(Mutex::new(EpochState {
            id: Some(format!("{LEDGER_FORMAT}-aa")),
            checked: true,
            ..EpochState::default()
        }));
        let w = witness_at(&path, &state);
        let task = AbortOnDrop(tokio::spawn(w.clone().run()));
        let advance = |seq: u64| -> Duration {
            let t = Instant::now();
            state.lock().expect("state").min_seq = seq;
            t.elapsed()
        };
        let run_for = Duration::from_millis(1_000);
        let start = Instant::now();
        let mut seq = 0;
        while start.elapsed() < run_for {
            seq += 1;
            advance(seq);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let writes = w.writes();
        let most = (run_for.as_millis() / WITNESS_EVERY.as_millis()) as u64 + 2;
        assert!(
            (2..=most).contains(&writes),
            "{writes} writes in {run_for:?} (at most {most})"
        );
        let on_disk = w.file.read().expect("read").expect("a mark").seq;
        assert!(on_disk <= seq && on_disk > 0, "{on_disk} of {seq}");

        // A disk that stalls: the writer waits on the lock; the request path does not.
        let other = WitnessFile::open(&path).expect("open");
        let stalled = other.hold(true).expect("lock");
        let mut slowest = Duration::ZERO;
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(600) {
            seq += 1;
            slowest = slowest.max(advance(seq));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(slowest < Duration::from_millis(20), "{slowest:?}");
        drop(stalled);
        drop(task);
        w.flush().await.expect("flush at shutdown");
        assert_eq!(w.file.read().expect("read").expect("a mark").seq, seq);
        assert!(!path.with_extension("tmp").exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_mark_is_written_before_the_ledger_is_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w");
        let state = Arc::new(Mutex::new(EpochState {
            id: Some(format!("{LEDGER_FORMAT}-aa")),
            min_seq: 7,
            ..EpochState::default()
        }));
        let w = witness_at(&path, &state);
        w.flush().await.expect("flush");
        assert_eq!(w.file.read().expect("read"), None);
        state.lock().expect("state").checked = true;
        w.flush().await.expect("flush");
        assert_eq!(w.file.read().expect("read").expect("a mark").seq, 7);
        assert_eq!(w.writes(), 1);
        w.flush().await.expect("flush");
        assert_eq!(w.writes(), 1, "an unchanged mark is not written again");
    }

    #[test]
    fn too_large_figures_are_refused() {
        let mut p = Policy::default();
        p.run.max_output_tokens = u64::MAX;
        assert!(policy_arg(&p, 1).is_err());
    }
}
