//! SPEC §6 `POST /v1/messages` (Anthropic's Messages shape) against a real `spendgate serve`
//! in front of the mock upstream, as an `api = "anthropic"` upstream.

use super::*;

/// The model served by the Anthropic-shaped upstream.
const CLAUDE: &str = "claude-mock";

/// 10 micros per input token, 1 per cache read, 25 per cache write, 30 per output token.
const PRICES: [u64; 4] = [10_000_000, 1_000_000, 25_000_000, 30_000_000];

/// [`PRICES`] without cache writes (for [`charge`], of usages without them).
fn claude_prices() -> Prices {
    Prices {
        input: PRICES[0],
        cached: PRICES[1],
        output: PRICES[3],
    }
}

/// The Anthropic-shaped upstream (the same mock) and its model.
fn anthropic_extra() -> String {
    format!(
        r#"
[models.{CLAUDE}]
upstream = "anthropic-up"
input_per_million = "{}"
cached_input_per_million = "{}"
cache_write_per_million = "{}"
output_per_million = "{}"
tokenizer = "bytes"

[upstreams.anthropic-up]
api = "anthropic"
base_url = "http://127.0.0.1:MOCK_PORT/v1"
api_key = "{UPSTREAM_KEY}"
"#,
        amount(PRICES[0]),
        amount(PRICES[1]),
        amount(PRICES[2]),
        amount(PRICES[3]),
    )
}

/// spendgate in front of the mock with the Anthropic-shaped upstream too.
async fn start(mut opts: Opts) -> Gateway {
    let mock = Mock::start().await;
    opts.extra =
        format!("{}{}", opts.extra, anthropic_extra()).replace("MOCK_PORT", &mock.port.to_string());
    let config = gateway_config(mock.port, &opts);
    let server = Server::start(&config);
    let session = server.session().await;
    Gateway {
        server,
        mock,
        session,
        prices: opts.prices,
    }
}

impl Gateway {
    /// A `POST /v1/messages` as Anthropic's clients send it (the token as `x-api-key`).
    async fn message(&self, conversation: &str, body: Value, headers: &[(&str, &str)]) -> Reply {
        let mut b = self
            .server
            .http
            .post(self.server.url("/v1/messages"))
            .header("x-api-key", SERVICE)
            .header("anthropic-version", "2023-06-01")
            .header("spendgate-session", &self.session)
            .header("spendgate-client-ip", "10.1.2.3")
            .header("spendgate-conversation", conversation)
            .json(&body);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        Self::send(b).await
    }
}

fn anthropic_opts() -> Opts {
    Opts {
        conversation_budget: "0.005",
        ..Opts::default()
    }
}

/// The anthropic error shape of `r`, its `error.type` and `error.code`.
fn anthropic_error(r: &Reply) -> (String, String) {
    let v = r.json();
    assert_eq!(v["type"], "error", "{}", r.text);
    let e = &v["error"];
    (
        e["type"].as_str().unwrap_or("").to_string(),
        e["code"].as_str().unwrap_or("").to_string(),
    )
}

/// Acceptance: the official `anthropic` Python package through `/v1/messages`, streaming and
/// not: charged to the micro from usage (cache classes each priced), `max_tokens` clamped, a
/// prompt over the context bound never reaching the mock, a budget refusal raised once as
/// `RateLimitError` without retries, an image refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn official_anthropic_python_client() {
    let g = start(anthropic_opts()).await;
    let env = [
        ("SPENDGATE_MODEL", CLAUDE.to_string()),
        ("SPENDGATE_PRICES", PRICES.map(|p| p.to_string()).join(",")),
    ];
    g.run_checks("test_proxy_anthropic.py", "", &env, 8).await;
    let stats = g.mock.stats();
    assert_eq!(
        stats.by_shape.get("messages").copied(),
        Some(stats.requests)
    );
}

/// Errors on `/v1/messages` leave in Anthropic's shape with their status: 415 without JSON,
/// 400 without `max_tokens`, a model of the other API refused (both ways), a server tool
/// refused; none reaches the mock. The key sent upstream is `x-api-key`, never the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_errors_are_in_anthropics_shape() {
    let g = start(anthropic_opts()).await;
    let r = Gateway::send(
        g.server
            .http
            .post(g.server.url("/v1/messages"))
            .header("x-api-key", SERVICE)
            .body("{}"),
    )
    .await;
    assert_eq!(r.status, 415, "{}", r.text);
    assert_eq!(anthropic_error(&r).0, "invalid_request_error");
    let r = g
        .message("c1", json!({"model": CLAUDE, "messages": user("hi")}), &[])
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        anthropic_error(&r),
        ("invalid_request_error".into(), "invalid_request".into())
    );
    let r = g
        .message(
            "c1",
            json!({"model": MODEL, "max_tokens": 5, "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(anthropic_error(&r).1, "model_not_allowed");
    let r = g
        .chat(
            "c1",
            json!({"model": CLAUDE, "max_tokens": 5, "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!((r.status, r.code().as_str()), (400, "model_not_allowed"));
    let body = json!({"model": CLAUDE, "max_tokens": 5, "messages": user("hi"),
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
    let r = g.message("c1", body, &[]).await;
    assert_eq!(r.status, 400);
    assert_eq!(anthropic_error(&r).1, "invalid_request");
    let r = g
        .message(
            "c1",
            json!({"model": CLAUDE, "max_tokens": 5, "messages": user("hi")}),
            &[("anthropic-beta", "x")],
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    let r = Gateway::send(
        g.server
            .http
            .post(g.server.url("/v1/messages"))
            .json(&json!({"model": CLAUDE, "max_tokens": 5, "messages": user("hi")})),
    )
    .await;
    assert_eq!(r.status, 401);
    assert_eq!(anthropic_error(&r).0, "authentication_error");
    assert_eq!(
        g.mock.stats().requests,
        0,
        "no refused call reached the mock"
    );
    // A budget refusal: 429 rate_limit_error, x-should-retry false, retry-after.
    let body = json!({"model": CLAUDE, "max_tokens": 10,
        "messages": user(&"x".repeat(1200))});
    let r = g.message("c2", body, &[]).await;
    assert_eq!(r.status, 429, "{}", r.text);
    assert_eq!(
        anthropic_error(&r),
        ("rate_limit_error".into(), "budget_exhausted".into())
    );
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    assert!(r.header("retry-after").is_some());
    // The upstream's key goes as x-api-key; the client's token never goes upstream.
    let r = g
        .message(
            "c3",
            json!({"model": CLAUDE, "max_tokens": 5, "messages": user("hi")}),
            &[],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.assert_no_key();
    assert!(g.mock.auth_seen().iter().all(|a| !a.contains(SERVICE)));
}

/// Faults in the Messages shape end as for chat completions: a stream dropped mid-way is
/// charged in full (an Anthropic `error` event ends the client's stream); an upstream past
/// its bound is cut at it and charged at least what it served; an answer without usage is
/// charged in full; an upstream's 429 is passed on and released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_faults_settle_like_chat() {
    let g = start(Opts::default()).await;
    let body = |stream: bool| json!({"model": CLAUDE, "max_tokens": 20, "stream": stream, "messages": user("hi")});
    let r = g
        .message(
            "f1",
            body(true),
            &[
                ("x-mock-fault", "drop_mid_stream"),
                ("x-mock-completion-tokens", "20"),
            ],
        )
        .await;
    assert_eq!(r.status, 200);
    assert!(r.text.contains("event: error"), "{}", r.text);
    let res = g.reservation(&r.step()).await;
    assert_eq!(res["state"], "unknown", "{res}");
    assert_eq!(res["charged_micros"], res["reserved_micros"]);
    let r = g
        .message("f2", body(false), &[("x-mock-fault", "no_usage")])
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("spendgate-outcome").as_deref(), Some("unknown"));
    let r = g
        .message("f3", body(false), &[("x-mock-fault", "http_429")])
        .await;
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert_eq!(r.header("spendgate-outcome").as_deref(), Some("released"));
    for (stream, conv) in [(true, "f4"), (false, "f5")] {
        let tag = format!("past-{conv}");
        let r = g
            .message(
                conv,
                body(stream),
                &[
                    ("x-mock-completion-tokens", "20"),
                    ("x-mock-extra-completion-tokens", "300"),
                    ("x-mock-tag", &tag),
                ],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let res = g.reservation(&r.step()).await;
        let s = g
            .mock
            .mock
            .served()
            .served
            .into_iter()
            .find(|s| s.tag == tag)
            .expect("served");
        assert_eq!(s.shape, "messages");
        let served_cost = charge(
            claude_prices(),
            &json!({"prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens}),
        );
        let charged = res["charged_micros"].as_u64().expect("charged");
        assert!(
            charged >= served_cost,
            "charged {charged} < served {served_cost} ({res})"
        );
        if stream {
            assert!(
                r.text.contains("event: error"),
                "the stream was cut: {}",
                r.text
            );
        } else {
            assert_eq!(r.header("spendgate-output-cut").as_deref(), Some("true"));
            assert_eq!(r.json()["stop_reason"], "max_tokens");
        }
    }
}

/// Acceptance: 200 concurrent Messages calls against a global budget of 50 calls: the mock's
/// ground truth never exceeds the budget, and the books equal it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_messages_never_overspend_the_global_budget() {
    // 10 and 30 micros per token: a "hello" call reserves (3 + 4 + "user" + "hello") × 10 +
    // 100 × 30 = 3160.
    let g = Arc::new(
        start(Opts {
            global_budget: "0.158", // 50 × 3160
            ..Opts::default()
        })
        .await,
    );
    let mut tasks = Vec::new();
    for i in 0..200 {
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": CLAUDE, "max_tokens": 100, "stream": i % 2 == 0,
                "messages": user("hello")});
            g.message(
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
                let (kind, code) = anthropic_error(&r);
                assert_eq!(kind, "rate_limit_error");
                assert!(
                    code == "budget_exhausted" || code == "budget_held",
                    "{code}"
                );
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
    assert_eq!(stats.by_shape.get("messages").copied().unwrap_or(0), served);
    let served_worth = priced_delta(claude_prices(), &MockStats::default(), &stats);
    assert!(
        served_worth <= 158_000,
        "the mock served {served_worth} micros, over the budget"
    );
    assert_eq!(served, 50, "the budget covers exactly 50 such calls");
    let global = g.global().await;
    assert_eq!(global["used_micros"], served_worth, "books = ground truth");
    assert_eq!(global["reserved_micros"], 0);
}

/// Asserts `r` is Anthropic's error shape with `status`, `error.type` `kind` and `error.code`
/// `code` (spendgate's), a message and a JSON content type.
fn assert_anthropic(r: &Reply, status: u16, kind: &str, code: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text);
    assert_eq!(
        anthropic_error(r),
        (kind.to_string(), code.to_string()),
        "{what}: {}",
        r.text
    );
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{what}: {}",
        r.text
    );
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json"),
        "{what}"
    );
}

/// SPEC §6: every answer on a `/v1/messages` path is in Anthropic's shape, also those made
/// before the route's handler: a wrong method (405, its `Allow` kept), an unknown path under
/// it (404; there is no `/v1/messages/count_tokens`), a body over the proxy's bound (413), no
/// JSON content type (415), headers over their bound (431). The same refusals on the
/// OpenAI-shaped routes stay in OpenAI's shape. None reaches the mock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_on_the_messages_path_is_in_anthropics_shape() {
    let g = start(anthropic_opts()).await;
    let http = &g.server.http;
    let r = Gateway::send(
        http.get(g.server.url("/v1/messages"))
            .header("x-api-key", SERVICE),
    )
    .await;
    assert_anthropic(&r, 405, "invalid_request_error", "invalid_request", "GET");
    assert_eq!(r.header("allow").as_deref(), Some("POST"));
    for path in [
        "/v1/messages/x",
        "/v1/messages/count_tokens",
        "/v1/messages/",
    ] {
        let r = Gateway::send(
            http.post(g.server.url(path))
                .header("x-api-key", SERVICE)
                .json(&json!({"model": CLAUDE, "max_tokens": 5, "messages": user("hi")})),
        )
        .await;
        assert_anthropic(&r, 404, "not_found_error", "not_found", path);
    }
    let big = format!(
        "{{\"model\": \"{CLAUDE}\", \"max_tokens\": 5, \"pad\": \"{}\"}}",
        "x".repeat(spendgate_proxy::PROXY_BODY_BYTES_MAX)
    );
    let r = g.message_raw(big, "application/json", &[]).await;
    assert_anthropic(
        &r,
        413,
        "request_too_large",
        "payload_too_large",
        "big body",
    );
    let r = g
        .message_raw(r#"{"model": "x"}"#.into(), "text/plain", &[])
        .await;
    assert_anthropic(&r, 415, "invalid_request_error", "invalid_request", "text");
    let pad = "p".repeat(spendgate_listener::HEADER_BYTES_MAX / 2 + 1);
    let body = json!({"model": CLAUDE, "max_tokens": 5, "messages": user("hi")}).to_string();
    let r = g
        .message_raw(
            body,
            "application/json",
            &[("x-pad-1", &pad), ("x-pad-2", &pad)],
        )
        .await;
    assert_anthropic(
        &r,
        431,
        "invalid_request_error",
        "invalid_request",
        "big headers",
    );
    // The OpenAI-shaped routes keep OpenAI's shape for the same refusals.
    let r = Gateway::send(http.get(g.server.url("/v1/chat/completions"))).await;
    assert_eq!((r.status, r.code()), (405, "invalid_request".into()));
    assert!(r.json()["error"]["type"].is_string() && r.json()["type"].is_null());
    let r = Gateway::send(http.post(g.server.url("/v1/messagesx"))).await;
    assert_eq!(
        (r.status, r.code()),
        (404, "not_found".into()),
        "{}",
        r.text
    );
    assert_eq!(g.mock.stats().requests, 0, "no refusal reached the mock");
}

impl Gateway {
    /// A `POST /v1/messages` with the service token as `x-api-key`, `body` sent as it is with
    /// `content_type`.
    async fn message_raw(
        &self,
        body: String,
        content_type: &str,
        headers: &[(&str, &str)],
    ) -> Reply {
        let mut b = self
            .server
            .http
            .post(self.server.url("/v1/messages"))
            .header("x-api-key", SERVICE)
            .header("anthropic-version", "2023-06-01")
            .header("spendgate-session", &self.session)
            .header("spendgate-client-ip", "10.1.2.3")
            .header("spendgate-conversation", "raw")
            .header("content-type", content_type)
            .body(body);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        Self::send(b).await
    }
}

/// A capacity refusal on `/v1/messages` (the service class at its bound, refused by the
/// capacity layer before any route) is in Anthropic's shape with the capacity layer's status,
/// headers and fields: 429 `rate_limit_error`, code `rate_limited`, scope `global`,
/// `retry_after_s` 1, `Retry-After: 1`, `x-should-retry: false`. The official `anthropic`
/// client raises it as its `RateLimitError`, without retrying, and reads spendgate's fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capacity_refusal_on_messages_is_in_anthropics_shape() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mock = Mock::start().await;
    let mut opts = anthropic_opts();
    opts.extra = anthropic_extra().replace("MOCK_PORT", &mock.port.to_string());
    let extra = gateway_config(mock.port, &opts);
    let (dir, store) = sqlite_dir();
    let server = Server::start_config(
        dir,
        |port| {
            config_text_full(
                port,
                "service_requests_max = 1\nbody_grace_ms = 10000",
                &store,
                DEFAULT_SESSIONS,
                &extra,
            )
        },
        Vec::new(),
    );
    // The service class's one slot, held by a run whose body is still coming.
    let mut held = tokio::net::TcpStream::connect(("127.0.0.1", server.port))
        .await
        .expect("connect");
    held.write_all(
        format!(
            "POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SERVICE}\r\n\
             Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"
        )
        .as_bytes(),
    )
    .await
    .expect("write");
    let mut buf = [0u8; 512];
    let early = tokio::time::timeout(Duration::from_millis(300), held.read(&mut buf)).await;
    assert!(early.is_err(), "the held run is not answered yet");

    let r = Gateway::send(
        server
            .http
            .post(server.url("/v1/messages"))
            .header("x-api-key", SERVICE)
            .json(&json!({"model": CLAUDE, "max_tokens": 5, "messages": user("hi")})),
    )
    .await;
    assert_anthropic(&r, 429, "rate_limit_error", "rate_limited", "capacity");
    let e = &r.json()["error"];
    assert_eq!(
        (e["scope"].as_str(), e["retry_after_s"].as_u64()),
        (Some("global"), Some(1))
    );
    assert_eq!(r.header("retry-after").as_deref(), Some("1"));
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    assert_eq!(r.header("connection").as_deref(), Some("close"));
    // The same refusal on the chat route stays OpenAI-shaped.
    let r = Gateway::send(
        server
            .http
            .post(server.url("/v1/chat/completions"))
            .bearer_auth(SERVICE)
            .json(&json!({"model": MODEL, "messages": user("hi")})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (429, "rate_limited".into()),
        "{}",
        r.text
    );

    // The official client.
    let script = r#"
import os, anthropic
client = anthropic.Anthropic(base_url=os.environ["BASE"], api_key=os.environ["KEY"])
try:
    client.messages.create(model=os.environ["MODEL"], max_tokens=5,
                           messages=[{"role": "user", "content": "hi"}])
    print("answered")
except anthropic.RateLimitError as e:
    err = e.body["error"]
    print("refused", e.status_code, err["type"], err["code"], err["scope"], err["retry_after_s"])
"#;
    let mut cmd = Command::new(test_python());
    cmd.arg("-c")
        .arg(script)
        .env("BASE", server.url(""))
        .env("KEY", SERVICE)
        .env("MODEL", CLAUDE)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("ANTHROPIC_BASE_URL")
        .env_remove("ANTHROPIC_AUTH_TOKEN");
    let (ok, output) =
        tokio::task::spawn_blocking(move || run_to_end(cmd, Duration::from_secs(60)))
            .await
            .expect("join");
    assert!(ok, "the anthropic client failed:\n{output}");
    assert!(
        output
            .lines()
            .any(|l| l == "refused 429 rate_limit_error rate_limited global 1"),
        "{output}"
    );
    assert_eq!(mock.stats().requests, 0, "no refused call reached the mock");
    drop(held);
}
