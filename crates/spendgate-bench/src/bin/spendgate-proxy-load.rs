//! `spendgate-proxy-load`: the latency the proxy adds, measured open-loop.
//!
//! The same chat completion is sent at a fixed rate both straight to the mock upstream and
//! through `spendgate` (which admits, reserves, forwards and commits it), interleaved in one
//! run so that both paths see the same machine. Latency is measured from each request's
//! *scheduled* instant (no coordinated omission): to the end of the answer when not streaming,
//! to the first body chunk (time to first token) when streaming. The proxy's added latency is
//! the difference of the two paths' percentiles.
//!
//! Requests are started by a pacing thread (`std::thread::sleep` to each scheduled instant,
//! tens of microseconds late at most) rather than by tokio's timer, whose 1 ms granularity
//! biased one path against the other when their slots fell at different offsets of a tick.
//!
//! A third phase streams paced answers (`x-mock-tokens-per-second`) with every chunk stamped
//! by the mock with its send time (`x-mock-stamp`): each chunk's transit from the mock to the
//! driver, through spendgate or not, gives what the proxy adds between chunks.
//!
//! With `--sequential` the two paths run one after the other (direct, then proxy) at the full
//! rate each, instead of interleaved at the rate each: the machine then carries one path's
//! load at a time, which is how a high rate is measured on a small machine.
//!
//! With `--clients N` it runs a closed loop instead (the side-by-side load of
//! `scripts/side-by-side.sh`): N clients, each sending one proxied, non-streaming call after
//! the other for `--seconds`, and it counts what came back: calls, answers by status and
//! error code, and when each 503 came (a burst at one instant is one slow store call). Its
//! last line is `calls=N ok=N refused=N status_503=N errors=N`.
//!
//! With `--clients N --compare-direct` the same closed loop runs on each path, straight to the
//! mock and through spendgate, alternated `--rounds` times after `--warmup` s of unmeasured load
//! on each (the proxy's throughput and added latency at N concurrent calls, for
//! `scripts/bench.sh`). Its last two lines are `closed path=direct|proxy clients=N calls=N ok=N errors=N rate=F p50_ms=F p99_ms=F`.
//!
//! Every loop is bounded in count and time; only loopback targets are accepted.

#![warn(clippy::too_many_lines)]

use clap::Parser;
use futures::StreamExt;
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

/// Requests in flight at most; past it a request counts as dropped.
const IN_FLIGHT_MAX: usize = 10_000;
/// Longest a measured phase may be asked to run.
const SECONDS_MAX: u64 = 600;
/// Chunks recorded per stream at most (the paced phase).
const CHUNKS_PER_STREAM_MAX: usize = 4096;
/// Clients of the closed loop at most.
const CLIENTS_MAX: u64 = 1024;
/// Calls one closed-loop client sends at most (besides `--seconds`).
const CALLS_PER_CLIENT_MAX: u64 = 1_000_000;
/// Rounds of `--compare-direct` at most.
const ROUNDS_MAX: u64 = 100;
/// 503 instants listed at most.
const INSTANTS_SHOWN_MAX: usize = 20;

#[derive(Parser, Clone)]
struct Args {
    /// Base URL of a running `spendgate serve` whose model routes to the mock.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    proxy: String,
    /// Base URL of the mock upstream itself.
    #[arg(long, default_value = "http://127.0.0.1:8090")]
    direct: String,
    #[arg(long, env = "SPENDGATE_SERVICE_TOKEN")]
    service_token: String,
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Requests per second on each path.
    #[arg(long, default_value_t = 200)]
    rate: u64,
    /// Seconds of each measured phase (non-streaming, streaming).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Seconds of unmeasured warm-up before each phase.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Conversations to spread proxied calls over.
    #[arg(long, default_value_t = 64)]
    conversations: u64,
    /// Run the paths one after the other instead of interleaved.
    #[arg(long)]
    sequential: bool,
    /// Token rate of the paced streaming phase (0 skips the phase).
    #[arg(long, default_value_t = 2000)]
    paced_tokens_per_second: u64,
    /// Completion tokens of each paced stream.
    #[arg(long, default_value_t = 64)]
    paced_tokens: u64,
    /// Closed loop: this many clients send proxied calls one after the other for
    /// `--seconds` (no warm-up, no direct path) and the answers are counted by status and
    /// error code. 0: the open-loop latency benchmark.
    #[arg(long, default_value_t = 0)]
    clients: u64,
    /// With `--clients`: runs the closed loop straight to the mock too, then through
    /// spendgate, each after `--warmup` s of unmeasured load, and compares them.
    #[arg(long)]
    compare_direct: bool,
    /// With `--compare-direct`: how many times the two paths alternate, `--seconds` split
    /// between the rounds.
    #[arg(long, default_value_t = 1)]
    rounds: u64,
}

/// What a phase measures.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Measure {
    /// Non-streaming: scheduled instant to the whole answer.
    Whole,
    /// Streaming: scheduled instant to the first body chunk.
    FirstToken,
    /// Paced, stamped streaming: each later chunk's transit from the mock to the driver.
    ChunkTransit,
}

impl Measure {
    fn name(self) -> &'static str {
        match self {
            Measure::Whole => "non-streaming, whole answer",
            Measure::FirstToken => "streaming, time to first token",
            Measure::ChunkTransit => "streaming, each chunk's transit after the first",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Direct,
    Proxy,
}

struct Ctx {
    http: reqwest::Client,
    args: Args,
    session: String,
    errors: [AtomicU64; 2],
    first_error: Mutex<Option<String>>,
}

fn hist() -> Histogram<u64> {
    // Nanoseconds, 1 ns to 60 s, 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds are valid")
}

fn loopback(url: &str) -> bool {
    url.starts_with("http://127.")
        || url.starts_with("http://localhost")
        || url.starts_with("http://[::1]")
}

impl Ctx {
    fn body(&self, measure: Measure) -> Value {
        let stream = measure != Measure::Whole;
        let mut b = json!({
            "model": self.args.model,
            "max_tokens": 16,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello! How are you today?"}
            ],
        });
        if measure == Measure::ChunkTransit {
            b["max_tokens"] = json!(self.args.paced_tokens);
        }
        if stream {
            b["stream"] = json!(true);
            // What the proxy asks the upstream for, so both paths do the same work.
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    }

    /// A chat completion on `path` (through spendgate: in `conversation`).
    fn request(
        &self,
        path: Path,
        measure: Measure,
        conversation: String,
    ) -> reqwest::RequestBuilder {
        let body = self.body(measure);
        match path {
            Path::Direct => self
                .http
                .post(format!("{}/v1/chat/completions", self.args.direct))
                .json(&body),
            Path::Proxy => self
                .http
                .post(format!("{}/v1/chat/completions", self.args.proxy))
                .bearer_auth(&self.args.service_token)
                .header("spendgate-session", &self.session)
                .header("spendgate-client-ip", "10.0.0.1")
                .header("spendgate-conversation", conversation)
                .json(&body),
        }
    }

    fn error(&self, path: Path, what: String) {
        self.errors[path as usize].fetch_add(1, Ordering::Relaxed);
        if let Ok(mut e) = self.first_error.lock() {
            e.get_or_insert(what);
        }
    }

    /// One call; what `measure` says: one latency from `scheduled` (whole answer or first
    /// chunk), or every later chunk's transit.
    async fn call(
        &self,
        path: Path,
        measure: Measure,
        k: u64,
        scheduled: Instant,
    ) -> Vec<Duration> {
        let conversation = format!("bench-{}", k % self.args.conversations.max(1));
        let mut req = self.request(path, measure, conversation);
        if measure == Measure::ChunkTransit {
            req = req
                .header("x-mock-stamp", "1")
                .header(
                    "x-mock-tokens-per-second",
                    self.args.paced_tokens_per_second,
                )
                .header("x-mock-completion-tokens", self.args.paced_tokens);
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                self.error(path, format!("send: {e}"));
                return Vec::new();
            }
        };
        if resp.status().as_u16() != 200 {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            self.error(path, format!("{status}: {text}"));
            return Vec::new();
        }
        if measure == Measure::Whole {
            return match resp.bytes().await {
                Ok(_) => vec![scheduled.elapsed()],
                Err(e) => {
                    self.error(path, format!("body: {e}"));
                    Vec::new()
                }
            };
        }
        let mut body = resp.bytes_stream();
        let mut out = Vec::new();
        let mut line = Vec::new();
        let mut events = 0usize;
        while let Some(chunk) = body.next().await {
            let c = match chunk {
                Ok(c) => c,
                Err(e) => {
                    self.error(path, format!("stream: {e}"));
                    return Vec::new();
                }
            };
            if c.is_empty() {
                continue;
            }
            if measure == Measure::FirstToken {
                if out.is_empty() {
                    out.push(scheduled.elapsed());
                }
                continue;
            }
            let now = unix_ns();
            for &b in c.iter() {
                if b != b'\n' {
                    if line.len() < 64 * 1024 {
                        line.push(b);
                    }
                    continue;
                }
                if let Some(sent) = stamp_of(&line) {
                    events += 1;
                    // The first chunk is time to first token, measured by its own phase.
                    if events > 1 && out.len() < CHUNKS_PER_STREAM_MAX {
                        out.push(Duration::from_nanos(now.saturating_sub(sent)));
                    }
                }
                line.clear();
            }
        }
        if measure == Measure::ChunkTransit && events == 0 {
            self.error(path, "a paced stream without stamped chunks".into());
        }
        out
    }
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The mock's send stamp of one SSE line, if it carries one.
fn stamp_of(line: &[u8]) -> Option<u64> {
    let data = line.strip_prefix(b"data: ")?;
    let v: Value = serde_json::from_slice(data).ok()?;
    v.get("x_mock_sent_unix_ns")?.as_u64()
}

struct Phase {
    hists: [Histogram<u64>; 2],
    errors: [u64; 2],
    dropped: u64,
}

/// Open loop at `rate` per path for `seconds`: the two paths interleaved, or only `only`.
///
/// A pacing thread sleeps to each scheduled instant and spawns the call on the runtime.
async fn phase(ctx: &Arc<Ctx>, measure: Measure, seconds: u64, only: Option<Path>) -> Phase {
    let rate = ctx.args.rate.max(1);
    let per_slot = if only.is_some() { 1 } else { 2 };
    let total = rate * seconds.min(SECONDS_MAX) * per_slot;
    let interval = Duration::from_nanos(1_000_000_000 / (rate * per_slot));
    let hists = Arc::new(Mutex::new([hist(), hist()]));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT_MAX));
    for e in &ctx.errors {
        e.store(0, Ordering::Relaxed);
    }
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let handle = tokio::runtime::Handle::current();
    let pacer = {
        let (ctx, hists) = (ctx.clone(), hists.clone());
        spendgate_bench::pace::paced(total, interval, 0u64, move |dropped, k, at| {
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                *dropped += 1;
                return;
            };
            let path = only.unwrap_or(if k % 2 == 0 {
                Path::Direct
            } else {
                Path::Proxy
            });
            let scheduled = Instant::from_std(at);
            let (ctx, hists, done) = (ctx.clone(), hists.clone(), done_tx.clone());
            handle.spawn(async move {
                let _permit = permit;
                let ds = ctx.call(path, measure, k / per_slot, scheduled).await;
                if let Ok(mut h) = hists.lock() {
                    for d in ds {
                        let _ = h[path as usize].record(d.as_nanos().max(1) as u64);
                    }
                }
                drop(done);
            });
        })
    };
    let dropped = tokio::task::spawn_blocking(move || pacer.join().unwrap_or(u64::MAX))
        .await
        .unwrap_or(u64::MAX);
    // Every call holds a sender; the channel closes when the last one ends.
    while done_rx.recv().await.is_some() {}
    let errors = [
        ctx.errors[0].load(Ordering::Relaxed),
        ctx.errors[1].load(Ordering::Relaxed),
    ];
    let hists = hists
        .lock()
        .map(|h| h.clone())
        .unwrap_or_else(|_| [hist(), hist()]);
    Phase {
        hists,
        errors,
        dropped,
    }
}

/// One measured phase of each path (interleaved, or one after the other), after a warm-up.
async fn measured(ctx: &Arc<Ctx>, measure: Measure) -> Phase {
    let args = &ctx.args;
    if !args.sequential {
        let _ = phase(ctx, measure, args.warmup, None).await;
        return phase(ctx, measure, args.seconds, None).await;
    }
    let mut out = Phase {
        hists: [hist(), hist()],
        errors: [0, 0],
        dropped: 0,
    };
    for path in [Path::Direct, Path::Proxy] {
        let _ = phase(ctx, measure, args.warmup, Some(path)).await;
        let p = phase(ctx, measure, args.seconds, Some(path)).await;
        let i = path as usize;
        out.hists[i] = p.hists[i].clone();
        out.errors[i] = p.errors[i];
        out.dropped += p.dropped;
    }
    out
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        loopback(&args.proxy) && loopback(&args.direct),
        "only loopback targets are allowed"
    );
    anyhow::ensure!(
        args.rate > 0 && args.rate <= 100_000,
        "--rate must be 1..=100000"
    );
    spendgate_bench::install_crypto();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .timeout(Duration::from_secs(10))
        .build()?;
    let s: Value = http
        .post(format!("{}/v1/sessions", args.proxy))
        .json(&json!({}))
        .send()
        .await?
        .json()
        .await?;
    let session = s["session"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no session: {s}"))?
        .to_string();
    let ctx = Arc::new(Ctx {
        http,
        args: args.clone(),
        session,
        errors: [AtomicU64::new(0), AtomicU64::new(0)],
        first_error: Mutex::new(None),
    });
    if args.clients > 0 {
        anyhow::ensure!(
            args.clients <= CLIENTS_MAX
                && args.seconds <= SECONDS_MAX
                && args.warmup <= SECONDS_MAX
                && (1..=ROUNDS_MAX).contains(&args.rounds),
            "--clients must be 1..={CLIENTS_MAX}, --seconds and --warmup at most {SECONDS_MAX}, \
             --rounds 1..={ROUNDS_MAX}"
        );
        if args.compare_direct {
            compare_closed(&ctx).await;
        } else {
            let (t, h, _) = closed_loop(&ctx, Path::Proxy, args.seconds).await;
            print_closed_loop(&ctx, &t, &h);
        }
        return Ok(());
    }

    let mut measures = vec![Measure::Whole, Measure::FirstToken];
    if args.paced_tokens_per_second > 0 {
        measures.push(Measure::ChunkTransit);
    }
    let mut results = Vec::new();
    for measure in measures {
        results.push((measure, measured(&ctx, measure).await));
    }

    print_open_loop(&ctx, &results);
    Ok(())
}

/// The open loop's tables: each path's latency, and what spendgate adds.
fn print_open_loop(ctx: &Ctx, results: &[(Measure, Phase)]) {
    let args = &ctx.args;
    println!(
        "Open loop, {} requests/s on each path ({}), {} s per phase after {} s warm-up; \
         latency from each request's scheduled instant; paced streams: {} tokens at {} tokens/s.",
        args.rate,
        if args.sequential {
            "one path after the other"
        } else {
            "interleaved"
        },
        args.seconds,
        args.warmup,
        args.paced_tokens,
        args.paced_tokens_per_second,
    );
    println!();
    println!("| path | measure | samples | errors | dropped | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|---|---|");
    for (measure, p) in results {
        let measure = measure.name();
        for (name, path) in [
            ("mock directly", Path::Direct),
            ("through spendgate", Path::Proxy),
        ] {
            let h = &p.hists[path as usize];
            println!(
                "| {name} | {measure} | {} | {} | {} | {:.3} | {:.3} | {:.3} |",
                h.len(),
                p.errors[path as usize],
                p.dropped,
                ms(h.value_at_quantile(0.5)),
                ms(h.value_at_quantile(0.99)),
                ms(h.max()),
            );
        }
    }
    println!();
    println!("| added by spendgate (admission on the sqlite store + forward + commit) | p50 ms | p99 ms |");
    println!("|---|---|---|");
    for (measure, p) in results {
        let (d, x) = (&p.hists[0], &p.hists[1]);
        let added = |q: f64| ms(x.value_at_quantile(q)) - ms(d.value_at_quantile(q));
        println!(
            "| {} | {:.3} | {:.3} |",
            measure.name(),
            added(0.5),
            added(0.99)
        );
    }
    if let Ok(Some(e)) = ctx.first_error.lock().map(|e| e.clone()) {
        println!();
        println!("first error: {e}");
    }
}

/// What the closed loop saw.
#[derive(Default)]
struct Tally {
    calls: u64,
    ok: u64,
    /// `(status, error code)` of each answer other than 200, counted.
    refused: std::collections::BTreeMap<(u16, String), u64>,
    /// Calls that got no HTTP answer (connection error, driver timeout).
    errors: u64,
    /// When each 503 came, in ms since the start.
    at_503: Vec<u64>,
}

/// One closed-loop client on `path`: calls one after the other until `end`, each counted in
/// `tally`.
async fn closed_client(
    ctx: &Ctx,
    (path, c): (Path, u64),
    (start, end): (Instant, Instant),
    tally: &Mutex<Tally>,
    latency: &Mutex<Histogram<u64>>,
) {
    for k in 0..CALLS_PER_CLIENT_MAX {
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        let conversation = format!("side-{}", (c * 7919 + k) % ctx.args.conversations.max(1));
        let answer = ctx.request(path, Measure::Whole, conversation).send().await;
        let outcome = match answer {
            Err(e) => Err(format!("send: {e}")),
            Ok(r) => {
                let status = r.status().as_u16();
                match r.bytes().await {
                    Err(e) => Err(format!("body: {e}")),
                    Ok(b) => Ok((status, b)),
                }
            }
        };
        let took = sent.elapsed();
        let Ok(mut t) = tally.lock() else { return };
        t.calls += 1;
        match outcome {
            Err(e) => {
                t.errors += 1;
                drop(t);
                ctx.error(path, e);
            }
            Ok((200, _)) => {
                t.ok += 1;
                drop(t);
                if let Ok(mut h) = latency.lock() {
                    let _ = h.record(took.as_nanos().max(1) as u64);
                }
            }
            Ok((status, body)) => {
                let code = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
                    .unwrap_or_else(|| "(no code)".into());
                *t.refused.entry((status, code)).or_default() += 1;
                if status == 503 {
                    let ms =
                        u64::try_from(sent.duration_since(start).as_millis()).unwrap_or(u64::MAX);
                    t.at_503.push(ms);
                }
                drop(t);
                ctx.error(
                    path,
                    format!("{status}: {}", String::from_utf8_lossy(&body)),
                );
            }
        }
    }
}

/// `--clients` clients on `path`, each sending one call after the other until `seconds` have
/// passed: what came back, the latency of the calls answered 200, and the time from the start
/// to the last answer.
async fn closed_loop(
    ctx: &Arc<Ctx>,
    path: Path,
    seconds: u64,
) -> (Tally, Histogram<u64>, Duration) {
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let latency = Arc::new(Mutex::new(hist()));
    let mut tasks = Vec::new();
    for c in 0..ctx.args.clients {
        let (ctx, tally, latency) = (ctx.clone(), tally.clone(), latency.clone());
        tasks.push(tokio::spawn(async move {
            closed_client(&ctx, (path, c), (start, end), &tally, &latency).await;
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = start.elapsed();
    let t = match tally.lock() {
        Ok(mut t) => std::mem::take(&mut *t),
        Err(_) => Tally::default(),
    };
    let h = latency.lock().map(|h| h.clone()).unwrap_or_else(|_| hist());
    (t, h, elapsed)
}

/// One path's closed loops of `--compare-direct`, summed over the rounds.
struct Sum {
    calls: u64,
    ok: u64,
    latency: Histogram<u64>,
    elapsed: Duration,
}

/// `--compare-direct`: the closed loop straight to the mock and through spendgate, alternated
/// `--rounds` times (`--seconds` split between them) so that both paths see the machine alike,
/// each path after `--warmup` s of unmeasured load; a table, then one `closed path=...` line per
/// path.
async fn compare_closed(ctx: &Arc<Ctx>) {
    let args = &ctx.args;
    let paths = [("direct", Path::Direct), ("proxy", Path::Proxy)];
    let mut sums: Vec<Sum> = (0..2)
        .map(|_| Sum {
            calls: 0,
            ok: 0,
            latency: hist(),
            elapsed: Duration::ZERO,
        })
        .collect();
    if args.warmup > 0 {
        for (_, path) in paths {
            let _ = closed_loop(ctx, path, args.warmup).await;
        }
    }
    let each = (args.seconds / args.rounds).max(1);
    for _ in 0..args.rounds {
        for (k, (_, path)) in paths.iter().enumerate() {
            let (t, h, elapsed) = closed_loop(ctx, *path, each).await;
            let sum = &mut sums[k];
            sum.calls += t.calls;
            sum.ok += t.ok;
            let _ = sum.latency.add(&h);
            sum.elapsed += elapsed;
        }
    }
    println!(
        "Closed loop, {} clients, non-streaming calls, the paths alternated {} times {} s each \
         after {} s warm-up.",
        args.clients, args.rounds, each, args.warmup
    );
    println!();
    println!("| path | calls | ok | not ok | ok calls/s | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut lines = Vec::new();
    for ((name, _), sum) in paths.iter().zip(&sums) {
        let not_ok = sum.calls - sum.ok;
        let rate = sum.ok as f64 / sum.elapsed.as_secs_f64().max(1e-9);
        let h = &sum.latency;
        let (p50, p99) = (ms(h.value_at_quantile(0.5)), ms(h.value_at_quantile(0.99)));
        println!(
            "| {name} | {} | {} | {not_ok} | {rate:.1} | {p50:.3} | {p99:.3} | {:.3} |",
            sum.calls,
            sum.ok,
            ms(h.max())
        );
        lines.push(format!(
            "closed path={name} clients={} calls={} ok={} errors={not_ok} rate={rate:.3} \
             p50_ms={p50:.3} p99_ms={p99:.3}",
            args.clients, sum.calls, sum.ok
        ));
    }
    if let Ok(Some(e)) = ctx.first_error.lock().map(|e| e.clone()) {
        println!("first error: {}", e.chars().take(300).collect::<String>());
    }
    for l in &lines {
        println!("{l}");
    }
}

/// The closed loop's table and its last line, `calls=N ok=N refused=N status_503=N errors=N`.
fn print_closed_loop(ctx: &Ctx, t: &Tally, h: &Histogram<u64>) {
    let args = &ctx.args;
    let refused: u64 = t.refused.values().sum();
    let status_503: u64 = t
        .refused
        .iter()
        .filter(|((s, _), _)| *s == 503)
        .map(|(_, n)| n)
        .sum();
    println!(
        "Closed loop, {} clients, {} s, proxied non-streaming calls.",
        args.clients, args.seconds
    );
    println!();
    println!("| calls | ok | refused | 503 | no answer | ok p50 ms | ok p99 ms | ok max ms |");
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} |",
        t.calls,
        t.ok,
        refused,
        status_503,
        t.errors,
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.99)),
        ms(h.max()),
    );
    for ((status, code), n) in &t.refused {
        println!("refused {status} {code}: {n}");
    }
    if !t.at_503.is_empty() {
        let mut at = t.at_503.clone();
        at.sort_unstable();
        let shown: Vec<String> = at
            .iter()
            .take(INSTANTS_SHOWN_MAX)
            .map(|ms| format!("{:.2}", *ms as f64 / 1e3))
            .collect();
        println!(
            "503s sent at (s from start): {}{}",
            shown.join(" "),
            if at.len() > INSTANTS_SHOWN_MAX {
                " ..."
            } else {
                ""
            }
        );
    }
    if let Ok(Some(e)) = ctx.first_error.lock().map(|e| e.clone()) {
        println!("first error: {}", e.chars().take(300).collect::<String>());
    }
    println!(
        "calls={} ok={} refused={} status_503={} errors={}",
        t.calls, t.ok, refused, status_503, t.errors
    );
}
