//! The usage history of a Redis ledger ([`spendgate_core::history`]): the ledger script
//! appends each record, in the same call as the change it records, to the capped stream
//! `{prefix}:history` (one JSON [`HistoryEvent`] in field `e`), and counts refusals per minute
//! in hashes `{prefix}:refusals:<minute>` (field `code|scope kind`), their minutes listed in the
//! sorted set `{prefix}:refusals` (ledger.lua, "history").
//!
//! Every replica runs a [`spawn_drain`] task: it reads the stream through one consumer group
//! (its consumer named by the replica id), writes each batch to a [`HistorySink`] (PostgreSQL)
//! in one transaction, and only then acknowledges it; entries left pending by a replica that
//! died mid-batch are claimed by another after [`CLAIM_IDLE`]. A sink keeps one record per key
//! (the larger charge of a reservation, the largest count of a refusal minute), so a batch
//! written twice (the drain was killed between the write and the acknowledgement) is kept
//! once: nothing is lost and nothing is counted twice. Refusal minutes are drained once the
//! ledger's clock is past them (no call adds to them any more), then deleted.
//!
//! Without a sink the stream is the history, up to its cap ([`HistoryStream`] reads it), and
//! the drain only tells the [`HistoryTap`] of new entries.

use crate::{map_redis_error, unavailable, RedisStore, SlotConn};
use async_trait::async_trait;
use spendgate_core::history::{
    AdjustmentRecord, HistoryEvent, RefusalMinute, ReservationRecord, RunRecord,
};
use spendgate_core::{RefusalCode, ScopeKind, UnixMs};
use spendgate_store::history::{cursor, parse_cursor, HistoryFilter, HistoryReader, Page};
use spendgate_store::{HistoryTap, StoreError, HISTORY_PAGE_MAX};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Default cap of the history stream (`[history] stream_max_len`): at about a thousand
/// records a second, some 15 minutes of drain lag before the oldest undrained ones are evicted.
pub const STREAM_MAX_LEN_DEFAULT: u64 = 1_000_000;
/// Entries one drain batch takes at most (one PostgreSQL transaction).
pub const DRAIN_BATCH_MAX: usize = 500;
/// An entry pending this long with another consumer (a replica killed mid-batch, or one that
/// cannot reach PostgreSQL) is claimed by the next drain that looks.
pub const CLAIM_IDLE: Duration = Duration::from_secs(30);
/// How often an idle drain looks at the stream.
pub const DRAIN_POLL: Duration = Duration::from_millis(250);
/// The longest wait between two attempts while the sink or Redis fails (doubling from
/// [`DRAIN_POLL`]).
pub const DRAIN_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Refusal minutes one drain pass takes at most.
pub const REFUSAL_MINUTES_MAX: usize = 64;
/// Stream entries a read of the stream ([`HistoryStream`]) scans at most.
pub const STREAM_SCAN_MAX: usize = 1_000_000;
/// Entries one `XRANGE` of a scan returns at most.
const SCAN_CHUNK: usize = 1_000;
/// A consumer of the group with nothing pending and idle this long (a replica that stopped:
/// every start is a new consumer) is deleted from the group, so the group stays small.
pub const CONSUMER_IDLE_DROP: Duration = Duration::from_secs(3_600);
/// The consumer group every replica drains through.
pub const DRAIN_GROUP: &str = "spendgate-drain";

/// Where a drain writes the history (PostgreSQL).
#[async_trait]
pub trait HistorySink: Send + Sync + 'static {
    /// Writes the events durably, in one transaction, keeping one record per
    /// [`HistoryEvent::key`] (a reservation's larger charge, a refusal minute's larger count),
    /// so that writing the same events again changes nothing.
    async fn write(&self, events: &[HistoryEvent]) -> Result<(), String>;
}

/// What a drain reports (the `/metrics` gauges and the lag alert read it).
#[derive(Debug, Default)]
pub struct DrainStatus {
    /// Age (ms) of the oldest entry not yet drained (pending or not yet delivered); 0: none.
    pub lag_ms: AtomicU64,
    /// Entries delivered to a consumer and not yet acknowledged.
    pub pending: AtomicU64,
    /// Entries this replica drained.
    pub drained: AtomicU64,
    /// Entries found evicted by the stream's cap before they were drained (lost to the sink).
    pub evicted: AtomicU64,
    /// Entries that were not a history event (acknowledged and skipped).
    pub malformed: AtomicU64,
    /// Failed drain attempts (sink or Redis down).
    pub failures: AtomicU64,
}

/// The history parts of a Redis store: its tap and the reader it answers
/// [`spendgate_store::Store::history`] with.
#[derive(Default)]
pub(crate) struct HistoryState {
    pub(crate) tap: Mutex<Option<Arc<dyn HistoryTap>>>,
    pub(crate) reader: Mutex<Option<Arc<dyn HistoryReader>>>,
}

/// Raw commands on the node that serves the deployment (its keys share one slot).
#[derive(Clone)]
pub(crate) struct Keys {
    pub(crate) conn: Arc<SlotConn>,
    pub(crate) base: String,
    pub(crate) timeout: Duration,
}

impl Keys {
    fn stream(&self) -> String {
        format!("{}:history", self.base)
    }
    async fn run(&self, cmd: &redis::Cmd) -> Result<redis::Value, StoreError> {
        let mut conn = self.conn.current().conn.clone();
        let t = self.timeout;
        match tokio::time::timeout(t, cmd.query_async::<redis::Value>(&mut conn)).await {
            Ok(r) => r.map_err(|e| map_redis_error(e, t)),
            Err(_) => Err(StoreError::Timeout(t)),
        }
    }
}

/// One stream entry: its id and its event (`None`: evicted, or not an event).
pub type Entry = (String, Option<Result<HistoryEvent, String>>);

fn bulk(v: &redis::Value) -> Option<String> {
    match v {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        redis::Value::SimpleString(s) => Some(s.clone()),
        redis::Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn array(v: &redis::Value) -> &[redis::Value] {
    match v {
        redis::Value::Array(a) => a,
        _ => &[],
    }
}

/// The entries of an `XRANGE` answer (or one stream's list of an `XREADGROUP` answer).
fn entries(v: &redis::Value) -> Vec<Entry> {
    array(v)
        .iter()
        .filter_map(|e| {
            let parts = array(e);
            let id = bulk(parts.first()?)?;
            let fields = parts.get(1).map(array).unwrap_or(&[]);
            let mut event = None;
            for pair in fields.chunks(2) {
                if let [k, v] = pair {
                    if bulk(k).as_deref() == Some("e") {
                        event = Some(match bulk(v) {
                            Some(s) => serde_json::from_str(&s).map_err(|e| e.to_string()),
                            None => Err("not UTF-8".to_string()),
                        });
                    }
                }
            }
            Some((id, event))
        })
        .collect()
}

/// The ms part of a stream id.
fn id_ms(id: &str) -> Option<u64> {
    id.split('-').next()?.parse().ok()
}

/// The refusal minutes a drain pass found: (minute, [(code|kind, count)]).
type Minutes = Vec<(u64, Vec<(String, u64)>)>;

fn refusal_events(minutes: &Minutes) -> Vec<HistoryEvent> {
    let mut out = Vec::new();
    for (minute, fields) in minutes {
        for (field, count) in fields {
            let Some((code, kind)) = field.split_once('|') else {
                continue;
            };
            let Some(code) = parse_code(code) else {
                continue;
            };
            out.push(HistoryEvent::Refusals {
                at: RefusalMinute {
                    minute: UnixMs(*minute),
                    code,
                    scope: ScopeKind::parse(kind),
                },
                count: *count,
            });
        }
    }
    out
}

fn parse_code(s: &str) -> Option<RefusalCode> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
}

impl RedisStore {
    /// Sets the history stream's cap (`[history] stream_max_len`, at least 1).
    pub fn set_history_stream_max_len(&mut self, n: u64) -> Result<(), StoreError> {
        self.policy_arg = crate::policy_arg(&self.policy, n.max(1))?;
        Ok(())
    }

    /// Answers [`spendgate_store::Store::history`] with `reader` (PostgreSQL) rather than the
    /// stream.
    pub fn set_history_reader(&self, reader: Arc<dyn HistoryReader>) {
        *self
            .history
            .reader
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(reader);
    }

    pub(crate) fn keys(&self) -> Keys {
        Keys {
            conn: self.conn.clone(),
            base: self.base.clone(),
            timeout: self.bound(),
        }
    }

    /// The reader of this store's own stream.
    pub fn history_stream(&self) -> HistoryStream {
        HistoryStream { keys: self.keys() }
    }

    fn tap(&self) -> Option<Arc<dyn HistoryTap>> {
        self.history
            .tap
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The refusal minutes the ledger's clock is past, at most [`REFUSAL_MINUTES_MAX`].
    async fn past_refusal_minutes(&self) -> Result<Minutes, StoreError> {
        let items = self
            .call_argv(true, "refusal_minutes", &[REFUSAL_MINUTES_MAX.to_string()])
            .await?;
        let rows = items
            .get(2)
            .ok_or_else(|| unavailable("redis store: refusal_minutes answered too little"))?
            .list()?;
        let mut out = Vec::new();
        for row in rows {
            let row = row.list()?;
            let Some(minute) = row.first().and_then(|m| m.str().ok()?.parse().ok()) else {
                continue;
            };
            let mut fields = Vec::new();
            for pair in row[1..].chunks(2) {
                if let [k, v] = pair {
                    if let Ok(n) = v.str()?.parse() {
                        fields.push((k.str()?.to_string(), n));
                    }
                }
            }
            out.push((minute, fields));
        }
        Ok(out)
    }
}

pub(crate) fn store_history(store: &RedisStore) -> Arc<dyn HistoryReader> {
    let set = store
        .history
        .reader
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    set.unwrap_or_else(|| Arc::new(store.history_stream()))
}

pub(crate) fn store_tap(store: &RedisStore, tap: Arc<dyn HistoryTap>) {
    *store.history.tap.lock().unwrap_or_else(|p| p.into_inner()) = Some(tap);
}

/// The history as the stream holds it (no PostgreSQL): what the cap left, read whole
/// (at most [`STREAM_SCAN_MAX`] entries) at each page.
#[derive(Clone)]
pub struct HistoryStream {
    keys: Keys,
}

impl HistoryStream {
    /// Every event the stream holds, oldest first.
    async fn scan(&self) -> Result<Vec<HistoryEvent>, StoreError> {
        let key = self.keys.stream();
        let mut start = "-".to_string();
        let mut out = Vec::new();
        let mut seen = 0;
        while seen < STREAM_SCAN_MAX {
            let v = self
                .keys
                .run(
                    redis::cmd("XRANGE")
                        .arg(&key)
                        .arg(&start)
                        .arg("+")
                        .arg("COUNT")
                        .arg(SCAN_CHUNK),
                )
                .await?;
            let chunk = entries(&v);
            let n = chunk.len();
            seen += n;
            let Some((last, _)) = chunk.last() else {
                break;
            };
            start = format!("({last}");
            out.extend(chunk.into_iter().filter_map(|(_, e)| e?.ok()));
            if n < SCAN_CHUNK {
                break;
            }
        }
        Ok(out)
    }
}

impl HistoryStream {
    /// Operator adjustments made in `[since, until)`, in time order, at most `limit` (and
    /// [`HISTORY_PAGE_MAX`]). (`HistoryReader::adjustments` once the trait has it.)
    pub async fn adjustments_in(
        &self,
        since: UnixMs,
        until: UnixMs,
        limit: usize,
    ) -> Result<Vec<AdjustmentRecord>, StoreError> {
        let mut by_key: BTreeMap<String, AdjustmentRecord> = BTreeMap::new();
        for e in self.scan().await? {
            let key = e.key();
            if let HistoryEvent::Adjustment(a) = e {
                if a.at >= since && a.at < until {
                    by_key.entry(key).or_insert(a);
                }
            }
        }
        let mut out: Vec<AdjustmentRecord> = by_key.into_values().collect();
        out.sort_by(|a, b| (a.at, &a.id).cmp(&(b.at, &b.id)));
        out.truncate(limit.clamp(1, HISTORY_PAGE_MAX));
        Ok(out)
    }
}

/// The page of `items` (sorted by (time, id)) after `after`, at most `limit`.
fn page<T>(
    mut items: Vec<(UnixMs, String, T)>,
    after: Option<&str>,
    limit: usize,
) -> Result<Page<T>, StoreError> {
    items.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let from = match after {
        None => 0,
        Some(c) => {
            let (at, id) = parse_cursor(c).ok_or_else(|| {
                StoreError::from(spendgate_core::LedgerError::Invalid(
                    "bad history cursor".into(),
                ))
            })?;
            items.partition_point(|x| (x.0, x.1.as_str()) <= (at, id))
        }
    };
    let limit = limit.clamp(1, HISTORY_PAGE_MAX);
    let rest = items.len() - from;
    let mut taken: Vec<(UnixMs, String, T)> = items.into_iter().skip(from).take(limit).collect();
    let next = if rest > limit {
        taken.last().map(|(at, id, _)| cursor(*at, id))
    } else {
        None
    };
    Ok(Page {
        items: taken.drain(..).map(|(_, _, t)| t).collect(),
        next,
    })
}

#[async_trait]
impl HistoryReader for HistoryStream {
    async fn reservations(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<ReservationRecord>, StoreError> {
        let mut by_id: BTreeMap<String, ReservationRecord> = BTreeMap::new();
        for e in self.scan().await? {
            let key = e.key();
            if let HistoryEvent::Reservation(r) = e {
                match by_id.get_mut(&key) {
                    Some(first) => first.merge(&r),
                    None => {
                        by_id.insert(key, r);
                    }
                }
            }
        }
        let items = by_id
            .into_values()
            .filter(|r| filter.selects(r))
            .map(|r| (r.resolved_at, r.id.0.clone(), r))
            .collect();
        page(items, after, limit)
    }

    async fn runs(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<RunRecord>, StoreError> {
        let mut by_id: BTreeMap<String, RunRecord> = BTreeMap::new();
        for e in self.scan().await? {
            let key = e.key();
            if let HistoryEvent::Run(r) = e {
                by_id.entry(key).or_insert(r);
            }
        }
        let items = by_id
            .into_values()
            .filter(|r| filter.selects_run(r))
            .map(|r| (r.ended_at, r.id.0.clone(), r))
            .collect();
        page(items, after, limit)
    }

    async fn refusals(
        &self,
        since: UnixMs,
        until: UnixMs,
    ) -> Result<Vec<(RefusalMinute, u64)>, StoreError> {
        let z = format!("{}:refusals", self.keys.base);
        let v = self
            .keys
            .run(
                redis::cmd("ZRANGEBYSCORE")
                    .arg(&z)
                    .arg(since.0)
                    .arg(format!("({}", until.0))
                    .arg("LIMIT")
                    .arg(0)
                    .arg(HISTORY_PAGE_MAX),
            )
            .await?;
        let mut minutes = Vec::new();
        for m in array(&v).iter().filter_map(bulk) {
            let Ok(minute) = m.parse::<u64>() else {
                continue;
            };
            let all = self
                .keys
                .run(redis::cmd("HGETALL").arg(format!("{}:refusals:{m}", self.keys.base)))
                .await?;
            let fields = array(&all)
                .chunks(2)
                .filter_map(|p| match p {
                    [k, v] => Some((bulk(k)?, bulk(v)?.parse().ok()?)),
                    _ => None,
                })
                .collect();
            minutes.push((minute, fields));
        }
        Ok(refusal_events(&minutes)
            .into_iter()
            .filter_map(|e| match e {
                HistoryEvent::Refusals { at, count } => Some((at, count)),
                _ => None,
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
        "redis-stream"
    }
}

/// The drain task; dropping it stops the task.
pub struct DrainHandle {
    pub status: Arc<DrainStatus>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for DrainHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts this replica's drain (consumer `consumer`, the replica id) of `store`'s history into
/// `sink` (`None`: no PostgreSQL; the tap alone is told).
pub fn spawn_drain(
    store: Arc<RedisStore>,
    sink: Option<Arc<dyn HistorySink>>,
    consumer: String,
) -> DrainHandle {
    let status = Arc::new(DrainStatus::default());
    let drain = Drain {
        store,
        sink,
        consumer,
        status: status.clone(),
        claim_idle: CLAIM_IDLE,
    };
    let task = tokio::spawn(drain.run());
    DrainHandle { status, task }
}

/// One replica's drain.
pub struct Drain {
    store: Arc<RedisStore>,
    sink: Option<Arc<dyn HistorySink>>,
    consumer: String,
    status: Arc<DrainStatus>,
    claim_idle: Duration,
}

impl Drain {
    /// A drain to run by hand ([`Drain::pass`]), for tests that stop it between steps.
    pub fn new(
        store: Arc<RedisStore>,
        sink: Option<Arc<dyn HistorySink>>,
        consumer: String,
    ) -> Drain {
        Drain {
            store,
            sink,
            consumer,
            status: Arc::new(DrainStatus::default()),
            claim_idle: CLAIM_IDLE,
        }
    }

    /// Claims entries pending this long with another consumer (default [`CLAIM_IDLE`]).
    pub fn with_claim_idle(mut self, idle: Duration) -> Drain {
        self.claim_idle = idle;
        self
    }

    pub fn status(&self) -> Arc<DrainStatus> {
        self.status.clone()
    }

    async fn run(self) {
        let mut wait = DRAIN_POLL;
        loop {
            match self.pass().await {
                Ok(n) if n > 0 => wait = Duration::ZERO,
                Ok(_) => wait = DRAIN_POLL,
                Err(e) => {
                    self.status.failures.fetch_add(1, Ordering::Relaxed);
                    wait = (wait * 2).clamp(DRAIN_POLL, DRAIN_BACKOFF_MAX);
                    tracing::warn!(error = %e, retry_in = ?wait, "history drain failed; will retry");
                }
            }
            if let Err(e) = self.measure().await {
                tracing::debug!(error = %e, "history drain lag unknown");
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// Creates the drain's consumer group on the stream, when the stream exists; whether it
    /// does. Never creates the stream itself (no `MKSTREAM`): only the ledger's script writes
    /// a key, so a replica never writes into a Redis that is not (or no longer) an
    /// initialized ledger (an emptied Redis stays empty until the operator says so).
    async fn ensure_group(&self, keys: &Keys) -> Result<bool, StoreError> {
        let r = keys
            .run(
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(keys.stream())
                    .arg(DRAIN_GROUP)
                    .arg("0"),
            )
            .await;
        match r {
            Ok(_) => Ok(true),
            Err(e) if e.to_string().contains("BUSYGROUP") => Ok(true),
            Err(e) if e.to_string().contains("requires the key to exist") => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// One batch: this consumer's own pending entries first (a write that failed), else those
    /// a dead consumer left pending, else new ones; written, then acknowledged. Then the
    /// refusal minutes. Returns how many entries it drained.
    pub async fn pass(&self) -> Result<usize, StoreError> {
        let batch = self.take().await?;
        let n = batch.len();
        if n > 0 {
            self.write(&batch, true).await?;
        }
        self.refusals().await?;
        Ok(n)
    }

    /// The next batch (delivered to this consumer, not yet acknowledged).
    pub async fn take(&self) -> Result<Vec<Entry>, StoreError> {
        let keys = self.store.keys();
        if !self.ensure_group(&keys).await? {
            return Ok(Vec::new());
        }
        let read = |id: &str| {
            let mut c = redis::cmd("XREADGROUP");
            c.arg("GROUP")
                .arg(DRAIN_GROUP)
                .arg(&self.consumer)
                .arg("COUNT")
                .arg(DRAIN_BATCH_MAX)
                .arg("STREAMS")
                .arg(keys.stream())
                .arg(id);
            c
        };
        let own = stream_entries(&keys.run(&read("0")).await?);
        if !own.is_empty() {
            return Ok(own);
        }
        let claimed = keys
            .run(
                redis::cmd("XAUTOCLAIM")
                    .arg(keys.stream())
                    .arg(DRAIN_GROUP)
                    .arg(&self.consumer)
                    .arg(self.claim_idle.as_millis() as u64)
                    .arg("0-0")
                    .arg("COUNT")
                    .arg(DRAIN_BATCH_MAX),
            )
            .await?;
        // (the ids of entries the cap evicted while they were pending: dropped from the group)
        let gone = array(&claimed).get(2).map_or(0, |g| array(g).len());
        if gone > 0 {
            self.status
                .evicted
                .fetch_add(gone as u64, Ordering::Relaxed);
            tracing::error!(
                n = gone,
                "history entries evicted by the stream's cap before they were drained"
            );
        }
        let claimed = array(&claimed).get(1).map(entries).unwrap_or_default();
        if !claimed.is_empty() {
            tracing::info!(
                n = claimed.len(),
                "history drain: claimed entries a dead drain left"
            );
            return Ok(claimed);
        }
        Ok(stream_entries(&keys.run(&read(">")).await?))
    }

    /// Writes a batch taken by [`Drain::take`] to the sink, then (with `ack`) acknowledges it.
    pub async fn write(&self, batch: &[Entry], ack: bool) -> Result<(), StoreError> {
        let mut events = Vec::with_capacity(batch.len());
        for (id, e) in batch {
            match e {
                Some(Ok(e)) => events.push(e.clone()),
                None => {
                    self.status.evicted.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(%id, "history entry evicted by the stream's cap before it was drained");
                }
                Some(Err(why)) => {
                    self.status.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(%id, error = %why, "history entry is not an event; skipped");
                }
            }
        }
        if let Some(sink) = &self.sink {
            sink.write(&events)
                .await
                .map_err(|e| unavailable(format!("history sink: {e}")))?;
        }
        if let Some(tap) = self.store.tap() {
            tap.seen(&events);
        }
        if ack {
            self.ack(batch).await?;
        }
        self.status
            .drained
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Acknowledges a batch (and, with a sink, deletes it from the stream: PostgreSQL holds it).
    pub async fn ack(&self, batch: &[Entry]) -> Result<(), StoreError> {
        let keys = self.store.keys();
        let ids: Vec<&str> = batch.iter().map(|(id, _)| id.as_str()).collect();
        keys.run(
            redis::cmd("XACK")
                .arg(keys.stream())
                .arg(DRAIN_GROUP)
                .arg(&ids),
        )
        .await?;
        if self.sink.is_some() {
            keys.run(redis::cmd("XDEL").arg(keys.stream()).arg(&ids))
                .await?;
        }
        Ok(())
    }

    /// Drains the refusal minutes the ledger's clock is past, then deletes them (with a sink;
    /// without, they stay for the stream reader until their TTL).
    async fn refusals(&self) -> Result<(), StoreError> {
        let Some(sink) = &self.sink else {
            return Ok(());
        };
        let minutes = self.store.past_refusal_minutes().await?;
        if minutes.is_empty() {
            return Ok(());
        }
        let events = refusal_events(&minutes);
        sink.write(&events)
            .await
            .map_err(|e| unavailable(format!("history sink: {e}")))?;
        if let Some(tap) = self.store.tap() {
            tap.seen(&events);
        }
        let keys = self.store.keys();
        for (m, _) in &minutes {
            keys.run(redis::cmd("DEL").arg(format!("{}:refusals:{m}", keys.base)))
                .await?;
            keys.run(
                redis::cmd("ZREM")
                    .arg(format!("{}:refusals", keys.base))
                    .arg(m.to_string()),
            )
            .await?;
        }
        Ok(())
    }

    /// The lag gauges: pending entries, and the age of the oldest undrained one.
    pub async fn measure(&self) -> Result<(), StoreError> {
        let keys = self.store.keys();
        let now = keys.run(&redis::cmd("TIME")).await?;
        let now_ms = array(&now)
            .first()
            .and_then(bulk)
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
            * 1000;
        let summary = keys
            .run(redis::cmd("XPENDING").arg(keys.stream()).arg(DRAIN_GROUP))
            .await?;
        let s = array(&summary);
        let pending = s
            .first()
            .and_then(bulk)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let mut oldest = s.get(1).and_then(bulk).and_then(|id| id_ms(&id));
        if oldest.is_none() {
            oldest = self.first_undelivered(&keys).await?;
        }
        self.status.pending.store(pending, Ordering::Relaxed);
        let lag = oldest.map_or(0, |at| now_ms.saturating_sub(at));
        self.status.lag_ms.store(lag, Ordering::Relaxed);
        self.drop_idle_consumers(&keys).await
    }

    /// Deletes the group's consumers that hold nothing and were idle past
    /// [`CONSUMER_IDLE_DROP`] (never this one).
    async fn drop_idle_consumers(&self, keys: &Keys) -> Result<(), StoreError> {
        let all = keys
            .run(
                redis::cmd("XINFO")
                    .arg("CONSUMERS")
                    .arg(keys.stream())
                    .arg(DRAIN_GROUP),
            )
            .await?;
        for c in array(&all) {
            let f = array(c);
            let field = |name: &str| {
                f.chunks(2).find_map(|p| match p {
                    [k, v] if bulk(k).as_deref() == Some(name) => bulk(v),
                    _ => None,
                })
            };
            let (Some(name), Some(pending), Some(idle)) =
                (field("name"), field("pending"), field("idle"))
            else {
                continue;
            };
            let idle: u64 = idle.parse().unwrap_or(0);
            if name != self.consumer
                && pending == "0"
                && idle > CONSUMER_IDLE_DROP.as_millis() as u64
            {
                keys.run(
                    redis::cmd("XGROUP")
                        .arg("DELCONSUMER")
                        .arg(keys.stream())
                        .arg(DRAIN_GROUP)
                        .arg(&name),
                )
                .await?;
            }
        }
        Ok(())
    }

    async fn first_undelivered(&self, keys: &Keys) -> Result<Option<u64>, StoreError> {
        let groups = keys
            .run(redis::cmd("XINFO").arg("GROUPS").arg(keys.stream()))
            .await?;
        let mut last = None;
        for g in array(&groups) {
            let f = array(g);
            let field = |name: &str| {
                f.chunks(2).find_map(|p| match p {
                    [k, v] if bulk(k).as_deref() == Some(name) => bulk(v),
                    _ => None,
                })
            };
            if field("name").as_deref() == Some(DRAIN_GROUP) {
                last = field("last-delivered-id");
            }
        }
        let start = last.map_or("-".to_string(), |l| format!("({l}"));
        let v = keys
            .run(
                redis::cmd("XRANGE")
                    .arg(keys.stream())
                    .arg(start)
                    .arg("+")
                    .arg("COUNT")
                    .arg(1),
            )
            .await?;
        Ok(entries(&v).first().and_then(|(id, _)| id_ms(id)))
    }
}

/// The entries of an `XREADGROUP` answer on one stream.
fn stream_entries(v: &redis::Value) -> Vec<Entry> {
    match v {
        redis::Value::Array(streams) => streams
            .first()
            .and_then(|s| array(s).get(1).map(entries))
            .unwrap_or_default(),
        redis::Value::Map(streams) => streams.first().map(|(_, e)| entries(e)).unwrap_or_default(),
        _ => Vec::new(),
    }
}
