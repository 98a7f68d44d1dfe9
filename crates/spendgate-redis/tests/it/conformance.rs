//! The shared conformance suite (`spendgate-conformance`) on Redis: one private redis-server
//! per test, a fresh key prefix per opened store, time driven by hand
//! (`ClockSource::Manual`).

use crate::support::*;
use spendgate_conformance::{conformance_tests, Backend};
use spendgate_core::{Policy, UnixMs};
use spendgate_redis::RedisOptions;
use spendgate_store::{ManualClock, Store};
use spendgate_testkit::RedisServer;
use std::sync::{Arc, Mutex};

struct RedisBackend {
    /// The server every store is opened on (`store.url`).
    server: RedisServer,
    /// The other nodes of a cluster.
    others: Vec<RedisServer>,
    last: Mutex<Option<(RedisOptions, Policy, ManualClock)>>,
}

impl RedisBackend {
    fn new() -> RedisBackend {
        RedisBackend {
            server: server(false),
            others: Vec::new(),
            last: Mutex::new(None),
        }
    }

    /// On Valkey (see `valkey_server`).
    fn valkey() -> RedisBackend {
        RedisBackend {
            server: valkey_server(),
            others: Vec::new(),
            last: Mutex::new(None),
        }
    }

    /// On a Redis Cluster of `n` nodes (see `cluster`), every store opened on the first node:
    /// each fresh prefix hashes to its own slot, which another node serves in most cases, so
    /// the store follows the cluster's redirection to it.
    fn cluster(n: u16) -> RedisBackend {
        let mut nodes = cluster(n);
        let server = nodes.remove(0);
        RedisBackend {
            server,
            others: nodes,
            last: Mutex::new(None),
        }
    }
}

#[async_trait::async_trait]
impl Backend for RedisBackend {
    async fn open(&self, policy: Policy, start: UnixMs) -> Arc<dyn Store> {
        let clock = ManualClock::new(start);
        let opts = options(
            &self.server,
            &fresh_prefix("conf"),
            Some(Arc::new(clock.clone())),
        );
        let store = open(opts.clone(), policy.clone()).await;
        *self.last.lock().expect("backend lock") = Some((opts, policy, clock));
        Arc::new(store)
    }

    fn advance(&self, ms: u64) {
        if let Some((_, _, clock)) = self.last.lock().expect("backend lock").as_ref() {
            clock.advance_ms(ms);
        }
    }

    /// A new store process on the same Redis data (what a crashed replica's successor sees).
    async fn reopen(&self) -> Option<Arc<dyn Store>> {
        let last = self.last.lock().expect("backend lock").clone();
        let (opts, policy, _) = last?;
        Some(Arc::new(open(opts, policy).await))
    }

    /// Every node refuses writes: `maxmemory 1` under `noeviction` (which the store requires)
    /// makes Redis answer `OOM` to every function that may write, before it runs, while reads
    /// still work. Back to `maxmemory 0` (no limit) to recover.
    async fn set_failing(&self, failing: bool) -> bool {
        let max = if failing { "1" } else { "0" };
        for node in std::iter::once(&self.server).chain(&self.others) {
            cmd(node, &["CONFIG", "SET", "maxmemory", max]);
        }
        true
    }

    /// Another replica: a second `RedisStore` with its own connection on the same prefix,
    /// opened without `init` (as a replica starts on what Redis holds).
    async fn replica(&self, _store: &Arc<dyn Store>) -> Option<Arc<dyn Store>> {
        let last = self.last.lock().expect("backend lock").clone();
        let (opts, policy, _) = last?;
        Some(Arc::new(open_only(opts, policy).await))
    }
}

conformance_tests!(RedisBackend::new());

/// The whole suite, case after case, on one Redis in cluster mode (one node serving every
/// slot): Redis refuses a script that touches keys of two slots, so this shows that every key
/// of a deployment shares one hash tag. One server for all cases: a cluster node serves only
/// 2 s after it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_suite_on_a_one_node_redis_cluster() {
    let backend = RedisBackend::cluster(1);
    spendgate_conformance::run_all_conformance_cases!(&backend);
}

/// The whole suite, case after case, on a Redis Cluster of three primaries, every store
/// configured with the first node's address: most prefixes live on another node, and the
/// store follows the cluster's `MOVED` to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_suite_on_a_three_node_redis_cluster() {
    let backend = RedisBackend::cluster(3);
    spendgate_conformance::run_all_conformance_cases!(&backend);
}

/// The whole suite, case after case, on Valkey (SPEC §7: the redis store works against Redis 7
/// and Valkey): the same functions, scripts and server checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_suite_on_valkey() {
    let backend = RedisBackend::valkey();
    let version = backend
        .server
        .command(&["INFO", "server"])
        .expect("INFO server");
    assert!(
        version.contains("server_name:valkey"),
        "not a Valkey server: {version}"
    );
    spendgate_conformance::run_all_conformance_cases!(&backend);
}
