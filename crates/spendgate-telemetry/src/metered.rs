//! The store as the handlers see it: every call timed into `spendgate_store_call_seconds`,
//! in one place, whatever calls it (a handler, the proxy, the sweeper, the alert checker).

use crate::metrics::StoreTiming;
use async_trait::async_trait;
use spendgate_core::{Command, Reply};
use spendgate_store::{Store, StoreError};
use std::sync::Arc;
use std::time::Instant;

/// A [`Store`] decorator that times each call of the store it wraps (its bounds included:
/// it wraps the store [`Timed`](spendgate_store::Timed) bounds). A batch
/// ([`Store::execute_many`]) is one call; `ready` (the readiness probe) is not timed.
pub struct Metered {
    inner: Arc<dyn Store>,
    timing: StoreTiming,
}

impl Metered {
    /// `inner`, timed into `timing`.
    pub fn wrap(inner: Arc<dyn Store>, timing: StoreTiming) -> Arc<dyn Store> {
        Arc::new(Metered { inner, timing })
    }
}

#[async_trait]
impl Store for Metered {
    async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
        let started = Instant::now();
        let reply = self.inner.execute(cmd).await;
        self.timing.record(started.elapsed());
        reply
    }

    async fn execute_many(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let started = Instant::now();
        let replies = self.inner.execute_many(cmds).await;
        self.timing.record(started.elapsed());
        replies
    }

    async fn ready(&self) -> Result<(), StoreError> {
        self.inner.ready().await
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn history(&self) -> Option<Arc<dyn spendgate_store::HistoryReader>> {
        self.inner.history()
    }

    fn tap_history(&self, tap: Arc<dyn spendgate_store::HistoryTap>) {
        self.inner.tap_history(tap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use spendgate_core::{Policy, ScopeKey};
    use spendgate_store::{MemoryStore, SystemClock};

    /// Every call through the decorator is timed once (a batch is one call), whichever typed
    /// call made it; the readiness probe is not.
    #[tokio::test]
    async fn every_store_call_is_timed_once() {
        let metrics = Metrics::default();
        let inner: Arc<dyn Store> =
            Arc::new(MemoryStore::new(Policy::default(), Arc::new(SystemClock)));
        let store = Metered::wrap(inner, metrics.store_timing());
        let count = |m: &Metrics| {
            m.render(None, &[], &[])
                .lines()
                .find_map(|l| l.strip_prefix("spendgate_store_call_seconds_count "))
                .map(str::to_string)
        };
        assert_eq!(count(&metrics).as_deref(), Some("0"));
        store.summary().await.expect("summary");
        store
            .usage(vec![(ScopeKey::global(), 1)])
            .await
            .expect("usage");
        let answers = store
            .execute_many(vec![Command::Summary, Command::Replicas])
            .await;
        assert_eq!(answers.len(), 2);
        store.ready().await.expect("ready");
        assert_eq!(count(&metrics).as_deref(), Some("3"));
        assert_eq!(store.kind(), "memory");
    }
}
