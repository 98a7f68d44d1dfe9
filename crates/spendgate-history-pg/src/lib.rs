//! The usage history in PostgreSQL (`[history] url`): where the replicas of a Redis ledger
//! drain its history stream ([`spendgate_redis::history`]), and where `report`, `tune` and the
//! admin API read it back ([`HistoryReader`]).
//!
//! Every insert is idempotent on the record's key, so a batch written twice (a drain killed
//! between its write and its acknowledgement, then resumed by another replica) is kept once:
//! a reservation keeps its larger charge (`ON CONFLICT DO UPDATE ... WHERE charged <
//! excluded.charged`: a late overrun re-writes it), a run and an adjustment their first write
//! (`DO NOTHING`), a refusal minute its largest count (`GREATEST`: the Redis counter only
//! grows). A batch is one transaction.

use async_trait::async_trait;
use spendgate_core::history::{
    AdjustmentRecord, HistoryEvent, RefusalMinute, ReservationRecord, RunRecord,
};
use spendgate_core::{ScopeKind, UnixMs};
use spendgate_redis::history::HistorySink;
use spendgate_store::history::{cursor, parse_cursor, HistoryFilter, HistoryReader, Page};
use spendgate_store::{StoreError, HISTORY_PAGE_MAX};
use std::time::Duration;
use tokio_postgres::{Client, NoTls};

/// Default retention by age (`[history] retention_days`).
pub const RETENTION_DAYS_DEFAULT: u64 = 90;
/// Default retention by size (`[history] rows_max`): reservation records kept at most (runs,
/// adjustments and refusal minutes each as many).
pub const ROWS_MAX_DEFAULT: u64 = 50_000_000;
/// Rows one retention statement deletes at most (a pass repeats it up to
/// [`RETENTION_ROUNDS_MAX`] times), so that no delete holds locks for long.
pub const RETENTION_DELETE_MAX: i64 = 10_000;
/// Bounded deletes one retention pass runs per table at most.
pub const RETENTION_ROUNDS_MAX: usize = 100;
/// The bound of every PostgreSQL call (connect, one batch, one page).
pub const PG_TIMEOUT: Duration = Duration::from_secs(10);

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS spendgate_reservations (
    key TEXT PRIMARY KEY,
    id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    session TEXT NOT NULL,
    conversation TEXT NOT NULL,
    address TEXT NOT NULL,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    charged BIGINT NOT NULL,
    resolved_at BIGINT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS spendgate_reservations_time ON spendgate_reservations (resolved_at, id);
CREATE TABLE IF NOT EXISTS spendgate_runs (
    key TEXT PRIMARY KEY,
    id TEXT NOT NULL,
    session TEXT NOT NULL,
    conversation TEXT NOT NULL,
    address TEXT NOT NULL,
    ended_at BIGINT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS spendgate_runs_time ON spendgate_runs (ended_at, id);
CREATE TABLE IF NOT EXISTS spendgate_adjustments (
    key TEXT PRIMARY KEY,
    id TEXT NOT NULL,
    at BIGINT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS spendgate_adjustments_time ON spendgate_adjustments (at, id);
CREATE TABLE IF NOT EXISTS spendgate_refusals (
    minute BIGINT NOT NULL,
    code TEXT NOT NULL,
    scope TEXT NOT NULL,
    count BIGINT NOT NULL,
    PRIMARY KEY (minute, code, scope)
);
";

const INSERT_RESERVATION: &str = "
INSERT INTO spendgate_reservations
    (key, id, run_id, session, conversation, address, name, state, charged, resolved_at, record)
VALUES ($11, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (key) DO UPDATE SET charged = EXCLUDED.charged, record = EXCLUDED.record
WHERE spendgate_reservations.charged < EXCLUDED.charged";
const INSERT_RUN: &str = "
INSERT INTO spendgate_runs (key, id, session, conversation, address, ended_at, record)
VALUES ($7, $1, $2, $3, $4, $5, $6) ON CONFLICT (key) DO NOTHING";
const INSERT_ADJUSTMENT: &str = "
INSERT INTO spendgate_adjustments (key, id, at, record) VALUES ($4, $1, $2, $3)
ON CONFLICT (key) DO NOTHING";
const INSERT_REFUSALS: &str = "
INSERT INTO spendgate_refusals (minute, code, scope, count) VALUES ($1, $2, $3, $4)
ON CONFLICT (minute, code, scope) DO UPDATE
SET count = GREATEST(spendgate_refusals.count, EXCLUDED.count)";

fn pg_err(what: &str, e: impl std::fmt::Display) -> String {
    format!("postgres history: {what}: {e}")
}

fn unavailable(e: String) -> StoreError {
    StoreError::Unavailable(e)
}

/// A figure as a BIGINT (micros and times are below 2^53; a larger one is kept at the bound).
fn big(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The history in one PostgreSQL database. Connects on first use and again after a failure.
pub struct PgHistory {
    url: String,
    client: tokio::sync::Mutex<Option<Client>>,
}

impl std::fmt::Debug for PgHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgHistory").finish_non_exhaustive()
    }
}

impl PgHistory {
    /// A history at `url` (`postgres://...`); nothing is connected yet.
    pub fn new(url: &str) -> PgHistory {
        PgHistory {
            url: url.to_string(),
            client: tokio::sync::Mutex::new(None),
        }
    }

    async fn connect(&self) -> Result<Client, String> {
        let (client, conn) =
            tokio::time::timeout(PG_TIMEOUT, tokio_postgres::connect(&self.url, NoTls))
                .await
                .map_err(|_| pg_err("connect", "timed out"))?
                .map_err(|e| pg_err("connect", e))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::warn!(error = %e, "postgres history connection closed");
            }
        });
        client
            .batch_execute(SCHEMA)
            .await
            .map_err(|e| pg_err("creating the schema", e))?;
        Ok(client)
    }

    /// Runs `f` on the connection (made if needed), bounded by [`PG_TIMEOUT`]; a failure drops
    /// the connection, so the next call makes a new one.
    async fn with<T, F>(&self, what: &str, f: F) -> Result<T, String>
    where
        F: for<'c> FnOnce(
            &'c mut Client,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, tokio_postgres::Error>> + Send + 'c>,
        >,
    {
        let mut guard = self.client.lock().await;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            *guard = Some(self.connect().await?);
        }
        let Some(client) = guard.as_mut() else {
            return Err(pg_err(what, "no connection"));
        };
        let out = tokio::time::timeout(PG_TIMEOUT, f(client)).await;
        match out {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                *guard = None;
                Err(pg_err(what, e))
            }
            Err(_) => {
                *guard = None;
                Err(pg_err(what, "timed out"))
            }
        }
    }

    /// Creates the schema if it is missing (also done at every connection).
    pub async fn ensure_schema(&self) -> Result<(), String> {
        self.with("schema", |_| Box::pin(async { Ok(()) })).await
    }

    /// Deletes records older than `retention` before `now`, then the oldest beyond `rows_max`
    /// per table, in bounded deletes. Returns how many rows went.
    pub async fn retain(
        &self,
        now: UnixMs,
        retention: Duration,
        rows_max: u64,
    ) -> Result<u64, String> {
        let cutoff = big(now.0.saturating_sub(retention.as_millis() as u64));
        let rows_max = big(rows_max);
        let mut gone = 0;
        for (table, time) in [
            ("spendgate_reservations", "resolved_at"),
            ("spendgate_runs", "ended_at"),
            ("spendgate_adjustments", "at"),
        ] {
            let by_age = format!(
                "DELETE FROM {table} WHERE key IN \
                 (SELECT key FROM {table} WHERE {time} < $1 ORDER BY {time} LIMIT $2)"
            );
            let by_size = format!(
                "DELETE FROM {table} WHERE key IN (SELECT key FROM {table} ORDER BY {time}, key \
                 LIMIT LEAST($2, GREATEST((SELECT count(*) FROM {table}) - $1, 0)))"
            );
            gone += self.repeat(&by_age, cutoff).await?;
            gone += self.repeat(&by_size, rows_max).await?;
        }
        gone += self
            .repeat(
                "DELETE FROM spendgate_refusals WHERE ctid IN (SELECT ctid FROM spendgate_refusals \
                 WHERE minute < $1 LIMIT $2)",
                cutoff,
            )
            .await?;
        Ok(gone)
    }

    /// Runs a bounded delete (`$1` its argument, `$2` the bound) until it deletes less than
    /// the bound, at most [`RETENTION_ROUNDS_MAX`] times.
    async fn repeat(&self, sql: &str, arg: i64) -> Result<u64, String> {
        let mut gone = 0;
        for _ in 0..RETENTION_ROUNDS_MAX {
            let sql = sql.to_string();
            let n = self
                .with("retention", move |c| {
                    Box::pin(async move { c.execute(&sql, &[&arg, &RETENTION_DELETE_MAX]).await })
                })
                .await?;
            gone += n;
            if n < RETENTION_DELETE_MAX as u64 {
                break;
            }
        }
        Ok(gone)
    }
}

/// Runs [`PgHistory::retain`] every `every` until the handle is dropped or aborted.
pub fn spawn_retention(
    pg: std::sync::Arc<PgHistory>,
    every: Duration,
    retention: Duration,
    rows_max: u64,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = UnixMs(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
            );
            match pg.retain(now, retention, rows_max).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(rows = n, "history retention deleted old rows"),
                Err(e) => tracing::warn!(error = %e, "history retention failed; will retry"),
            }
        }
    })
}

/// One event's insert: the statement and its parameters, owned.
enum Row {
    Reservation(ReservationRecord, String, String),
    Run(RunRecord, String, String),
    Adjustment(String, i64, String, String),
    Refusals(RefusalMinute, i64),
}

fn row(e: &HistoryEvent) -> Result<Row, String> {
    let json = |e| serde_json::to_string(e).map_err(|e| pg_err("encoding a record", e));
    Ok(match e {
        HistoryEvent::Reservation(r) => Row::Reservation(r.clone(), json(e)?, e.key()),
        HistoryEvent::Run(r) => Row::Run(r.clone(), json(e)?, e.key()),
        HistoryEvent::Adjustment(a) => {
            Row::Adjustment(a.id.clone(), big(a.at.0), json(e)?, e.key())
        }
        HistoryEvent::Refusals { at, count } => Row::Refusals(*at, big(*count)),
    })
}

async fn insert(
    tx: &tokio_postgres::Transaction<'_>,
    row: &Row,
) -> Result<(), tokio_postgres::Error> {
    match row {
        Row::Reservation(r, json, key) => {
            tx.execute(
                INSERT_RESERVATION,
                &[
                    &r.id.0,
                    &r.run_id.0,
                    &r.session,
                    &r.conversation,
                    &r.address,
                    &r.name,
                    &r.state.name(),
                    &big(r.charged.0),
                    &big(r.resolved_at.0),
                    json,
                    key,
                ],
            )
            .await?;
        }
        Row::Run(r, json, key) => {
            tx.execute(
                INSERT_RUN,
                &[
                    &r.id.0,
                    &r.session,
                    &r.conversation,
                    &r.address,
                    &big(r.ended_at.0),
                    json,
                    key,
                ],
            )
            .await?;
        }
        Row::Adjustment(id, at, json, key) => {
            tx.execute(INSERT_ADJUSTMENT, &[id, at, json, key]).await?;
        }
        Row::Refusals(at, count) => {
            let scope = at.scope.map_or("", ScopeKind::name);
            tx.execute(
                INSERT_REFUSALS,
                &[&big(at.minute.0), &at.code.name(), &scope, count],
            )
            .await?;
        }
    }
    Ok(())
}

#[async_trait]
impl HistorySink for PgHistory {
    async fn write(&self, events: &[HistoryEvent]) -> Result<(), String> {
        if events.is_empty() {
            return Ok(());
        }
        let rows = events.iter().map(row).collect::<Result<Vec<_>, _>>()?;
        self.with("writing a batch", move |c| {
            Box::pin(async move {
                let tx = c.transaction().await?;
                for r in &rows {
                    insert(&tx, r).await?;
                }
                tx.commit().await
            })
        })
        .await
    }
}

/// `(time, id) > cursor` and the filters of a page query, as SQL and parameters.
struct Query {
    sql: String,
    params: Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>,
}

impl Query {
    fn new(select: &str) -> Query {
        Query {
            sql: select.to_string(),
            params: Vec::new(),
        }
    }
    fn and(&mut self, cond: &str, v: impl tokio_postgres::types::ToSql + Sync + Send + 'static) {
        self.params.push(Box::new(v));
        let n = self.params.len();
        self.sql
            .push_str(&format!(" AND {}", cond.replace('?', &format!("${n}"))));
    }
}

fn filtered(
    select: &str,
    time: &str,
    filter: &HistoryFilter,
    after: Option<&str>,
    reservations: bool,
) -> Result<Query, StoreError> {
    let mut q = Query::new(select);
    q.and(&format!("{time} >= ?"), big(filter.since.0));
    q.and(&format!("{time} < ?"), big(filter.until.0));
    for (col, v) in [
        ("session", &filter.session),
        ("address", &filter.address),
        ("conversation", &filter.conversation),
    ] {
        if let Some(v) = v {
            q.and(&format!("{col} = ?"), v.clone());
        }
    }
    if reservations {
        if let Some(n) = &filter.name {
            q.and("name = ?", n.clone());
        }
        if let Some(s) = filter.state {
            q.and("state = ?", s.name().to_string());
        }
    }
    if let Some(c) = after {
        let (at, id) = parse_cursor(c).ok_or_else(|| {
            StoreError::from(spendgate_core::LedgerError::Invalid(
                "bad history cursor".into(),
            ))
        })?;
        q.and(&format!("({time}, id) > (?"), big(at.0));
        q.params.push(Box::new(id.to_string()));
        let n = q.params.len();
        q.sql.push_str(&format!(", ${n})"));
    }
    q.sql.push_str(&format!(" ORDER BY {time}, id"));
    Ok(q)
}

impl PgHistory {
    /// The `record` column of a page query's rows, at most `limit` (+1 to know of a next page).
    async fn records(&self, mut q: Query, limit: usize) -> Result<Vec<String>, StoreError> {
        let limit = limit.clamp(1, HISTORY_PAGE_MAX);
        q.sql.push_str(&format!(" LIMIT {}", limit + 1));
        let rows = self
            .with("reading the history", move |c| {
                Box::pin(async move {
                    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = q
                        .params
                        .iter()
                        .map(|p| p.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
                        .collect();
                    let rows = c.query(&q.sql, &params).await?;
                    Ok(rows
                        .iter()
                        .map(|r| r.get::<_, String>(0))
                        .collect::<Vec<_>>())
                })
            })
            .await
            .map_err(unavailable)?;
        Ok(rows)
    }
}

fn page_of<T>(
    records: Vec<String>,
    limit: usize,
    pick: impl Fn(HistoryEvent) -> Option<T>,
    key: impl Fn(&T) -> (UnixMs, String),
) -> Result<Page<T>, StoreError> {
    let limit = limit.clamp(1, HISTORY_PAGE_MAX);
    let more = records.len() > limit;
    let mut items = Vec::with_capacity(limit);
    for r in records.into_iter().take(limit) {
        let e: HistoryEvent = serde_json::from_str(&r)
            .map_err(|e| unavailable(pg_err("a stored record is not an event", e)))?;
        if let Some(t) = pick(e) {
            items.push(t);
        }
    }
    let next = if more {
        items.last().map(|t| {
            let (at, id) = key(t);
            cursor(at, &id)
        })
    } else {
        None
    };
    Ok(Page { items, next })
}

#[async_trait]
impl HistoryReader for PgHistory {
    async fn reservations(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<ReservationRecord>, StoreError> {
        let q = filtered(
            "SELECT record FROM spendgate_reservations WHERE true",
            "resolved_at",
            filter,
            after,
            true,
        )?;
        let records = self.records(q, limit).await?;
        page_of(
            records,
            limit,
            |e| match e {
                HistoryEvent::Reservation(r) => Some(r),
                _ => None,
            },
            |r| (r.resolved_at, r.id.0.clone()),
        )
    }

    async fn runs(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<RunRecord>, StoreError> {
        let q = filtered(
            "SELECT record FROM spendgate_runs WHERE true",
            "ended_at",
            filter,
            after,
            false,
        )?;
        let records = self.records(q, limit).await?;
        page_of(
            records,
            limit,
            |e| match e {
                HistoryEvent::Run(r) => Some(r),
                _ => None,
            },
            |r| (r.ended_at, r.id.0.clone()),
        )
    }

    async fn refusals(
        &self,
        since: UnixMs,
        until: UnixMs,
    ) -> Result<Vec<(RefusalMinute, u64)>, StoreError> {
        let (s, u) = (big(since.0), big(until.0));
        let rows = self
            .with("reading refusals", move |c| {
                Box::pin(async move {
                    let rows = c
                        .query(
                            "SELECT minute, code, scope, count FROM spendgate_refusals \
                             WHERE minute >= $1 AND minute < $2 ORDER BY minute, code, scope LIMIT $3",
                            &[&s, &u, &(HISTORY_PAGE_MAX as i64)],
                        )
                        .await?;
                    Ok(rows
                        .iter()
                        .map(|r| {
                            (
                                r.get::<_, i64>(0),
                                r.get::<_, String>(1),
                                r.get::<_, String>(2),
                                r.get::<_, i64>(3),
                            )
                        })
                        .collect::<Vec<_>>())
                })
            })
            .await
            .map_err(unavailable)?;
        Ok(rows
            .into_iter()
            .filter_map(|(minute, code, scope, count)| {
                let code = serde_json::from_value(serde_json::Value::String(code)).ok()?;
                Some((
                    RefusalMinute {
                        minute: UnixMs(u64::try_from(minute).ok()?),
                        code,
                        scope: ScopeKind::parse(&scope),
                    },
                    u64::try_from(count).unwrap_or(0),
                ))
            })
            .collect())
    }

    async fn adjustments(
        &self,
        since: UnixMs,
        until: UnixMs,
        limit: usize,
    ) -> Result<Vec<AdjustmentRecord>, StoreError> {
        self.adjustments_in(since, until, limit).await
    }
    fn kind(&self) -> &'static str {
        "postgres"
    }
}

impl PgHistory {
    /// Operator adjustments made in `[since, until)`, in time order, at most `limit` (and
    /// [`HISTORY_PAGE_MAX`]). (`HistoryReader::adjustments` once the trait has it.)
    pub async fn adjustments_in(
        &self,
        since: UnixMs,
        until: UnixMs,
        limit: usize,
    ) -> Result<Vec<AdjustmentRecord>, StoreError> {
        let (s, u, n) = (
            big(since.0),
            big(until.0),
            limit.clamp(1, HISTORY_PAGE_MAX) as i64,
        );
        let records = self
            .with("reading adjustments", move |c| {
                Box::pin(async move {
                    let rows = c
                        .query(
                            "SELECT record FROM spendgate_adjustments WHERE at >= $1 AND at < $2 \
                             ORDER BY at, id LIMIT $3",
                            &[&s, &u, &n],
                        )
                        .await?;
                    Ok(rows
                        .iter()
                        .map(|r| r.get::<_, String>(0))
                        .collect::<Vec<_>>())
                })
            })
            .await
            .map_err(unavailable)?;
        let mut out = Vec::new();
        for r in records {
            if let HistoryEvent::Adjustment(a) = serde_json::from_str(&r)
                .map_err(|e| unavailable(pg_err("a stored record is not an event", e)))?
            {
                out.push(a);
            }
        }
        Ok(out)
    }
}

/// Sum of charges per counter and of adjustments, for reconciliation tests and `report`'s
/// checks: (counter as `kind:id|window|index`, charged + adjusted micros).
pub async fn totals(pg: &PgHistory) -> Result<Vec<(String, i64)>, String> {
    pg.with("totals", |c| {
        Box::pin(async move {
            let rows = c
                .query(
                    "SELECT record FROM spendgate_reservations UNION ALL \
                     SELECT record FROM spendgate_adjustments",
                    &[],
                )
                .await?;
            Ok(rows
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>())
        })
    })
    .await
    .map(|records| {
        let mut sums: std::collections::BTreeMap<String, i64> = Default::default();
        for r in records {
            let Ok(e) = serde_json::from_str::<HistoryEvent>(&r) else {
                continue;
            };
            // (what an adjustment moved each counter by: `applied`, when the record has it)
            let applied: Vec<i64> = serde_json::from_str::<serde_json::Value>(&r)
                .ok()
                .and_then(|v| serde_json::from_value(v.get("applied")?.clone()).ok())
                .unwrap_or_default();
            let (counters, amount) = match &e {
                HistoryEvent::Reservation(r) => (&r.counters, big(r.charged.0)),
                HistoryEvent::Adjustment(a) => (&a.counters, a.amount_micros),
                _ => continue,
            };
            for (i, c) in counters.iter().enumerate() {
                let amount = applied.get(i).copied().unwrap_or(amount);
                let k = format!(
                    "{}:{}|{}|{}",
                    c.scope.kind.name(),
                    c.scope.id,
                    c.window.window.name(),
                    c.window.index
                );
                *sums.entry(k).or_default() += amount;
            }
        }
        sums.into_iter().collect()
    })
}
