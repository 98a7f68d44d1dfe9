//! Redis CPU per ledger operation, measured on a private `redis-server`.
//!
//! `cargo run --release -p spendgate-redis --example opbench -- [PAIRS] [CLIENTS] [POLICY]`
//!
//! Runs PAIRS reserve+commit pairs from CLIENTS concurrent clients; each client's run takes
//! 16 tool steps, then is finished and a new run admitted (like `spendgate-load`). Every script
//! call is recorded by SLOWLOG (threshold 0); the table gives the server-side µs per call of
//! each operation. POLICY is `bench` (the limits of scripts/bench-redis.sh: one global day
//! budget) or `full` (budgets on every scope kind, as the default policy: 5 counters a step).
//! `OPBENCH_SLOWLOG=0` skips SLOWLOG (which costs the server time of its own); either way the
//! last lines give the wall time, pairs/s and the server main thread's CPU per pair, which
//! does not depend on how many script calls carried the pairs.

mod common;

use spendgate_core::{IpScope, ReservationId, Resolution, RunId, RunRequest, Settlement};
use spendgate_redis::RedisStore;
use spendgate_store::Store;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const STEPS_PER_RUN: usize = 16;

fn run_request(client: usize, n: usize) -> RunRequest {
    RunRequest {
        run_id: RunId(format!("run-{client}-{n}")),
        session: format!("session-{client}"),
        ips: vec![IpScope {
            prefix: format!("10.0.{client}.1/32"),
            factor: 1,
        }],
        conversation: format!("conv-{client}-{n}"),
        input_bytes: 10,
    }
}

async fn client(store: Arc<RedisStore>, c: usize, pairs: usize) -> Result<(), String> {
    let s: &dyn Store = &*store;
    let mut n = 0;
    let mut run = run_request(c, n);
    s.admit_run(run.clone(), None)
        .await
        .map_err(|e| e.to_string())?
        .value
        .map_err(|r| format!("{r:?}"))?;
    let mut steps = 0;
    for i in 0..pairs {
        if steps == STEPS_PER_RUN {
            s.finish(run.run_id.clone())
                .await
                .map_err(|e| e.to_string())?;
            n += 1;
            run = run_request(c, n);
            s.admit_run(run.clone(), None)
                .await
                .map_err(|e| e.to_string())?
                .value
                .map_err(|r| format!("{r:?}"))?;
            steps = 0;
        }
        if i % 8 == 7 {
            s.heartbeat(run.run_id.clone())
                .await
                .map_err(|e| e.to_string())?;
        }
        let step = ReservationId(format!("{}.{steps}", run.run_id.0));
        steps += 1;
        let req = common::tool_step(&run.run_id, step.clone());
        s.reserve_step(req, None)
            .await
            .map_err(|e| e.to_string())?
            .value
            .map_err(|r| format!("{r:?}"))?;
        s.resolve(step, Resolution::Commit(Settlement::Units(0)))
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The server main thread's CPU seconds so far (user + system).
async fn cpu_secs(conn: &mut redis::aio::MultiplexedConnection) -> Result<f64, String> {
    let info = redis::cmd("INFO")
        .arg("cpu")
        .query_async::<String>(conn)
        .await
        .map_err(|e| e.to_string())?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .ok_or_else(|| format!("INFO cpu has no {name}"))
    };
    Ok(field("used_cpu_user_main_thread")? + field("used_cpu_sys_main_thread")?)
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn text(v: &redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::Int(i) => i.to_string(),
        other => format!("{other:?}"),
    }
}

/// A command from its words.
fn command(args: &[&str]) -> redis::Cmd {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c
}

/// Runs each command on `conn`, in order.
async fn run_all(
    conn: &mut redis::aio::MultiplexedConnection,
    cmds: &[&[&str]],
) -> Result<(), String> {
    for args in cmds {
        command(args)
            .query_async::<redis::Value>(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// SLOWLOG on (threshold 0: every call; `slowlog`: false leaves it off), emptied, and the
/// server's command statistics reset.
async fn slowlog_on(
    conn: &mut redis::aio::MultiplexedConnection,
    slowlog: bool,
) -> Result<(), String> {
    let threshold = if slowlog { "0" } else { "-1" };
    run_all(
        conn,
        &[
            &["CONFIG", "SET", "slowlog-log-slower-than", threshold],
            &["CONFIG", "SET", "slowlog-max-len", "4000000"],
            &["SLOWLOG", "RESET"],
            &["CONFIG", "RESETSTAT"],
        ],
    )
    .await
}

/// SLOWLOG off, and the µs of every script call it logged, by operation.
async fn slowlog_by_op(
    conn: &mut redis::aio::MultiplexedConnection,
) -> Result<BTreeMap<String, Vec<u64>>, String> {
    run_all(
        conn,
        &[&["CONFIG", "SET", "slowlog-log-slower-than", "10000000"]],
    )
    .await?;
    let log = command(&["SLOWLOG", "GET", "-1"])
        .query_async::<redis::Value>(conn)
        .await
        .map_err(|e| e.to_string())?;
    let mut by_op: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let redis::Value::Array(entries) = log else {
        return Ok(by_op);
    };
    for e in entries {
        let redis::Value::Array(f) = e else { continue };
        let (Some(redis::Value::Int(us)), Some(redis::Value::Array(argv))) = (f.get(2), f.get(3))
        else {
            continue;
        };
        let cmd0 = argv.first().map(text).unwrap_or_default().to_lowercase();
        if !matches!(cmd0.as_str(), "evalsha" | "eval" | "fcall" | "fcall_ro") {
            continue;
        }
        let op = argv.get(4).map(text).unwrap_or_default();
        by_op.entry(op).or_default().push(*us as u64);
    }
    Ok(by_op)
}

/// Prints the table of µs per call by operation; answers how many calls it counted.
fn print_by_op(by_op: &mut BTreeMap<String, Vec<u64>>) -> u64 {
    // The median resists the preemptions of a busy machine (a call preempted by another
    // process counts its wait in SLOWLOG); the mean is what throughput pays.
    println!("| operation | calls | µs per call | median µs |");
    println!("|---|---|---|---|");
    let (mut calls, mut total) = (0, 0);
    let mut all = Vec::new();
    for (op, us) in by_op.iter_mut() {
        let n = us.len() as u64;
        let sum: u64 = us.iter().sum();
        calls += n;
        total += sum;
        all.extend_from_slice(us);
        println!(
            "| {op} | {n} | {:.1} | {} |",
            sum as f64 / n.max(1) as f64,
            median(us)
        );
    }
    println!(
        "| all | {calls} | {:.1} | {} |",
        total as f64 / calls.max(1) as f64,
        median(&mut all)
    );
    calls
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let pairs: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let clients: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(32);
    let kind = args.get(3).cloned().unwrap_or_else(|| "bench".into());
    // OPBENCH_URL: an existing (empty) server instead of a private one, e.g. one run under
    // `valgrind --tool=callgrind` to count instructions per call, which a busy machine does
    // not blur. OPBENCH_SLOWLOG=0 leaves SLOWLOG off: every command a script runs is logged
    // too, which adds to the script's time.
    let external = std::env::var("OPBENCH_URL").ok();
    let slowlog = std::env::var("OPBENCH_SLOWLOG").map_or(true, |v| v != "0");
    let server = match &external {
        Some(_) => None,
        None => Some(
            spendgate_testkit::RedisServer::start(Default::default())
                .map_err(|e| format!("redis-server: {e}"))?,
        ),
    };
    let url = match (&external, &server) {
        (Some(u), _) => u.clone(),
        (None, Some(s)) => s.url(),
        (None, None) => return Err("no server".into()),
    };
    let store = Arc::new(
        common::open_store(
            &url,
            "opbench",
            Duration::from_secs(5),
            common::policy(&kind),
        )
        .await?,
    );
    let client_redis = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client_redis
        .get_multiplexed_async_connection_with_config(
            &redis::AsyncConnectionConfig::new()
                .set_response_timeout(Some(Duration::from_secs(60))),
        )
        .await
        .map_err(|e| e.to_string())?;
    slowlog_on(&mut conn, slowlog).await?;
    let cpu0 = cpu_secs(&mut conn).await?;
    let started = std::time::Instant::now();
    let per = pairs / clients.max(1);
    let mut tasks = Vec::new();
    for c in 0..clients {
        tasks.push(tokio::spawn(client(store.clone(), c, per)));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = cpu_secs(&mut conn).await? - cpu0;
    let mut by_op = slowlog_by_op(&mut conn).await?;
    let stats = command(&["INFO", "commandstats"])
        .query_async::<String>(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    println!("{pairs} pairs, {clients} clients, policy {kind}");
    let calls = print_by_op(&mut by_op);
    // CPU time of the server's main thread (user + system, from getrusage): unlike SLOWLOG it
    // does not count time the server spent preempted; it includes reading and answering.
    if calls > 0 {
        println!(
            "server main-thread CPU: {:.1} µs per call (all operations, with network I/O)",
            cpu * 1e6 / calls as f64
        );
    }
    // Per pair, whatever the number of script calls (the store may put several commands in
    // one call): what a reservation with its commit costs the one Redis core.
    let done = (per * clients) as f64;
    println!(
        "wall {wall:.2} s: {:.0} pairs/s; server main-thread CPU {:.1} µs per pair, busy {:.0}%",
        done / wall,
        cpu * 1e6 / done,
        cpu * 100.0 / wall
    );
    for l in stats.lines().filter(|l| l.starts_with("cmdstat_")) {
        println!("    {l}");
    }
    Ok(())
}
