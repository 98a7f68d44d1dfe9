//! Shared helpers: a private Redis server and stores on it.

use spendgate_core::{Micros, Policy, StepRequest, ToolPrice};
use spendgate_redis::{ClockSource, InitMode, RedisOptions, RedisStore};
use spendgate_store::Clock;
use spendgate_testkit::RedisServer;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A well-formed ledger id that no `store init` made.
pub const PIN: &str = "lg-00000000000000000000000000000000";

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

/// Slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// One node of a private Redis Cluster: the server and its cluster bus port.
pub struct ClusterNode {
    pub server: RedisServer,
    pub bus: u16,
}

/// A redis-server in cluster mode on free ports (its bus port too), not yet in any cluster.
pub fn cluster_node(extra_args: &[&str]) -> ClusterNode {
    let bus = spendgate_testkit::free_port();
    let mut args: Vec<String> = [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-port",
    ]
    .map(String::from)
    .to_vec();
    args.push(bus.to_string());
    args.extend(extra_args.iter().map(|a| a.to_string()));
    let server = RedisServer::start(spendgate_testkit::RedisOptions {
        extra_args: args,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("cannot start a private redis-server in cluster mode: {e}"));
    ClusterNode { server, bus }
}

/// One command on a test server, panicking on an error.
pub fn cmd(server: &RedisServer, args: &[&str]) -> String {
    server
        .command(args)
        .unwrap_or_else(|e| panic!("{args:?} on port {}: {e}", server.port()))
}

/// `node` joins the cluster that `to` is part of.
pub fn meet(node: &RedisServer, to: &ClusterNode) {
    let (port, bus) = (to.server.port().to_string(), to.bus.to_string());
    cmd(node, &["CLUSTER", "MEET", "127.0.0.1", &port, &bus]);
}

/// Waits (up to 20 s) until `node` sees a healthy cluster of `known` nodes.
pub fn wait_cluster_ok(node: &RedisServer, known: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let info = cmd(node, &["CLUSTER", "INFO"]);
        if info.contains("cluster_state:ok")
            && info.contains(&format!("cluster_known_nodes:{known}"))
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster of {known} never became ok on port {}: {info}",
            node.port()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A private Redis Cluster of `n` primaries on loopback (no replicas), the slots split evenly
/// in order (node 0 serves the lowest), each node started with `extra_args`. Redis checks in
/// cluster mode that a script touches keys of one slot only (else "Script attempted to access
/// keys that do not hash to the same slot"), so the ledger running here shows that one
/// deployment's keys really share one hash tag (SPEC §7: a Redis Cluster can serve them).
pub fn cluster_with(n: u16, extra_args: &[&str]) -> Vec<ClusterNode> {
    let nodes: Vec<ClusterNode> = (0..n).map(|_| cluster_node(extra_args)).collect();
    for node in &nodes[1..] {
        meet(&node.server, &nodes[0]);
    }
    for (i, node) in nodes.iter().enumerate() {
        let i = i as u32;
        let lo = u32::from(SLOTS) * i / u32::from(n);
        let hi = u32::from(SLOTS) * (i + 1) / u32::from(n) - 1;
        cmd(
            &node.server,
            &["CLUSTER", "ADDSLOTSRANGE", &lo.to_string(), &hi.to_string()],
        );
    }
    for node in &nodes {
        wait_cluster_ok(&node.server, usize::from(n));
    }
    nodes
}

/// [`cluster_with`] with Redis's defaults.
pub fn cluster(n: u16) -> Vec<RedisServer> {
    cluster_with(n, &[]).into_iter().map(|c| c.server).collect()
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
        slow_grace: Duration::ZERO,
        clock: match clock {
            Some(c) => ClockSource::Manual(c),
            None => ClockSource::Server,
        },
        ledger_id: None,
        witness: None,
    }
}

/// The ledger id pinned for each (url, prefix) by [`open`], as an operator's config holds it
/// once `spendgate store init` printed it.
fn pins() -> &'static Mutex<BTreeMap<(String, String), String>> {
    static PINS: std::sync::OnceLock<Mutex<BTreeMap<(String, String), String>>> =
        std::sync::OnceLock::new();
    PINS.get_or_init(Default::default)
}

/// The ledger id [`open`] pinned for `opts`' url and prefix.
pub fn pinned(opts: &RedisOptions) -> Option<String> {
    let key = (opts.url.clone(), opts.prefix.clone());
    pins().lock().expect("pins").get(&key).cloned()
}

/// `opts` with the ledger id pinned for its prefix, unless it has one.
pub fn with_pin(opts: RedisOptions) -> RedisOptions {
    let ledger_id = opts.ledger_id.clone().or_else(|| pinned(&opts));
    RedisOptions { ledger_id, ..opts }
}

/// Opens a store on `opts.prefix`, first running `store init` there (with the pin it got
/// before, if any: it creates a ledger only on a new prefix), as an operator does once, and
/// pinning the ledger id it printed.
pub async fn open(opts: RedisOptions, policy: Policy) -> RedisStore {
    let opts = with_pin(opts);
    let done = RedisStore::init(&opts, InitMode::Routine)
        .await
        .unwrap_or_else(|e| panic!("init redis store: {e}"));
    let key = (opts.url.clone(), opts.prefix.clone());
    pins()
        .lock()
        .expect("pins")
        .insert(key, done.ledger().to_string());
    open_only(opts, policy).await
}

/// Opens a store without initialising anything (a replica starting on what Redis holds),
/// pinned to the ledger [`open`] created on that prefix (unless `opts` pins one).
pub async fn open_only(opts: RedisOptions, policy: Policy) -> RedisStore {
    RedisStore::open(with_pin(opts), policy)
        .await
        .unwrap_or_else(|e| panic!("open redis store: {e}"))
}

/// A tool step of `run` priced `per_call` micros a call.
pub fn tool_step(run: &str, step: &str, per_call: u64) -> StepRequest {
    let price = ToolPrice {
        per_call: Micros(per_call),
        per_unit: Micros::ZERO,
    };
    spendgate_conformance::support::tool_step(run, step, price, 0)
}
