//! A Redis Cluster of three primaries that moves the deployment's slot to another node while
//! replicas hold reservations on it: every store follows the slot (the cluster's `MOVED`),
//! the limit stays one limit, and nothing is lost or counted twice.

use crate::support::{
    cluster, cluster_node, cluster_with, cmd, fresh_prefix, meet, open, options, wait_cluster_ok,
    ClusterNode,
};
use spendgate_conformance::support::{
    admit, day, micros_step, policy, reserve, reserve_refused, resolve, units, usage, Who,
};
use spendgate_core::{RefusalCode, ScopeKind};
use spendgate_store::{Store, StoreError};
use spendgate_testkit::RedisServer;
use std::sync::Arc;

fn keyslot(node: &RedisServer, prefix: &str) -> u16 {
    cmd(node, &["CLUSTER", "KEYSLOT", &format!("{{{prefix}}}")])
        .parse()
        .expect("a slot number")
}

/// The port of the primary that serves `slot`, as `CLUSTER NODES` on `via` says (lines of
/// `id host:port@bus flags master ping pong epoch state slot-ranges...`).
fn owner_port(via: &RedisServer, slot: u16) -> u16 {
    let table = cmd(via, &["CLUSTER", "NODES"]);
    for line in table.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let serves = fields.iter().skip(8).any(|range| {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            matches!((lo.parse::<u16>(), hi.parse::<u16>()), (Ok(lo), Ok(hi)) if lo <= slot && slot <= hi)
        });
        if serves && fields[2].contains("master") {
            return fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse::<u16>().ok())
                .expect("host:port@bus");
        }
    }
    panic!("no node serves slot {slot}: {table}")
}

/// The index in `nodes` of the node that serves `slot`, as `nodes[0]` sees it.
fn owner(nodes: &[&RedisServer], slot: u16) -> usize {
    let port = owner_port(nodes[0], slot);
    nodes
        .iter()
        .position(|n| n.port() == port)
        .unwrap_or_else(|| panic!("port {port} is none of ours"))
}

fn dbsize(node: &RedisServer) -> u64 {
    cmd(node, &["DBSIZE"]).parse().expect("a count")
}

/// A move of `slot` from `nodes[from]` to `nodes[to]`, step by step as `redis-cli --cluster
/// reshard` does it.
struct Migration<'a> {
    nodes: &'a [RedisServer],
    slot: String,
    from: usize,
    to: usize,
}

impl<'a> Migration<'a> {
    /// Importing and migrating states.
    fn begin(nodes: &'a [RedisServer], slot: u16, from: usize, to: usize) -> Migration<'a> {
        let m = Migration {
            nodes,
            slot: slot.to_string(),
            from,
            to,
        };
        let (from_id, to_id) = (m.id(from), m.id(to));
        cmd(
            &nodes[to],
            &["CLUSTER", "SETSLOT", &m.slot, "IMPORTING", &from_id],
        );
        cmd(
            &nodes[from],
            &["CLUSTER", "SETSLOT", &m.slot, "MIGRATING", &to_id],
        );
        m
    }

    fn id(&self, i: usize) -> String {
        cmd(&self.nodes[i], &["CLUSTER", "MYID"])
    }

    /// `MIGRATE`s up to `count` keys; how many it moved.
    fn move_keys(&self, count: usize) -> usize {
        let keys = cmd(
            &self.nodes[self.from],
            &["CLUSTER", "GETKEYSINSLOT", &self.slot, &count.to_string()],
        );
        let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        if keys.is_empty() {
            return 0;
        }
        let port = self.nodes[self.to].port().to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend(&keys);
        cmd(&self.nodes[self.from], &args);
        keys.len()
    }

    /// Every other key moved, then the new owner announced to every node.
    fn finish(self) {
        for _ in 0..1000 {
            if self.move_keys(100) == 0 {
                break;
            }
        }
        let to_id = self.id(self.to);
        let (to, from) = (self.to, self.from);
        for i in std::iter::once(to)
            .chain(std::iter::once(from))
            .chain((0..self.nodes.len()).filter(|&i| i != to && i != from))
        {
            cmd(
                &self.nodes[i],
                &["CLUSTER", "SETSLOT", &self.slot, "NODE", &to_id],
            );
        }
    }
}

/// A fresh prefix whose slot `nodes[i]` serves.
fn prefix_on(nodes: &[&RedisServer], i: usize) -> (String, u16) {
    (0..1000)
        .map(|_| fresh_prefix("slot"))
        .map(|p| {
            let slot = keyslot(nodes[0], &p);
            (p, slot)
        })
        .find(|(_, slot)| owner(nodes, *slot) == i)
        .unwrap_or_else(|| panic!("no prefix hashes to node {i}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_follow_the_ledger_slot_across_a_resharding() {
    let nodes = cluster(3);
    let all: Vec<&RedisServer> = nodes.iter().collect();
    // A deployment whose slot node 1 serves; the stores are configured with nodes 0 and 2.
    let (prefix, slot) = prefix_on(&all, 1);
    let mut p = policy();
    p.global.budgets = vec![day(1_000)];
    let a: Arc<dyn Store> = Arc::new(open(options(&nodes[0], &prefix, None), p.clone()).await);
    let b: Arc<dyn Store> = Arc::new(open(options(&nodes[2], &prefix, None), p).await);
    let (w1, w2) = (
        Who::new("s", "c1", "10.0.0.1/32"),
        Who::new("s", "c2", "10.0.0.2/32"),
    );

    admit(&a, w1.run("r1")).await;
    reserve(&a, micros_step("r1", "s1", 100)).await;
    resolve(&a, "s1", units(100)).await;
    admit(&b, w2.run("r2")).await;
    // Held while its slot moves.
    reserve(&b, micros_step("r2", "s2", 300)).await;
    assert!(dbsize(&nodes[1]) > 0, "the ledger lives on the slot's node");
    assert_eq!((dbsize(&nodes[0]), dbsize(&nodes[2])), (0, 0));

    // Half-way through the move, with the ledger split over two nodes, nothing runs: the
    // script's one declared key (the bare hash tag) never exists, so Redis answers `ASK`,
    // which the store does not follow (it would run the script on a half-moved ledger).
    let migration = Migration::begin(&nodes, slot, 1, 2);
    assert_eq!(migration.move_keys(1), 1);
    match a.reserve_step(micros_step("r1", "s-mid", 1), None).await {
        Err(StoreError::Unavailable(e)) => assert!(e.contains("moving"), "{e}"),
        other => panic!("a call during the move ran: {other:?}"),
    }
    migration.finish();
    assert_eq!(owner(&all, slot), 2);
    assert_eq!(dbsize(&nodes[1]), 0, "every key moved");

    // Both stores go on, on node 2 now: the held step commits from the other replica, the
    // budget's rest is granted exactly once, and past it the global budget refuses.
    assert_eq!(resolve(&a, "s2", units(250)).await.value.charged.0, 250);
    reserve(&b, micros_step("r2", "s3", 650)).await;
    // (s3's hold takes the rest: a wait, `budget_held`)
    let refused = reserve_refused(&a, micros_step("r1", "s4", 1)).await;
    assert_eq!(
        (refused.code, refused.scope),
        (RefusalCode::BudgetHeld, Some(ScopeKind::Global))
    );
    resolve(&b, "s3", units(650)).await;
    for s in [&a, &b] {
        let lines = usage(s, &w1.scopes()).await;
        let global = &lines[0];
        assert_eq!(global.scope.kind, ScopeKind::Global);
        assert_eq!((global.used.0, global.reserved.0), (1_000, 0), "{lines:?}");
    }
    assert!(dbsize(&nodes[2]) > 0);
    assert_eq!((dbsize(&nodes[0]), dbsize(&nodes[1])), (0, 0));
}

/// The primary that serves the ledger's slot is killed and its replica takes over (an
/// operator's `CLUSTER FAILOVER TAKEOVER`, what the cluster's own failover does after
/// `cluster-node-timeout`; forced here so that the test does not hang on timing). The store,
/// redirected to the dead primary before, goes back to its configured node, which redirects
/// it to the new primary: service resumes without a restart and with the ledger whole (the
/// replica had every write: `WAIT` before the kill).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_follows_the_ledger_slot_across_a_failover() {
    let mut nodes = cluster_with(3, &[]);
    let replica = cluster_node(&[]);
    meet(&replica.server, &nodes[0]);
    wait_cluster_ok(&replica.server, 4);
    let primary_id = cmd(&nodes[1].server, &["CLUSTER", "MYID"]);
    cmd(&replica.server, &["CLUSTER", "REPLICATE", &primary_id]);
    let logs = |nodes: &[ClusterNode], replica: &ClusterNode| {
        let mut out = format!("--- replica ---\n{}", replica.server.log());
        for (i, n) in nodes.iter().enumerate() {
            out.push_str(&format!("\n--- node {i} ---\n{}", n.server.log()));
        }
        out
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !cmd(&replica.server, &["INFO", "replication"]).contains("master_link_status:up") {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica never synced\n{}",
            logs(&nodes, &replica)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (prefix, slot) = prefix_on(
        &[
            &nodes[0].server,
            &nodes[1].server,
            &nodes[2].server,
            &replica.server,
        ],
        1,
    );
    let mut p = policy();
    p.global.budgets = vec![day(1_000)];
    let mut opts = options(&nodes[0].server, &prefix, None);
    opts.timeout = std::time::Duration::from_millis(500);
    let a: Arc<dyn Store> = Arc::new(open(opts, p).await);
    let w = Who::new("s", "c1", "10.0.0.1/32");
    admit(&a, w.run("r1")).await;
    reserve(&a, micros_step("r1", "s1", 100)).await;
    resolve(&a, "s1", units(100)).await;
    reserve(&a, micros_step("r1", "s2", 300)).await;
    assert_eq!(cmd(&nodes[1].server, &["WAIT", "1", "5000"]), "1");

    nodes[1].server.stop().expect("kill the primary");
    cmd(&replica.server, &["CLUSTER", "FAILOVER", "TAKEOVER"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while owner_port(&nodes[0].server, slot) != replica.server.port() {
        assert!(
            std::time::Instant::now() < deadline,
            "node 0 never saw the replica take over\n{}",
            logs(&nodes, &replica)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // A commit is idempotent: retried until the store reaches the new primary.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let charged = loop {
        match a
            .resolve(spendgate_conformance::support::step_id("s2"), units(250))
            .await
        {
            Ok(r) => break r.value.charged.0,
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the store never reached the new primary: {e}\n{}",
                    logs(&nodes, &replica)
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(charged, 250);
    reserve(&a, micros_step("r1", "s3", 650)).await;
    // (s3's hold takes the rest: a wait, `budget_held`)
    let refused = reserve_refused(&a, micros_step("r1", "s4", 1)).await;
    assert_eq!(refused.code, RefusalCode::BudgetHeld);
    let lines = usage(&a, &w.scopes()).await;
    assert_eq!(
        (lines[0].used.0, lines[0].reserved.0),
        (350, 650),
        "{lines:?}"
    );
    assert!(
        dbsize(&replica.server) > 0,
        "the ledger lives on the new primary"
    );
}
