//! The usage history in the sqlite file: four tables written by the disk thread in the same
//! transaction as the log row of the change they record (so a crash keeps both or neither),
//! read back through the disk thread between two transactions.
//!
//! - `history_reservations`: one row per reservation (its `uid`: run, id and creation time,
//!   since a purged reservation's id may be taken again), upserted keeping the larger charge
//!   (a late overrun writes the record again).
//! - `history_runs`: one row per ended run (insert or ignore).
//! - `history_adjustments`: one row per operator adjustment (its id: the ledger's sequence
//!   number).
//! - `history_refusals`: a count per minute, code and scope kind, added up. The applier
//!   holds refusal counts aside and writes them with the next write, at the latest after
//!   `REFUSALS_HELD_MS` (a batch of refusals alone changes nothing in the ledger, and a flood
//!   of them must not make a write per batch).
//!
//! Records are JSON (`record`): self-describing, so a field added later reads as its default
//! in older rows. Each table has an index on its time column for range reads.
//!
//! Retention: rows older than `SqliteOptions::history_retention`, and the rows of a table past
//! its `history_rows_max` most recently inserted, are deleted by the applier's periodic prune
//! (at most every [`HISTORY_PRUNE_EVERY_MS`] of the store's clock, at most
//! [`HISTORY_PRUNE_ROWS_MAX`] rows per table and bound, in the transaction of the next write):
//! never an unbounded delete in the hot path.

use crate::history::{
    bad_cursor, parse_cursor, HistoryFilter, HistoryReader, Page, HISTORY_PAGE_MAX,
};
use crate::StoreError;
use async_trait::async_trait;
use rusqlite::{Connection, Transaction};
use spendgate_core::history::{
    AdjustmentRecord, HistoryEvent, RefusalMinute, ReservationRecord, RunRecord,
};
use spendgate_core::{RefusalCode, ScopeKind, UnixMs};
use std::sync::Weak;
use std::time::Duration;

/// How long history rows are kept by default (`SqliteOptions::history_retention`).
pub const HISTORY_RETENTION_DEFAULT: Duration = Duration::from_secs(90 * 86_400);
/// Rows one history table keeps at most by default (`SqliteOptions::history_rows_max`).
pub const HISTORY_ROWS_MAX_DEFAULT: u64 = 10_000_000;
/// The history is pruned at most this often (of the store's clock).
pub const HISTORY_PRUNE_EVERY_MS: u64 = 1_000;
/// Rows one prune deletes at most, per table and per bound (age, size).
pub const HISTORY_PRUNE_ROWS_MAX: u64 = 5_000;

pub(super) const HISTORY_TABLES_SQL: &str = "
CREATE TABLE IF NOT EXISTS history_reservations(
    uid TEXT PRIMARY KEY,
    at INTEGER NOT NULL,
    charged INTEGER NOT NULL,
    session TEXT NOT NULL,
    address TEXT NOT NULL,
    conversation TEXT NOT NULL,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_reservations_at ON history_reservations(at, uid);
CREATE TABLE IF NOT EXISTS history_runs(
    uid TEXT PRIMARY KEY,
    at INTEGER NOT NULL,
    session TEXT NOT NULL,
    address TEXT NOT NULL,
    conversation TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_runs_at ON history_runs(at, uid);
CREATE TABLE IF NOT EXISTS history_adjustments(
    uid TEXT PRIMARY KEY,
    at INTEGER NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_adjustments_at ON history_adjustments(at, uid);
CREATE TABLE IF NOT EXISTS history_refusals(
    minute INTEGER NOT NULL,
    code TEXT NOT NULL,
    scope TEXT NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY(minute, code, scope)
);";

const UPSERT_RESERVATION_SQL: &str = "INSERT INTO history_reservations
    (uid, at, charged, session, address, conversation, name, state, record)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
    ON CONFLICT(uid) DO UPDATE SET charged = excluded.charged, record = excluded.record
    WHERE excluded.charged > history_reservations.charged";
const INSERT_RUN_SQL: &str = "INSERT OR IGNORE INTO history_runs
    (uid, at, session, address, conversation, record) VALUES (?1, ?2, ?3, ?4, ?5, ?6)";
const INSERT_ADJUSTMENT_SQL: &str =
    "INSERT OR IGNORE INTO history_adjustments(uid, at, record) VALUES (?1, ?2, ?3)";
const ADD_REFUSALS_SQL: &str = "INSERT INTO history_refusals(minute, code, scope, count)
    VALUES (?1, ?2, ?3, ?4)
    ON CONFLICT(minute, code, scope) DO UPDATE SET count = count + excluded.count";

/// A reservation record's row id: its id alone may be taken again once its run was purged.
fn reservation_uid(r: &ReservationRecord) -> String {
    format!("{}|{}|{}", r.created.0, r.run_id.0, r.id.0)
}

fn run_uid(r: &RunRecord) -> String {
    format!("{}|{}", r.created.0, r.id.0)
}

fn ms(at: UnixMs) -> i64 {
    i64::try_from(at.0).unwrap_or(i64::MAX)
}

fn json<T: serde::Serialize>(v: &T) -> Result<String, rusqlite::Error> {
    serde_json::to_string(v).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}

/// Writes history events in the caller's transaction.
pub(super) fn write_events(tx: &Transaction<'_>, events: &[HistoryEvent]) -> rusqlite::Result<()> {
    for e in events {
        match e {
            HistoryEvent::Reservation(r) => {
                tx.prepare_cached(UPSERT_RESERVATION_SQL)?.execute((
                    reservation_uid(r),
                    ms(r.resolved_at),
                    i64::try_from(r.charged.0).unwrap_or(i64::MAX),
                    &r.session,
                    &r.address,
                    &r.conversation,
                    &r.name,
                    r.state.name(),
                    json(r)?,
                ))?;
            }
            HistoryEvent::Run(r) => {
                tx.prepare_cached(INSERT_RUN_SQL)?.execute((
                    run_uid(r),
                    ms(r.ended_at),
                    &r.session,
                    &r.address,
                    &r.conversation,
                    json(r)?,
                ))?;
            }
            HistoryEvent::Adjustment(a) => {
                tx.prepare_cached(INSERT_ADJUSTMENT_SQL)?
                    .execute((&a.id, ms(a.at), json(a)?))?;
            }
            HistoryEvent::Refusals { at, count } => {
                tx.prepare_cached(ADD_REFUSALS_SQL)?.execute((
                    ms(at.minute),
                    at.code.name(),
                    at.scope.map_or("", |s| s.name()),
                    i64::try_from(*count).unwrap_or(i64::MAX),
                ))?;
            }
        }
    }
    Ok(())
}

/// Deletes, in the caller's transaction, rows older than `before` and rows past the
/// `rows_max` most recently inserted of each table, at most [`HISTORY_PRUNE_ROWS_MAX`] per
/// table and bound.
pub(super) fn prune(tx: &Transaction<'_>, before: UnixMs, rows_max: u64) -> rusqlite::Result<()> {
    let n = i64::try_from(HISTORY_PRUNE_ROWS_MAX).unwrap_or(i64::MAX);
    let keep = i64::try_from(rows_max.max(1)).unwrap_or(i64::MAX);
    for (table, at) in [
        ("history_reservations", "at"),
        ("history_runs", "at"),
        ("history_adjustments", "at"),
        ("history_refusals", "minute"),
    ] {
        tx.prepare_cached(&format!(
            "DELETE FROM {table} WHERE rowid IN
             (SELECT rowid FROM {table} WHERE {at} < ?1 ORDER BY {at} LIMIT ?2)"
        ))?
        .execute((ms(before), n))?;
        tx.prepare_cached(&format!(
            "DELETE FROM {table} WHERE rowid IN
             (SELECT rowid FROM {table}
              WHERE rowid <= (SELECT max(rowid) FROM {table}) - ?1 ORDER BY rowid LIMIT ?2)"
        ))?
        .execute((keep, n))?;
    }
    Ok(())
}

/// A read the disk thread runs on its connection between two transactions.
pub(super) type Read = Box<dyn FnOnce(&Connection) + Send>;

/// What runs a read: hands it to the store's applier, which passes it on to the disk thread
/// in order with the writes (so a read sees every change answered before it).
pub(super) trait ReadQueue: Send + Sync + 'static {
    fn read(&self, f: Read) -> Result<(), StoreError>;
}

/// The sqlite store's history reader. It holds the store weakly: once the store is dropped,
/// reads fail (`Unavailable`) and the file is closed as if no reader existed.
pub struct SqliteHistory {
    pub(super) queue: Weak<dyn ReadQueue>,
}

impl SqliteHistory {
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let gone = || StoreError::Unavailable("the sqlite store is closed".into());
        let queue = self.queue.upgrade().ok_or_else(gone)?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        queue.read(Box::new(move |conn: &Connection| {
            let _ = tx.send(f(conn));
        }))?;
        drop(queue);
        rx.await
            .map_err(|_| gone())?
            .map_err(|e| StoreError::Unavailable(format!("sqlite history read: {e}")))
    }
}

/// The (time, uid) after which a page starts; the start of time without a cursor.
fn after_of(after: Option<&str>) -> Result<(i64, String), StoreError> {
    match after {
        None => Ok((i64::MIN, String::new())),
        Some(c) => {
            let (at, uid) = parse_cursor(c).ok_or_else(|| bad_cursor(c))?;
            Ok((ms(at), uid.to_owned()))
        }
    }
}

fn decode<T: serde::de::DeserializeOwned>(s: &str) -> rusqlite::Result<T> {
    serde_json::from_str(s).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

/// Reads one page: `sql` selects (at, uid, record) ordered by (at, uid), with `?1`..`?4` the
/// period and the cursor and `?5` the limit (one more than the page, to know if there is a
/// next one), and the filter's columns after.
fn page<T: serde::de::DeserializeOwned>(
    conn: &Connection,
    sql: &str,
    params: &[&dyn rusqlite::ToSql],
    limit: usize,
) -> rusqlite::Result<Page<T>> {
    let mut stmt = conn.prepare_cached(sql)?;
    let mut rows = stmt.query(params)?;
    let mut items = Vec::new();
    let mut last = None;
    let mut more = false;
    while let Some(row) = rows.next()? {
        if items.len() == limit {
            more = true;
            break;
        }
        let at: i64 = row.get(0)?;
        let uid: String = row.get(1)?;
        let record: String = row.get(2)?;
        items.push(decode(&record)?);
        last = Some((at, uid));
    }
    let next = match (more, last) {
        (true, Some((at, uid))) => Some(crate::history::cursor(
            UnixMs(u64::try_from(at).unwrap_or(0)),
            &uid,
        )),
        _ => None,
    };
    Ok(Page { items, next })
}

const RESERVATIONS_SQL: &str = "SELECT at, uid, record FROM history_reservations
    WHERE at >= ?1 AND at < ?2 AND (at > ?3 OR (at = ?3 AND uid > ?4))
      AND (?6 IS NULL OR session = ?6) AND (?7 IS NULL OR address = ?7)
      AND (?8 IS NULL OR conversation = ?8) AND (?9 IS NULL OR name = ?9)
      AND (?10 IS NULL OR state = ?10)
    ORDER BY at, uid LIMIT ?5";
const RUNS_SQL: &str = "SELECT at, uid, record FROM history_runs
    WHERE at >= ?1 AND at < ?2 AND (at > ?3 OR (at = ?3 AND uid > ?4))
      AND (?6 IS NULL OR session = ?6) AND (?7 IS NULL OR address = ?7)
      AND (?8 IS NULL OR conversation = ?8)
    ORDER BY at, uid LIMIT ?5";
const ADJUSTMENTS_SQL: &str = "SELECT at, uid, record FROM history_adjustments
    WHERE at >= ?1 AND at < ?2 ORDER BY at, uid LIMIT ?3";
const REFUSALS_SQL: &str = "SELECT minute, code, scope, count FROM history_refusals
    WHERE minute >= ?1 AND minute < ?2 ORDER BY minute, code, scope LIMIT ?3";

fn refusal_code(s: &str) -> Option<RefusalCode> {
    [
        RefusalCode::RateLimited,
        RefusalCode::ConcurrencyLimited,
        RefusalCode::BudgetExhausted,
        RefusalCode::RunBoundExceeded,
        RefusalCode::PayloadTooLarge,
        RefusalCode::ContextTooLarge,
        RefusalCode::CutoffEngaged,
        RefusalCode::BudgetHeld,
    ]
    .into_iter()
    .find(|c| c.name() == s)
}

#[async_trait]
impl HistoryReader for SqliteHistory {
    async fn reservations(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<ReservationRecord>, StoreError> {
        let (at, uid) = after_of(after)?;
        let limit = limit.clamp(1, HISTORY_PAGE_MAX);
        let f = filter.clone();
        self.run(move |conn| {
            let state = f.state.map(|s| s.name());
            page(
                conn,
                RESERVATIONS_SQL,
                &[
                    &ms(f.since),
                    &ms(f.until),
                    &at,
                    &uid,
                    &(limit as i64 + 1),
                    &f.session,
                    &f.address,
                    &f.conversation,
                    &f.name,
                    &state,
                ],
                limit,
            )
        })
        .await
    }

    async fn runs(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<RunRecord>, StoreError> {
        let (at, uid) = after_of(after)?;
        let limit = limit.clamp(1, HISTORY_PAGE_MAX);
        let f = filter.clone();
        self.run(move |conn| {
            page(
                conn,
                RUNS_SQL,
                &[
                    &ms(f.since),
                    &ms(f.until),
                    &at,
                    &uid,
                    &(limit as i64 + 1),
                    &f.session,
                    &f.address,
                    &f.conversation,
                ],
                limit,
            )
        })
        .await
    }

    async fn refusals(
        &self,
        since: UnixMs,
        until: UnixMs,
    ) -> Result<Vec<(RefusalMinute, u64)>, StoreError> {
        // (a period's rows: codes × scope kinds per minute; bounded like a page)
        let max = HISTORY_PAGE_MAX as i64;
        self.run(move |conn| {
            let mut stmt = conn.prepare_cached(REFUSALS_SQL)?;
            let mut rows = stmt.query((ms(since), ms(until), max))?;
            let mut out = Vec::new();
            while let Some(row) = rows.next()? {
                let (minute, code, scope, count): (i64, String, String, i64) =
                    (row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?);
                let Some(code) = refusal_code(&code) else {
                    continue;
                };
                let at = RefusalMinute {
                    minute: UnixMs(u64::try_from(minute).unwrap_or(0)),
                    code,
                    scope: ScopeKind::parse(&scope),
                };
                out.push((at, u64::try_from(count).unwrap_or(0)));
            }
            Ok(out)
        })
        .await
    }

    async fn adjustments(
        &self,
        since: UnixMs,
        until: UnixMs,
        limit: usize,
    ) -> Result<Vec<AdjustmentRecord>, StoreError> {
        let limit = limit.clamp(1, HISTORY_PAGE_MAX) as i64;
        self.run(move |conn| {
            let mut stmt = conn.prepare_cached(ADJUSTMENTS_SQL)?;
            let mut rows = stmt.query((ms(since), ms(until), limit))?;
            let mut out = Vec::new();
            while let Some(row) = rows.next()? {
                let record: String = row.get(2)?;
                out.push(decode(&record)?);
            }
            Ok(out)
        })
        .await
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }
}

/// The history of a sqlite file that no process holds, read-only: `spendgate report
/// --config` and `tune --config` once the server has stopped, or over a copy of the file (a
/// running server holds its file exclusively; read it through its admin API then).
pub struct SqliteFileHistory {
    /// The connection the reads run on (the reader holds it only weakly).
    _queue: std::sync::Arc<dyn ReadQueue>,
    reader: SqliteHistory,
}

/// Runs each read on a blocking thread, on the file's one read-only connection.
struct FileQueue(std::sync::Arc<std::sync::Mutex<Connection>>);

impl ReadQueue for FileQueue {
    fn read(&self, f: Read) -> Result<(), StoreError> {
        let conn = self.0.clone();
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| StoreError::Unavailable("no runtime to read the sqlite file on".into()))?;
        handle.spawn_blocking(move || {
            let c = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&c);
        });
        Ok(())
    }
}

impl SqliteFileHistory {
    /// Opens `path` read-only and checks that it holds a usage history.
    pub fn open(path: &std::path::Path) -> Result<SqliteFileHistory, StoreError> {
        let shown = path.display();
        if !path.exists() {
            return Err(StoreError::Unavailable(format!(
                "sqlite {shown}: no such file"
            )));
        }
        let conn = Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|e| StoreError::Unavailable(format!("sqlite {shown}: {e}")))?;
        let version = conn
            .pragma_query_value(None, "user_version", |r| r.get::<_, i64>(0))
            .and_then(|v| {
                conn.query_row("SELECT count(*) FROM history_runs WHERE 0", [], |_| Ok(()))
                    .map(|()| v)
            });
        match version {
            Ok(v) if v >= super::SCHEMA_VERSION => {}
            Ok(v) => {
                return Err(StoreError::Unavailable(format!(
                    "sqlite {shown}: a version {v} file keeps no usage history (version {} \
                     does: serve it once with this spendgate)",
                    super::SCHEMA_VERSION
                )))
            }
            Err(e)
                if matches!(
                    e.sqlite_error_code(),
                    Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
                ) =>
            {
                return Err(StoreError::Unavailable(format!(
                    "sqlite {shown} is held by a running spendgate: read its history through \
                     its admin API (--url and --admin-token)"
                )))
            }
            Err(e) => {
                return Err(StoreError::Unavailable(format!(
                    "sqlite {shown}: not a spendgate file with a usage history ({e})"
                )))
            }
        }
        let queue: std::sync::Arc<dyn ReadQueue> =
            std::sync::Arc::new(FileQueue(std::sync::Arc::new(std::sync::Mutex::new(conn))));
        Ok(SqliteFileHistory {
            reader: SqliteHistory {
                queue: std::sync::Arc::downgrade(&queue),
            },
            _queue: queue,
        })
    }
}

#[async_trait]
impl HistoryReader for SqliteFileHistory {
    async fn reservations(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<ReservationRecord>, StoreError> {
        self.reader.reservations(filter, after, limit).await
    }

    async fn runs(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<RunRecord>, StoreError> {
        self.reader.runs(filter, after, limit).await
    }

    async fn refusals(
        &self,
        since: UnixMs,
        until: UnixMs,
    ) -> Result<Vec<(RefusalMinute, u64)>, StoreError> {
        self.reader.refusals(since, until).await
    }

    async fn adjustments(
        &self,
        since: UnixMs,
        until: UnixMs,
        limit: usize,
    ) -> Result<Vec<AdjustmentRecord>, StoreError> {
        self.reader.adjustments(since, until, limit).await
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }
}
