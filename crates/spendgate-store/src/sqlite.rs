//! `sqlite`: the embedded default store. One file, durable across restarts, no server to run.
//!
//! Layout:
//! - One SQLite file in WAL mode with `synchronous=FULL` and `locking_mode=EXCLUSIVE`: one
//!   process owns the file for as long as the store is open; a second open fails with
//!   [`StoreError::Unavailable`].
//! - Two tables. `records(key TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID` holds
//!   every ledger entity, its [`Record`] encoded with postcard (compact, about a third of
//!   JSON's size). `log(seq INTEGER PRIMARY KEY, changes BLOB NOT NULL)` holds one row per
//!   group commit: every entity that batch changed, as `(key, Option<Record>)` pairs
//!   (`None`: deleted). A batch is durable once its log row is: one row of a few pages
//!   appended, instead of a B-tree update per changed entity (a step's reservation and
//!   commit change about eight entities each). The file's state is `records` with every
//!   log row replayed over it in order.
//! - Compaction by generations: the entities logged since a generation began are gathered
//!   (deduplicated: a global counter changed by every step is one entry); when the
//!   generation is full ([`GENERATION_ROWS_MAX`] rows, [`GENERATION_ENTITIES_MAX`] entities
//!   or [`GENERATION_LOG_BYTES_MAX`] bytes) it closes, and each later batch writes the
//!   current record of some of its entities into `records`, sorted (on a thread of its own:
//!   the applier goes on meanwhile, and the slices begin once the sort is done) so that one
//!   batch's rows share a few pages (at least
//!   [`COMPACT_PER_BATCH_MIN`], paced to finish in about as many batches as the generation
//!   took to fill), in the same transaction as that batch's log row. Most of that work goes
//!   to batches nobody waits on (only resolutions: their answers left before the write),
//!   at twice the pace; a batch that holds an admission does half a slice, or four once
//!   the open generation is full (compaction fell behind). When the last is
//!   written, the log rows of that generation are deleted in that same transaction. So the
//!   log holds at most about three generations (the closing one, the open one, and what
//!   the open one gathers past its bound while the closing one drains), and every state is on disk twice at most
//!   (log, then `records`) instead of once per change. A clean close compacts everything
//!   (the log is empty after it); an open after a crash replays what the log holds.
//! - The usage history (`history` module; decision 0042): four more tables, written by the
//!   disk thread in the transaction of the batch whose changes they record, pruned by age
//!   and size, read back through the disk thread (the file's exclusive lock admits no second
//!   connection). [`SqliteOptions::history`] turns it off.
//! - The schema version is kept in `PRAGMA user_version`. Older files are upgraded at open:
//!   version 4 (`records` alone, reservations under their run's prefix) gains the empty log
//!   and each reservation's row moves to its own key; versions 4 and 5 listed a run's steps
//!   in its record (rewritten at every step, growing with the run), which version 6 keeps
//!   in memory only, and version 7 appends the run's tally and adds the history tables (see
//!   [`v5`]): the whole file is read in the old layout and written in the new one in one
//!   transaction. Postcard does not describe itself: a change to the layout of
//!   any record type in `spendgate-core` (other than a new enum variant at the end) must
//!   bump [`SCHEMA_VERSION`]. A record that does not decode to exactly its bytes fails the
//!   open (fail closed).
//! - Keys are [`Entity::storage_key`], except that a run and its run counter share one key
//!   prefix (see `table_key`). A key depends on its entity alone, so a row never moves
//!   (a reservation's id may be taken again by another run once its own run was purged).
//! - Two threads, a pipeline. The applier thread owns the whole [`Ledger`] (restored from
//!   the file at open) and the log's state; the disk thread owns the connection. Callers
//!   hand the applier commands through a bounded queue ([`QUEUE_MAX`]); when the queue is
//!   full the call is refused at once (fail closed), never blocking the runtime.
//! - Group commit: the applier takes the first queued command, then up to [`BATCH_MAX`]
//!   more without waiting, applies each at the clock's `now`, encodes every changed entity
//!   as one log row (a job) and hands the job to the disk thread (a bounded queue,
//!   [`DISK_QUEUE_MAX`]); it then goes on with the next batch while the disk writes. The
//!   disk thread writes the jobs in order, all those queued (up to [`JOBS_PER_WRITE_MAX`])
//!   in one `BEGIN IMMEDIATE … COMMIT`. A command that needs durability
//!   ([`Command::needs_durability`]), or whose answer does (a commit above its reservation,
//!   or a repeat of one: [`Command::reply_needs_durability`]), is answered by the disk thread only
//!   after the commit holding its job and that commit's fsync; other commands are answered
//!   by the applier as soon as they are applied, and a transaction of only such jobs is
//!   written without an fsync of its own (the next durable commit's fsync covers it):
//!   losing one only errs towards charging more. Except while an overrun commit is applied
//!   but not yet written: until then, the other answers (a finish's charge, a release
//!   refused because the step is committed, a read) may tell of it, so they wait for their
//!   job's turn (sent after its transaction, and refused if a write before failed). A job
//!   that changed nothing but holds answers (a refusal, a repeated answer) still goes
//!   through the disk queue, so it is answered only after every job before it is written.
//! - An admission still queued when its caller stopped waiting (store timeout: it answered
//!   503) is dropped unapplied.
//! - If a write fails, it is rolled back; the disk thread answers every waiting command of
//!   it, and of every later job built on it, with [`StoreError::Unavailable`], and tells
//!   the applier, which takes no more commands into the batch under way and before its
//!   next batch has the disk thread reload the ledger from the file (dropping every change
//!   not on disk); `ready` fails until a write succeeds
//!   again. After an I/O error or corruption the file's content is not known (Linux may
//!   drop unsynced pages and report it once): the store refuses everything until the
//!   process restarts and SQLite recovers the file.

use crate::{Clock, Store, StoreError};
use async_trait::async_trait;
use rusqlite::{Connection, ErrorCode, OpenFlags, Transaction, TransactionBehavior};
use spendgate_core::{Command, Entity, Ledger, Policy, Record, Reply, ScopeKind};
use std::collections::HashMap;

/// Hashes with foldhash, seeded at random per process (see `spendgate_core`'s ledger).
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;

mod history;
#[doc(hidden)]
pub mod v5;

pub use history::{
    SqliteFileHistory, SqliteHistory, HISTORY_PRUNE_EVERY_MS, HISTORY_PRUNE_ROWS_MAX,
    HISTORY_RETENTION_DEFAULT, HISTORY_ROWS_MAX_DEFAULT,
};
use spendgate_core::history::HistoryEvent;
use v5::Old;

/// Commands waiting for the applier at most; past it calls are refused ("store queue full").
pub const QUEUE_MAX: usize = 4096;
/// Commands the applier applies together at most (one job, one log row; the disk thread may
/// write several jobs in one transaction).
pub const BATCH_MAX: usize = 512;
/// How long `open` waits for another holder of the file to let go before it fails.
pub const LOCK_WAIT_MS_DEFAULT: u64 = 250;
/// The layout version kept in `PRAGMA user_version`: the table, the keys, and the postcard
/// layout of [`Record`].
pub const SCHEMA_VERSION: i64 = 7;
/// A file of this version (no log table) is upgraded at open.
const SCHEMA_VERSION_BEFORE_LOG: i64 = 4;
/// The last version whose run records listed their steps (see [`v5`]).
const SCHEMA_VERSION_OLD_RUNS: i64 = 5;
/// The version before runs kept their tally and the file its history tables.
const SCHEMA_VERSION_NO_HISTORY: i64 = 6;
/// Log rows (group commits) a generation gathers at most before it is compacted.
pub const GENERATION_ROWS_MAX: u64 = 1024;
/// Distinct entities a generation gathers at most before it is compacted. It also bounds the
/// work of sorting them when the generation closes (~10 ms at the bound on a fast host, 3–16
/// ms for 11–26k entities on a slow one), done on a thread of its own so that the applier
/// does not pause for it; 16,384 cost ~7% of the store's throughput in more compaction.
pub const GENERATION_ENTITIES_MAX: usize = 65_536;
/// Log bytes a generation gathers at most before it is compacted.
pub const GENERATION_LOG_BYTES_MAX: usize = 8 << 20;
/// Entities of a closed generation written into `records` per batch, at least.
pub const COMPACT_PER_BATCH_MIN: usize = 16;
/// WAL pages between automatic checkpoints (SQLite's default is 1000). Larger means fewer,
/// longer checkpoints and a larger WAL file between them.
pub const WAL_AUTOCHECKPOINT_PAGES: u32 = 4000;
/// SQLite's page cache, in KiB (SQLite's default is 2000).
pub const PAGE_CACHE_KIB: i64 = 65_536;

/// A test hook ([`SqliteOptions::disk_gate`]): the disk thread passes it before each write,
/// and waits there while a test holds it.
#[derive(Debug, Default)]
pub struct DiskGate {
    lock: Mutex<()>,
    arrivals: AtomicU64,
}

impl DiskGate {
    /// Stalls the disk thread at its next write until the guard is dropped.
    pub fn hold(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many writes reached the gate (counted before they wait at it).
    pub fn arrivals(&self) -> u64 {
        self.arrivals.load(Ordering::SeqCst)
    }

    fn pass(&self) -> std::sync::MutexGuard<'_, ()> {
        self.arrivals.fetch_add(1, Ordering::SeqCst);
        self.hold()
    }
}

/// Added to a [`SqliteOptions::write_fault`] code: only the next write fails.
pub const WRITE_FAULT_ONCE: i32 = 1 << 16;
/// Refusal counts (minute, code, scope kind) the applier holds aside at most before it writes
/// them (a batch of refusals alone changes nothing: see `Writer::flush_refusals`).
pub const REFUSALS_HELD_MAX: usize = 1024;
/// How long the applier holds refusal counts aside at most (of the store's clock, checked at
/// each batch).
pub const REFUSALS_HELD_MS: u64 = 1_000;
/// Applied batches waiting for the disk thread at most; past it the applier waits for the
/// disk (its command queue then fills and callers are refused: fail closed).
pub const DISK_QUEUE_MAX: usize = 64;
/// Batches the disk thread writes in one transaction (one fsync) at most, when they queued
/// up behind the write before.
pub const JOBS_PER_WRITE_MAX: usize = 64;

const _: () = assert!(BATCH_MAX >= 1 && BATCH_MAX <= QUEUE_MAX);
const _: () = assert!(DISK_QUEUE_MAX >= 1 && JOBS_PER_WRITE_MAX >= 1);

const UPSERT_SQL: &str = "INSERT OR REPLACE INTO records(key, value) VALUES (?1, ?2)";
const DELETE_SQL: &str = "DELETE FROM records WHERE key = ?1";
const RECORDS_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS records(
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL
) WITHOUT ROWID;";
const LOG_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS log(
    seq INTEGER PRIMARY KEY,
    changes BLOB NOT NULL
);";
const LOG_SQL: &str = "INSERT INTO log(seq, changes) VALUES (?1, ?2)";
const TRIM_SQL: &str = "DELETE FROM log WHERE seq <= ?1";

#[derive(Debug, Clone)]
pub struct SqliteOptions {
    /// The database file (created when missing). Its directory must exist.
    pub path: PathBuf,
    /// Bound of the command queue in front of the applier (at least 1).
    pub queue_max: usize,
    /// Commands per group commit at most (at least 1).
    pub batch_max: usize,
    /// How long `open` waits for the file's lock before failing.
    pub lock_wait: Duration,
    /// A hard cap on the database size; past it writes fail and the store refuses new work
    /// (fail closed). `None`: no cap beyond the disk.
    pub max_file_bytes: Option<u64>,
    /// For tests of failing disks: while it holds a nonzero SQLite result code (such as
    /// `SQLITE_FULL` = 13 or `SQLITE_IOERR` = 10), every write fails with that code before
    /// it reaches the file; with [`WRITE_FAULT_ONCE`] added, only the next write fails (the
    /// value is then reset to 0). `None` in production.
    pub write_fault: Option<Arc<AtomicI32>>,
    /// For tests of the pipeline: the disk thread passes this gate before each write (or
    /// discard), so a test that holds it stalls the disk thread with the jobs it took.
    /// `None` in production.
    pub disk_gate: Option<Arc<DiskGate>>,
    /// Log rows per generation at most (at least 1; see the module's "Compaction").
    pub generation_rows_max: u64,
    /// Whether closing the store compacts the whole log into `records`. Only tests turn it
    /// off, to leave a file as a crash would.
    pub compact_on_close: bool,
    /// Whether the store keeps the usage history (in the same transactions as the ledger;
    /// see `sqlite/history.rs`). On by default.
    pub history: bool,
    /// History rows older than this are deleted (by a bounded periodic prune).
    pub history_retention: Duration,
    /// Rows one history table keeps at most (the most recently inserted).
    pub history_rows_max: u64,
}

impl SqliteOptions {
    pub fn new(path: impl Into<PathBuf>) -> SqliteOptions {
        SqliteOptions {
            path: path.into(),
            queue_max: QUEUE_MAX,
            batch_max: BATCH_MAX,
            lock_wait: Duration::from_millis(LOCK_WAIT_MS_DEFAULT),
            max_file_bytes: None,
            write_fault: None,
            disk_gate: None,
            generation_rows_max: GENERATION_ROWS_MAX,
            compact_on_close: true,
            history: true,
            history_retention: HISTORY_RETENTION_DEFAULT,
            history_rows_max: HISTORY_ROWS_MAX_DEFAULT,
        }
    }
}

type Answer<T> = oneshot::Sender<Result<T, StoreError>>;
type Inspector = Box<dyn FnOnce(&Ledger) + Send>;

enum Msg {
    Exec(Command, Answer<Reply>),
    /// Several commands applied in order in the same batch (one durable write).
    Many(Vec<(Command, Answer<Reply>)>),
    /// Answered by the applier itself: whether it and the disk thread are alive and serving.
    Ping(Answer<()>),
    /// Runs a closure over the ledger, between commands.
    Inspect(Inspector),
    /// A history read, passed on to the disk thread in order with the writes.
    Read(history::Read),
}

/// The applier's command queue (the history reader holds it weakly).
struct Queue(SyncSender<Msg>);

impl Queue {
    fn send(&self, msg: Msg) -> Result<(), StoreError> {
        self.0.try_send(msg).map_err(|e| match e {
            TrySendError::Full(_) => StoreError::Unavailable("store queue full".into()),
            TrySendError::Disconnected(_) => writer_gone(),
        })
    }
}

impl history::ReadQueue for Queue {
    fn read(&self, f: history::Read) -> Result<(), StoreError> {
        self.send(Msg::Read(f))
    }
}

/// The tap told of every history event once its transaction is committed.
type TapSlot = Arc<std::sync::RwLock<Option<Arc<dyn crate::HistoryTap>>>>;

pub struct SqliteStore {
    path: PathBuf,
    /// `None` only while dropping.
    queue: Option<Arc<Queue>>,
    writer: Option<JoinHandle<()>>,
    /// `None`: the store keeps no history.
    history: Option<Arc<SqliteHistory>>,
    tap: TapSlot,
}

impl SqliteStore {
    /// Opens (or creates) the file, takes its exclusive lock, loads the ledger and starts the
    /// writer thread.
    pub fn open(
        opts: SqliteOptions,
        policy: Policy,
        clock: Arc<dyn Clock>,
    ) -> Result<SqliteStore, StoreError> {
        let (conn, version) = open_connection(&opts)?;
        let rows_max = opts.generation_rows_max.max(1);
        let failed =
            |e: String| StoreError::Unavailable(format!("sqlite {}: {e}", opts.path.display()));
        let old = match version {
            SCHEMA_VERSION_OLD_RUNS => Some(Old::V5),
            SCHEMA_VERSION_NO_HISTORY => Some(Old::V6),
            _ => None,
        };
        let (mut ledger, mut log) = load_as(&conn, rows_max, old).map_err(failed)?;
        ledger.set_history(opts.history);
        if version < SCHEMA_VERSION {
            upgrade(&conn, &ledger).map_err(failed)?;
            // The file now holds the ledger in `records` and an empty log.
            log = LogState::new(rows_max);
        }
        let health = Arc::new(Health::default());
        let written = Arc::new(AtomicU64::new(0));
        let tap: TapSlot = Arc::default();
        let (disk_tx, disk_rx) = sync_channel(DISK_QUEUE_MAX);
        let disk = Disk {
            conn,
            rx: disk_rx,
            health: health.clone(),
            rows_max,
            write_fault: opts.write_fault.clone(),
            gate: opts.disk_gate.clone(),
            written: written.clone(),
            synced: true,
            discarding: false,
            fatal: false,
            history_rows_max: opts.history_rows_max,
            tap: tap.clone(),
        };
        let disk_thread = std::thread::Builder::new()
            .name("spendgate-sqlite-io".into())
            .spawn(move || disk.run())
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot start sqlite disk thread: {e}"))
            })?;
        let (queue, rx) = sync_channel(opts.queue_max.max(1));
        let writer = Writer {
            ledger,
            log,
            policy,
            clock,
            rx,
            batch_max: opts.batch_max.max(1),
            disk: Some(disk_tx),
            disk_thread: Some(disk_thread),
            health,
            broken: None,
            fatal: false,
            row_hint: 1024,
            jobs_sent: 0,
            overrun_job: 0,
            written,
            compact_on_close: opts.compact_on_close,
            keeps_history: opts.history,
            history_retention_ms: u64::try_from(opts.history_retention.as_millis())
                .unwrap_or(u64::MAX),
            pruned: None,
            events: Vec::new(),
            reads: Vec::new(),
            refusals: std::collections::BTreeMap::new(),
            refusals_since: spendgate_core::UnixMs(0),
        };
        // (if this fails, `writer` is dropped: its disk sender closes and the disk thread ends)
        let handle = std::thread::Builder::new()
            .name("spendgate-sqlite".into())
            .spawn(move || writer.run())
            .map_err(|e| StoreError::Unavailable(format!("cannot start sqlite writer: {e}")))?;
        let queue = Arc::new(Queue(queue));
        let history = opts.history.then(|| {
            let weak: std::sync::Weak<dyn history::ReadQueue> =
                Arc::downgrade(&(queue.clone() as Arc<dyn history::ReadQueue>));
            Arc::new(SqliteHistory { queue: weak })
        });
        Ok(SqliteStore {
            path: opts.path,
            queue: Some(queue),
            writer: Some(handle),
            history,
            tap,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` over the applier's ledger between two commands (for tests that check state
    /// and invariants directly). It sees applied changes, including any not yet committed.
    pub async fn inspect<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Ledger) -> T + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.enqueue(Msg::Inspect(Box::new(move |l: &Ledger| {
            let _ = tx.send(f(l));
        })))?;
        rx.await.map_err(|_| writer_gone())
    }

    fn enqueue(&self, msg: Msg) -> Result<(), StoreError> {
        self.queue.as_ref().ok_or_else(writer_gone)?.send(msg)
    }
}

impl Drop for SqliteStore {
    /// Closes the queue and waits for both threads to finish what was queued and close the file
    /// (so that the file can be opened again at once).
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(h) = self.writer.take() {
            // Dropped by the applier itself (the last handle went into an `inspect` closure):
            // it ends on its own once the queue is empty.
            if h.thread().id() == std::thread::current().id() {
                return;
            }
            if h.join().is_err() {
                tracing::error!("sqlite writer thread panicked");
            }
        }
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.enqueue(Msg::Exec(cmd, tx))?;
        rx.await.map_err(|_| writer_gone())?
    }

    async fn execute_many(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let n = cmds.len();
        let (msgs, rxs): (Vec<_>, Vec<_>) = cmds
            .into_iter()
            .map(|cmd| {
                let (tx, rx) = oneshot::channel();
                ((cmd, tx), rx)
            })
            .unzip();
        if let Err(e) = self.enqueue(Msg::Many(msgs)) {
            return vec![Err(e); n];
        }
        let mut out = Vec::with_capacity(n);
        for rx in rxs {
            out.push(rx.await.map_err(|_| writer_gone()).and_then(|r| r));
        }
        out
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let (tx, rx) = oneshot::channel();
        self.enqueue(Msg::Ping(tx))?;
        rx.await.map_err(|_| writer_gone())?
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn history(&self) -> Option<Arc<dyn crate::HistoryReader>> {
        self.history
            .clone()
            .map(|h| h as Arc<dyn crate::HistoryReader>)
    }

    fn tap_history(&self, tap: Arc<dyn crate::HistoryTap>) {
        *self.tap.write().unwrap_or_else(|p| p.into_inner()) = Some(tap);
    }
}

fn writer_gone() -> StoreError {
    StoreError::Unavailable("sqlite writer stopped".into())
}

fn sql_err(path: &Path, e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => {
            StoreError::Unavailable(format!(
                "sqlite {} is in use by another process (spendgate holds the file exclusively)",
                path.display()
            ))
        }
        _ => StoreError::Unavailable(format!("sqlite {}: {e}", path.display())),
    }
}

/// Tables of a file that spendgate did not make (at version 0, before it made any).
const OTHER_TABLES_SQL: &str = "SELECT count(*) FROM sqlite_master WHERE name <> 'records'";

fn not_ours(path: &Path) -> StoreError {
    StoreError::Unavailable(format!(
        "sqlite {}: not a spendgate database (it holds other tables)",
        path.display()
    ))
}

/// Refuses another application's database before anything is written to it (even the
/// journal mode, which lives in the file's header): tables, and no spendgate version. Any
/// doubt (no file, a file it cannot read, one in use) is left to `open_connection`, which
/// checks again inside its first transaction.
fn refuse_foreign(path: &Path) -> Result<(), StoreError> {
    if !path.exists() {
        return Ok(());
    }
    let Ok(c) = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY) else {
        return Ok(());
    };
    let version = c.pragma_query_value(None, "user_version", |r| r.get::<_, i64>(0));
    let others = c.query_row(OTHER_TABLES_SQL, [], |r| r.get::<_, i64>(0));
    match (version, others) {
        (Ok(0), Ok(n)) if n > 0 => Err(not_ours(path)),
        _ => Ok(()),
    }
}

/// Opens the file, sets the pragmas, takes the exclusive lock and checks or creates the
/// schema. Answers the file's version: [`SCHEMA_VERSION`], or [`SCHEMA_VERSION_OLD_RUNS`]
/// (a version 4 file is brought to 5 here; `upgrade` takes 5 to 6 once it is loaded).
fn open_connection(opts: &SqliteOptions) -> Result<(Connection, i64), StoreError> {
    let path = opts.path.as_path();
    let err = |e| sql_err(path, e);
    refuse_foreign(path)?;
    let conn = Connection::open(path).map_err(err)?;
    conn.busy_timeout(opts.lock_wait).map_err(err)?;
    // Before the first access, so that WAL runs without shared memory and the lock taken by
    // the first write is held until the connection closes.
    conn.pragma_update(None, "locking_mode", "EXCLUSIVE")
        .map_err(err)?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
        .map_err(err)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Unavailable(format!(
            "sqlite {}: cannot use WAL journal mode (got {mode})",
            path.display()
        )));
    }
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(err)?;
    conn.pragma_update(None, "wal_autocheckpoint", WAL_AUTOCHECKPOINT_PAGES)
        .map_err(err)?;
    conn.pragma_update(None, "cache_size", -PAGE_CACHE_KIB)
        .map_err(err)?;
    if let Some(bytes) = opts.max_file_bytes {
        let page: i64 = conn
            .pragma_query_value(None, "page_size", |r| r.get(0))
            .map_err(err)?;
        let page = u64::try_from(page).unwrap_or(4096).max(512);
        let pages = i64::try_from(bytes.div_ceil(page).max(1)).unwrap_or(i64::MAX);
        conn.pragma_update(None, "max_page_count", pages)
            .map_err(err)?;
    }
    let tx = Transaction::new_unchecked(&conn, TransactionBehavior::Immediate).map_err(err)?;
    let found: i64 = tx
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(err)?;
    let version = match found {
        0 => {
            let objects: i64 = tx
                .query_row(OTHER_TABLES_SQL, [], |r| r.get(0))
                .map_err(err)?;
            if objects > 0 {
                return Err(not_ours(path));
            }
            tx.execute_batch(&format!(
                "{RECORDS_TABLE_SQL}{LOG_TABLE_SQL}{}",
                history::HISTORY_TABLES_SQL
            ))
            .map_err(err)?;
            SCHEMA_VERSION
        }
        SCHEMA_VERSION_BEFORE_LOG => {
            tx.execute_batch(LOG_TABLE_SQL).map_err(err)?;
            tx.execute(MOVE_RESERVATIONS_SQL, []).map_err(err)?;
            SCHEMA_VERSION_OLD_RUNS
        }
        SCHEMA_VERSION_OLD_RUNS | SCHEMA_VERSION_NO_HISTORY | SCHEMA_VERSION => found,
        other => {
            return Err(StoreError::Unavailable(format!(
                "sqlite {}: schema version {other} is not supported (this build reads \
                 versions {SCHEMA_VERSION_BEFORE_LOG} to {SCHEMA_VERSION})",
                path.display()
            )))
        }
    };
    // Always a write: it takes the exclusive lock now, so a second process fails at open
    // rather than at its first command.
    tx.pragma_update(None, "user_version", version)
        .map_err(err)?;
    tx.commit().map_err(err)?;
    Ok((conn, version))
}

/// Brings a version 5 or 6 file to [`SCHEMA_VERSION`] (with the history tables, empty): every record of `ledger` (loaded from it
/// with the old layout) is written in the new one, the log emptied and the version set, in
/// one fsynced transaction (a crash before its end leaves the version 5 file as it was).
fn upgrade(conn: &Connection, ledger: &Ledger) -> Result<(), String> {
    let entities: Vec<Entity> = ledger.records().iter().map(Record::entity).collect();
    let encoded = encode_records(ledger, &entities)?;
    let write = || -> Result<(), WriteError> {
        let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
        tx.execute_batch("DELETE FROM records; DELETE FROM log;")?;
        tx.execute_batch(history::HISTORY_TABLES_SQL)?;
        write_encoded(&tx, &encoded)?;
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        tx.commit()?;
        Ok(())
    };
    write().map_err(|e| {
        format!(
            "upgrading to schema version {SCHEMA_VERSION}: {}",
            e.message
        )
    })
}

/// The table key of an entity: [`Entity::storage_key`], except for a run and its run
/// counter, which share the run's prefix.
fn table_key(entity: &Entity) -> String {
    let mut key = String::new();
    write_table_key(entity, &mut key);
    key
}

/// Appends [`table_key`] to `out`. A run's rows begin with its id, length first, so that no
/// id can reach into another run's rows whatever characters it holds.
fn write_table_key(entity: &Entity, out: &mut String) {
    use std::fmt::Write;
    // Writing into a String cannot fail.
    match entity {
        Entity::Run(id) => {
            let _ = write!(out, "r|{:03}{}", id.0.len(), id.0);
        }
        Entity::Counter(k) if k.scope.kind == ScopeKind::Run => {
            let _ = write!(
                out,
                "r|{:03}{}|c|{}|{}",
                k.scope.id.len(),
                k.scope.id,
                k.window.window.name(),
                k.window.index
            );
        }
        other => other.write_storage_key(out),
    }
}

/// Version 4 kept a reservation under its run's prefix (`r|NNNrun|s|id`, NNN the run id's
/// length); version 5 keeps it under its own key (`s|id`).
const MOVE_RESERVATIONS_SQL: &str = "UPDATE records
    SET key = 's|' || substr(key, 9 + CAST(substr(key, 3, 3) AS INTEGER))
    WHERE key LIKE 'r|%' AND substr(key, 6 + CAST(substr(key, 3, 3) AS INTEGER), 3) = '|s|'";

/// Where the log stands: the next row's number, the open generation and the closed one
/// being compacted (see the module's "Compaction").
#[derive(Default)]
struct LogState {
    /// The `seq` of the next log row.
    next_seq: i64,
    /// Rows per generation at most.
    rows_max: u64,
    /// Entities logged since the open generation began.
    open: HashSet<Entity>,
    open_rows: u64,
    open_bytes: usize,
    /// Entities of the closed generation not yet written into `records`, in order.
    closing: Vec<Entity>,
    /// The closed generation's entities while a thread of their own sorts them (`closing`
    /// is empty until [`LogState::take_sorted`] takes them).
    sorting: Option<Receiver<Vec<Entity>>>,
    /// The closed generation's last log row: rows up to it are deleted once `closing` is
    /// written whole.
    closing_last: Option<i64>,
    /// Entities of `closing` written per batch.
    per_batch: usize,
}

impl LogState {
    /// The state of an empty log.
    fn new(rows_max: u64) -> LogState {
        LogState {
            next_seq: 1,
            rows_max,
            ..LogState::default()
        }
    }

    /// Whether the open generation reached one of its bounds.
    fn open_full(&self) -> bool {
        self.open_rows >= self.rows_max
            || self.open.len() >= GENERATION_ENTITIES_MAX
            || self.open_bytes >= GENERATION_LOG_BYTES_MAX
    }

    /// Closes the open generation when it is full (`force`: whenever it holds anything) and
    /// no other is being compacted.
    fn maybe_close(&mut self, last_seq: i64, force: bool) {
        if self.closing_last.is_some() || self.open_rows == 0 {
            return;
        }
        if !(self.open_full() || force) {
            return;
        }
        let open = std::mem::take(&mut self.open);
        let rows = usize::try_from(self.open_rows).unwrap_or(usize::MAX).max(1);
        self.per_batch = open.len().div_ceil(rows).max(COMPACT_PER_BATCH_MIN);
        self.closing_last = Some(last_seq);
        self.open_rows = 0;
        self.open_bytes = 0;
        debug_assert!(self.closing.is_empty() && self.sorting.is_none());
        match sort_aside(open) {
            Ok(sorted) => self.sorting = Some(sorted),
            // (no thread to be had: sorted here, a pause of the applier)
            Err(open) => self.closing = sorted(open),
        }
    }

    /// Takes the closed generation's entities once they are sorted; `wait`: blocks until
    /// they are. An error: the sorting thread died without them (the generation's log rows
    /// stay until its entities are written, so the caller's reload loses nothing).
    fn take_sorted(&mut self, wait: bool) -> Result<(), String> {
        let Some(rx) = &self.sorting else {
            return Ok(());
        };
        let got = if wait {
            rx.recv().ok()
        } else {
            match rx.try_recv() {
                Ok(v) => Some(v),
                Err(TryRecvError::Empty) => return Ok(()),
                Err(TryRecvError::Disconnected) => None,
            }
        };
        match got {
            Some(v) => {
                self.closing = v;
                self.sorting = None;
                Ok(())
            }
            // (`sorting` stays: the generation is never taken for written)
            None => Err("the sqlite compaction's sorting thread ended without its answer".into()),
        }
    }

    /// Whether the closed generation is written whole (or there is none).
    fn closing_done(&self) -> bool {
        self.closing.is_empty() && self.sorting.is_none()
    }
}

/// A closed generation's entities sorted by entity (kind, then id; no key strings built):
/// close to the table's key order (within a kind, ids that sort together are stored together;
/// a run counter's row sits with its run's, and run keys start with the id's length), so a
/// slice taken from the end writes mostly neighbouring rows (a few pages) instead of rows
/// spread over the table.
fn sorted(open: HashSet<Entity>) -> Vec<Entity> {
    let mut v: Vec<Entity> = open.into_iter().collect();
    v.sort_unstable();
    v
}

/// [`sorted`] on a thread of its own (one per closed generation, and one generation is
/// compacted at a time): the answer comes on the receiver. Gives the set back when no thread
/// could be started.
fn sort_aside(open: HashSet<Entity>) -> Result<Receiver<Vec<Entity>>, HashSet<Entity>> {
    let (in_tx, in_rx) = sync_channel::<HashSet<Entity>>(1);
    let (out_tx, out_rx) = sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("spendgate-sqlite-sort".into())
        .spawn(move || {
            if let Ok(open) = in_rx.recv() {
                let _ = out_tx.send(sorted(open));
            }
        });
    if spawned.is_err() {
        return Err(open);
    }
    in_tx.send(open).map_err(|e| e.0)?;
    Ok(out_rx)
}

/// Runs `f` on each row of `sql`'s answer, in order.
fn each_row(
    conn: &Connection,
    sql: &str,
    mut f: impl FnMut(&rusqlite::Row<'_>) -> Result<(), String>,
) -> Result<(), String> {
    let mut stmt = conn.prepare(sql).map_err(|e| e.to_string())?;
    let mut rows = stmt.query([]).map_err(|e| e.to_string())?;
    while let Some(row) = rows.next().map_err(|e| e.to_string())? {
        f(row)?;
    }
    Ok(())
}

/// Reads every record, replays the log over them and rebuilds the ledger (with change
/// tracking) and the log's state: everything the log holds is one closed generation, to be
/// compacted by the next batches.
fn load(conn: &Connection, rows_max: u64) -> Result<(Ledger, LogState), String> {
    load_as(conn, rows_max, None)
}

/// [`load`], reading the layout of an older version when `old` (see [`v5`]).
fn load_as(
    conn: &Connection,
    rows_max: u64,
    old: Option<Old>,
) -> Result<(Ledger, LogState), String> {
    let mut records: HashMap<String, Record> = HashMap::new();
    let check = |key: &str, record: &Record| -> Result<(), String> {
        if table_key(&record.entity()) != key {
            return Err(format!("record {key} is stored under the wrong key"));
        }
        Ok(())
    };
    each_row(conn, "SELECT key, value FROM records", |row| {
        let key: String = row.get(0).map_err(|e| e.to_string())?;
        let value = row.get_ref(1).map_err(|e| e.to_string())?;
        let bytes = value.as_blob().map_err(|e| format!("record {key}: {e}"))?;
        let (record, rest) = if let Some(old) = old {
            v5::take_record(bytes, old)
        } else {
            postcard::take_from_bytes(bytes)
        }
        .map_err(|e| format!("record {key}: {e}"))?;
        if !rest.is_empty() {
            return Err(format!(
                "record {key} has {} bytes past its end (written by another layout?)",
                rest.len()
            ));
        }
        check(&key, &record)?;
        records.insert(key, record);
        Ok(())
    })?;
    let mut log = LogState::new(rows_max);
    let mut touched: HashSet<Entity> = HashSet::default();
    let meta_key = Entity::Meta.storage_key();
    each_row(conn, "SELECT seq, changes FROM log ORDER BY seq", |row| {
        let seq: i64 = row.get(0).map_err(|e| e.to_string())?;
        let value = row.get_ref(1).map_err(|e| e.to_string())?;
        let blob = value.as_blob().map_err(|e| format!("log row {seq}: {e}"))?;
        let (count, mut bytes) = match blob.split_first_chunk::<4>() {
            Some((count, rest)) if u32::from_le_bytes(*count) > 0 => {
                (u32::from_le_bytes(*count), rest)
            }
            _ => return Err(format!("log row {seq}: no entries")),
        };
        for _ in 0..count {
            let ((key, record), rest): ((String, Option<Record>), &[u8]) = if let Some(old) = old {
                v5::take_entry(bytes, old)
            } else {
                postcard::take_from_bytes(bytes)
            }
            .map_err(|e| format!("log row {seq}: {e}"))?;
            bytes = rest;
            if key.is_empty() || (record.is_none() && key == meta_key) {
                return Err(format!("log row {seq}: a malformed entry ({key:?})"));
            }
            match record {
                Some(record) => {
                    check(&key, &record).map_err(|e| format!("log row {seq}: {e}"))?;
                    touched.insert(record.entity());
                    records.insert(key, record);
                }
                None => {
                    if let Some(old) = records.remove(&key) {
                        touched.insert(old.entity());
                    }
                }
            }
        }
        if !bytes.is_empty() {
            return Err(format!(
                "log row {seq} has {} bytes past its entries",
                bytes.len()
            ));
        }
        log.next_seq = seq.saturating_add(1);
        log.open_rows += 1;
        Ok(())
    })?;
    log.open = touched;
    log.maybe_close(log.next_seq - 1, true);
    Ok((Ledger::restore(records.into_values(), true), log))
}

/// The applier thread: owns the [`Ledger`] and the log's state, applies each batch of
/// commands, encodes what it changed and hands it to the disk thread as a [`Job`].
struct Writer {
    ledger: Ledger,
    /// Where the log stands (kept with the file: rebuilt on reload). It runs ahead of the
    /// file by the jobs the disk thread has not written yet.
    log: LogState,
    policy: Policy,
    clock: Arc<dyn Clock>,
    rx: Receiver<Msg>,
    batch_max: usize,
    /// `None` only while closing.
    disk: Option<SyncSender<DiskMsg>>,
    disk_thread: Option<JoinHandle<()>>,
    health: Arc<Health>,
    /// Why the ledger is not being served: a failed write could not be followed by a reload.
    /// Every batch retries the reload first, unless `fatal`.
    broken: Option<String>,
    /// The file failed in a way after which what it holds is not known (an I/O error, which
    /// on Linux may have dropped earlier unsynced pages while the next fsync succeeds, or
    /// corruption): nothing is served again until the process restarts and recovers it.
    fatal: bool,
    /// The length of the last log row (the next one's first allocation).
    row_hint: usize,
    /// Jobs made so far (the last one's number).
    jobs_sent: u64,
    /// The number of the last job that holds an overrun commit's answer, the batch being
    /// applied included (0: none).
    overrun_job: u64,
    /// The number of the last job the disk thread wrote (a discarded one does not count).
    written: Arc<AtomicU64>,
    compact_on_close: bool,
    /// Whether the ledger keeps a usage history (set again after every reload).
    keeps_history: bool,
    history_retention_ms: u64,
    /// When the history was last pruned (of the store's clock).
    pruned: Option<spendgate_core::UnixMs>,
    /// History events of the batch under way (taken from the ledger after each command).
    events: Vec<HistoryEvent>,
    /// History reads taken in the batch under way (at most the batch's size).
    reads: Vec<history::Read>,
    /// Refusal counts not yet written (see [`Writer::flush_refusals`]), and since when.
    refusals: std::collections::BTreeMap<spendgate_core::history::RefusalMinute, u64>,
    refusals_since: spendgate_core::UnixMs,
}

/// A command applied in this batch whose answer waits for the write.
type Pending = (Answer<Reply>, Result<Reply, StoreError>);

/// The answers of a batch that wait for its job.
#[derive(Default)]
struct Waiting {
    /// Answers that wait for the job's write and its fsync.
    pending: Vec<Pending>,
    /// Answers that wait only for the job's turn: sent once its transaction is committed,
    /// with no fsync of their own. They were applied while an overrun commit was not yet on
    /// disk, and may tell of it (a finish's charge, a refused release of the committed
    /// step, a read): they must not leave before it is written, nor at all if its write fails.
    ordered: Vec<Pending>,
}

impl Waiting {
    fn is_empty(&self) -> bool {
        self.pending.is_empty() && self.ordered.is_empty()
    }

    fn send(self) {
        for (tx, answer) in self.pending.into_iter().chain(self.ordered) {
            let _ = tx.send(answer);
        }
    }

    fn refuse(self, why: &str) {
        let err = StoreError::Unavailable(why.to_string());
        for (tx, _) in self.pending.into_iter().chain(self.ordered) {
            let _ = tx.send(Err(err.clone()));
        }
    }
}

/// Records encoded for `records`: each entity's table key and its record (`None`: deleted).
type Encoded = Vec<(String, Option<Vec<u8>>)>;

/// One applied batch, for the disk thread to write and then answer.
struct Job {
    /// The log row: its `seq` and its changes. `None`: the batch changed nothing (its
    /// answers still wait for every job before it).
    row: Option<(i64, Vec<u8>)>,
    /// The next part of the closed generation's compaction.
    records: Encoded,
    /// Log rows up to this `seq` are deleted (their generation is wholly in `records`).
    trim: Option<i64>,
    answers: Waiting,
    /// This job's number (the applier's count of jobs made).
    number: u64,
    /// The usage history its changes made, written in the same transaction.
    history: Vec<HistoryEvent>,
    /// History rows older than this are pruned in its transaction (bounded).
    prune: Option<spendgate_core::UnixMs>,
}

impl Job {
    /// Whether its answers wait for the disk's flush (see [`Command::needs_durability`]).
    fn durable(&self) -> bool {
        !self.answers.pending.is_empty()
    }

    fn writes(&self) -> bool {
        self.row.is_some()
            || !self.records.is_empty()
            || self.trim.is_some()
            || !self.history.is_empty()
            || self.prune.is_some()
    }
}

type Reloaded = Result<(Ledger, LogState), String>;

enum DiskMsg {
    Write(Job),
    /// Rebuild the ledger from the file (after a failed write, once every earlier job is
    /// done or discarded); from then on jobs are written again.
    Reload(SyncSender<Reloaded>),
    /// A clean close: write every record and empty the log.
    Close(Encoded),
    /// A history read, run on the connection between two transactions.
    Read(history::Read),
}

/// What the disk thread tells the applier and `ready`.
#[derive(Default)]
struct DiskHealth {
    /// A write failed and the applier has not reloaded since (a fatal one: it must not).
    failed: Option<WriteError>,
    /// The last write failed and none has succeeded since (a full disk, say): `ready` says
    /// so, even though the ledger was reloaded and small batches may still fit.
    write_failing: Option<String>,
}

/// [`DiskHealth`], shared by the two threads.
#[derive(Default)]
struct Health {
    state: Mutex<DiskHealth>,
    /// Whether `state.failed` holds a failure (set and cleared under the lock): read without
    /// it before each command a batch takes, so that a batch takes no more once a write
    /// failed and the next one reloads before it applies anything (a command applied on
    /// changes that the failed write dropped would only be refused when its job is discarded).
    failure_reported: AtomicBool,
}

impl Health {
    /// The disk thread's report of a failed write.
    fn report_failure(&self, failed: WriteError) {
        let mut state = lock(self);
        state.write_failing = Some(format!("the last sqlite write failed: {}", failed.message));
        state.failed = Some(failed);
        self.failure_reported.store(true, Ordering::Release);
    }

    /// Takes the failure reported since the last call, if any.
    fn take_failure(&self) -> Option<WriteError> {
        let mut state = lock(self);
        self.failure_reported.store(false, Ordering::Release);
        state.failed.take()
    }

    fn failure_reported(&self) -> bool {
        self.failure_reported.load(Ordering::Acquire)
    }
}

fn lock(health: &Health) -> std::sync::MutexGuard<'_, DiskHealth> {
    // Its fields are plain values, whole whatever panicked while holding it.
    health
        .state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Writer {
    fn run(mut self) {
        let mut waiting = Waiting::default();
        // Ends when every sender is gone (the store was dropped) and the queue is empty.
        while let Ok(first) = self.rx.recv() {
            self.take_disk_failure();
            if self.broken.is_some() && !self.fatal {
                self.reload();
            }
            let mut failed = self.handle(first, &mut waiting);
            for _ in 1..self.batch_max {
                if failed || self.health.failure_reported() {
                    break;
                }
                match self.rx.try_recv() {
                    Ok(msg) => failed = self.handle(msg, &mut waiting),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            let job = if failed {
                Err("the ledger failed while applying a command".to_string())
            } else {
                self.job(&mut waiting)
            };
            match job {
                Ok(None) => {}
                Ok(Some(job)) => {
                    // Blocks while the disk thread is [`DISK_QUEUE_MAX`] jobs behind: the
                    // command queue then fills and callers are refused (fail closed).
                    let unsent = match &self.disk {
                        Some(disk) => disk.send(DiskMsg::Write(job)).err().map(|e| e.0),
                        None => Some(DiskMsg::Write(job)),
                    };
                    if let Some(DiskMsg::Write(job)) = unsent {
                        self.disk_gone(job.answers);
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "sqlite batch abandoned; reloading the ledger from disk");
                    lock(&self.health).write_failing =
                        Some(format!("the last sqlite write failed: {e}"));
                    std::mem::take(&mut waiting).refuse(&format!("sqlite write failed: {e}"));
                    self.reload();
                }
            }
            // (a read the disk thread cannot take is dropped: its caller hears "closed")
            for f in std::mem::take(&mut self.reads) {
                if let Some(disk) = &self.disk {
                    let _ = disk.send(DiskMsg::Read(f));
                }
            }
        }
        self.close();
    }

    /// The disk thread is gone (it panicked): nothing the ledger holds from now on reaches
    /// the file, so the store refuses everything until a restart.
    fn disk_gone(&mut self, answers: Waiting) {
        const WHY: &str = "the sqlite disk thread stopped; refusing until spendgate restarts";
        tracing::error!("{WHY}");
        answers.refuse(WHY);
        self.ledger.clear_changes();
        self.fatal = true;
        self.broken = Some(WHY.to_string());
        lock(&self.health).write_failing = Some(WHY.to_string());
    }

    /// Takes a failure the disk thread reported: a fatal one closes the store until a
    /// restart; another makes the next batch reload the ledger first.
    fn take_disk_failure(&mut self) {
        let Some(WriteError { message, fatal }) = self.health.take_failure() else {
            return;
        };
        self.ledger.clear_changes();
        if fatal {
            tracing::error!(error = %message, "sqlite file failed; refusing every command until a restart recovers it");
            self.fatal = true;
            self.broken = Some(format!(
                "sqlite file failed ({message}); refusing until spendgate restarts"
            ));
        } else if self.broken.is_none() {
            self.broken = Some(format!("the last sqlite write failed: {message}"));
        }
    }

    /// Handles one message; returns true when the ledger panicked (the batch is abandoned).
    fn handle(&mut self, msg: Msg, waiting: &mut Waiting) -> bool {
        match msg {
            Msg::Many(list) => {
                let mut failed = false;
                for (cmd, tx) in list {
                    if failed {
                        let _ = tx.send(Err(StoreError::Unavailable(
                            "the ledger failed while applying a command".into(),
                        )));
                    } else {
                        failed = self.handle(Msg::Exec(cmd, tx), waiting);
                    }
                }
                failed
            }
            Msg::Ping(tx) => {
                if !self.fatal && self.disk_thread.as_ref().is_some_and(|h| h.is_finished()) {
                    self.disk_gone(Waiting::default());
                }
                let failing = lock(&self.health).write_failing.clone();
                let _ = tx.send(match self.broken.clone().or(failing) {
                    None => Ok(()),
                    Some(e) => Err(StoreError::Unavailable(e)),
                });
                false
            }
            Msg::Read(f) => {
                // Passed on after this batch's job, so that it sees every change answered
                // before it (an answer that needs no fsync leaves before its job is written).
                self.reads.push(f);
                false
            }
            Msg::Inspect(f) => {
                if self.broken.is_none() {
                    // It only reads: a panic in it leaves the ledger whole.
                    let ledger = &self.ledger;
                    if catch_unwind(AssertUnwindSafe(|| f(ledger))).is_err() {
                        tracing::error!("an inspect closure panicked");
                    }
                }
                false
            }
            Msg::Exec(cmd, tx) => {
                if let Some(e) = &self.broken {
                    let _ = tx.send(Err(StoreError::Unavailable(e.clone())));
                    return false;
                }
                if tx.is_closed()
                    && matches!(cmd, Command::AdmitRun { .. } | Command::ReserveStep { .. })
                {
                    // Its caller gave up waiting (store timeout: it answered 503): a hold
                    // nobody will use would only block a slot and be charged at expiry.
                    return false;
                }
                let now = self.clock.now();
                let (ledger, policy) = (&mut self.ledger, &self.policy);
                let applied = catch_unwind(AssertUnwindSafe(|| {
                    crate::apply_to(ledger, policy, now, &cmd)
                }));
                let answer = match applied {
                    Ok(r) => r,
                    Err(_) => {
                        // The ledger may be half-changed: nothing of this batch is written.
                        let _ = tx.send(Err(StoreError::Unavailable(
                            "the ledger failed while applying a command".into(),
                        )));
                        return true;
                    }
                };
                if self.keeps_history {
                    self.take_history();
                }
                let overrun = answer.as_ref().is_ok_and(Command::reply_needs_durability);
                if overrun {
                    // (the number of the job this batch becomes)
                    self.overrun_job = self.jobs_sent + 1;
                }
                if cmd.needs_durability() || overrun {
                    waiting.pending.push((tx, answer));
                } else if self.overrun_job > self.written.load(Ordering::Acquire) {
                    waiting.ordered.push((tx, answer));
                } else {
                    let _ = tx.send(answer);
                }
                false
            }
        }
    }

    /// The batch's job: every entity changed since the last job, encoded as one log row
    /// (read from the ledger without cloning), with the next part of the compaction. `None`
    /// when there is nothing to write and no answer waits. An error (an encoding failure)
    /// leaves `log` ahead of the file: the caller reloads.
    fn job(&mut self, waiting: &mut Waiting) -> Result<Option<Job>, String> {
        let changes = self.ledger.take_dirty();
        self.flush_refusals(!changes.is_empty() || !self.events.is_empty());
        if changes.is_empty() {
            if waiting.is_empty() && self.events.is_empty() {
                return Ok(None);
            }
            return Ok(Some(self.numbered(None, Vec::new(), None, waiting)));
        }
        let durable = !waiting.pending.is_empty();
        let (ledger, log) = (&self.ledger, &mut self.log);
        // The row: the number of entries (u32, little-endian), then the entries.
        let mut buf = Vec::with_capacity(self.row_hint);
        buf.extend_from_slice(&[0; 4]);
        let entries = u32::try_from(changes.len()).map_err(|e| e.to_string())?;
        let mut key = String::new();
        for entity in changes {
            let record = ledger.record_ref(&entity);
            key.clear();
            write_table_key(&entity, &mut key);
            buf = postcard::to_extend(&(key.as_str(), record), buf).map_err(|e| e.to_string())?;
            log.open.insert(entity);
        }
        buf[..4].copy_from_slice(&entries.to_le_bytes());
        let seq = log.next_seq;
        log.next_seq = seq.saturating_add(1);
        log.open_rows += 1;
        log.open_bytes = log.open_bytes.saturating_add(buf.len());
        self.row_hint = buf.len();
        // (bounded whatever the mix: with every batch durable, a generation closes at most
        // about 4/3 of `rows_max` rows after the one before it)
        let quota = if !durable {
            log.per_batch.saturating_mul(2)
        } else if log.open_full() {
            log.per_batch.saturating_mul(4)
        } else {
            log.per_batch.div_ceil(2)
        };
        // (while the closed generation is being sorted, no slice: a few batches later)
        log.take_sorted(false)?;
        let n = quota.min(log.closing.len());
        let at = log.closing.len() - n;
        let records = encode_records(ledger, &log.closing[at..])?;
        log.closing.truncate(at);
        let mut trim = None;
        if log.closing_done() {
            trim = log.closing_last.take();
            log.maybe_close(log.next_seq - 1, false);
        }
        Ok(Some(self.numbered(
            Some((seq, buf)),
            records,
            trim,
            waiting,
        )))
    }

    /// Takes the history the last command made: records into the batch's events, refusal
    /// counts aside (added up), so that a flood of refusals, which changes nothing, does not
    /// make a write of its own per batch.
    fn take_history(&mut self) {
        for e in self.ledger.take_history() {
            match e {
                HistoryEvent::Refusals { at, count } => {
                    if self.refusals.is_empty() {
                        self.refusals_since = self.clock.now();
                    }
                    *self.refusals.entry(at).or_insert(0) += count;
                }
                other => self.events.push(other),
            }
        }
    }

    /// Moves the refusal counts held aside into the batch's events when the batch writes
    /// anyway (`writes`), when a history read waits in it, when the oldest is
    /// [`REFUSALS_HELD_MS`] old or when [`REFUSALS_HELD_MAX`] are held. A crash loses at most
    /// that many of them (counts, never a charge).
    fn flush_refusals(&mut self, writes: bool) {
        if self.refusals.is_empty() {
            return;
        }
        let due = writes
            || !self.reads.is_empty()
            || self.refusals.len() >= REFUSALS_HELD_MAX
            || self.clock.now().0 >= self.refusals_since.0.saturating_add(REFUSALS_HELD_MS);
        if due {
            for (at, count) in std::mem::take(&mut self.refusals) {
                self.events.push(HistoryEvent::Refusals { at, count });
            }
        }
    }

    fn numbered(
        &mut self,
        row: Option<(i64, Vec<u8>)>,
        records: Encoded,
        trim: Option<i64>,
        waiting: &mut Waiting,
    ) -> Job {
        self.jobs_sent += 1;
        let mut prune = None;
        if self.keeps_history {
            let now = self.clock.now();
            if self
                .pruned
                .is_none_or(|p| now.0 >= p.0.saturating_add(HISTORY_PRUNE_EVERY_MS))
            {
                self.pruned = Some(now);
                prune = Some(spendgate_core::UnixMs(
                    now.0.saturating_sub(self.history_retention_ms),
                ));
            }
        }
        Job {
            row,
            records,
            trim,
            answers: std::mem::take(waiting),
            number: self.jobs_sent,
            history: std::mem::take(&mut self.events),
            prune,
        }
    }

    /// Rebuilds the ledger from the file once the disk thread has finished (or discarded)
    /// every job sent before, dropping every change that is not on disk.
    fn reload(&mut self) {
        // (what the batch under way made is dropped with its changes, and the refusal counts
        // held aside: the write that failed may have held some)
        self.events.clear();
        self.refusals.clear();
        let (tx, rx) = sync_channel(1);
        let reloaded = match &self.disk {
            Some(disk) if disk.send(DiskMsg::Reload(tx)).is_ok() => rx
                .recv()
                .unwrap_or_else(|_| Err("the sqlite disk thread stopped".into())),
            _ => Err("the sqlite disk thread stopped".into()),
        };
        match reloaded {
            Ok((ledger, log)) => {
                self.ledger = ledger;
                self.ledger.set_history(self.keeps_history);
                self.log = log;
                self.broken = None;
                // Every job sent before was written or discarded; an overrun not written is
                // gone with the changes the reload dropped.
                self.overrun_job = 0;
            }
            Err(e) => {
                tracing::error!(error = %e, "sqlite reload failed; refusing all commands");
                self.ledger.clear_changes();
                self.broken = Some(format!("sqlite ledger could not be reloaded: {e}"));
            }
        }
    }

    /// At a clean close: has every logged entity written into `records` and the log
    /// emptied, in one fsynced transaction, so the next open has nothing to replay; then
    /// waits for the disk thread to finish.
    fn close(mut self) {
        self.take_disk_failure();
        if self.broken.is_none() && self.compact_on_close {
            if let Err(e) = self.log.take_sorted(true) {
                // The log stays whole: the next open replays it.
                tracing::error!(error = %e, "sqlite compaction at close failed");
                self.compact_on_close = false;
            }
        }
        if self.broken.is_none() && self.compact_on_close {
            let mut all: Vec<Entity> = std::mem::take(&mut self.log.closing);
            all.extend(self.log.open.drain());
            match encode_records(&self.ledger, &all) {
                Ok(records) => {
                    if let Some(disk) = &self.disk {
                        let _ = disk.send(DiskMsg::Close(records));
                    }
                }
                // The log stays whole: the next open replays it.
                Err(e) => tracing::error!(error = %e, "sqlite compaction at close failed"),
            }
        }
        drop(self.disk.take());
        if let Some(h) = self.disk_thread.take() {
            if h.join().is_err() {
                tracing::error!("sqlite disk thread panicked");
            }
        }
    }
}

/// Encodes the current record of each entity for `records` (`None`: it no longer exists).
fn encode_records(ledger: &Ledger, entities: &[Entity]) -> Result<Encoded, String> {
    entities
        .iter()
        .map(|entity| {
            let value = match ledger.record_ref(entity) {
                Some(r) => Some(postcard::to_allocvec(&r).map_err(|e| e.to_string())?),
                None => None,
            };
            Ok((table_key(entity), value))
        })
        .collect()
}

/// The disk thread: owns the connection, writes the applier's jobs in order (several in one
/// transaction when they queued up behind a write), and answers each job's waiting
/// commands once its transaction is committed (and fsynced, when one of them needs it).
struct Disk {
    conn: Connection,
    rx: Receiver<DiskMsg>,
    health: Arc<Health>,
    rows_max: u64,
    write_fault: Option<Arc<AtomicI32>>,
    gate: Option<Arc<DiskGate>>,
    /// See `Writer::written`.
    written: Arc<AtomicU64>,
    /// Whether the connection is at `synchronous=FULL` (every commit fsynced).
    synced: bool,
    /// A write failed and no reload has followed: jobs are not written but answered
    /// unavailable (they were built on changes the file does not hold).
    discarding: bool,
    /// See `Writer::fatal`: no reload either.
    fatal: bool,
    /// `SqliteOptions::history_rows_max`.
    history_rows_max: u64,
    tap: TapSlot,
}

impl Disk {
    fn run(mut self) {
        let mut next: Option<DiskMsg> = None;
        loop {
            let msg = match next.take() {
                Some(msg) => msg,
                None => match self.rx.recv() {
                    Ok(msg) => msg,
                    // The applier is gone (after its close).
                    Err(_) => return,
                },
            };
            match msg {
                DiskMsg::Write(job) => {
                    let mut jobs = vec![job];
                    while jobs.len() < JOBS_PER_WRITE_MAX {
                        match self.rx.try_recv() {
                            Ok(DiskMsg::Write(job)) => jobs.push(job),
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    self.write(jobs);
                }
                DiskMsg::Reload(tx) => {
                    let _ = tx.send(self.reload());
                }
                DiskMsg::Close(records) => self.close(&records),
                DiskMsg::Read(f) => {
                    // It only reads: a panic in it leaves the connection whole.
                    if catch_unwind(AssertUnwindSafe(|| f(&self.conn))).is_err() {
                        tracing::error!("a sqlite history read panicked");
                    }
                }
            }
        }
    }

    fn injected(&self) -> i32 {
        let Some(fault) = &self.write_fault else {
            return 0;
        };
        let code = fault.load(Ordering::Relaxed);
        if code & WRITE_FAULT_ONCE == 0 {
            return code;
        }
        match fault.compare_exchange(code, 0, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => code & !WRITE_FAULT_ONCE,
            Err(_) => 0,
        }
    }

    /// Writes the jobs in one transaction: fsynced (`synchronous=FULL`) when one of them
    /// needs it; otherwise written to the WAL without waiting for the disk
    /// (`synchronous=NORMAL`), and the next durable commit's fsync covers it too (the WAL
    /// is one file, synced whole). A crash of the machine can lose only such a trailing run
    /// of non-durable transactions: commits, releases and finishes, whose loss only errs
    /// towards charging more (the holds expire and are charged in full). A crash of the
    /// process loses nothing written.
    fn write(&mut self, jobs: Vec<Job>) {
        let gate = self.gate.clone();
        let _passed = gate.as_ref().map(|g| g.pass());
        let last = jobs.iter().map(|j| j.number).max().unwrap_or(0);
        if self.discarding {
            for job in jobs {
                job.answers
                    .refuse("sqlite write failed: an earlier write failed");
            }
            return;
        }
        let durable = jobs.iter().any(Job::durable);
        let writes = jobs.iter().any(Job::writes);
        let result = if !writes {
            Ok(())
        } else {
            match self.injected() {
                0 => self
                    .set_synchronous(durable)
                    .and_then(|()| write_jobs(&self.conn, &jobs, self.history_rows_max)),
                code => Err(WriteError::from(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(code),
                    Some("injected write fault".into()),
                ))),
            }
        };
        match result {
            Ok(()) => {
                if writes {
                    lock(&self.health).write_failing = None;
                }
                // (only a write advances it: after a failure the applier defers its answers
                // until its reload, which forgets the overrun that failed)
                self.written.fetch_max(last, Ordering::Release);
                let tap = self.tap.read().unwrap_or_else(|p| p.into_inner()).clone();
                for job in jobs {
                    job.answers.send();
                    if let (Some(tap), false) = (&tap, job.history.is_empty()) {
                        tap.seen(&job.history);
                    }
                }
            }
            Err(WriteError { message, fatal }) => {
                tracing::error!(error = %message, fatal, "sqlite write failed");
                self.discarding = true;
                self.fatal |= fatal;
                self.health.report_failure(WriteError {
                    message: message.clone(),
                    fatal: self.fatal,
                });
                let why = format!("sqlite write failed: {message}");
                for job in jobs {
                    job.answers.refuse(&why);
                }
            }
        }
    }

    fn set_synchronous(&mut self, durable: bool) -> Result<(), WriteError> {
        if self.synced != durable {
            let level = if durable { "FULL" } else { "NORMAL" };
            self.conn.pragma_update(None, "synchronous", level)?;
            self.synced = durable;
        }
        Ok(())
    }

    fn reload(&mut self) -> Reloaded {
        if self.fatal {
            return Err("the sqlite file failed; refusing until spendgate restarts".into());
        }
        if !self.conn.is_autocommit() {
            self.conn
                .execute_batch("ROLLBACK")
                .map_err(|e| format!("sqlite transaction could not be rolled back: {e}"))?;
        }
        let reloaded = load(&self.conn, self.rows_max)?;
        self.discarding = false;
        Ok(reloaded)
    }

    /// Writes every record the applier sent into `records` and deletes the log, in one
    /// fsynced transaction.
    fn close(&mut self, records: &Encoded) {
        if self.discarding || self.injected() != 0 {
            return;
        }
        let result = self.set_synchronous(true).and_then(|()| {
            let tx = Transaction::new_unchecked(&self.conn, TransactionBehavior::Immediate)?;
            write_encoded(&tx, records)?;
            tx.execute("DELETE FROM log", [])?;
            tx.commit()?;
            Ok(())
        });
        if let Err(e) = result {
            // The log stays whole: the next open replays it.
            tracing::error!(error = %e.message, "sqlite compaction at close failed");
        }
    }
}

/// Why a write failed, and whether the file may be trusted after it.
struct WriteError {
    message: String,
    /// An I/O error or corruption: see `Writer::fatal`. A full disk, a size cap or a busy
    /// lock is not (the transaction was rolled back whole).
    fatal: bool,
}

impl From<rusqlite::Error> for WriteError {
    fn from(e: rusqlite::Error) -> WriteError {
        let fatal = matches!(
            e.sqlite_error_code(),
            Some(ErrorCode::SystemIoFailure | ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase)
        );
        WriteError {
            message: e.to_string(),
            fatal,
        }
    }
}

/// Writes the jobs' log rows, compaction parts and trims, in order, in one transaction
/// (rolled back whole on any error).
fn write_jobs(conn: &Connection, jobs: &[Job], history_rows_max: u64) -> Result<(), WriteError> {
    let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
    for job in jobs {
        history::write_events(&tx, &job.history)?;
        if let Some(before) = job.prune {
            history::prune(&tx, before, history_rows_max)?;
        }
        if let Some((seq, changes)) = &job.row {
            tx.prepare_cached(LOG_SQL)?
                .execute((seq, changes.as_slice()))?;
        }
        write_encoded(&tx, &job.records)?;
        if let Some(last) = job.trim {
            tx.prepare_cached(TRIM_SQL)?.execute([last])?;
        }
    }
    tx.commit()?;
    Ok(())
}

/// Writes encoded records into `records` (a row deleted for an entity that no longer exists).
fn write_encoded(tx: &Transaction<'_>, records: &Encoded) -> Result<(), WriteError> {
    if records.is_empty() {
        return Ok(());
    }
    let mut upsert = tx.prepare_cached(UPSERT_SQL)?;
    let mut delete = tx.prepare_cached(DELETE_SQL)?;
    for (key, value) in records {
        match value {
            Some(bytes) => upsert.execute((key.as_str(), bytes.as_slice()))?,
            None => delete.execute([key.as_str()])?,
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_core::{
        Budget, IdempotencyKey, Micros, Rate, ReservationId, RunId, ScopePolicy, StepKind,
        StepRequest, ToolPrice, UnixMs, Window,
    };

    /// A closed generation is compacted in entity order: for runs (ids of one length) and
    /// reservations, the order of their table keys, so a slice taken from the end of
    /// `closing` holds neighbouring rows.
    #[test]
    fn a_closed_generation_is_compacted_in_key_order() {
        let mut log = LogState {
            rows_max: 4,
            ..LogState::default()
        };
        for i in [7, 3, 9, 1, 5] {
            log.open
                .insert(Entity::Reservation(spendgate_core::ReservationId(format!(
                    "step-{i}"
                ))));
            log.open
                .insert(Entity::Run(spendgate_core::RunId(format!("run-{i}"))));
        }
        log.open.insert(Entity::Meta);
        log.open_rows = 4;
        log.maybe_close(4, false);
        assert_eq!(log.closing_last, Some(4));
        log.take_sorted(true).expect("sorted");
        let mut taken: Vec<String> = Vec::new();
        while let Some(e) = log.closing.pop() {
            taken.push(table_key(&e));
        }
        let mut sorted = taken.clone();
        sorted.sort();
        assert_eq!(taken.len(), 11);
        sorted.reverse();
        assert_eq!(taken, sorted, "taken from the end in descending key order");
    }

    /// While the closed generation is being sorted, a batch takes no slice and the generation
    /// is not done (its log rows stay); once sorted, its entities are there to compact; a
    /// sorting thread that ends without them is an error (the caller reloads), never an empty
    /// generation taken for a written one.
    #[test]
    fn a_generation_being_sorted_is_not_done_until_its_entities_arrive() {
        let (tx, rx) = sync_channel(1);
        let mut log = LogState {
            closing_last: Some(9),
            sorting: Some(rx),
            ..LogState::default()
        };
        log.take_sorted(false).expect("still sorting");
        assert!(!log.closing_done() && log.closing.is_empty());
        tx.send(vec![Entity::Meta]).expect("send");
        log.take_sorted(false).expect("sorted");
        assert_eq!(log.closing, vec![Entity::Meta]);
        assert!(log.sorting.is_none() && !log.closing_done());
        log.closing.clear();
        assert!(log.closing_done());

        let (tx, rx) = sync_channel::<Vec<Entity>>(1);
        let mut log = LogState {
            closing_last: Some(9),
            sorting: Some(rx),
            ..LogState::default()
        };
        drop(tx);
        assert!(log.take_sorted(false).is_err());
        assert!(
            !log.closing_done(),
            "an empty generation is not a written one"
        );
    }

    /// This test's run record as version 5 wrote it (postcard bytes from a build of d024bc1):
    /// a reference for `v5`'s layout made without it.
    const V5_RUN: &str = "030572756e2d3101730163010b31302e302e302e302f32340180a0f1c2b134c0c9f8c2b1\
        34b08af3c2b1340001000000040000010b31302e302e302e302f32340201730301630106737465702d3100\
        808001807d800880800408100278c09a0c004000";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// What the writer encodes from a borrowed record decodes as the owned record, for every
    /// kind of record a ledger holds.
    /// A ledger (tracking changes) whose changes hold every kind of record: meta, a counter, a
    /// rate, a run, a reservation and an idempotency record.
    fn ledger_with_every_kind_of_record() -> Ledger {
        let policy = Policy {
            global: ScopePolicy {
                budgets: vec![Budget::new(Micros(1_000_000), Window::Day)],
                rate: Some(Rate {
                    count: 10,
                    period_ms: 1000,
                    burst: 10,
                }),
                concurrency: Some(4),
                dry_run: false,
                rate_dry_run: false,
                concurrency_dry_run: false,
            },
            ..Policy::default()
        };
        let mut l = Ledger::with_change_tracking();
        let now = UnixMs(1_800_000_000_000);
        let run = RunId("run-1".into());
        let req = spendgate_core::RunRequest {
            run_id: run.clone(),
            session: "s".into(),
            ips: vec![spendgate_core::IpScope {
                prefix: "10.0.0.0/24".into(),
                factor: 1,
            }],
            conversation: "c".into(),
            input_bytes: 10,
        };
        let cmds = [
            Command::AdmitRun { req, idem: None },
            Command::ReserveStep {
                req: StepRequest {
                    run_id: run,
                    step_id: ReservationId("step-1".into()),
                    kind: StepKind::Tool {
                        tool: "t".into(),
                        price: ToolPrice {
                            per_call: Micros(10),
                            per_unit: Micros(0),
                        },
                        units: 1,
                    },
                },
                idem: Some(IdempotencyKey {
                    key: "step:run-1:k".into(),
                    fingerprint: "f".into(),
                }),
            },
            Command::SetCutoff {
                engaged: true,
                reason: "test".into(),
            },
        ];
        for cmd in &cmds {
            l.apply(&policy, now, cmd).expect("applied");
        }
        l
    }

    #[test]
    fn borrowed_records_encode_as_owned_records() {
        let mut l = ledger_with_every_kind_of_record();
        let dirty = l.take_dirty();
        for e in &dirty {
            let owned = l.record(e).expect("exists");
            let borrowed = l.record_ref(e).expect("exists");
            let a = postcard::to_allocvec(&owned).expect("owned");
            let b = postcard::to_allocvec(&borrowed).expect("borrowed");
            assert_eq!(a, b, "{e:?}");
            let (back, rest): (Record, &[u8]) = postcard::take_from_bytes(&b).expect("decodes");
            assert!(rest.is_empty());
            assert_eq!(back, owned);
            // Versions 4 and 5 (see `v5`): a run's record carried its steps; version 6's had
            // no tally. Every other record, and a log entry of one, reads the same; an old
            // run reads with an empty tally.
            let mut untallied = owned.clone();
            if let Record::Run(run) = &mut untallied {
                run.tally = spendgate_core::RunTally::default();
            }
            for layout in [v5::Old::V5, v5::Old::V6] {
                let old = match (&owned, layout) {
                    (Record::Run(run), v5::Old::V5) => {
                        assert_eq!(b.first(), Some(&v5::RUN_VARIANT), "Record::Run's index");
                        let old = v5::encode_run(run, vec![ReservationId("step-1".into())])
                            .expect("v5 run");
                        assert_eq!(old, unhex(V5_RUN), "as version 5 wrote this run");
                        old
                    }
                    (Record::Run(run), v5::Old::V6) => v5::encode_run_v6(run).expect("v6 run"),
                    _ => b.clone(),
                };
                let (back, rest) = v5::take_record(&old, layout).expect("old layout decodes");
                assert!(rest.is_empty());
                assert_eq!(back, untallied);
                let mut entry = postcard::to_allocvec(&("key", true)).expect("entry head");
                entry.extend(&old);
                let ((key, back), rest) = v5::take_entry(&entry, layout).expect("entry decodes");
                assert!(rest.is_empty());
                assert_eq!((key.as_str(), back), ("key", Some(untallied.clone())));
            }
        }
        let deleted = postcard::to_allocvec(&("key", Option::<Record>::None)).expect("entry");
        let (entry, rest) = v5::take_entry(&deleted, v5::Old::V5).expect("v5 deletion decodes");
        assert!(rest.is_empty());
        assert_eq!(entry, ("key".to_string(), None));
        let names: std::collections::BTreeSet<&str> = dirty
            .iter()
            .map(|e| match e {
                Entity::Meta => "meta",
                Entity::Counter(_) => "counter",
                Entity::Rate(_) => "rate",
                Entity::Run(_) => "run",
                Entity::Reservation(_) => "reservation",
                Entity::Idempotency(_) => "idempotency",
            })
            .collect();
        assert_eq!(names.len(), 6, "every kind of record is covered: {names:?}");
    }
}
