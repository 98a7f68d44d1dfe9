//! `spendgate-proxy-load`: the latency the proxy adds, measured open-loop.
//!
//! The same chat completion is sent at a fixed rate both straight to the mock upstream and
//! through `spendgate` (which admits, reserves, forwards and commits it), interleaved in one
//! run so that both paths see the same machine. Latency is measured from each request's
//! *scheduled* instant (no coordinated omission): to the end of the answer when not streaming,
//! to the first body chunk (time to first token) when streaming. The proxy's added latency is
//! the difference of the two paths' percentiles.
//!
//! Every loop is bounded in count and time; only loopback targets are accepted.

use clap::Parser;
use futures::StreamExt;
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Requests in flight at most; past it a request counts as dropped.
const IN_FLIGHT_MAX: usize = 10_000;
/// Longest a measured phase may be asked to run.
const SECONDS_MAX: u64 = 600;

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
    fn body(&self, stream: bool) -> Value {
        let mut b = json!({
            "model": self.args.model,
            "max_tokens": 16,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello! How are you today?"}
            ],
        });
        if stream {
            b["stream"] = json!(true);
            // What the proxy asks the upstream for, so both paths do the same work.
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    }

    fn error(&self, path: Path, what: String) {
        self.errors[path as usize].fetch_add(1, Ordering::Relaxed);
        if let Ok(mut e) = self.first_error.lock() {
            e.get_or_insert(what);
        }
    }

    /// One call; the latency from `scheduled` to the whole answer (not streaming) or to its
    /// first body chunk (streaming).
    async fn call(&self, path: Path, stream: bool, k: u64, scheduled: Instant) -> Option<Duration> {
        let body = self.body(stream);
        let req = match path {
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
                .header(
                    "spendgate-conversation",
                    format!("bench-{}", k % self.args.conversations.max(1)),
                )
                .json(&body),
        };
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                self.error(path, format!("send: {e}"));
                return None;
            }
        };
        if resp.status().as_u16() != 200 {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            self.error(path, format!("{status}: {text}"));
            return None;
        }
        if !stream {
            return match resp.bytes().await {
                Ok(_) => Some(scheduled.elapsed()),
                Err(e) => {
                    self.error(path, format!("body: {e}"));
                    None
                }
            };
        }
        let mut body = resp.bytes_stream();
        let mut first = None;
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) if !c.is_empty() && first.is_none() => first = Some(scheduled.elapsed()),
                Ok(_) => {}
                Err(e) => {
                    self.error(path, format!("stream: {e}"));
                    return None;
                }
            }
        }
        first
    }
}

struct Phase {
    hists: [Histogram<u64>; 2],
    errors: [u64; 2],
    dropped: u64,
}

/// Open loop at `rate` per path for `seconds`, the two paths interleaved.
async fn phase(ctx: &Arc<Ctx>, stream: bool, seconds: u64) -> Phase {
    let rate = ctx.args.rate.max(1);
    let total = rate * seconds.min(SECONDS_MAX) * 2;
    let interval = Duration::from_nanos(1_000_000_000 / (rate * 2));
    let hists = Arc::new(Mutex::new([hist(), hist()]));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT_MAX));
    let mut dropped = 0;
    for e in &ctx.errors {
        e.store(0, Ordering::Relaxed);
    }
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total as usize);
    for k in 0..total {
        let scheduled = start + interval * u32::try_from(k).unwrap_or(u32::MAX);
        tokio::time::sleep_until(scheduled).await;
        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
            dropped += 1;
            continue;
        };
        let path = if k % 2 == 0 {
            Path::Direct
        } else {
            Path::Proxy
        };
        let (ctx, hists) = (ctx.clone(), hists.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            if let Some(d) = ctx.call(path, stream, k / 2, scheduled).await {
                if let Ok(mut h) = hists.lock() {
                    let _ = h[path as usize].record(d.as_nanos().max(1) as u64);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
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
    spendgate_server::install_crypto();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .timeout(Duration::from_secs(10))
        .build()?;
    let s: Value = http
        .post(format!("{}/v1/sessions", args.proxy))
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

    let mut results = Vec::new();
    for stream in [false, true] {
        let _ = phase(&ctx, stream, args.warmup).await;
        results.push((stream, phase(&ctx, stream, args.seconds).await));
    }

    println!(
        "Open loop, {} requests/s on each path (interleaved), {} s per phase after {} s warm-up; \
         latency from each request's scheduled instant.",
        args.rate, args.seconds, args.warmup
    );
    println!();
    println!("| path | measure | completed | errors | dropped | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|---|---|");
    for (stream, p) in &results {
        let measure = if *stream {
            "streaming, time to first token"
        } else {
            "non-streaming, whole answer"
        };
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
    for (stream, p) in &results {
        let (d, x) = (&p.hists[0], &p.hists[1]);
        let added = |q: f64| ms(x.value_at_quantile(q)) - ms(d.value_at_quantile(q));
        println!(
            "| {} | {:.3} | {:.3} |",
            if *stream {
                "streaming, time to first token"
            } else {
                "non-streaming"
            },
            added(0.5),
            added(0.99)
        );
    }
    if let Ok(Some(e)) = ctx.first_error.lock().map(|e| e.clone()) {
        println!();
        println!("first error: {e}");
    }
    Ok(())
}
