//! SPEC §6 `POST /v1/chat/completions` against a real `spendgate serve` process on sqlite, in
//! front of the mock upstream (in this test process, so its counters are the ground truth).

use crate::harness::*;
use axum::response::IntoResponse;
use futures::StreamExt;
use serde_json::{json, Value};
use spendgate_mock_upstream::{prompt_tokens_of, MockConfig, MockStats, MockUpstream};
use spendgate_testkit::free_port;
use std::collections::BTreeSet;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `POST /v1/messages`, with this module's gateway and mock.
#[path = "proxy_messages.rs"]
mod messages;

/// `POST /v1/embeddings`, with this module's gateway and mock.
#[path = "proxy_embeddings.rs"]
mod embeddings;

/// `POST /v1/responses`, with this module's gateway and mock.
#[path = "proxy_responses.rs"]
mod responses;

const MODEL: &str = "mock-model";
/// The upstream's key: it must reach the upstream and never the client.
const UPSTREAM_KEY: &str = "sk-upstream-secret-7f3a9c21e4b8";

/// The mock upstream served from this test's runtime; records the `Authorization` headers it
/// received.
struct Mock {
    mock: MockUpstream,
    port: u16,
    auth: Arc<Mutex<BTreeSet<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Mock {
    async fn start() -> Mock {
        let mock = MockUpstream::new(MockConfig::default());
        let auth = Arc::new(Mutex::new(BTreeSet::new()));
        let seen = auth.clone();
        let app = mock.router().layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let seen = seen.clone();
                async move {
                    let a = req
                        .headers()
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    if let Ok(mut s) = seen.lock() {
                        if s.len() < 16 {
                            s.insert(a.clone());
                        }
                    }
                    if req.uri().path().starts_with("/unauthorized/") {
                        // An upstream that refuses the key and, like some do, echoes it.
                        let body = json!({"error": {"message": format!("Incorrect API key provided: {a}"),
                            "type": "invalid_request_error", "code": "invalid_api_key"}});
                        return (axum::http::StatusCode::UNAUTHORIZED, axum::Json(body))
                            .into_response();
                    }
                    next.run(req).await
                }
            },
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind mock");
        let port = listener.local_addr().expect("mock addr").port();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Mock {
            mock,
            port,
            auth,
            task,
        }
    }

    fn stats(&self) -> MockStats {
        self.mock.stats()
    }

    fn auth_seen(&self) -> BTreeSet<String> {
        self.auth.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Prices in micros per million tokens, as the config strings say.
#[derive(Clone, Copy)]
struct Prices {
    input: u64,
    cached: u64,
    output: u64,
}

fn amount(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

struct Opts {
    global_budget: &'static str,
    /// The global limits in dry-run (reported, not enforced).
    global_dry_run: bool,
    conversation_budget: &'static str,
    prices: Prices,
    timeout_s: u64,
    lease_ttl_s: u64,
    /// `run.max_seconds`
    max_seconds: u64,
    /// `server.browser_direct`
    browser_direct: bool,
    /// `alerts.webhook_url`
    webhook: Option<String>,
    /// `run.max_input_bytes`
    max_input_bytes: u64,
    /// More config, appended (more `[models.*]` and `[upstreams.*]`).
    extra: String,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            global_budget: "1000",
            global_dry_run: false,
            conversation_budget: "1000",
            // 0.15 / 0.075 / 0.60 per million: most charges are fractions of a micro.
            prices: Prices {
                input: 150_000,
                cached: 75_000,
                output: 600_000,
            },
            timeout_s: 30,
            lease_ttl_s: 10,
            max_seconds: 120,
            browser_direct: false,
            webhook: None,
            max_input_bytes: 16_384,
            extra: String::new(),
        }
    }
}

fn gateway_config(mock_port: u16, o: &Opts) -> String {
    format!(
        r#"lease_ttl_s = {lease_ttl_s}

[limits.global]
rate = "100000/second"
burst = 100000
concurrency = 10000
budgets = [{{ amount = "{global}", window = "day" }}]
dry_run = {global_dry_run}

[limits.ip]
rate = "100000/second"
burst = 100000
concurrency = 10000
budgets = []

[limits.session]
rate = "100000/second"
burst = 100000
concurrency = 10000
budgets = []

[limits.conversation]
concurrency = 1
budgets = [{{ amount = "{conv}", window = "day" }}]

[run]
max_seconds = {max_seconds}
max_input_bytes = {max_input_bytes}
max_context_tokens = 2000
max_output_tokens = 100
max_tool_result_bytes = 1000
max_model_rounds = 3
max_retries = 1
max_cost = "100"

[models."{MODEL}"]
upstream = "up"
input_per_million = "{input}"
cached_input_per_million = "{cached}"
output_per_million = "{output}"
tokenizer = "bytes"

[upstreams.up]
base_url = "http://127.0.0.1:{mock_port}/v1"
api_key = "{UPSTREAM_KEY}"
timeout_s = {timeout}

[models.bpe-model]
upstream = "up"
input_per_million = "1"
output_per_million = "1"
tokenizer = "o200k_base"

[models.reasoning-model]
upstream = "up"
input_per_million = "1"
output_per_million = "1"
output_bound_field = "max_completion_tokens"

[models.refused-key]
upstream = "refusing"
input_per_million = "1"
output_per_million = "1"
tokenizer = "bytes"

[upstreams.refusing]
base_url = "http://127.0.0.1:{mock_port}/unauthorized/v1"
api_key = "{UPSTREAM_KEY}"

[models.unreachable]
upstream = "down"
input_per_million = "1"
output_per_million = "1"
tokenizer = "bytes"

[upstreams.down]
base_url = "http://127.0.0.1:{down_port}/v1"
{extra}
{alerts}"#,
        extra = o.extra,
        alerts = o
            .webhook
            .as_ref()
            .map(|url| format!("\n[alerts]\nwebhook_url = \"{url}\"\n"))
            .unwrap_or_default(),
        down_port = free_port(),
        max_seconds = o.max_seconds,
        max_input_bytes = o.max_input_bytes,
        global = o.global_budget,
        global_dry_run = o.global_dry_run,
        conv = o.conversation_budget,
        input = amount(o.prices.input),
        cached = amount(o.prices.cached),
        output = amount(o.prices.output),
        timeout = o.timeout_s,
        lease_ttl_s = o.lease_ttl_s,
    )
}

/// spendgate in front of the mock, with one guest session.
struct Gateway {
    // Dropped first: the server goes before the mock it talks to.
    server: Server,
    mock: Mock,
    session: String,
    prices: Prices,
}

struct Reply {
    status: u16,
    headers: reqwest::header::HeaderMap,
    text: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or(Value::Null)
    }
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
    fn step(&self) -> String {
        self.header("spendgate-step")
            .unwrap_or_else(|| panic!("no spendgate-step header: {} {}", self.status, self.text))
    }
    fn reserved(&self) -> u64 {
        self.header("spendgate-reserved-micros")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no reserved header: {} {}", self.status, self.text))
    }
    fn code(&self) -> String {
        code(&self.json()).to_string()
    }
    /// The `data:` payloads of an SSE body, in order.
    fn events(&self) -> Vec<String> {
        self.text
            .split('\n')
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.trim().to_string())
            .collect()
    }
    /// Nothing the client received names the upstream's key.
    fn assert_no_key(&self) {
        assert!(!self.text.contains(UPSTREAM_KEY), "key in body");
        for (k, v) in &self.headers {
            assert!(
                !String::from_utf8_lossy(v.as_bytes()).contains(UPSTREAM_KEY),
                "key in header {k}"
            );
        }
    }
}

impl Gateway {
    async fn start(opts: Opts) -> Gateway {
        let mock = Mock::start().await;
        let config = gateway_config(mock.port, &opts);
        let server = if opts.browser_direct {
            Server::start_browser_direct(&config)
        } else {
            Server::start(&config)
        };
        let session = server.session().await;
        Gateway {
            server,
            mock,
            session,
            prices: opts.prices,
        }
    }

    fn request(&self, conversation: &str, body: &Value) -> reqwest::RequestBuilder {
        self.server
            .http
            .post(self.server.url("/v1/chat/completions"))
            .bearer_auth(SERVICE)
            .header("spendgate-session", &self.session)
            .header("spendgate-client-ip", "10.1.2.3")
            .header("spendgate-conversation", conversation)
            .json(body)
    }

    async fn chat(&self, conversation: &str, body: Value, headers: &[(&str, &str)]) -> Reply {
        let mut b = self.request(conversation, &body);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        Self::send(b).await
    }

    /// A stream of `tokens` tokens at 20 a second, read up to its first chunk: its step and
    /// the rest of its body.
    async fn slow_stream(
        &self,
        conversation: &str,
        tokens: u64,
    ) -> (
        String,
        impl futures::Stream<Item = reqwest::Result<bytes::Bytes>>,
    ) {
        let b = self
            .request(
                conversation,
                &json!({"model": MODEL, "stream": true, "messages": user("slowly")}),
            )
            .header("x-mock-tokens-per-second", "20")
            .header("x-mock-completion-tokens", tokens.to_string());
        Self::first_chunk(b).await
    }

    /// Sends a streaming request (answered 200) and reads its first chunk: the step and the
    /// rest of the body.
    async fn first_chunk(
        b: reqwest::RequestBuilder,
    ) -> (
        String,
        impl futures::Stream<Item = reqwest::Result<bytes::Bytes>>,
    ) {
        let r = b.send().await.expect("send");
        assert_eq!(r.status().as_u16(), 200);
        let step = r
            .headers()
            .get("spendgate-step")
            .and_then(|v| v.to_str().ok())
            .expect("step")
            .to_string();
        let mut body = Box::pin(r.bytes_stream());
        let first = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .expect("first chunk in time");
        assert!(matches!(first, Some(Ok(_))));
        (step, body)
    }

    /// A stream whose upstream writes 800 tokens past its bound of 100 at 2,000 a second,
    /// without usage, read up to its first chunk (`run`: a step of that run).
    async fn stream_past_its_bound(
        &self,
        conversation: &str,
        run: Option<&str>,
    ) -> (
        String,
        impl futures::Stream<Item = reqwest::Result<bytes::Bytes>>,
    ) {
        let mut b = self
            .request(
                conversation,
                &json!({"model": MODEL, "stream": true, "max_tokens": 100,
                    "messages": user("tell me everything")}),
            )
            .header("x-mock-tokens-per-second", "2000")
            .header("x-mock-completion-tokens", "100")
            .header("x-mock-extra-completion-tokens", "800")
            .header("x-mock-fault", "no_usage");
        if let Some(run) = run {
            b = b.header("spendgate-run", run);
        }
        Self::first_chunk(b).await
    }

    /// A chat completion from a guest with its cookie alone (browser-direct).
    fn guest_chat(&self, token: &str) -> reqwest::RequestBuilder {
        self.server
            .http
            .post(self.server.url("/v1/chat/completions"))
            .header("cookie", format!("spendgate_session={token}"))
    }

    /// `GET /v1/usage{query}` as a guest with its cookie.
    async fn guest_usage(&self, token: &str, query: &str) -> Value {
        self.server
            .http
            .get(self.server.url(&format!("/v1/usage{query}")))
            .header("cookie", format!("spendgate_session={token}"))
            .send()
            .await
            .expect("usage")
            .json()
            .await
            .expect("json")
    }

    /// Sends a request and reads its whole answer.
    async fn send(b: reqwest::RequestBuilder) -> Reply {
        let r = b.send().await.expect("send");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        // A stream cut by the upstream still ends cleanly here (the proxy ends it with an
        // error event), so reading to the end never fails.
        let text = r.text().await.expect("body");
        Reply {
            status,
            headers,
            text,
        }
    }

    fn charge(&self, usage: &Value) -> u64 {
        charge(self.prices, usage)
    }

    /// The admin view of one reservation, once it has left `held` (bounded wait).
    async fn reservation(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let v = self
                .server
                .admin_get("/admin/v1/reservations?limit=1000")
                .await;
            let row = v["reservations"]
                .as_array()
                .and_then(|rows| rows.iter().find(|r| r["id"] == id).cloned());
            match row {
                Some(r) if r["state"] != "held" => return r,
                other if Instant::now() > deadline => {
                    panic!("reservation {id} not resolved: {other:?}")
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    async fn global(&self) -> Value {
        self.server.global_usage().await
    }

    async fn metric(&self, line_prefix: &str) -> u64 {
        let text = self.server.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix(line_prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// usage × prices, rounded up to the micro.
impl Gateway {
    /// Runs the `tests/python` script `script` of checks with an official client against
    /// this gateway: `SPENDGATE_BASE_URL` (the server's URL + `base`), `SPENDGATE_MOCK_URL`,
    /// `SPENDGATE_SERVICE_TOKEN`, `SPENDGATE_SESSION`, `SPENDGATE_UPSTREAM_KEY` and `env`;
    /// no provider key or base URL of the caller's environment; what the client writes in the
    /// test's own temp dir. Asserts that it exited 0 with every one of its `checks` checks
    /// run and passed (one `ok   test_…` line each).
    async fn run_checks(&self, script: &str, base: &str, env: &[(&str, String)], checks: usize) {
        let mut cmd = Command::new(test_python());
        cmd.arg(workspace_root().join("tests/python").join(script))
            .env("SPENDGATE_BASE_URL", self.server.url(base))
            .env(
                "SPENDGATE_MOCK_URL",
                format!("http://127.0.0.1:{}", self.mock.port),
            )
            .env("SPENDGATE_SERVICE_TOKEN", SERVICE)
            .env("SPENDGATE_SESSION", &self.session)
            .env("SPENDGATE_UPSTREAM_KEY", UPSTREAM_KEY)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("TMPDIR", self.server.dir.path());
        for (k, v) in env {
            cmd.env(k, v);
        }
        for k in [
            "OPENAI_API_KEY",
            "OPENAI_BASE_URL",
            "ANTHROPIC_API_KEY",
            "ANTHROPIC_BASE_URL",
            "ANTHROPIC_AUTH_TOKEN",
        ] {
            cmd.env_remove(k);
        }
        let (ok, output) =
            tokio::task::spawn_blocking(move || run_to_end(cmd, Duration::from_secs(120)))
                .await
                .expect("join");
        assert!(ok, "{script} failed:\n{output}");
        let ok_lines = output
            .lines()
            .filter(|l| l.starts_with("ok   test_"))
            .count();
        assert_eq!(ok_lines, checks, "every check ran and passed:\n{output}");
        let summary = format!("{checks} passed, 0 failed");
        assert!(output.lines().any(|l| l == summary), "{output}");
    }
}

fn charge(p: Prices, usage: &Value) -> u64 {
    let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    let completion = usage["completion_tokens"]
        .as_u64()
        .expect("completion_tokens");
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let num = (prompt - cached) * p.input + cached * p.cached + completion * p.output;
    num.div_ceil(1_000_000)
}

/// What the mock counted as served, priced.
fn priced_delta(p: Prices, before: &MockStats, after: &MockStats) -> u64 {
    charge(
        p,
        &json!({
            "prompt_tokens": after.prompt_tokens - before.prompt_tokens,
            "completion_tokens": after.completion_tokens - before.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": after.cached_tokens - before.cached_tokens},
        }),
    )
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn last_sent(g: &Gateway) -> Value {
    g.mock
        .stats()
        .last_request
        .expect("a request reached the mock")
}

/// Acceptance: normal and streamed calls are clamped, forwarded with exactly one output
/// bound, and charged exactly the mock's reported usage × prices, rounded up; the upstream key
/// reaches the upstream only.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_are_clamped_forwarded_and_charged_at_the_upstreams_usage() {
    let g = Gateway::start(Opts::default()).await;
    let mut replies = Vec::new();

    // Non-streaming; max_tokens 100000 reaches the upstream as run.max_output_tokens.
    let body = json!({"model": MODEL, "max_tokens": 100000, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there, how are you?"}]});
    let r = g
        .chat(
            "c-normal",
            body,
            &[
                ("x-mock-cached-tokens", "5"),
                ("x-mock-completion-tokens", "37"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let v = r.json();
    let sent = last_sent(&g);
    assert_eq!(sent["max_tokens"], 100, "clamped to run.max_output_tokens");
    assert!(sent.get("max_completion_tokens").is_none(), "{sent}");
    assert_eq!(g.mock.stats().max_tokens_seen.last(), Some(&100));
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens_of(&sent));
    assert_eq!(v["usage"]["completion_tokens"], 37);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
    assert!(v["choices"][0]["message"]["content"]
        .as_str()
        .is_some_and(|c| c.starts_with("tok0 tok1")));
    let expected = g.charge(&v["usage"]);
    assert_eq!(
        r.header("spendgate-charged-micros"),
        Some(expected.to_string())
    );
    assert_eq!(r.header("spendgate-outcome").as_deref(), Some("committed"));
    let row = g.reservation(&r.step()).await;
    assert_eq!(row["state"], "committed");
    assert_eq!(row["charged_micros"], expected);
    assert!(r.reserved() >= expected);
    assert_eq!(row["reserved_micros"], r.reserved());
    // A call that opened its own run is an admission: it says what the rates leave.
    let policy = r.header("ratelimit-policy").expect("RateLimit-Policy");
    assert!(policy.contains("\"session\";q=100000;w=1"), "{policy}");
    let left = r.header("ratelimit").expect("RateLimit");
    assert!(left.contains(";r=") && left.contains(";t="), "{left}");
    replies.push(r);

    // Absent: the bound is inserted.
    let r = g
        .chat(
            "c-absent",
            json!({"model": MODEL, "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let sent = last_sent(&g);
    assert_eq!(sent["max_tokens"], 100);
    assert!(sent.get("max_completion_tokens").is_none());
    assert_eq!(
        r.header("spendgate-max-output-tokens").as_deref(),
        Some("100")
    );
    replies.push(r);

    // Only max_completion_tokens: forwarded as the field the model's upstream honours
    // (`max_tokens` by default), never the client's pick, under our bound.
    let r = g
        .chat(
            "c-mct",
            json!({"model": MODEL, "max_completion_tokens": 50, "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let sent = last_sent(&g);
    assert_eq!(sent["max_tokens"], 50);
    assert!(
        sent.get("max_completion_tokens").is_none(),
        "exactly one alias: {sent}"
    );
    replies.push(r);

    // A model configured with `output_bound_field = "max_completion_tokens"` gets only that
    // one, whichever the client sent (or none).
    for (conv, body) in [
        (
            "c-r1",
            json!({"model": "reasoning-model", "max_tokens": 40, "messages": user("hi")}),
        ),
        (
            "c-r2",
            json!({"model": "reasoning-model", "messages": user("hi")}),
        ),
    ] {
        let r = g.chat(conv, body, &[]).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let sent = last_sent(&g);
        assert!(
            sent.get("max_tokens").is_none(),
            "exactly one alias: {sent}"
        );
        assert_eq!(
            sent["max_completion_tokens"],
            if conv == "c-r1" { 40 } else { 100 },
            "{sent}"
        );
        replies.push(r);
    }

    // Both: the smallest wins and exactly one is forwarded.
    let r = g
        .chat(
            "c-both",
            json!({"model": MODEL, "max_tokens": 80, "max_completion_tokens": 30, "messages": user("hi")}),
            &[("x-mock-completion-tokens", "64")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let sent = last_sent(&g);
    assert_eq!(sent["max_tokens"], 30);
    assert!(
        sent.get("max_completion_tokens").is_none(),
        "exactly one alias: {sent}"
    );
    assert_eq!(r.json()["usage"]["completion_tokens"], 30);
    assert_eq!(
        r.header("spendgate-charged-micros"),
        Some(g.charge(&r.json()["usage"]).to_string())
    );
    replies.push(r);

    // A bound of 0 (which some upstreams read as "no limit") never reaches the upstream.
    let served = g.mock.stats().requests;
    for k in ["max_tokens", "max_completion_tokens"] {
        let r = g
            .chat(
                "c-zero",
                json!({"model": MODEL, k: 0, "messages": user("hi")}),
                &[],
            )
            .await;
        assert_eq!(
            (r.status, r.code()),
            (400, "invalid_request".into()),
            "{}",
            r.text
        );
    }
    assert_eq!(g.mock.stats().requests, served);

    // Streamed without asking for usage: the proxy asks for it, reads it, and does not pass
    // the usage chunk (it has no choices) to a client that did not ask.
    let r = g
        .chat(
            "c-stream",
            json!({"model": MODEL, "stream": true, "max_tokens": 100000, "messages": user("stream me")}),
            &[
                ("x-mock-completion-tokens", "23"),
                ("x-mock-cached-tokens", "2"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream")));
    let sent = last_sent(&g);
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert_eq!(sent["max_tokens"], 100);
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).expect("chunk json");
        let choices = c["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 1, "every chunk has its choice: {e}");
        if let Some(t) = choices[0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    assert_eq!(text.split(' ').count(), 23);
    let usage = json!({"prompt_tokens": prompt_tokens_of(&sent), "completion_tokens": 23,
        "prompt_tokens_details": {"cached_tokens": 2}});
    let row = g.reservation(&r.step()).await;
    assert_eq!(row["state"], "committed");
    assert_eq!(row["charged_micros"], g.charge(&usage));
    replies.push(r);

    // Streamed, asking for usage: the usage chunk passes and is what was charged.
    let r = g
        .chat(
            "c-stream-usage",
            json!({"model": MODEL, "stream": true, "stream_options": {"include_usage": true}, "messages": user("stream me too")}),
            &[],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let events = r.events();
    let usage_chunk: Value = serde_json::from_str(&events[events.len() - 2]).expect("usage chunk");
    assert_eq!(usage_chunk["choices"], json!([]));
    let row = g.reservation(&r.step()).await;
    assert_eq!(row["charged_micros"], g.charge(&usage_chunk["usage"]));
    replies.push(r);

    // The books: every charge above is in the global counter, nothing is held.
    let global = g.global().await;
    assert_eq!(global["reserved_micros"], 0);
    let reservations = g
        .server
        .admin_get("/admin/v1/reservations?limit=1000")
        .await;
    let charged: u64 = reservations["reservations"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| r["charged_micros"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(global["used_micros"], charged);
    assert_eq!(g.mock.stats().requests, 8);

    // The key reached the upstream, and never the client.
    assert_eq!(
        g.mock.auth_seen(),
        BTreeSet::from([format!("Bearer {UPSTREAM_KEY}")])
    );
    for r in &replies {
        r.assert_no_key();
    }
}

/// Acceptance: what is over a bound never reaches the upstream, and is refused with the SPEC
/// code; a request without identity or with an unknown model is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_bound_requests_never_reach_the_upstream() {
    let g = Gateway::start(Opts::default()).await;
    let before = g.mock.stats().requests;
    let summary = g.server.admin_get("/admin/v1/summary").await;

    // Prompt over max_context_tokens (2000; one token per byte).
    for stream in [false, true] {
        let r = g
            .chat(
                "c-ctx",
                json!({"model": MODEL, "stream": stream, "messages": user(&"x".repeat(2100))}),
                &[],
            )
            .await;
        assert_eq!(
            (r.status, r.code()),
            (400, "context_too_large".into()),
            "{}",
            r.text
        );
    }
    // The same prompt carried by fields a gateway might not count: the legacy
    // `function_call` (billed as prompt text), a message field, a request field.
    let big = "x".repeat(2100);
    for body in [
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": big}}]}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi", "context": big}]}),
        json!({"model": MODEL, "messages": user("hi"), "documents": [big]}),
    ] {
        let r = g.chat("c-ctx", body, &[]).await;
        assert_eq!(
            (r.status, r.code()),
            (400, "context_too_large".into()),
            "{}",
            r.text
        );
    }
    // With a BPE tokenizer: more text than 16 bytes a token of the context bound is refused
    // before it is counted (a million spaces would cost the tokenizer seconds, and crash
    // it); a long prompt under that bound is counted off the async workers, and refused.
    for (what, text) in [
        ("spaces", " ".repeat(1_000_000)),
        (
            "prose",
            "the quick brown fox jumps over the lazy dog ".repeat(600),
        ),
    ] {
        let started = std::time::Instant::now();
        let r = g
            .chat(
                "c-bpe",
                json!({"model": "bpe-model", "messages": [
                    {"role": "system", "content": text}, {"role": "user", "content": "hi"}]}),
                &[],
            )
            .await;
        assert_eq!(
            (r.status, r.code()),
            (400, "context_too_large".into()),
            "{what}: {}",
            r.text
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "{what}: refused in {:?}",
            started.elapsed()
        );
    }
    // A tool result over max_tool_result_bytes (1000) fed back.
    let r = g
        .chat(
            "c-tool",
            json!({"model": MODEL, "messages": [
                {"role": "user", "content": "search"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "web_search", "arguments": "{\"q\":\"x\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "r".repeat(1001)}]}),
            &[],
        )
        .await;
    assert_eq!(
        (r.status, r.code()),
        (400, "run_bound_exceeded".into()),
        "{}",
        r.text
    );
    assert_eq!(r.json()["error"]["scope"], "run");
    // A model that is not configured.
    let r = g
        .chat(
            "c-m",
            json!({"model": "gpt-4o", "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!((r.status, r.code()), (400, "model_not_allowed".into()));
    // Unparseable and shapeless requests.
    let r = g
        .chat("c-m", json!({"model": MODEL, "messages": "hi"}), &[])
        .await;
    assert_eq!((r.status, r.code()), (400, "invalid_request".into()));
    let r = g
        .chat(
            "c-m",
            json!({"model": MODEL, "max_tokens": -5, "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!((r.status, r.code()), (400, "invalid_request".into()));
    // What the upstream charges beyond text tokens at the configured prices: an image (a
    // short URL, a thousand tokens upstream), audio output, a priority tier; more than one
    // paid choice, however spelled; a `stream` that is not a boolean.
    for extra in [
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}),
        json!({"messages": user("hi"), "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}),
        json!({"messages": user("hi"), "service_tier": "priority"}),
        json!({"messages": user("hi"), "n": 2}),
        json!({"messages": user("hi"), "n": 2.0}),
        json!({"messages": user("hi"), "n": "2"}),
        json!({"messages": user("hi"), "n": 1.0}),
        json!({"messages": user("hi"), "stream": "true"}),
        json!({"messages": user("hi"), "stream": 1}),
    ] {
        let mut body = json!({"model": MODEL});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let r = g.chat("c-priced", body, &[]).await;
        assert_eq!(
            (r.status, r.code()),
            (400, "invalid_request".into()),
            "{extra}: {}",
            r.text
        );
    }
    // No identity.
    let r = g
        .server
        .http
        .post(g.server.url("/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": user("hi")}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 401);
    let r = g
        .server
        .http
        .post(g.server.url("/v1/chat/completions"))
        .bearer_auth("not-the-token")
        .header("spendgate-session", &g.session)
        .header("spendgate-client-ip", "10.1.2.3")
        .header("spendgate-conversation", "c")
        .json(&json!({"model": MODEL, "messages": user("hi")}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 401);
    let r = g
        .server
        .http
        .post(g.server.url("/v1/chat/completions"))
        .bearer_auth(SERVICE)
        .header("spendgate-session", "forged")
        .header("spendgate-client-ip", "10.1.2.3")
        .header("spendgate-conversation", "c")
        .json(&json!({"model": MODEL, "messages": user("hi")}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 401);

    assert_eq!(
        g.mock.stats().requests,
        before,
        "nothing reached the upstream"
    );
    let after = g.server.admin_get("/admin/v1/summary").await;
    assert_eq!(
        summary["reservations"], after["reservations"],
        "nothing was reserved"
    );

    // An upstream that refuses our key (and echoes it): the client gets a 502 of ours, not
    // the upstream's 401 (its own key is fine) and never the key; nothing is charged.
    let r = g
        .chat(
            "c-key",
            json!({"model": "refused-key", "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!(
        (r.status, r.code()),
        (502, "upstream_error".into()),
        "{}",
        r.text
    );
    r.assert_no_key();
    let row = g.reservation(&r.step()).await;
    assert_eq!(
        (row["state"].as_str(), row["charged_micros"].as_u64()),
        (Some("released"), Some(0))
    );
    // An upstream that cannot be reached: the request never left, nothing is charged (and
    // the failed call is timed like any upstream call).
    let timed = g.metric("spendgate_upstream_call_seconds_count ").await;
    let r = g
        .chat(
            "c-down",
            json!({"model": "unreachable", "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!(
        (r.status, r.code()),
        (502, "upstream_unreachable".into()),
        "{}",
        r.text
    );
    assert_eq!(
        g.metric("spendgate_upstream_call_seconds_count ").await,
        timed + 1
    );
    let row = g.reservation(&r.step()).await;
    assert_eq!(
        (row["state"].as_str(), row["charged_micros"].as_u64()),
        (Some("released"), Some(0))
    );
    assert_eq!(g.global().await["used_micros"], 0);
}

/// Acceptance: 200 concurrent calls (half streamed) against a global budget that covers 50
/// of their reservations: the mock serves at most the budget's worth (its own count is the
/// ground truth), and every refused call gets 429 `budget_exhausted`, or `budget_held` (a
/// wait, retry invited) while other calls' holds take the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_never_overspend_the_global_budget() {
    // 10 and 30 micros per token: a "hello" call reserves 16 × 10 + 100 × 30 = 3160 (bytes
    // bound: 3 + 4 + "user" + "hello") and the mock reports 9 × 10 + 100 × 30 = 3090.
    let prices = Prices {
        input: 10_000_000,
        cached: 10_000_000,
        output: 30_000_000,
    };
    let g = Arc::new(
        Gateway::start(Opts {
            global_budget: "0.158", // 50 × 3160
            prices,
            ..Opts::default()
        })
        .await,
    );
    let mut tasks = Vec::new();
    for i in 0..200 {
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": MODEL, "stream": i % 2 == 0, "messages": user("hello")});
            g.chat(
                &format!("conv-{i}"),
                body,
                &[
                    ("x-mock-completion-tokens", "100"),
                    ("x-mock-latency-ms", "50"),
                ],
            )
            .await
        }));
    }
    let (mut served, mut refused) = (0u64, 0u64);
    for t in tasks {
        let r = t.await.expect("task");
        match r.status {
            200 => {
                assert_eq!(r.reserved(), 3160);
                served += 1;
            }
            429 => {
                let v = r.json();
                let retry = match code(&v) {
                    "budget_exhausted" => "false",
                    "budget_held" => "true",
                    _ => panic!("{v}"),
                };
                assert_eq!(v["error"]["scope"], "global");
                assert_eq!(r.header("x-should-retry").as_deref(), Some(retry));
                assert!(r.header("retry-after").is_some());
                refused += 1;
            }
            s => panic!("unexpected {s}: {}", r.text),
        }
    }
    assert_eq!(served + refused, 200);
    let stats = g.mock.stats();
    assert_eq!(
        stats.requests, served,
        "only admitted calls reach the upstream"
    );
    assert_eq!(stats.completed, served);
    let served_worth = priced_delta(prices, &MockStats::default(), &stats);
    assert!(
        served_worth <= 156_000,
        "the mock served {served_worth} micros, over the budget"
    );
    assert_eq!(served, 50, "the budget covers exactly 50 such calls");
    let global = g.global().await;
    assert_eq!(global["used_micros"], served_worth, "books = ground truth");
    assert_eq!(global["reserved_micros"], 0);
}

/// SPEC §8 through the proxy: with the global budget in dry-run, the call past it is still
/// forwarded, marked `Spendgate-Dry-Run`, counted, and charged at the upstream's usage like
/// any other: the books stay equal to what the mock served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_in_dry_run_reports_and_forwards() {
    let prices = Prices {
        input: 10_000_000,
        cached: 10_000_000,
        output: 30_000_000,
    };
    let g = Gateway::start(Opts {
        global_budget: "0.00632", // 2 × 3160: two "hello" calls
        global_dry_run: true,
        prices,
        ..Opts::default()
    })
    .await;
    let mut marks = Vec::new();
    for i in 0..3 {
        let body = json!({"model": MODEL, "stream": i == 2, "messages": user("hello")});
        let r = g
            .chat(
                &format!("dry-{i}"),
                body,
                &[("x-mock-completion-tokens", "100")],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.reserved(), 3160);
        marks.push(r.header("spendgate-dry-run"));
    }
    assert_eq!(
        marks,
        vec![
            None,
            None,
            Some("budget_exhausted; scope=global".to_string())
        ]
    );
    assert_eq!(
        g.metric("spendgate_dry_run_refusals_total{what=\"proxy_step\",code=\"budget_exhausted\",scope=\"global\"}")
            .await,
        1
    );
    let stats = g.mock.stats();
    assert_eq!(stats.requests, 3, "a limit in dry-run forwards");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let global = g.global().await;
        if global["reserved_micros"] == 0 {
            assert_eq!(
                global["used_micros"],
                priced_delta(prices, &MockStats::default(), &stats),
                "books = ground truth: {global}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "never reconciled: {global}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Acceptance: each fault mode ends in the right terminal state, the client gets a clear
/// error, and the books reconcile with what the mock counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fault_modes_end_in_the_right_state_and_reconcile() {
    let g = Gateway::start(Opts {
        timeout_s: 1,
        ..Opts::default()
    })
    .await;
    struct Case {
        fault: &'static str,
        stream: bool,
        status: u16,
        state: &'static str,
        code: &'static str,
    }
    let case = |fault, stream, status, state, code| Case {
        fault,
        stream,
        status,
        state,
        code,
    };
    let cases = [
        case("none", false, 200, "committed", ""),
        case("http_429", false, 429, "released", "rate_limit_exceeded"),
        case("http_429", true, 429, "released", "rate_limit_exceeded"),
        case("http_500", false, 500, "released", ""),
        case("http_500", true, 500, "released", ""),
        // A gateway's timeout after the provider generated: the work may have been done.
        case("http_504", false, 504, "unknown", ""),
        case("http_504", true, 504, "unknown", ""),
        case("drop_mid_stream", false, 502, "unknown", "upstream_error"),
        case("drop_mid_stream", true, 200, "unknown", "upstream_error"),
        case("hang", false, 504, "unknown", "upstream_timeout"),
        case("hang", true, 504, "unknown", "upstream_timeout"),
        case("no_usage", false, 200, "unknown", ""),
        case("no_usage", true, 200, "unknown", ""),
        case("usage_over", false, 200, "committed", ""),
        case("usage_over", true, 200, "committed", ""),
        case("tool_call", false, 200, "committed", ""),
        case("tool_call", true, 200, "committed", ""),
    ];
    let mut total_charged = 0u64;
    for (i, c) in cases.iter().enumerate() {
        let what = format!("{} stream={}", c.fault, c.stream);
        let before = g.mock.stats();
        let started = Instant::now();
        let r = g
            .chat(
                &format!("fault-{i}"),
                json!({"model": MODEL, "stream": c.stream, "messages": user("misbehave")}),
                &[("x-mock-fault", c.fault)],
            )
            .await;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what}: bounded"
        );
        assert_eq!(r.status, c.status, "{what}: {}", r.text);
        r.assert_no_key();
        let after = g.mock.stats();
        assert_eq!(after.requests, before.requests + 1, "{what}: one attempt");
        let row = g.reservation(&r.step()).await;
        assert_eq!(row["state"], c.state, "{what}: {row}");
        let charged = row["charged_micros"].as_u64().expect("charged");
        let reserved = row["reserved_micros"].as_u64().expect("reserved");
        let served = priced_delta(g.prices, &before, &after);
        match c.state {
            "released" => {
                assert_eq!(charged, 0, "{what}");
                assert_eq!(served, 0, "{what}: the mock served nothing");
            }
            "unknown" => {
                assert_eq!(charged, reserved, "{what}: charged in full");
                assert!(served <= charged, "{what}: the hold covers what was served");
            }
            _ => {
                assert_eq!(charged, served, "{what}: charged what the mock counted");
            }
        }
        total_charged += charged;
        // What the client sees.
        match (c.fault, c.stream) {
            ("usage_over", _) => {
                assert!(charged > reserved, "{what}: an overrun");
                assert_eq!(row["overrun"], true);
            }
            ("tool_call", false) => {
                let v = r.json();
                assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
                assert_eq!(
                    v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
                    "web_search"
                );
            }
            ("tool_call", true) => {
                assert!(r.text.contains("\"tool_calls\""), "{}", r.text);
                assert_eq!(r.events().last().map(String::as_str), Some("[DONE]"));
            }
            ("drop_mid_stream", true) => {
                // The stream started, then ends with an OpenAI-shaped error event.
                let events = r.events();
                let last: Value =
                    serde_json::from_str(events.last().expect("events")).expect("json");
                assert_eq!(last["error"]["code"], c.code, "{}", r.text);
                assert!(events.len() >= 2, "content came first: {}", r.text);
                assert!(!r.text.contains("[DONE]"));
            }
            ("no_usage", true) => {
                assert_eq!(r.events().last().map(String::as_str), Some("[DONE]"));
            }
            _ if !c.code.is_empty() => {
                assert_eq!(r.code(), c.code, "{what}: {}", r.text);
            }
            _ => {}
        }
        // (the upstream's own 5xx pass through as they came)
        if c.status >= 500 && !c.fault.starts_with("http_") {
            assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
        }
    }
    let global = g.global().await;
    assert_eq!(global["used_micros"], total_charged, "the books reconcile");
    assert_eq!(global["reserved_micros"], 0);
    assert!(g.metric("spendgate_overruns_total ").await >= 2);
    assert!(g.metric("spendgate_unknown_outcomes_total ").await >= 6);
}

/// `run.max_input_bytes` bounds what the caller wrote: a guest calling with its cookie wrote
/// the whole history, so every message counts; the operator's backend composes the history,
/// so only its last user message does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guests_whole_history_is_its_input() {
    let g = Gateway::start(Opts {
        browser_direct: true,
        max_input_bytes: 100,
        ..Opts::default()
    })
    .await;
    let history = json!({"model": MODEL, "messages": [
        {"role": "user", "content": "x".repeat(150)},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "hi"}]});
    let served = g.mock.stats().requests;
    let guest = g.server.session().await;
    let r = Gateway::send(g.guest_chat(&guest).json(&history)).await;
    assert_eq!(
        (r.status, r.code()),
        (413, "payload_too_large".into()),
        "{}",
        r.text
    );
    assert_eq!(
        g.mock.stats().requests,
        served,
        "never reached the upstream"
    );
    let r = g.chat("backend", history, &[]).await;
    assert_eq!(r.status, 200, "the backend's history: {}", r.text);
    // Text in any other billed field is the guest's input too (a short message with a long
    // tool description is no way around the bound).
    let tools = json!({"model": MODEL, "messages": user("summarise the tool"), "tools": [
        {"type": "function", "function": {"name": "doc", "description": "y".repeat(150)}}]});
    let r = Gateway::send(g.guest_chat(&guest).json(&tools)).await;
    assert_eq!(
        (r.status, r.code()),
        (413, "payload_too_large".into()),
        "{}",
        r.text
    );
    assert_eq!(
        g.mock.stats().requests,
        served + 1,
        "only the backend's call"
    );
}

/// An overrun through the proxy (the upstream reports more output than was bounded) is
/// alerted like one committed through the decision API, naming the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxied_overrun_is_alerted() {
    let (url, got, task) = crate::alerts::receiver().await;
    let g = Gateway::start(Opts {
        webhook: Some(url),
        ..Opts::default()
    })
    .await;
    let r = g
        .chat(
            "over",
            json!({"model": MODEL, "messages": user("misbehave")}),
            &[("x-mock-fault", "usage_over")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    crate::alerts::wait_for(&got, "overrun").await;
    let o = crate::alerts::events(&got, "overrun");
    assert_eq!(o.len(), 1, "{o:?}");
    assert_eq!(o[0]["step"], r.step().as_str(), "{o:?}");
    assert!(o[0]["charged_micros"].as_u64() > o[0]["reserved_micros"].as_u64());
    task.abort();
}

/// With `Spendgate-Run` a call is a step of that run: it counts as a model round (or a retry
/// with `Spendgate-Retry: 1`), and the run stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_can_be_a_step_of_an_existing_run() {
    let g = Gateway::start(Opts::default()).await;
    let run = g.server.run(&g.session, "10.1.2.3", "c-run").await;
    let body = json!({"model": MODEL, "messages": user("step")});
    for _ in 0..3 {
        let r = g
            .chat("c-run", body.clone(), &[("spendgate-run", &run)])
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("spendgate-run"), Some(run.clone()));
        let row = g.reservation(&r.step()).await;
        assert_eq!(row["run_id"], run);
        assert_eq!(row["state"], "committed");
    }
    // max_model_rounds = 3: a fourth round is refused before the upstream, a retry is not.
    let before = g.mock.stats().requests;
    let r = g
        .chat("c-run", body.clone(), &[("spendgate-run", &run)])
        .await;
    assert_eq!(
        (r.status, r.code()),
        (400, "run_bound_exceeded".into()),
        "{}",
        r.text
    );
    assert_eq!(g.mock.stats().requests, before);
    let r = g
        .chat(
            "c-run",
            body.clone(),
            &[("spendgate-run", &run), ("spendgate-retry", "1")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = g
        .chat(
            "c-run",
            body.clone(),
            &[("spendgate-run", &run), ("spendgate-retry", "1")],
        )
        .await;
    assert_eq!((r.status, r.code()), (400, "run_bound_exceeded".into()));
    // The run is still active (the proxy did not finish it); finishing it works.
    let (status, v) = g
        .server
        .post(&format!("/v1/runs/{run}/finish"), json!({}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["steps"], 4);
    // A step of a finished or unknown run is refused.
    let r = g
        .chat("c-run", body.clone(), &[("spendgate-run", &run)])
        .await;
    assert!(r.status >= 400, "{}", r.text);
    let r = g
        .chat("c-run", body, &[("spendgate-run", "run_doesnotexist")])
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
}

/// A client that goes away mid-stream: the step is charged in full (`unknown`) and its
/// one-step run finished, so nothing stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_gone_mid_stream_is_charged_in_full() {
    let g = Gateway::start(Opts::default()).await;
    let (step, body) = g.slow_stream("c-gone", 100).await;
    drop(body);
    let row = g.reservation(&step).await;
    assert_eq!(row["state"], "unknown");
    assert_eq!(row["charged_micros"], row["reserved_micros"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = g.server.admin_get("/admin/v1/summary").await;
        if s["runs_active"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "run not finished: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client that goes away after the first event of a stream whose upstream writes its whole
/// answer at once, far past the bound and without usage (finding 3 of issue 18, seen by the
/// chaos run): what the upstream had sent is still read and counted after the client left,
/// and the step is charged at least what the upstream served, not only its reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_gone_from_a_stream_past_its_bound_is_charged_what_was_served() {
    let g = Gateway::start(Opts::default()).await;
    let before = g.mock.stats();
    let (step, body) = g.stream_past_its_bound("c-gone-past", None).await;
    drop(body);
    let row = g.reservation(&step).await;
    let after = g.mock.stats();
    assert_eq!(
        after.completion_tokens - before.completion_tokens,
        900,
        "the mock served its whole answer: the bound (100) and 800 past it"
    );
    let served = priced_delta(g.prices, &before, &after);
    let charged = row["charged_micros"].as_u64().expect("charged");
    assert!(
        charged >= served,
        "charged {charged} < served {served}: {row}"
    );
    assert!(
        charged > row["reserved_micros"].as_u64().expect("reserved"),
        "charged above the reservation: {row}"
    );
}

/// A stream whose upstream wrote far past its bound, and whose run its backend finished
/// mid-stream (the client still reading, or gone): the finish charges the held step its
/// reservation (`unknown`); what the upstream had sent is still read and counted, and the
/// charge raised to it (a late overrun), never left below what was served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_finished_under_a_stream_past_its_bound_is_charged_what_was_served() {
    let g = Gateway::start(Opts::default()).await;
    for leave in [false, true] {
        let conversation = format!("c-finished-{leave}");
        let run = g.server.run(&g.session, "10.1.2.3", &conversation).await;
        let before = g.mock.stats();
        let (step, body) = g.stream_past_its_bound(&conversation, Some(&run)).await;
        if leave {
            drop(body);
        }
        let (status, v) = g
            .server
            .post(&format!("/v1/runs/{run}/finish"), json!({}))
            .await;
        assert_eq!(status, 200, "leave={leave}: {v}");
        // The upstream writes its whole answer (the proxy goes on reading it); the late
        // overrun lands once the proxy has read it (bounded).
        let deadline = Instant::now() + Duration::from_secs(10);
        while g.mock.stats().completion_tokens - before.completion_tokens < 900 {
            assert!(
                Instant::now() < deadline,
                "leave={leave}: the mock did not finish"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (row, served) = loop {
            let row = g.reservation(&step).await;
            let served = priced_delta(g.prices, &before, &g.mock.stats());
            let charged = row["charged_micros"].as_u64().expect("charged");
            if charged >= served || Instant::now() > deadline {
                break (row, served);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let charged = row["charged_micros"].as_u64().expect("charged");
        assert!(
            charged >= served,
            "leave={leave}: charged {charged} < served {served}: {row}"
        );
        assert_eq!(row["state"], "unknown", "leave={leave}: {row}");
        assert_eq!(row["overrun"], true, "leave={leave}: {row}");
    }
}

// ---------------------------------------------------------------------------------------
// Real clients.

/// Conversation budget 1000 micros at 10/10/30 micros per token: a call with `max_tokens` 10
/// fits (≈ 430), one with the default bound of 100 (≈ 3130) is refused for budget.
fn client_opts() -> Opts {
    Opts {
        conversation_budget: "0.001",
        prices: Prices {
            input: 10_000_000,
            cached: 10_000_000,
            output: 30_000_000,
        },
        ..Opts::default()
    }
}

/// Acceptance: the official `openai` Python package creates and streams chat completions
/// through the proxy, and reads a budget refusal as `openai.RateLimitError` with the SPEC code.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn official_openai_python_client() {
    let g = Gateway::start(client_opts()).await;
    let prices = format!("{},{},{}", g.prices.input, g.prices.cached, g.prices.output);
    let env = [
        ("SPENDGATE_METRICS_URL", g.server.url("/metrics")),
        ("SPENDGATE_ADMIN_TOKEN", ADMIN.to_string()),
        ("SPENDGATE_MODEL", MODEL.to_string()),
        ("SPENDGATE_PRICES", prices),
    ];
    g.run_checks("test_proxy_openai.py", "/v1", &env, 8).await;
    assert!(g.mock.stats().requests >= 3);
}

/// Acceptance: a Rust OpenAI client (`async-openai`, default settings: it retries 429s
/// unless they say the quota is spent) makes a normal call, a streamed call, and reads a
/// budget refusal without retrying it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rust_openai_client() {
    use async_openai::config::OpenAIConfig;
    use async_openai::error::OpenAIError;
    use async_openai::types::chat::{
        ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs,
    };
    use async_openai::Client;

    let g = Gateway::start(client_opts()).await;
    let client = |conversation: &str| {
        let config = OpenAIConfig::new()
            .with_api_base(g.server.url("/v1"))
            .with_api_key(SERVICE)
            .with_header("spendgate-session", g.session.as_str())
            .and_then(|c| c.with_header("spendgate-client-ip", "10.7.7.7"))
            .and_then(|c| c.with_header("spendgate-conversation", conversation))
            .expect("headers");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .expect("http client");
        Client::build(http, config)
    };
    let request = |max_tokens: Option<u32>| {
        let mut b = CreateChatCompletionRequestArgs::default();
        b.model(MODEL)
            .messages([ChatCompletionRequestUserMessageArgs::default()
                .content("Say hi")
                .build()
                .expect("message")
                .into()]);
        if let Some(m) = max_tokens {
            b.max_completion_tokens(m);
        }
        b.build().expect("request")
    };

    // A normal call, charged at its usage.
    let used_before = g.global().await["used_micros"].as_u64().unwrap_or(0);
    let resp = client("rust-1")
        .chat()
        .create(request(Some(10)))
        .await
        .expect("chat completion");
    let content = resp.choices[0].message.content.clone().unwrap_or_default();
    assert!(content.starts_with("tok0"), "{content}");
    let usage = resp.usage.expect("usage");
    assert_eq!(usage.completion_tokens, 10);
    let used_after = g.global().await["used_micros"].as_u64().unwrap_or(0);
    let cached = usage
        .prompt_tokens_details
        .as_ref()
        .and_then(|d| d.cached_tokens)
        .unwrap_or(0);
    assert_eq!(
        used_after - used_before,
        g.charge(&json!({"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}))
    );

    // A stream: every chunk parses and has its choice (the usage chunk the proxy asked for
    // is not passed to a client that did not ask).
    let mut stream = client("rust-2")
        .chat()
        .create_stream(request(Some(10)))
        .await
        .expect("stream");
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Some(chunk) = stream.next().await {
        assert!(Instant::now() < deadline);
        let chunk = chunk.expect("chunk");
        assert_eq!(chunk.choices.len(), 1);
        if let Some(t) = &chunk.choices[0].delta.content {
            text.push_str(t);
        }
    }
    assert_eq!(text.split(' ').count(), 10, "{text}");

    // A refusal: 429 budget_exhausted, seen at once, not retried.
    let refused_metric =
        "spendgate_refusals_total{what=\"proxy_step\",code=\"budget_exhausted\",scope=\"conversation\"} ";
    let refusals_before = g.metric(refused_metric).await;
    let started = Instant::now();
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        client("rust-3").chat().create(request(None)),
    )
    .await
    .expect("a refusal is not retried for long")
    .expect_err("refused");
    assert!(started.elapsed() < Duration::from_secs(5));
    match err {
        OpenAIError::ApiError(e) => {
            assert_eq!(e.status_code.as_u16(), 429);
            assert_eq!(e.api_error.code.as_deref(), Some("budget_exhausted"));
        }
        other => panic!("expected an API error, got {other:?}"),
    }
    assert_eq!(
        g.metric(refused_metric).await,
        refusals_before + 1,
        "the client did not retry"
    );
}

// ---------------------------------------------------------------------------------------
// `spendgate demo`.

/// `spendgate demo` needs no config: the gateway, its built-in mock upstream and the demo page;
/// a guest with only the cookie can chat.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn demo_starts_and_a_cookie_call_works() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut child, port) = start_demo(dir.path());
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client");
    let page = http
        .get(format!("{base}/demo/"))
        .send()
        .await
        .expect("page");
    assert_eq!(page.status().as_u16(), 200);
    assert!(page
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("text/html")));
    let html = page.text().await.expect("html");
    assert!(html.contains("/v1/chat/completions") && html.contains("/v1/sessions"));

    let s = http
        .post(format!("{base}/v1/sessions"))
        .json(&json!({}))
        .send()
        .await
        .expect("session");
    assert_eq!(s.status().as_u16(), 201);
    let cookie = s
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .and_then(|c| c.split(';').next())
        .expect("cookie")
        .to_string();
    assert!(cookie.starts_with("spendgate_session="), "{cookie}");
    let models: Value = http
        .get(format!("{base}/demo/models"))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("models json");
    let model = models["models"][0]
        .as_str()
        .expect("a demo model")
        .to_string();
    for stream in [false, true] {
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .header("cookie", &cookie)
            .json(&json!({"model": model, "stream": stream, "messages": user("hello demo")}))
            .send()
            .await
            .expect("chat");
        assert_eq!(r.status().as_u16(), 200);
        let text = r.text().await.expect("body");
        assert!(text.contains("tok0"), "{text}");
    }
    // A guest cannot attach a call to a run (runs are the operator backend's).
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .header("cookie", &cookie)
        .header("spendgate-run", "run_0123456789abcdef")
        .json(&json!({"model": model, "messages": user("hello")}))
        .send()
        .await
        .expect("chat");
    assert_eq!(r.status().as_u16(), 401);
    // Without the cookie: refused.
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": model, "messages": user("hello")}))
        .send()
        .await
        .expect("chat");
    assert_eq!(r.status().as_u16(), 401);
    let usage: Value = http
        .get(format!("{base}/v1/usage"))
        .header("cookie", &cookie)
        .send()
        .await
        .expect("usage")
        .json()
        .await
        .expect("usage json");
    let session_used = usage["scopes"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["kind"] == "global"))
        .and_then(|s| s["used_micros"].as_u64())
        .unwrap_or(0);
    assert!(session_used > 0, "{usage}");
    child.terminate().expect("terminate");
}

/// Starts a slow call (`tokens` at 10 a second) streamed and one not, on conversations
/// `{prefix}-true` and `{prefix}-false`; each task answers (streamed, reply, time taken).
fn long_calls(
    g: &Arc<Gateway>,
    prefix: &str,
    tokens: &'static str,
) -> Vec<tokio::task::JoinHandle<(bool, Reply, Duration)>> {
    [true, false]
        .into_iter()
        .map(|stream| {
            let g = g.clone();
            let conversation = format!("{prefix}-{stream}");
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let r = g
                    .chat(
                        &conversation,
                        json!({"model": MODEL, "stream": stream, "messages": user("tell me a long story")}),
                        &[
                            ("x-mock-completion-tokens", tokens),
                            ("x-mock-tokens-per-second", "10"),
                        ],
                    )
                    .await;
                (stream, r, started.elapsed())
            })
        })
        .collect()
}

/// A call that outlasts the lease keeps its run alive: the proxy renews the lease while the
/// upstream works, so the conversation's one generation slot stays taken and the step is
/// committed at its usage, not expired and charged in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_longer_than_the_lease_keeps_its_slot_and_is_committed() {
    let g = Arc::new(
        Gateway::start(Opts {
            lease_ttl_s: 1,
            ..Opts::default()
        })
        .await,
    );
    // (40 tokens at 10 a second: 4 s of generation)
    let long = long_calls(&g, "c-long", "40");
    // Past the lease (1 s) and the sweeper's period, while both calls are still running.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for stream in [true, false] {
        let r = g
            .chat(
                &format!("c-long-{stream}"),
                json!({"model": MODEL, "messages": user("hi")}),
                &[],
            )
            .await;
        assert_eq!(
            (r.status, r.code()),
            (429, "concurrency_limited".into()),
            "stream {stream}: {}",
            r.text
        );
    }
    for t in long {
        let (_, r, _) = t.await.expect("task");
        assert_eq!(r.status, 200, "{}", r.text);
        let row = g.reservation(&r.step()).await;
        assert_eq!(row["state"], "committed", "{row}");
        assert!(
            row["charged_micros"].as_u64() < Some(r.reserved()),
            "charged at usage, not in full: {row}"
        );
    }
    assert_eq!(g.global().await["reserved_micros"], 0);
}

/// A run never exceeds its seconds (I5): a proxied call still running at its run's deadline
/// is cut there, streamed or not, and charged in full (its lease ends with the deadline, so
/// its usage could no longer be committed); the run's conversation is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_runs_deadline_is_cut_and_charged_in_full() {
    let g = Arc::new(
        Gateway::start(Opts {
            max_seconds: 2,
            ..Opts::default()
        })
        .await,
    );
    // (60 tokens at 10 a second: 6 s of generation)
    for c in long_calls(&g, "c-late", "60") {
        let (stream, r, took) = c.await.expect("task");
        assert!(
            took < Duration::from_millis(4_000),
            "stream {stream}: the 6 s call ended after {took:?}, past the 2 s deadline"
        );
        if stream {
            assert_eq!(r.status, 200, "{}", r.text);
            assert!(
                r.text.contains("run_deadline_exceeded"),
                "the stream ends with the reason: {}",
                r.text
            );
        } else {
            assert!([502, 504].contains(&r.status), "{} {}", r.status, r.text);
        }
        let row = g.reservation(&r.step()).await;
        // `unknown` when the cut's resolution came first, `expired` when the lease's end at
        // the deadline did: charged in full either way.
        assert!(
            row["state"] == "unknown" || row["state"] == "expired",
            "stream {stream}: {row}"
        );
        assert_eq!(
            row["charged_micros"], row["reserved_micros"],
            "stream {stream}: charged in full: {row}"
        );
        let again = g
            .chat(
                &format!("c-late-{stream}"),
                json!({"model": MODEL, "messages": user("hi")}),
                &[],
            )
            .await;
        assert_eq!(
            again.status, 200,
            "the conversation is free: {}",
            again.text
        );
    }
    assert_eq!(g.global().await["reserved_micros"], 0);
}

/// Browser-direct: a guest names its conversation freely, and gets its own. Another guest
/// naming the same id neither takes its one generation slot nor reads or spends its
/// conversation budget; the same guest naming it again is one conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guests_conversation_is_its_own() {
    // A guest cannot pace the mock (its `x-mock-*` headers are not forwarded): a second
    // mock, slow by its own config, serves "slow-model".
    let (slow_port, slow_task) = slow_mock().await;
    let g = Arc::new(
        Gateway::start(Opts {
            browser_direct: true,
            extra: slow_model_config(slow_port),
            ..Opts::default()
        })
        .await,
    );
    let guest = |token: String, conversation: &'static str, body: Value| {
        let g = g.clone();
        async move {
            let req = g
                .guest_chat(&token)
                .header("spendgate-conversation", conversation)
                .json(&body);
            Gateway::send(req).await
        }
    };
    let a = g.server.session().await;
    let b = g.server.session().await;
    let slow = json!({"model": "slow-model", "stream": true, "messages": user("a long story")});
    let long = tokio::spawn(guest(a.clone(), "chat-1", slow.clone()));
    // (the mock streams 20 tokens at 10 a second: two seconds of generation)
    tokio::time::sleep(Duration::from_millis(500)).await;
    let hi = json!({"model": MODEL, "messages": user("hi")});
    let r = guest(b.clone(), "chat-1", hi.clone()).await;
    assert_eq!(
        r.status, 200,
        "another guest's chat-1 is another conversation: {}",
        r.text
    );
    let r = guest(a.clone(), "chat-1", hi.clone()).await;
    assert_eq!(
        (r.status, r.code()),
        (429, "concurrency_limited".into()),
        "the same guest's chat-1 is busy: {}",
        r.text
    );
    let r = long.await.expect("task");
    assert_eq!(r.status, 200, "{}", r.text);
    // Each guest's usage of chat-1 is its own conversation's.
    for token in [&a, &b] {
        let v = g.guest_usage(token, "?conversation=chat-1").await;
        let conv: Vec<&Value> = v["scopes"]
            .as_array()
            .expect("scopes")
            .iter()
            .filter(|s| s["kind"] == "conversation")
            .collect();
        assert!(!conv.is_empty(), "{v}");
        assert!(
            conv.iter()
                .all(|s| s["id"] != "chat-1" && s["used_micros"].as_u64() > Some(0)),
            "a namespaced conversation with this guest's spend: {v}"
        );
    }
    // A call that names no conversation is billed to the session's own, which the guest's
    // usage shows when it names none either.
    let c = g.server.session().await;
    let r = Gateway::send(g.guest_chat(&c).json(&hi)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let v = g.guest_usage(&c, "").await;
    let spent = |kind: &str| {
        v["scopes"]
            .as_array()
            .expect("scopes")
            .iter()
            .filter(|s| s["kind"] == kind)
            .map(|s| s["used_micros"].as_u64().unwrap_or(0))
            .max()
    };
    assert!(
        spent("conversation") > Some(0),
        "the session's own conversation, with the call's spend: {v}"
    );
    slow_task.abort();
}

/// A mock answering 20 tokens at 10 a second (two seconds a stream) by its own config: its
/// port and task.
async fn slow_mock() -> (u16, tokio::task::JoinHandle<std::io::Result<()>>) {
    let slow = MockUpstream::new(MockConfig {
        completion_tokens: 20,
        tokens_per_second: 10,
        ..MockConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind slow mock");
    let port = listener.local_addr().expect("slow mock addr").port();
    (port, tokio::spawn(slow.serve(listener)))
}

/// `[models.slow-model]` on the [`slow_mock`] at `port`, priced as [`MODEL`] by default.
fn slow_model_config(port: u16) -> String {
    let p = Opts::default().prices;
    format!(
        r#"
[models.slow-model]
upstream = "slow"
input_per_million = "{input}"
cached_input_per_million = "{cached}"
output_per_million = "{output}"
tokenizer = "bytes"

[upstreams.slow]
base_url = "http://127.0.0.1:{port}/v1"
"#,
        input = amount(p.input),
        cached = amount(p.cached),
        output = amount(p.output),
    )
}

/// The words (the mock's tokens) of a reply's content, streamed or not.
fn content_words(r: &Reply) -> u64 {
    let mut text = String::new();
    if let Some(c) = r.json()["choices"][0]["message"]["content"].as_str() {
        text.push_str(c);
    }
    for e in r.events() {
        if let Ok(v) = serde_json::from_str::<Value>(&e) {
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(c);
            }
        }
    }
    text.split_whitespace().count() as u64
}

/// The `usage` objects of a streamed reply's events, in order.
fn usages(r: &Reply) -> Vec<Value> {
    r.events()
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
        .collect()
}

/// A stream's usage is trusted only when it covers the whole answer: sent last (no content
/// after it), in no error event, and followed by `[DONE]` or in a final, choices-less chunk.
/// Else the step is charged in full (`unknown`), unless a usage read or the output counted
/// costs more than the reservation: that is then committed, an overrun (a stream past its
/// bound is also cut there). Of several usages, the fewest cached tokens are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn untrusted_stream_usages_are_charged_in_full_or_above() {
    // One micro a prompt token, half one cached, 100 an output token: a usage past a small
    // output bound costs more than the reservation whatever the prompt bound.
    let g = Gateway::start(Opts {
        prices: Prices {
            input: 1_000_000,
            cached: 500_000,
            output: 100_000_000,
        },
        ..Opts::default()
    })
    .await;
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Expect {
        /// `unknown`, charged the reservation.
        InFull,
        /// Past its bound: cut there, and committed above the reservation, at least what
        /// the mock served.
        Overrun,
        /// Committed at what the mock served.
        Served,
    }
    use Expect::*;
    let fault = |f| ("x-mock-fault", f);
    const RUNNING: (&str, &str) = ("x-mock-running-usage", "1");
    const EXTRA: (&str, &str) = ("x-mock-extra-completion-tokens", "20");
    /// The mock's headers, the request's `max_tokens`, the outcome.
    type Case = (Vec<(&'static str, &'static str)>, Option<u64>, Expect);
    let cases: Vec<Case> = vec![
        // Content after the usage.
        (vec![fault("content_after_usage")], None, InFull),
        (vec![fault("content_after_usage"), EXTRA], Some(1), Overrun),
        // Cut after a running usage.
        (vec![fault("drop_mid_stream"), RUNNING], None, InFull),
        (
            vec![fault("drop_mid_stream"), RUNNING, EXTRA],
            Some(1),
            Overrun,
        ),
        // An error event carrying a usage, then [DONE].
        (vec![fault("error_event")], None, InFull),
        (vec![fault("error_event"), EXTRA], Some(1), Overrun),
        // A clean end after a running usage, without [DONE] or a final usage chunk.
        (vec![fault("clean_cut"), RUNNING], None, InFull),
        (vec![fault("clean_cut"), RUNNING, EXTRA], Some(1), Overrun),
        // A clean end right after the final usage chunk, without [DONE]: trusted.
        (vec![fault("no_done")], None, Served),
        (vec![fault("no_done"), RUNNING], None, Served),
        // Running usages, then the final one and [DONE]: trusted.
        (vec![RUNNING], None, Served),
        // The running usages report more cached tokens than the final one.
        (
            vec![RUNNING, ("x-mock-running-cached-tokens", "1000")],
            None,
            Served,
        ),
    ];
    let mut total = 0;
    for (i, (headers, max_tokens, expect)) in cases.into_iter().enumerate() {
        let what = format!("{headers:?} max_tokens={max_tokens:?}");
        let mut body = json!({"model": MODEL, "stream": true,
            "stream_options": {"include_usage": true}, "messages": user(&"x".repeat(200))});
        if let Some(m) = max_tokens {
            body["max_tokens"] = json!(m);
        }
        let before = g.mock.stats();
        let r = g.chat(&format!("untrusted-{i}"), body, &headers).await;
        assert_eq!(r.status, 200, "{what}: {}", r.text);
        r.assert_no_key();
        let row = g.reservation(&r.step()).await;
        let served = priced_delta(g.prices, &before, &g.mock.stats());
        let charged = row["charged_micros"].as_u64().expect("charged");
        let reserved = row["reserved_micros"].as_u64().expect("reserved");
        match expect {
            InFull => {
                assert_eq!(row["state"], "unknown", "{what}: {row}");
                assert_eq!(charged, reserved, "{what}");
                assert!(served <= charged, "{what}: {served} > {charged}");
            }
            Overrun => {
                assert_eq!(row["state"], "committed", "{what}: {row}");
                assert_eq!(row["overrun"], true, "{what}: {row}");
                assert!(charged >= served, "{what}: {charged} < {served}");
                assert!(charged > reserved, "{what}");
                // Cut at the bound (1): no usage and no more than a word reached the client.
                assert!(usages(&r).is_empty(), "{what}: {}", r.text);
                assert!(content_words(&r) <= 1, "{what}: {}", r.text);
                let last: Value =
                    serde_json::from_str(r.events().last().expect("events")).expect("error event");
                assert_eq!(last["error"]["code"], "upstream_error", "{what}");
            }
            Served => {
                assert_eq!(row["state"], "committed", "{what}: {row}");
                assert_eq!(charged, served, "{what}: {}", r.text);
            }
        }
        total += charged;
    }
    let global = g.global().await;
    assert_eq!(global["used_micros"], total, "the books reconcile");
    assert_eq!(global["reserved_micros"], 0);
    assert!(g.metric("spendgate_overruns_total ").await >= 4);
}

/// A redirect from the upstream is not followed: the client gets a 502 `upstream_error`
/// (without the upstream's `Location`), and the step is released like any answer that did
/// no work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_redirect_is_not_followed() {
    let g = Gateway::start(Opts::default()).await;
    for stream in [false, true] {
        let before = g.mock.stats();
        let r = g
            .chat(
                &format!("redirect-{stream}"),
                json!({"model": MODEL, "stream": stream, "messages": user("hi")}),
                &[("x-mock-fault", "http_307")],
            )
            .await;
        assert_eq!(
            (r.status, r.code()),
            (502, "upstream_error".into()),
            "{}",
            r.text
        );
        assert_eq!(r.header("location"), None);
        assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
        assert_eq!(r.header("spendgate-outcome").as_deref(), Some("released"));
        let row = g.reservation(&r.step()).await;
        assert_eq!(row["state"], "released", "{row}");
        assert_eq!(row["charged_micros"], 0);
        let after = g.mock.stats();
        assert_eq!(after.requests, before.requests + 1, "one attempt");
        assert_eq!(priced_delta(g.prices, &before, &after), 0);
    }
    assert_eq!(g.global().await["used_micros"], 0);
}

/// The upstream's headers reach the client whole (each value of a repeated one), but not its
/// `spendgate-*` headers, which would pass for ours, nor hop-by-hop ones (those its
/// `Connection` names included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_headers_pass_whole_but_ours_and_hop_by_hop() {
    let g = Gateway::start(Opts::default()).await;
    for stream in [false, true] {
        let r = g
            .chat(
                &format!("headers-{stream}"),
                json!({"model": MODEL, "stream": stream, "messages": user("hi")}),
                &[("x-mock-fault", "odd_headers")],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let all = |k: &str| -> Vec<&str> {
            r.headers
                .get_all(k)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect()
        };
        assert_eq!(
            all("vary"),
            ["accept-encoding", "origin"],
            "stream={stream}"
        );
        assert_eq!(all("link").len(), 2, "stream={stream}");
        assert!(all("x-mock-hop").is_empty(), "named by Connection");
        assert!(all("proxy-authenticate").is_empty());
        let row = g.reservation(&r.step()).await;
        assert_eq!(row["state"], "committed", "{row}");
        if stream {
            // A stream is resolved after its head: no outcome header at all.
            assert!(all("spendgate-outcome").is_empty(), "{:?}", r.headers);
            assert!(all("spendgate-charged-micros").is_empty());
        } else {
            assert_eq!(all("spendgate-outcome"), ["committed"]);
            let charged = row["charged_micros"].as_u64().expect("charged").to_string();
            assert_eq!(all("spendgate-charged-micros"), [charged.as_str()]);
        }
    }
}

/// A guest (browser-direct) does not choose how the upstream behaves: its `x-mock-*` headers
/// are not forwarded; the operator's backend's are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guests_mock_headers_are_not_forwarded() {
    let g = Gateway::start(Opts {
        browser_direct: true,
        ..Opts::default()
    })
    .await;
    let body = json!({"model": MODEL, "messages": user("hi")});
    let controls = [
        ("x-mock-completion-tokens", "3"),
        ("x-mock-cached-tokens", "5"),
    ];
    let guest = g.server.session().await;
    let mut req = g.guest_chat(&guest).json(&body);
    for (k, v) in controls {
        req = req.header(k, v);
    }
    let r = Gateway::send(req.header("x-mock-fault", "http_500")).await;
    assert_eq!(
        r.status, 200,
        "the guest's fault is not forwarded: {}",
        r.text
    );
    let usage = &r.json()["usage"];
    assert_eq!(usage["completion_tokens"], 16, "{usage}");
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "{usage}"
    );
    let r = g.chat("backend", body, &controls).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let usage = &r.json()["usage"];
    assert_eq!(usage["completion_tokens"], 3, "{usage}");
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 5,
        "{usage}"
    );
}

/// I3: a step's resolution that cannot reach the store is tried again: when the store is back
/// before the hold expires, the step is committed at its usage rather than left held, to
/// expire charged in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_the_store_refused_is_retried() {
    let redis = spendgate_testkit::RedisServer::start(spendgate_testkit::RedisOptions::default())
        .expect("redis");
    let mock = Mock::start().await;
    let opts = Opts::default();
    let server = Server::start_redis(&redis.url(), "retry", &gateway_config(mock.port, &opts));
    let ready = Instant::now() + Duration::from_secs(10);
    loop {
        let r = server.http.get(server.url("/readyz")).send().await;
        if r.is_ok_and(|r| r.status().as_u16() == 200) {
            break;
        }
        assert!(Instant::now() < ready, "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let session = server.session().await;
    let g = Gateway {
        server,
        mock,
        session,
        prices: opts.prices,
    };
    let before = g.mock.stats();
    // One second of streaming: 20 tokens at 20 a second.
    let (step, mut body) = g.slow_stream("retry", 20).await;
    // Redis now refuses every write (out of memory under `noeviction`): the commit at the
    // stream's end fails at once.
    redis
        .command(&["CONFIG", "SET", "maxmemory", "1"])
        .expect("maxmemory");
    let mut text = Vec::new();
    while let Some(chunk) = body.next().await {
        text.extend_from_slice(&chunk.expect("chunk"));
    }
    assert!(String::from_utf8_lossy(&text).contains("[DONE]"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The commit at the stream's end failed and was not applied: the reservation is still
    // held (the admin listing is a read, a `no-writes` function, that Redis still serves).
    let rows = g
        .server
        .admin_get("/admin/v1/reservations?limit=1000")
        .await;
    let row = rows["reservations"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["id"] == step.as_str()))
        .unwrap_or_else(|| panic!("{step} not listed: {rows}"));
    assert_eq!(
        row["state"], "held",
        "the first commit cannot have applied: {row}"
    );
    redis
        .command(&["CONFIG", "SET", "maxmemory", "0"])
        .expect("maxmemory");
    // Well before the lease (10 s) would expire it.
    let row = g.reservation(&step).await;
    assert_eq!(row["state"], "committed", "{row}");
    let served = priced_delta(g.prices, &before, &g.mock.stats());
    assert_eq!(row["charged_micros"], served, "{row}");
}

/// A stream is whole at its `[DONE]`: the step is resolved and the one-step run finished
/// before the client reads it, so a next call in the same conversation (one active run
/// allowed) is admitted at once, even while the upstream's connection lingers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_call_after_done_is_admitted_at_once() {
    let g = Gateway::start(Opts::default()).await;
    for i in 0..3 {
        let started = Instant::now();
        let r = g
            .chat(
                "c-back-to-back",
                json!({"model": MODEL, "stream": true, "messages": user(&format!("call {i}"))}),
                &[("x-mock-linger-ms", "3000")],
            )
            .await;
        assert_eq!(r.status, 200, "call {i}: {}", r.text);
        assert_eq!(r.events().last().map(String::as_str), Some("[DONE]"));
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the body waited for the upstream's end: {:?}",
            started.elapsed()
        );
        let row = g.reservation(&r.step()).await;
        assert_eq!(row["state"], "committed", "{row}");
    }
    assert_eq!(g.mock.mock.stats().completed, 3);
}

// ---------------------------------------------------------------------------------------
// Issue 18, finding 3: the proxy enforces the output bound it forwarded.

/// `[models.bpe-priced]`: the mock behind the model's BPE tokenizer, at [`MODEL`]'s prices.
fn bpe_priced_model() -> String {
    let p = Opts::default().prices;
    format!(
        r#"
[models.bpe-priced]
upstream = "up"
input_per_million = "{}"
cached_input_per_million = "{}"
output_per_million = "{}"
tokenizer = "o200k_base"
"#,
        amount(p.input),
        amount(p.cached),
        amount(p.output)
    )
}

/// How an upstream past its bound reports its usage.
#[derive(Clone, Copy, Debug)]
enum Report {
    /// What it generated.
    Honest,
    /// Nothing (`no_usage`).
    None,
    /// The bound it was given, whatever it generated.
    Under,
}

/// Acceptance (issue 18, finding 3): an upstream given `max_tokens: 20` that generates 516
/// tokens, with its usage, without any, or under-reported, streamed or not, behind a model
/// counted one token per byte or with its BPE tokenizer: the client receives at most the
/// bound (a word a token, as the mock counts), the stream ends with an error event and the
/// whole answer is cut to the bound (`finish_reason: "length"`), and the charge is at least
/// what the mock served, at spendgate's prices (an overrun, counted). The upstream's
/// connection is closed at the cut: a paced one stops generating.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_past_its_bound_is_cut_there_and_charged_what_it_served() {
    let g = Gateway::start(Opts {
        extra: bpe_priced_model(),
        ..Opts::default()
    })
    .await;
    let mut total = 0;
    for model in [MODEL, "bpe-priced"] {
        for stream in [false, true] {
            for report in [Report::Honest, Report::None, Report::Under] {
                let what = format!("{model} stream={stream} {report:?}");
                let mut headers = vec![
                    ("x-mock-completion-tokens", "20"),
                    ("x-mock-extra-completion-tokens", "496"),
                ];
                match report {
                    Report::Honest => {}
                    Report::None => headers.push(("x-mock-fault", "no_usage")),
                    Report::Under => headers.push(("x-mock-reported-completion-tokens", "20")),
                }
                let before = g.mock.stats();
                let r = g
                    .chat(
                        &format!("past-{model}-{stream}-{report:?}"),
                        json!({"model": model, "stream": stream, "max_tokens": 20,
                            "messages": user("tell me everything")}),
                        &headers,
                    )
                    .await;
                assert_eq!(r.status, 200, "{what}: {}", r.text);
                r.assert_no_key();
                let after = g.mock.stats();
                assert_eq!(
                    after.completion_tokens - before.completion_tokens,
                    516,
                    "{what}: the mock sent it all before the cut"
                );
                let words = content_words(&r);
                assert!(words <= 20, "{what}: {words} words reached the client");
                if model == MODEL {
                    // A word a token, as the mock counts: the answer up to the bound, whole.
                    assert_eq!(words, 20, "{what}: {}", r.text);
                } else {
                    assert!(words >= 5, "{what}: the answer up to the bound: {words}");
                }
                if stream {
                    let events = r.events();
                    let last: Value =
                        serde_json::from_str(events.last().expect("events")).expect("json");
                    assert_eq!(last["error"]["code"], "upstream_error", "{what}");
                    assert!(!r.text.contains("[DONE]"), "{what}");
                } else {
                    let v = r.json();
                    assert_eq!(v["choices"][0]["finish_reason"], "length", "{what}");
                    assert_eq!(r.header("spendgate-output-cut").as_deref(), Some("true"));
                }
                let row = g.reservation(&r.step()).await;
                let charged = row["charged_micros"].as_u64().expect("charged");
                let served = priced_delta(g.prices, &before, &after);
                assert!(
                    charged >= served,
                    "{what}: charged {charged} < served {served}: {row}"
                );
                assert_eq!(row["state"], "committed", "{what}: {row}");
                assert_eq!(row["overrun"], true, "{what}: {row}");
                if !stream {
                    assert_eq!(
                        r.header("spendgate-charged-micros"),
                        Some(charged.to_string()),
                        "{what}"
                    );
                }
                total += charged;
            }
        }
    }
    let global = g.global().await;
    assert_eq!(global["used_micros"], total, "the books reconcile");
    assert_eq!(global["reserved_micros"], 0);
    assert_eq!(g.metric("spendgate_output_cuts_total ").await, 12);
    assert!(g.metric("spendgate_overruns_total ").await >= 12);

    // A tool call past the bound: its arguments are cut at it (a word a token), streamed or
    // not, and the call charged at least what was served.
    for stream in [false, true] {
        let before = g.mock.stats();
        let r = g
            .chat(
                &format!("past-tool-{stream}"),
                json!({"model": MODEL, "stream": stream, "max_tokens": 20,
                    "messages": user("search everything")}),
                &[
                    ("x-mock-fault", "tool_call"),
                    ("x-mock-completion-tokens", "20"),
                    ("x-mock-extra-completion-tokens", "300"),
                ],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let mut args = String::new();
        if stream {
            for e in r.events() {
                if let Ok(v) = serde_json::from_str::<Value>(&e) {
                    if let Some(a) =
                        v["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str()
                    {
                        args.push_str(a);
                    }
                }
            }
        } else {
            args = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap_or_default()
                .to_string();
        }
        // `{"q":"tok0 tok1 ...`: the tool's name is a token of the bound too.
        let words = args.split_whitespace().count() as u64;
        assert!(
            (15..=19).contains(&words),
            "stream={stream}: {words}: {args}"
        );
        let row = g.reservation(&r.step()).await;
        let charged = row["charged_micros"].as_u64().expect("charged");
        let served = priced_delta(g.prices, &before, &g.mock.stats());
        assert!(
            charged >= served,
            "stream={stream}: {charged} < {served}: {row}"
        );
        assert_eq!(row["overrun"], true, "{row}");
    }

    // A paced upstream past its bound (50 tokens a second for 20 s): cut at once, its
    // connection closed, so it stops generating; charged at least what it served.
    let before = g.mock.stats();
    let started = Instant::now();
    let r = g
        .chat(
            "past-paced",
            json!({"model": MODEL, "stream": true, "max_tokens": 20,
                "messages": user("slowly, everything")}),
            &[
                ("x-mock-completion-tokens", "20"),
                ("x-mock-extra-completion-tokens", "1000"),
                ("x-mock-tokens-per-second", "50"),
            ],
        )
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(content_words(&r) <= 20, "{}", r.text);
    let row = g.reservation(&r.step()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopped = g.mock.stats();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = g.mock.stats();
    assert_eq!(
        after.completion_tokens, stopped.completion_tokens,
        "the upstream went on generating after the cut"
    );
    assert!(after.completion_tokens - before.completion_tokens < 200);
    let served = priced_delta(g.prices, &before, &after);
    let charged = row["charged_micros"].as_u64().expect("charged");
    assert!(
        charged >= served,
        "charged {charged} < served {served}: {row}"
    );
}

/// An upstream that keeps to its bound is never cut, and a trusted usage is charged as
/// reported (a model counted one token per byte: the mock's words are never fewer tokens
/// than it reports), or at least as reported (with a BPE tokenizer, which counts the mock's
/// words as more tokens than the mock does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_at_its_bound_is_neither_cut_nor_charged_more() {
    let g = Gateway::start(Opts {
        extra: bpe_priced_model(),
        ..Opts::default()
    })
    .await;
    for stream in [false, true] {
        let before = g.mock.stats();
        let r = g
            .chat(
                &format!("at-bound-{stream}"),
                json!({"model": MODEL, "stream": stream, "max_tokens": 20,
                    "messages": user("exactly twenty")}),
                &[("x-mock-completion-tokens", "64")],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(content_words(&r), 20);
        assert_eq!(r.header("spendgate-output-cut"), None);
        if stream {
            assert_eq!(r.events().last().map(String::as_str), Some("[DONE]"));
        }
        let row = g.reservation(&r.step()).await;
        assert_eq!(row["state"], "committed");
        let served = priced_delta(g.prices, &before, &g.mock.stats());
        assert_eq!(row["charged_micros"], served, "{row}");
    }
    // BPE: at least the usage, never cut within the bound as the mock counts it.
    let before = g.mock.stats();
    let r = g
        .chat(
            "at-bound-bpe",
            json!({"model": "bpe-priced", "stream": true, "max_tokens": 100,
                "messages": user("a few words")}),
            &[("x-mock-completion-tokens", "30")],
        )
        .await;
    assert_eq!(r.events().last().map(String::as_str), Some("[DONE]"));
    assert_eq!(content_words(&r), 30);
    let row = g.reservation(&r.step()).await;
    assert_eq!(row["state"], "committed");
    let served = priced_delta(g.prices, &before, &g.mock.stats());
    assert!(row["charged_micros"].as_u64() >= Some(served), "{row}");
    assert_eq!(g.metric("spendgate_output_cuts_total ").await, 0);
}
