//! The load: simulated guests, each served by the operator's backend, running multi-step
//! agent runs. A step goes either through the decision API (the backend reserves, calls the
//! upstream itself with the step id as its tag, and commits what the upstream reported) or
//! through spendgate's proxy (as a step of the run, `Spendgate-Run`, with a tag of its own).
//! The backend behaves as a careful one would: idempotency keys on creations, retries of
//! resolutions on another replica, heartbeats while a call is slow. What it cannot help
//! (a replica killed under it, a store outage) it leaves to spendgate's leases.

use crate::cluster::lock;
use crate::cluster::{MAX_OUTPUT_TOKENS, MODEL, SERVICE_TOKEN, UPSTREAM_TIMEOUT};
use crate::record::{read_refusal, Record, Refusal, Route, SessionInfo, TagInfo};
use crate::schedule::{Event, FaultKind, FaultSet};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a run's load behaves (the chances are per run, step or call).
#[derive(Clone, Debug)]
pub struct Knobs {
    /// A run's backend vanishes after one of its decision steps (no commit, no finish).
    pub vanish: f64,
    /// A guest leaves a proxied stream after its first chunk.
    pub disconnect: f64,
    /// The upstream is told to generate beyond the bound it is given.
    pub overbound: f64,
    /// A step goes through the proxy (else through the decision API).
    pub proxy: f64,
    /// A call streams.
    pub stream: f64,
    /// While an upstream fault window is open, a call gets that fault.
    pub upstream_fault: f64,
    /// Served as reserved: one-byte messages (the proxy's byte count of a prompt then
    /// differs from the upstream's by a few tokens) and every answer as long as its bound,
    /// so that budgets are spent to within one step and any spend beyond them shows.
    pub tight: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            vanish: 0.05,
            disconnect: 0.1,
            overbound: 0.05,
            proxy: 0.5,
            stream: 0.5,
            upstream_fault: 0.5,
            tight: false,
        }
    }
}

/// A spendgate call bounded end to end (above the upstream's timeout, for proxied calls).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// A stream read (through the proxy or from the upstream) ends at this deadline.
const STREAM_READ_MAX: Duration = Duration::from_secs(15);
/// Attempts of a call that may be repeated (on other replicas).
const ATTEMPTS: usize = 4;
/// A refusal's `Retry-After` is waited at most this long (the run is short).
const WAIT_MAX: Duration = Duration::from_secs(1);
/// The backend's heartbeat while a decision step's upstream call runs.
const HEARTBEAT_EVERY: Duration = Duration::from_millis(1300);
/// Bytes of a guest message, at least and at most.
const MESSAGE_BYTES: (usize, usize) = (80, 500);

/// What the guests share: where to call, what is scheduled, what they record.
pub struct Ctx {
    pub bases: Vec<String>,
    /// Replicas believed up (a killed one is marked down until it is ready again).
    pub up: Vec<AtomicBool>,
    pub mock_base: String,
    pub http: reqwest::Client,
    pub upstream_http: reqwest::Client,
    pub schedule: Vec<Event>,
    pub faults: FaultSet,
    pub knobs: Knobs,
    pub start: Instant,
    pub stop: AtomicBool,
    pub record: Mutex<Record>,
    /// The next fresh client address (the first ones are shared by pairs of guests).
    pub next_ip: AtomicUsize,
}

impl Ctx {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn rec(&self) -> std::sync::MutexGuard<'_, Record> {
        lock(&self.record)
    }

    /// A replica to call: one believed up, other than `avoid` when there is a choice.
    fn pick(&self, rng: &mut StdRng, avoid: Option<usize>) -> usize {
        let n = self.bases.len();
        let up: Vec<usize> = (0..n)
            .filter(|i| self.up[*i].load(Ordering::Relaxed) && Some(*i) != avoid)
            .collect();
        if up.is_empty() {
            rng.random_range(0..n)
        } else {
            up[rng.random_range(0..up.len())]
        }
    }
}

/// The address of client number `i` (documentation-free private range, one per /32).
pub fn ip_of(i: usize) -> String {
    format!(
        "10.{}.{}.{}",
        77 + (i / 65_536) % 100,
        (i / 256) % 256,
        i % 256
    )
}

/// An answer of spendgate.
enum Answer {
    Ok(Value),
    Refused(Refusal),
    /// An error answer that broke the contract (recorded), or one not understood.
    Bad,
    /// No answer: the replica was killed, the connection dropped, the call timed out.
    Silent,
}

/// One call to one replica; records refusals and latency.
async fn call(
    ctx: &Ctx,
    replica: usize,
    path: &str,
    body: Option<&Value>,
    key: Option<&str>,
    what: &str,
) -> Answer {
    let url = format!("{}{path}", ctx.bases[replica]);
    let mut req = match body {
        Some(b) => ctx.http.post(&url).json(b),
        None => ctx.http.get(&url),
    };
    req = req.bearer_auth(SERVICE_TOKEN).timeout(CALL_TIMEOUT);
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    let started = Instant::now();
    let resp = match req.send().await {
        Ok(r) => r,
        Err(_) => {
            ctx.rec().no_answer += 1;
            return Answer::Silent;
        }
    };
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let value = match resp.bytes().await {
        Ok(b) => serde_json::from_slice::<Value>(&b).unwrap_or(Value::Null),
        Err(_) => {
            ctx.rec().no_answer += 1;
            return Answer::Silent;
        }
    };
    Record::latency(&mut ctx.rec().lat_api, started.elapsed());
    if (200..300).contains(&status) {
        return Answer::Ok(value);
    }
    let read = read_refusal(status, &headers, &value);
    ctx.rec().answer(what, &read);
    match read {
        Ok(r) => Answer::Refused(r),
        Err(_) => Answer::Bad,
    }
}

/// A call that may be repeated: on no answer it goes to another replica, on
/// `store_unavailable` it waits a moment and goes again (with the same idempotency key, a
/// repeat returns the first answer), at most [`ATTEMPTS`] times.
async fn call_again(
    ctx: &Ctx,
    rng: &mut StdRng,
    path: &str,
    body: Option<&Value>,
    key: Option<&str>,
    what: &str,
) -> Answer {
    let mut last = None;
    let mut answer = Answer::Silent;
    for _ in 0..ATTEMPTS {
        let r = ctx.pick(rng, last);
        answer = call(ctx, r, path, body, key, what).await;
        match &answer {
            Answer::Silent => last = Some(r),
            Answer::Refused(f) if f.code == "store_unavailable" => {
                tokio::time::sleep(Duration::from_millis(rng.random_range(200..500))).await;
            }
            _ => return answer,
        }
    }
    answer
}

/// How a run (or a step) ended, for what the guest does next.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Next {
    Go,
    /// End the run here (a bound, a closed run or reservation, an error).
    EndRun,
    /// The backend vanished: no finish.
    Vanished,
    SessionSpent,
    IpSpent,
    Wait(Duration),
}

fn next_after(r: &Refusal) -> Next {
    let wait = Duration::from_secs(r.retry_after_s.unwrap_or(1)).min(WAIT_MAX);
    match (r.code.as_str(), r.scope.as_deref()) {
        ("budget_exhausted", Some("session")) => Next::SessionSpent,
        ("budget_exhausted", Some("ip")) => Next::IpSpent,
        ("budget_exhausted", _) | ("rate_limited", _) | ("concurrency_limited", _) => {
            Next::Wait(wait)
        }
        ("store_unavailable", _) | ("cutoff_engaged", _) => Next::Wait(Duration::from_millis(300)),
        _ => Next::EndRun,
    }
}

/// A guest: sessions, runs and steps until the load stops.
pub async fn guest(ctx: Arc<Ctx>, g: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ g as u64);
    let mut ip = ip_of(g / 2);
    let mut session: Option<usize> = None;
    let mut n = 0usize;
    while !ctx.stopped() {
        let s = match session {
            Some(s) => s,
            None => match new_session(&ctx, &mut rng, &ip).await {
                Some(s) => {
                    session = Some(s);
                    s
                }
                None => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            },
        };
        n += 1;
        match run(&ctx, &mut rng, g, n, s).await {
            Next::SessionSpent => session = None,
            Next::IpSpent => {
                ip = ip_of(ctx.next_ip.fetch_add(1, Ordering::Relaxed));
                session = None;
            }
            Next::Wait(d) => tokio::time::sleep(d).await,
            Next::Go | Next::EndRun | Next::Vanished => {}
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(20..150))).await;
    }
}

/// A new guest session, created by the operator's backend for this address.
async fn new_session(ctx: &Ctx, rng: &mut StdRng, ip: &str) -> Option<usize> {
    let body = json!({"client_ip": ip});
    // (not idempotent; a session created for an answer that was lost is never used)
    let answer = call_again(ctx, rng, "/v1/sessions", Some(&body), None, "session").await;
    let Answer::Ok(v) = answer else {
        return None;
    };
    let token = v.get("session").and_then(Value::as_str)?.to_string();
    let mut rec = ctx.rec();
    rec.admit("session");
    rec.sessions.push(SessionInfo {
        token,
        ip: ip.to_string(),
    });
    Some(rec.sessions.len() - 1)
}

fn message(rng: &mut StdRng) -> String {
    const WORDS: [&str; 12] = [
        "budget",
        "agent",
        "search",
        "the",
        "answer",
        "please",
        "summarise",
        "guest",
        "tokens",
        "careful",
        "result",
        "plan",
    ];
    let want = rng.random_range(MESSAGE_BYTES.0..=MESSAGE_BYTES.1);
    let mut s = String::with_capacity(want + 16);
    while s.len() < want {
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        s.push(' ');
    }
    s
}

/// One run: opened through the decision API, 1 to 4 paid steps, finished (unless the
/// backend vanished).
async fn run(ctx: &Ctx, rng: &mut StdRng, g: usize, n: usize, s: usize) -> Next {
    let (token, ip) = {
        let rec = ctx.rec();
        (rec.sessions[s].token.clone(), rec.sessions[s].ip.clone())
    };
    let first = if ctx.knobs.tight {
        "y".to_string()
    } else {
        message(rng)
    };
    let body = json!({"session": token, "client_ip": ip, "conversation": format!("c{g}-{n}"),
        "input_text": first});
    let key = format!("run-{g}-{n}");
    let run_id = match call_again(ctx, rng, "/v1/runs", Some(&body), Some(&key), "run").await {
        Answer::Ok(v) => match v.get("run_id").and_then(Value::as_str) {
            Some(r) => r.to_string(),
            None => return Next::EndRun,
        },
        Answer::Refused(r) => return next_after(&r),
        Answer::Bad | Answer::Silent => return Next::Wait(Duration::from_millis(200)),
    };
    {
        let mut rec = ctx.rec();
        rec.admit("run");
        rec.runs.insert(run_id.clone(), s);
    }
    let steps = rng.random_range(1..=4usize);
    let vanish_at = (ctx.faults.has(FaultKind::Vanish) && rng.random_bool(ctx.knobs.vanish))
        .then(|| rng.random_range(0..steps));
    let mut messages = vec![
        json!({"role": "system", "content": if ctx.knobs.tight { "x" } else {
            "You are a careful assistant with a budget." }}),
        json!({"role": "user", "content": first}),
    ];
    let who = Who {
        run: &run_id,
        token: &token,
        ip: &ip,
        conversation: format!("c{g}-{n}"),
        tag_base: format!("p{g}-{n}"),
    };
    let mut next = Next::Go;
    for k in 0..steps {
        if ctx.stopped() && k > 0 {
            break;
        }
        let vanish = vanish_at == Some(k);
        next = if !vanish && rng.random_bool(ctx.knobs.proxy) {
            proxy_step(ctx, rng, &who, k, &messages).await
        } else {
            decision_step(ctx, rng, &who, k, &messages, vanish).await
        };
        if next != Next::Go {
            break;
        }
        if !ctx.knobs.tight {
            messages.push(json!({"role": "assistant", "content": "tok0 tok1 tok2"}));
            messages.push(json!({"role": "user", "content": message(rng)}));
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(20..120))).await;
    }
    if next == Next::Vanished {
        ctx.rec().inject(FaultKind::Vanish);
        return Next::Go;
    }
    let path = format!("/v1/runs/{run_id}/finish");
    let _ = call_again(ctx, rng, &path, Some(&json!({})), None, "finish").await;
    next
}

/// A run's identity, as its calls carry it.
struct Who<'a> {
    run: &'a str,
    token: &'a str,
    ip: &'a str,
    conversation: String,
    tag_base: String,
}

/// When a call may be told to go beyond its output bound.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Over {
    Never,
    /// Only when no upstream fault was picked for it.
    Unfaulted,
    Always,
}

/// The headers that make the upstream misbehave for this call, if a fault window is open
/// (and the dice say so), or if it is to overrun its bound.
fn upstream_headers(
    ctx: &Ctx,
    rng: &mut StdRng,
    stream: bool,
    over: Over,
) -> Vec<(&'static str, String)> {
    let length = if ctx.knobs.tight {
        200
    } else {
        rng.random_range(8..=90u64)
    };
    let mut h = vec![
        ("x-mock-completion-tokens", length.to_string()),
        ("x-mock-latency-ms", rng.random_range(5..=60u64).to_string()),
    ];
    if stream {
        h.push((
            "x-mock-tokens-per-second",
            rng.random_range(150..=600u64).to_string(),
        ));
    }
    let t = ctx.start.elapsed();
    let open: Vec<FaultKind> = ctx
        .schedule
        .iter()
        .filter(|e| e.kind.upstream() && e.covers(t))
        .map(|e| e.kind)
        .collect();
    let mut faulted = false;
    if !open.is_empty() && rng.random_bool(ctx.knobs.upstream_fault) {
        let kind = open[rng.random_range(0..open.len())];
        faulted = true;
        *ctx.rec().upstream_faulted.entry(kind).or_insert(0) += 1;
        match kind {
            FaultKind::Slow if rng.random_bool(0.2) => h.push(("x-mock-fault", "hang".into())),
            FaultKind::Slow => {
                h[1].1 = rng.random_range(800..=2500u64).to_string();
                if stream {
                    h[2].1 = rng.random_range(40..=100u64).to_string();
                }
            }
            FaultKind::Drop if stream && rng.random_bool(0.5) => {
                h.push(("x-mock-fault", "clean_cut".into()))
            }
            FaultKind::Drop => h.push(("x-mock-fault", "drop_mid_stream".into())),
            FaultKind::Http5xx if rng.random_bool(0.5) => {
                h.push(("x-mock-fault", "http_504".into()))
            }
            FaultKind::Http5xx => h.push(("x-mock-fault", "http_500".into())),
            _ => h.push(("x-mock-fault", "no_usage".into())),
        }
    }
    if (over == Over::Always || (over == Over::Unfaulted && !faulted))
        && ctx.faults.has(FaultKind::Overbound)
        && rng.random_bool(ctx.knobs.overbound)
    {
        ctx.rec().inject(FaultKind::Overbound);
        h.push((
            "x-mock-extra-completion-tokens",
            rng.random_range(20..=150u64).to_string(),
        ));
        // Half of them also send no usage (the finding: 516 tokens for a bound of 20, and
        // no usage to tell).
        if !faulted && rng.random_bool(0.5) {
            h.push(("x-mock-fault", "no_usage".into()));
        }
    }
    h
}

/// What an upstream answer told the one who read it.
#[derive(Debug, Default)]
struct Read {
    usage: Option<(u64, u64, u64)>,
    /// Completion tokens counted in what arrived (one a word).
    counted: u64,
    /// The stream ended cleanly with `[DONE]`, or the whole answer was read.
    whole: bool,
}

fn usage_in(v: &Value) -> Option<(u64, u64, u64)> {
    let u = v.get("usage")?;
    Some((
        u.get("prompt_tokens")?.as_u64()?,
        u.get("completion_tokens")?.as_u64()?,
        u.get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0),
    ))
}

fn words_in(v: &Value) -> u64 {
    let text = |c: Option<&Value>| {
        c.and_then(Value::as_str)
            .map_or(0, |s| s.split_whitespace().count() as u64)
    };
    v.get("choices").and_then(Value::as_array).map_or(0, |cs| {
        cs.iter()
            .map(|c| {
                text(c.get("delta").and_then(|d| d.get("content")))
                    + text(c.get("message").and_then(|m| m.get("content")))
            })
            .sum()
    })
}

/// Reads an answer's body: a stream event by event (leaving after `leave_after` events when
/// set), or the whole JSON.
async fn read_body(resp: reqwest::Response, stream: bool, leave_after: Option<usize>) -> Read {
    let mut read = Read::default();
    if !stream {
        let Ok(Ok(bytes)) = tokio::time::timeout(STREAM_READ_MAX, resp.bytes()).await else {
            return read;
        };
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            read.usage = usage_in(&v);
            read.counted = words_in(&v);
            read.whole = true;
        }
        return read;
    }
    let deadline = tokio::time::Instant::now() + STREAM_READ_MAX;
    let mut body = resp;
    let mut buf: Vec<u8> = Vec::new();
    let mut events = 0usize;
    loop {
        let chunk = match tokio::time::timeout_at(deadline, body.chunk()).await {
            Ok(Ok(Some(c))) => c,
            _ => return read,
        };
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                read.whole = true;
                return read;
            }
            if let Ok(v) = serde_json::from_str::<Value>(data) {
                if let Some(u) = usage_in(&v) {
                    read.usage = Some(u);
                }
                read.counted += words_in(&v);
            }
            events += 1;
            if leave_after.is_some_and(|n| events >= n) {
                // The guest leaves: the connection is dropped with the response.
                return read;
            }
        }
        if buf.len() > 1 << 20 {
            return read;
        }
    }
}

/// The output bound a call asks for (at least the run's bound when tight).
fn asked(ctx: &Ctx, rng: &mut StdRng) -> u64 {
    let least = if ctx.knobs.tight {
        MAX_OUTPUT_TOKENS
    } else {
        16
    };
    rng.random_range(least..=100)
}

/// A decision-API step: reserve, call the upstream with the step id as tag, resolve.
async fn decision_step(
    ctx: &Ctx,
    rng: &mut StdRng,
    who: &Who<'_>,
    k: usize,
    messages: &[Value],
    vanish: bool,
) -> Next {
    let stream = rng.random_bool(ctx.knobs.stream);
    let asked = asked(ctx, rng);
    let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": asked,
        "stream": stream});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    let prompt = spendgate_mock_upstream::prompt_tokens_of(&body);
    let (step, granted) = match reserve(ctx, rng, who, k, prompt, asked).await {
        Ok(s) => s,
        Err(next) => return next,
    };
    body["max_tokens"] = json!(granted);
    // The backend counts what it reads; past its bound with no usage it could not tell what
    // an upstream that also failed generated, nor can a backend that vanishes tell anything
    // (its hold, the bound, is what expiry charges): an upstream over its bound only when
    // the backend can see all of it.
    let over = if vanish { Over::Never } else { Over::Unfaulted };
    let headers = upstream_headers(ctx, rng, stream, over);
    let released_on_500 = headers
        .iter()
        .any(|(h, v)| *h == "x-mock-fault" && v == "http_500");
    let beat = heartbeat(ctx, who.run);
    let (status, read) = call_upstream(ctx, &step, &body, &headers, stream).await;
    beat.abort();
    if vanish {
        return Next::Vanished;
    }
    let (what, usage) = match (status, read.usage) {
        (Some(200), Some((p, c, cached))) => ("commit", Some((p, c, cached))),
        // No usage: charged in full, unless more arrived than the bound (then what arrived).
        (Some(200), None) if read.counted > granted => ("commit", Some((prompt, read.counted, 0))),
        // The upstream said it did no work.
        (Some(500), _) if released_on_500 => ("release", None),
        _ => ("unknown", None),
    };
    let body = match usage {
        Some((p, c, cached)) => json!({"usage": {"prompt_tokens": p, "completion_tokens": c,
            "cached_tokens": cached}}),
        None => json!({}),
    };
    let path = format!("/v1/steps/{step}/{what}");
    match resolve_again(ctx, rng, &path, &body, what).await {
        Answer::Refused(r) => next_after(&r),
        _ => Next::Go,
    }
}

/// How long a backend goes on trying to settle a step it knows the outcome of, while no
/// replica answers or the store is away (a Redis restart reloading its data takes seconds).
const RESOLVE_PATIENCE: Duration = Duration::from_secs(30);

/// A step's resolution, repeated (each round [`call_again`]) until a replica answers with
/// something other than `store_unavailable`, for at most [`RESOLVE_PATIENCE`]: a backend
/// that knows what the upstream served keeps trying to tell it, as the proxy does
/// (`SETTLE_RETRY_PAUSES`); one that arrives after the step expired or its run ended still
/// charges a usage above the hold (a late overrun).
async fn resolve_again(
    ctx: &Ctx,
    rng: &mut StdRng,
    path: &str,
    body: &Value,
    what: &str,
) -> Answer {
    let until = tokio::time::Instant::now() + RESOLVE_PATIENCE;
    loop {
        let answer = call_again(ctx, rng, path, Some(body), None, what).await;
        let unsettled = match &answer {
            Answer::Silent => true,
            Answer::Refused(r) => r.code == "store_unavailable",
            _ => false,
        };
        if !unsettled || tokio::time::Instant::now() >= until {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..500))).await;
    }
}

/// Reserves a model step of `prompt` tokens asking `asked` out (an idempotency key, so a
/// repeat on another replica returns the same step): its id and the bound granted.
async fn reserve(
    ctx: &Ctx,
    rng: &mut StdRng,
    who: &Who<'_>,
    k: usize,
    prompt: u64,
    asked: u64,
) -> Result<(String, u64), Next> {
    let body = json!({"kind": "model", "model": MODEL, "prompt_tokens": prompt,
        "max_output_tokens": asked});
    let path = format!("/v1/runs/{}/steps", who.run);
    let key = format!("{}-s{k}", who.run);
    let (step, granted) = match call_again(ctx, rng, &path, Some(&body), Some(&key), "step").await {
        Answer::Ok(v) => {
            let step = v
                .get("step_id")
                .and_then(Value::as_str)
                .ok_or(Next::EndRun)?
                .to_string();
            let granted = v
                .get("max_output_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(MAX_OUTPUT_TOKENS);
            (step, granted)
        }
        Answer::Refused(r) => return Err(next_after(&r)),
        Answer::Bad | Answer::Silent => return Err(Next::EndRun),
    };
    let mut rec = ctx.rec();
    rec.admit("decision step");
    rec.tags.insert(
        step.clone(),
        TagInfo {
            run: who.run.to_string(),
            route: Route::Decision,
            step: Some(step.clone()),
        },
    );
    Ok((step, granted))
}

/// The backend's own call to the upstream, tagged with the step id: its status (`None`:
/// no answer within the upstream timeout) and what it read.
async fn call_upstream(
    ctx: &Ctx,
    step: &str,
    body: &Value,
    headers: &[(&'static str, String)],
    stream: bool,
) -> (Option<u16>, Read) {
    let mut req = ctx
        .upstream_http
        .post(format!("{}/v1/chat/completions", ctx.mock_base))
        .header("x-mock-tag", step)
        .json(body);
    for (h, v) in headers {
        req = req.header(*h, v);
    }
    match tokio::time::timeout(UPSTREAM_TIMEOUT, req.send()).await {
        Ok(Ok(resp)) => {
            let status = resp.status().as_u16();
            (Some(status), read_body(resp, stream, None).await)
        }
        _ => (None, Read::default()),
    }
}

/// Renews a run's lease while a slow upstream call runs (aborted when it ends).
fn heartbeat(ctx: &Ctx, run: &str) -> tokio::task::AbortHandle {
    let http = ctx.http.clone();
    let bases = ctx.bases.clone();
    let up: Vec<bool> = ctx.up.iter().map(|u| u.load(Ordering::Relaxed)).collect();
    let run = run.to_string();
    tokio::spawn(async move {
        let mut i = 0usize;
        loop {
            tokio::time::sleep(HEARTBEAT_EVERY).await;
            i += 1;
            let r = (0..bases.len())
                .map(|j| (i + j) % bases.len())
                .find(|j| up[*j])
                .unwrap_or(0);
            let _ = http
                .post(format!("{}/v1/runs/{run}/heartbeat", bases[r]))
                .bearer_auth(SERVICE_TOKEN)
                .json(&json!({}))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
        }
    })
    .abort_handle()
}

/// A proxied step: one call to one replica (a paid call is never repeated).
async fn proxy_step(
    ctx: &Ctx,
    rng: &mut StdRng,
    who: &Who<'_>,
    k: usize,
    messages: &[Value],
) -> Next {
    let stream = rng.random_bool(ctx.knobs.stream);
    let tag = format!("{}-{k}", who.tag_base);
    let body = json!({"model": MODEL, "messages": messages,
        "max_tokens": asked(ctx, rng), "stream": stream});
    let replica = ctx.pick(rng, None);
    let mut req = ctx
        .http
        .post(format!("{}/v1/chat/completions", ctx.bases[replica]))
        .bearer_auth(SERVICE_TOKEN)
        .header("spendgate-session", who.token)
        .header("spendgate-client-ip", who.ip)
        .header("spendgate-conversation", &who.conversation)
        .header("spendgate-run", who.run)
        .header("x-mock-tag", &tag)
        .timeout(CALL_TIMEOUT)
        .json(&body);
    for (h, v) in upstream_headers(ctx, rng, stream, Over::Always) {
        req = req.header(h, v);
    }
    let leave =
        (stream && ctx.faults.has(FaultKind::Disconnect) && rng.random_bool(ctx.knobs.disconnect))
            .then_some(1usize);
    ctx.rec().tags.insert(
        tag.clone(),
        TagInfo {
            run: who.run.to_string(),
            route: Route::Proxy,
            step: None,
        },
    );
    let started = Instant::now();
    let resp = match req.send().await {
        Ok(r) => r,
        Err(_) => {
            ctx.rec().no_answer += 1;
            return Next::Go;
        }
    };
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    {
        let mut rec = ctx.rec();
        Record::latency(&mut rec.lat_proxy, started.elapsed());
        if let Some(step) = headers.get("spendgate-step").and_then(|v| v.to_str().ok()) {
            rec.admit("proxied step");
            if let Some(t) = rec.tags.get_mut(&tag) {
                t.step = Some(step.to_string());
            }
        }
    }
    if status == 200 {
        if leave.is_some() {
            ctx.rec().inject(FaultKind::Disconnect);
        }
        let _ = read_body(resp, stream, leave).await;
        return Next::Go;
    }
    let value = match resp.bytes().await {
        Ok(b) => serde_json::from_slice::<Value>(&b).unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    // The upstream's own error answer, passed through: not spendgate's refusal.
    let upstream_said = value
        .pointer("/error/message")
        .and_then(Value::as_str)
        .is_some_and(|m| m.starts_with("mock upstream:"));
    if upstream_said {
        ctx.rec().relayed += 1;
        return Next::Go;
    }
    let read = read_refusal(status, &headers, &value);
    ctx.rec().answer("proxy", &read);
    match read {
        Ok(r) => next_after(&r),
        Err(_) => Next::EndRun,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_distinct() {
        let a: std::collections::HashSet<String> = (0..70_000).map(ip_of).collect();
        assert_eq!(a.len(), 70_000);
        assert_eq!(ip_of(0), "10.77.0.0");
        assert_eq!(ip_of(257), "10.77.1.1");
    }

    #[test]
    fn stream_events_count_words_and_usage() {
        let v = json!({"choices": [{"delta": {"content": "tok0 tok1 tok2"}}]});
        assert_eq!(words_in(&v), 3);
        let u = json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 2}}});
        assert_eq!(usage_in(&u), Some((9, 4, 2)));
        assert_eq!(usage_in(&json!({"usage": null})), None);
    }
}
