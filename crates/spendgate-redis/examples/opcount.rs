//! Server instructions per ledger operation: drives a `redis-server` that runs under
//! `valgrind --tool=callgrind` one phase per operation, each phase between a
//! `callgrind_control -z` (zero) and a `callgrind_control -d PHASE` (dump), so that each dump
//! holds the instructions of one kind of call only (the total of a dump / the calls of its
//! phase = instructions per call; the idle server adds a few thousand per second).
//!
//! `OPCOUNT_URL=redis://127.0.0.1:PORT cargo run --release -p spendgate-redis --example opcount
//!  -- [RUNS] [POLICY] [PREFIX] [STEPS]`
//!
//! Phases: admit_run (RUNS runs), reserve_step (STEPS tool steps per run, default 4), resolve
//! (their commits), reserve_model and resolve_model (one model step per run), heartbeat, finish, then
//! the proxy's batches: admit_run + reserve_step, and resolve + finish. POLICY as in opbench
//! (`bench`: one global day budget; `full`: budgets on every scope). Sequential, one client.
//! Run ids and step ids have the length of the server's (`api::new_id`: 48 bytes), so that
//! records weigh what they weigh in service. Run it against a fresh server (or another PREFIX)
//! each time. `scripts/opcount.sh` runs it under callgrind and prints the table.

mod common;

use spendgate_core::{
    Command, IpScope, Micros, ModelPrice, Policy, Reply, ReservationId, Resolution, RunId,
    RunRequest, Settlement, StepKind, StepRequest, TokenUsage,
};
use spendgate_store::Store;
use std::time::Duration;

const TOOL_STEPS: usize = 4;

/// An id of the server's length (`api::new_id`: a 4-byte prefix and 44 hex digits), unique
/// per (`family`, `n`).
fn id(prefix: &str, family: u64, n: usize) -> String {
    format!("{prefix}_{family:012x}{n:032x}")
}

/// Step `k` of a run: the run id's last 40 digits (its first 4 are zeros) with the step's own
/// prefix and `k` after them.
fn step_id(run: &RunId, k: &str) -> ReservationId {
    let base = run.0.get(8..).unwrap_or(&run.0);
    ReservationId(format!("stp_{base}{k:->4}"))
}

/// The shared policy, with room for model rounds and leases long enough for a slow
/// (instrumented) server.
fn policy(kind: &str) -> Policy {
    let mut p = common::policy(kind);
    p.run.max_model_rounds = 64;
    p.lease_ttl_ms = 600_000;
    p
}

fn run_request(family: u64, n: usize) -> RunRequest {
    RunRequest {
        run_id: RunId(id("run", family, n)),
        session: format!("session-{}", n % 8),
        ips: vec![IpScope {
            prefix: format!("10.0.{}.1/32", n % 8),
            factor: 1,
        }],
        conversation: format!("conv-{n}"),
        input_bytes: 10,
    }
}

fn model_step(run: &RunId, step: ReservationId) -> StepRequest {
    StepRequest {
        run_id: run.clone(),
        step_id: step,
        kind: StepKind::Model {
            model: "bench-model".into(),
            price: ModelPrice {
                input_per_million: Micros(2_500_000),
                cached_input_per_million: Micros(1_250_000),
                output_per_million: Micros(10_000_000),
            },
            prompt_tokens: 1200,
            max_output_tokens: Some(256),
            retry: false,
        },
    }
}

fn usage() -> Settlement {
    Settlement::Tokens(TokenUsage {
        prompt_tokens: 1200,
        cached_tokens: 200,
        completion_tokens: 100,
    })
}

fn callgrind(args: &[&str]) -> Result<(), String> {
    let st = std::process::Command::new("callgrind_control")
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("callgrind_control: {e}"))?;
    if !st.success() {
        return Err(format!("callgrind_control {args:?} failed"));
    }
    Ok(())
}

struct Phase<'a> {
    tag: &'a str,
    pid: Option<String>,
}

impl Phase<'_> {
    fn start(&self) -> Result<(), String> {
        match &self.pid {
            Some(pid) => callgrind(&["-z", pid]),
            None => Ok(()),
        }
    }
    fn end(&self, name: &str, calls: usize) -> Result<(), String> {
        println!("phase {}-{name} {calls}", self.tag);
        match &self.pid {
            Some(pid) => callgrind(&["-d", &format!("{}-{name}", self.tag), pid]),
            None => Ok(()),
        }
    }
}

fn check(r: Result<Reply, spendgate_store::StoreError>, what: &str) -> Result<(), String> {
    match r {
        Ok(Reply::Run(a)) if a.value.is_err() => Err(format!("{what}: {:?}", a.value)),
        Ok(Reply::Step(a)) if a.value.is_err() => Err(format!("{what}: {:?}", a.value)),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

/// The phases of single calls: admit, tool steps reserved and committed, a model step
/// reserved and committed, heartbeat, finish.
async fn one_by_one(
    s: &dyn Store,
    ph: &Phase<'_>,
    runs: usize,
    steps: usize,
) -> Result<(), String> {
    let reqs: Vec<RunRequest> = (0..runs).map(|n| run_request(1, n)).collect();
    let ids: Vec<RunId> = reqs.iter().map(|r| r.run_id.clone()).collect();
    let one = |cmd: Command| s.execute(cmd);

    ph.start()?;
    for r in &reqs {
        check(
            one(Command::AdmitRun {
                req: r.clone(),
                idem: None,
            })
            .await,
            "admit",
        )?;
    }
    ph.end("admit_run", runs)?;

    ph.start()?;
    for k in 0..steps {
        for id in &ids {
            let req = common::tool_step(id, step_id(id, &k.to_string()));
            check(
                one(Command::ReserveStep { req, idem: None }).await,
                "reserve",
            )?;
        }
    }
    ph.end("reserve_step", runs * steps)?;

    ph.start()?;
    for k in 0..steps {
        for id in &ids {
            let step = step_id(id, &k.to_string());
            let how = Resolution::Commit(Settlement::Units(0));
            check(one(Command::Resolve { step, how }).await, "resolve")?;
        }
    }
    ph.end("resolve", runs * steps)?;

    ph.start()?;
    for id in &ids {
        let req = model_step(id, step_id(id, "m"));
        check(one(Command::ReserveStep { req, idem: None }).await, "model")?;
    }
    ph.end("reserve_model", runs)?;

    ph.start()?;
    for id in &ids {
        let step = step_id(id, "m");
        let how = Resolution::Commit(usage());
        check(one(Command::Resolve { step, how }).await, "resolve model")?;
    }
    ph.end("resolve_model", runs)?;

    ph.start()?;
    for id in &ids {
        check(
            one(Command::Heartbeat { run: id.clone() }).await,
            "heartbeat",
        )?;
    }
    ph.end("heartbeat", runs)?;

    // finish with one step still held (charged as unknown), like a run cut short
    for id in &ids {
        let req = common::tool_step(id, step_id(id, "h"));
        check(
            one(Command::ReserveStep { req, idem: None }).await,
            "reserve",
        )?;
    }
    ph.start()?;
    for id in &ids {
        check(one(Command::Finish { run: id.clone() }).await, "finish")?;
    }
    ph.end("finish", runs)?;

    Ok(())
}

/// The phases of the proxy's batches.
async fn batches(s: &dyn Store, ph: &Phase<'_>, runs: usize) -> Result<(), String> {
    // admission + model step in one batch, then commit + finish in one batch
    let reqs2: Vec<RunRequest> = (0..runs).map(|n| run_request(2, n)).collect();
    ph.start()?;
    for r in &reqs2 {
        let cmds = vec![
            Command::AdmitRun {
                req: r.clone(),
                idem: None,
            },
            Command::ReserveStep {
                req: model_step(&r.run_id, step_id(&r.run_id, "0")),
                idem: None,
            },
        ];
        for a in s.execute_many(cmds).await {
            check(a, "batch admit")?;
        }
    }
    ph.end("batch_admit_step", runs)?;

    ph.start()?;
    for r in &reqs2 {
        let cmds = vec![
            Command::Resolve {
                step: step_id(&r.run_id, "0"),
                how: Resolution::Commit(usage()),
            },
            Command::Finish {
                run: r.run_id.clone(),
            },
        ];
        for a in s.execute_many(cmds).await {
            check(a, "batch finish")?;
        }
    }
    ph.end("batch_commit_finish", runs)?;
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let kind = args.get(2).cloned().unwrap_or_else(|| "bench".into());
    let tag = args.get(3).cloned().unwrap_or_else(|| "opcount".into());
    let steps: usize = args
        .get(4)
        .and_then(|a| a.parse().ok())
        .unwrap_or(TOOL_STEPS);
    let url = std::env::var("OPCOUNT_URL").map_err(|_| "set OPCOUNT_URL")?;
    // OPCOUNT_PID: the valgrind'ed server's pid (callgrind_control target); unset = no dumps.
    let ph = Phase {
        tag: &tag,
        pid: std::env::var("OPCOUNT_PID").ok(),
    };
    let store = common::open_store(&url, &tag, Duration::from_secs(60), policy(&kind)).await?;
    let s: &dyn Store = &store;
    // Warm up: the library loaded, the policy parsed, the epoch written.
    s.ready().await.map_err(|e| e.to_string())?;
    one_by_one(s, &ph, runs, steps).await?;
    batches(s, &ph, runs).await?;
    Ok(())
}
