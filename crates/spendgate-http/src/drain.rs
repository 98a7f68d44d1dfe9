//! The usage history's background work on a Redis store (`[history]`): this replica's drain
//! of the history stream into PostgreSQL (or, without PostgreSQL, to the metrics' tap only),
//! PostgreSQL's retention, and the drain lag's gauges and alert.

use crate::state::Shared;
use serde_json::json;
use spendgate_config::Config;
use spendgate_history_pg::PgHistory;
use spendgate_redis::history::{spawn_drain, DrainHandle, HistorySink};
use spendgate_redis::RedisStore;
use spendgate_store::Store;
use spendgate_telemetry::HistoryDrain;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How often the drain's figures are copied to the metrics and its lag checked.
pub const HISTORY_WATCH_EVERY: Duration = Duration::from_secs(5);
/// How often PostgreSQL's retention runs.
pub const HISTORY_RETENTION_EVERY: Duration = Duration::from_secs(3_600);
/// A drain lag alert is raised at most once per this period across replicas.
pub const DRAIN_LAG_ALERT_EVERY_MS: u64 = 3_600_000;

/// What a Redis store's history needs once the replica runs: the store, and PostgreSQL when
/// `[history] url` is set.
pub struct HistorySetup {
    pub redis: Arc<RedisStore>,
    pub pg: Option<Arc<PgHistory>>,
}

impl HistorySetup {
    /// Sets the store's stream cap and, with PostgreSQL, makes it the history's reader.
    pub fn configure(
        store: &mut RedisStore,
        config: &Config,
    ) -> Result<Option<Arc<PgHistory>>, spendgate_store::StoreError> {
        store.set_history_stream_max_len(config.history.stream_max_len)?;
        let pg = config
            .history
            .url
            .as_ref()
            .map(|u| Arc::new(PgHistory::new(u.expose())));
        if let Some(pg) = &pg {
            store.set_history_reader(pg.clone());
        }
        Ok(pg)
    }
}

/// The running history tasks; dropping it stops them.
pub struct HistoryTasks {
    _drain: DrainHandle,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for HistoryTasks {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Starts this replica's drain (its consumer named by the replica id), the retention of
/// PostgreSQL, and the watch of the drain's lag.
pub fn spawn_history(state: &Shared, setup: HistorySetup) -> HistoryTasks {
    let sink = setup.pg.clone().map(|p| p as Arc<dyn HistorySink>);
    let drain = spawn_drain(setup.redis, sink, state.replica.id.clone());
    let mut tasks = Vec::new();
    if let Some(pg) = setup.pg {
        tasks.push(spendgate_history_pg::spawn_retention(
            pg,
            HISTORY_RETENTION_EVERY,
            state.config.history.retention,
            state.config.history.rows_max,
        ));
        let (state, status) = (state.clone(), drain.status.clone());
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(HISTORY_WATCH_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let d = HistoryDrain {
                    lag_ms: status.lag_ms.load(Ordering::Relaxed),
                    pending: status.pending.load(Ordering::Relaxed),
                    drained: status.drained.load(Ordering::Relaxed),
                    evicted: status.evicted.load(Ordering::Relaxed),
                };
                state.metrics.history_drain(d);
                lag_alert(&state, d).await;
            }
        }));
    }
    HistoryTasks {
        _drain: drain,
        tasks,
    }
}

/// Alerts (once per [`DRAIN_LAG_ALERT_EVERY_MS`] across replicas) when the oldest record not
/// yet drained is older than `[history] drain_lag_alert_s`.
async fn lag_alert(state: &Shared, d: HistoryDrain) {
    let bound = state.config.history.drain_lag_alert;
    if d.lag_ms <= bound.as_millis() as u64 {
        return;
    }
    let period = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.as_millis() as u64)
        / DRAIN_LAG_ALERT_EVERY_MS;
    let store: &Arc<dyn Store> = &state.store;
    match store
        .consume_once(
            format!("alert:history_lag:{period}"),
            DRAIN_LAG_ALERT_EVERY_MS,
        )
        .await
    {
        Ok(a) if a.value => state.alerts.emit(
            "history_drain_lag",
            format!(
                "the usage history is {} s behind its drain into PostgreSQL (bound {} s); the \
                 Redis stream evicts records not drained past its cap",
                d.lag_ms / 1000,
                bound.as_secs()
            ),
            json!({ "lag_ms": d.lag_ms, "pending": d.pending, "evicted": d.evicted }),
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "history drain lag alert not deduplicated; skipped"),
    }
}
