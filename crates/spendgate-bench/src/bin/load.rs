//! `spendgate-load`: an open-loop load driver for the decision API.
//!
//! Closed-loop tools (wrk, hey) wait for each answer before sending the next request, so a slow
//! answer delays the requests behind it and its cost disappears from the percentiles
//! (coordinated omission). Here requests are *scheduled* at a fixed rate and latency is measured
//! from the scheduled instant, so queueing shows up in p99.
//!
//! One invocation measures, against the same server in the same run:
//! 1. `/healthz` open-loop at `--rate` (the latency baseline), then reserve+commit pairs
//!    open-loop at `--rate`: p50/p99 of the reserve and of the pair. Requests are started by
//!    a pacing thread (see `spendgate_bench::pace`).
//! 2. `/healthz` closed-loop throughput (the baseline: what the HTTP stack alone does);
//! 3. reserve+commit pair closed-loop throughput. The closed loops come last: they saturate
//!    the server and the disk, and the writeback they leave would sit in the open loop's tail.
//!
//! Every loop is bounded in count and time.

#![warn(clippy::too_many_lines)]

use clap::Parser;
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use spendgate_bench::pace::paced;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests in flight at most in the open-loop phase; past it a request counts as dropped.
const IN_FLIGHT_MAX: usize = 10_000;

#[derive(Parser, Clone)]
struct Args {
    /// Base URL of a running `spendgate serve` (loopback only); several, comma-separated, to
    /// spread the load over replicas (request i goes to replica i mod n).
    #[arg(long, default_value = "http://127.0.0.1:8080", value_delimiter = ',')]
    base: Vec<String>,
    #[arg(long, env = "SPENDGATE_SERVICE_TOKEN")]
    service_token: String,
    /// Tool name priced in the server's config.
    #[arg(long, default_value = "bench_tool")]
    tool: String,
    /// Open-loop rate, pairs per second.
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of each phase.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Connections for the closed-loop phases; several, comma-separated, run each phase once
    /// per figure. A throughput is the best of them: a pair waits on an fsync, so it may take
    /// more connections than `/healthz` to keep the server busy (both are reported).
    #[arg(long, default_value = "32", value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Runs open at once to spread steps over.
    #[arg(long, default_value_t = 64)]
    runs: usize,
    /// Steps of one run before it is finished and a new run opened in its place, as real
    /// runs are bounded (`run.max_tool_calls`). Run admissions and finishes are not counted
    /// as pairs but are part of the load.
    #[arg(long, default_value_t = 16)]
    steps_per_run: u32,
    /// Skips the closed-loop phases (for A/B runs of the open loop alone).
    #[arg(long)]
    open_only: bool,
}

/// One open run and how many steps it has had.
struct Slot {
    session: String,
    client_ip: String,
    run: String,
    steps: u32,
    opened: u64,
}

struct Ctx {
    http: reqwest::Client,
    bases: Vec<String>,
    args: Args,
    slots: Vec<tokio::sync::Mutex<Slot>>,
    tag: u32,
    errors: AtomicU64,
}

async fn open_run(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    session: &str,
    ip: &str,
    conversation: &str,
) -> anyhow::Result<String> {
    let r = http
        .post(format!("{base}/v1/runs"))
        .bearer_auth(token)
        .json(&json!({"session": session, "client_ip": ip, "conversation": conversation, "input_bytes": 10}))
        .send()
        .await?;
    let v: Value = r.json().await?;
    Ok(v["run_id"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("run refused: {v}"))?
        .to_string())
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds are valid")
}

async fn setup(args: &Args) -> anyhow::Result<Ctx> {
    for b in &args.base {
        anyhow::ensure!(
            b.starts_with("http://127.")
                || b.starts_with("http://localhost")
                || b.starts_with("http://[::1]"),
            "only loopback targets are allowed"
        );
    }
    // (a worker has a run of its own: two sharing one would wait on each other)
    let most = args.concurrency.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(
        args.runs >= most && most > 0,
        "--runs ({}) must be at least the largest --concurrency ({most})",
        args.runs
    );
    let bases = args.base.clone();
    spendgate_bench::install_crypto();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .timeout(Duration::from_secs(10))
        .build()?;
    let mut slots = Vec::new();
    // Conversations unique to this invocation (another run may hold the same store).
    let tag: u32 = rand::random();
    for i in 0..args.runs {
        let base = &bases[i % bases.len()];
        let s: Value = http
            .post(format!("{base}/v1/sessions"))
            .json(&json!({}))
            .send()
            .await?
            .json()
            .await?;
        let session = s["session"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no session: {s}"))?
            .to_string();
        let client_ip = format!("10.{}.{}.1", i / 256, i % 256);
        let run = open_run(
            &http,
            base,
            &args.service_token,
            &session,
            &client_ip,
            &format!("bench-{tag:08x}-{i}-0"),
        )
        .await?;
        slots.push(tokio::sync::Mutex::new(Slot {
            session,
            client_ip,
            run,
            steps: 0,
            opened: 0,
        }));
    }
    Ok(Ctx {
        http,
        bases,
        args: args.clone(),
        slots,
        tag,
        errors: AtomicU64::new(0),
    })
}

/// One reserve + commit pair; returns the reserve latency.
async fn pair(ctx: &Ctx, i: usize) -> Option<Duration> {
    let index = i % ctx.slots.len();
    let base = &ctx.bases[(i / ctx.slots.len()) % ctx.bases.len()];
    let mut slot = ctx.slots[index].lock().await;
    if slot.steps >= ctx.args.steps_per_run {
        let _ = ctx
            .http
            .post(format!("{base}/v1/runs/{}/finish", slot.run))
            .bearer_auth(&ctx.args.service_token)
            .send()
            .await;
        slot.opened += 1;
        let conversation = format!("bench-{:08x}-{index}-{}", ctx.tag, slot.opened);
        match open_run(
            &ctx.http,
            base,
            &ctx.args.service_token,
            &slot.session,
            &slot.client_ip,
            &conversation,
        )
        .await
        {
            Ok(run) => {
                slot.run = run;
                slot.steps = 0;
            }
            Err(e) => {
                if ctx.errors.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!("first refusal: {e}");
                }
                return None;
            }
        }
    }
    slot.steps += 1;
    let run = slot.run.clone();
    let t = Instant::now();
    let r = ctx
        .http
        .post(format!("{base}/v1/runs/{run}/steps"))
        .bearer_auth(&ctx.args.service_token)
        .json(&json!({"kind": "tool", "tool": ctx.args.tool}))
        .send()
        .await
        .ok()?;
    if r.status().as_u16() != 201 {
        if ctx.errors.fetch_add(1, Ordering::Relaxed) == 0 {
            let status = r.status();
            let body = r.text().await.unwrap_or_default();
            eprintln!("first refusal: {status} {body}");
        }
        return None;
    }
    let v: Value = r.json().await.ok()?;
    let reserve = t.elapsed();
    let step = v["step_id"].as_str()?;
    let c = ctx
        .http
        .post(format!("{base}/v1/steps/{step}/commit"))
        .bearer_auth(&ctx.args.service_token)
        .json(&json!({"units": 0}))
        .send()
        .await
        .ok()?;
    if c.status().as_u16() != 200 {
        ctx.errors.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    Some(reserve)
}

async fn healthz(ctx: &Ctx) -> bool {
    match ctx
        .http
        .get(format!("{}/healthz", ctx.bases[0]))
        .send()
        .await
    {
        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
        Err(_) => false,
    }
}

/// Closed loop: `concurrency` workers as fast as they can for `seconds`; returns ops/s.
async fn closed_loop(ctx: Arc<Ctx>, which: &'static str, concurrency: usize) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(ctx.args.seconds);
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let (ctx, done) = (ctx.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while Instant::now() < until {
                let ok = if which == "healthz" {
                    healthz(&ctx).await
                } else {
                    pair(&ctx, i).await.is_some()
                };
                if ok {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                i += concurrency;
            }
        }));
    }
    let start = Instant::now();
    for t in tasks {
        let _ = t.await;
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64().max(ctx.args.seconds as f64)
}

/// The open loop's baseline: `/healthz` at the rate of the pairs, each call on its own task
/// started by the pacing thread. Its latency.
async fn open_healthz(ctx: &Arc<Ctx>, total: u64, interval: Duration) -> Histogram<u64> {
    let handle = tokio::runtime::Handle::current();
    let healthz_h = Arc::new(std::sync::Mutex::new(hist()));
    {
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let (ctx, hh, handle) = (ctx.clone(), healthz_h.clone(), handle.clone());
        let pacer = paced(total, interval, (), move |_, _, _| {
            let (ctx, hh, done) = (ctx.clone(), hh.clone(), done_tx.clone());
            handle.spawn(async move {
                let sent = Instant::now();
                if healthz(&ctx).await {
                    let took = sent.elapsed();
                    if let Ok(mut h) = hh.lock() {
                        let _ = h.record(took.as_micros().max(1) as u64);
                    }
                }
                drop(done);
            });
        });
        let _ = tokio::task::spawn_blocking(move || pacer.join()).await;
        // Every call holds a sender; the channel closes when the last one ends.
        while done_rx.recv().await.is_some() {}
    }
    let h = healthz_h.lock().map(|h| h.clone());
    h.unwrap_or_else(|_| hist())
}

/// The open loop of reserve+commit pairs: the reserve latency, the pair latency from each
/// pair's scheduled instant, the pairs dropped (past `IN_FLIGHT_MAX`) and when it started.
async fn open_pairs(
    ctx: &Arc<Ctx>,
    total: u64,
    interval: Duration,
) -> (Histogram<u64>, Histogram<u64>, u64, Instant) {
    let handle = tokio::runtime::Handle::current();
    let reserve_h = Arc::new(std::sync::Mutex::new(hist()));
    let pair_h = Arc::new(std::sync::Mutex::new(hist()));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT_MAX));
    let start = Instant::now();
    let dropped = {
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let (ctx, rh, ph) = (ctx.clone(), reserve_h.clone(), pair_h.clone());
        let pacer = paced(total, interval, 0u64, move |dropped, i, scheduled| {
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                *dropped += 1;
                return;
            };
            let (ctx, rh, ph, done) = (ctx.clone(), rh.clone(), ph.clone(), done_tx.clone());
            handle.spawn(async move {
                let _permit = permit;
                if let Some(reserve) = pair(&ctx, i as usize).await {
                    // From the instant the request was due, so any queueing counts.
                    let whole = scheduled.elapsed();
                    if let Ok(mut h) = rh.lock() {
                        let _ = h.record(reserve.as_micros().max(1) as u64);
                    }
                    if let Ok(mut h) = ph.lock() {
                        let _ = h.record(whole.as_micros().max(1) as u64);
                    }
                }
                drop(done);
            });
        });
        let dropped = tokio::task::spawn_blocking(move || pacer.join().unwrap_or(u64::MAX))
            .await
            .unwrap_or(u64::MAX);
        while done_rx.recv().await.is_some() {}
        dropped
    };
    let lock = |h: &std::sync::Mutex<Histogram<u64>>| {
        h.lock().map(|h| h.clone()).unwrap_or_else(|_| hist())
    };
    (lock(&reserve_h), lock(&pair_h), dropped, start)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let ctx = Arc::new(setup(&args).await?);
    // Warm up connections.
    for i in 0..ctx.slots.len() {
        let _ = pair(&ctx, i).await;
    }

    // Open loop.
    let total = args.rate * args.seconds;
    let interval = Duration::from_nanos(1_000_000_000 / args.rate.max(1));
    // Baseline: `/healthz` at the same rate. Both open loops are started by a pacing thread
    // (see `spendgate_bench::pace`), each call on its own task.
    let healthz_h = open_healthz(&ctx, total, interval).await;
    let (reserve_h, pair_h, dropped, start) = open_pairs(&ctx, total, interval).await;
    let elapsed = start.elapsed().as_secs_f64();
    // (the closed loops below count theirs apart: the open loop's row is its own)
    let open_errors = ctx.errors.swap(0, Ordering::Relaxed);
    // The closed loops come last: they saturate the server and the disk, and what they leave
    // to write back would otherwise sit in the open loop's tail.
    let mut closed = Vec::new();
    if !args.open_only {
        for &c in &args.concurrency {
            closed.push((
                c,
                closed_loop(ctx.clone(), "healthz", c).await,
                closed_loop(ctx.clone(), "pairs", c).await,
            ));
        }
    }
    let healthz_rps = closed.iter().map(|x| x.1).fold(0.0, f64::max);
    let pairs_rps = closed.iter().map(|x| x.2).fold(0.0, f64::max);
    let (rh, ph, hh) = (reserve_h, pair_h, healthz_h);
    let ms = |us: u64| us as f64 / 1000.0;
    println!("| measure | value |");
    println!("|---|---|");
    for (c, h, p) in &closed {
        println!("| `/healthz` closed-loop, {c} connections | {h:.0} req/s |");
        println!(
            "| reserve+commit pairs closed-loop, {c} connections | {p:.0} pairs/s ({:.0} req/s) |",
            p * 2.0
        );
    }
    println!(
        "| pair requests vs `/healthz` requests (best of each) | {:.0}% |",
        100.0 * pairs_rps * 2.0 / healthz_rps.max(1.0)
    );
    if !closed.is_empty() {
        println!(
            "| closed loops: refused or failed calls | {} |",
            ctx.errors.load(Ordering::Relaxed)
        );
    }
    println!(
        "| open loop: offered | {} pairs/s for {}s ({} pairs, {:.1}s) |",
        args.rate, args.seconds, total, elapsed
    );
    println!(
        "| open loop: completed / dropped / errors | {} / {} / {} |",
        ph.len(),
        dropped,
        open_errors
    );
    println!(
        "| open loop: `/healthz` latency at the same rate (baseline) p50 / p99 / max | {:.3} / {:.3} / {:.3} ms |",
        ms(hh.value_at_quantile(0.5)),
        ms(hh.value_at_quantile(0.99)),
        ms(hh.max())
    );
    println!(
        "| open loop: reserve latency p50 / p99 / max | {:.3} / {:.3} / {:.3} ms |",
        ms(rh.value_at_quantile(0.5)),
        ms(rh.value_at_quantile(0.99)),
        ms(rh.max())
    );
    println!(
        "| open loop: pair latency from schedule p50 / p99 / max | {:.3} / {:.3} / {:.3} ms |",
        ms(ph.value_at_quantile(0.5)),
        ms(ph.value_at_quantile(0.99)),
        ms(ph.max())
    );
    Ok(())
}
