//! Shared helpers: a private Redis server and stores on it.

use spendgate_core::Policy;
use spendgate_redis::{ClockSource, RedisOptions, RedisStore};
use spendgate_store::Clock;
use spendgate_testkit::RedisServer;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Generous timeout for tests that are not about timeouts (2 shared cores, many tests).
pub const TEST_TIMEOUT: Duration = Duration::from_secs(5);

pub fn server(appendonly: bool) -> RedisServer {
    RedisServer::start(spendgate_testkit::RedisOptions {
        appendonly,
        ..Default::default()
    })
    .unwrap_or_else(|e| {
        panic!(
            "cannot start a private redis-server (install the Debian package `redis-server`): {e}"
        )
    })
}

/// The Valkey server binary: `$SPENDGATE_VALKEY_SERVER`, else `.valkey/valkey-server` in the
/// workspace (where `scripts/fetch-valkey.sh`, run by `scripts/test.sh`, puts it), else
/// `valkey-server` on `$PATH`. Missing, it fails the test: SPEC §7 promises Valkey.
pub fn valkey_binary() -> std::path::PathBuf {
    let fetched =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.valkey/valkey-server");
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("valkey-server"))
            .find(|c| c.is_file())
    });
    std::env::var_os("SPENDGATE_VALKEY_SERVER")
        .map(std::path::PathBuf::from)
        .or_else(|| fetched.is_file().then_some(fetched))
        .or(on_path)
        .unwrap_or_else(|| {
            panic!(
                "no valkey-server: run scripts/fetch-valkey.sh (scripts/test.sh does) or set \
                 SPENDGATE_VALKEY_SERVER"
            )
        })
}

/// A private Valkey server (see [`valkey_binary`]), configured as `server` configures Redis.
pub fn valkey_server() -> RedisServer {
    let binary = valkey_binary();
    RedisServer::start(spendgate_testkit::RedisOptions {
        binary: Some(binary.clone()),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("cannot start a private {}: {e}", binary.display()))
}

/// A private redis-server in cluster mode, a cluster of one node that serves every slot. Redis
/// checks in cluster mode that a script touches keys of one slot only (else "Script attempted
/// to access keys that do not hash to the same slot"), so the ledger running here shows that
/// one deployment's keys really share one hash tag (SPEC §7: a Redis Cluster can serve them).
pub fn cluster_server() -> RedisServer {
    let server = RedisServer::start(spendgate_testkit::RedisOptions {
        extra_args: [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ]
        .map(String::from)
        .to_vec(),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("cannot start a private redis-server in cluster mode: {e}"));
    server
        .command(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"])
        .unwrap_or_else(|e| panic!("CLUSTER ADDSLOTSRANGE: {e}"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let info = server
            .command(&["CLUSTER", "INFO"])
            .unwrap_or_else(|e| panic!("CLUSTER INFO: {e}"));
        if info.contains("cluster_state:ok") {
            return server;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the one-node cluster never became ok: {info}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A fresh prefix per call, so stores on one server never share data.
pub fn fresh_prefix(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("t-{tag}-{}", N.fetch_add(1, Ordering::Relaxed))
}

pub fn options(server: &RedisServer, prefix: &str, clock: Option<Arc<dyn Clock>>) -> RedisOptions {
    RedisOptions {
        url: server.url(),
        prefix: prefix.to_string(),
        timeout: TEST_TIMEOUT,
        clock: match clock {
            Some(c) => ClockSource::Manual(c),
            None => ClockSource::Server,
        },
    }
}

pub async fn open(opts: RedisOptions, policy: Policy) -> RedisStore {
    RedisStore::open(opts, policy)
        .await
        .unwrap_or_else(|e| panic!("open redis store: {e}"))
}
