//! SPEC §6 `POST /v1/responses` (OpenAI's Responses shape) against a real `spendgate serve`
//! in front of the mock upstream: hosted tools priced from `[tools.X]` and reserved with the
//! call, an unpriced one refused before it.

use super::*;

/// One `web_search` call, in micros.
const WEB_SEARCH: u64 = 100;

/// 10 / 10 / 30 micros per input / cached / output token: every charge is whole micros.
fn whole_prices() -> Prices {
    Prices {
        input: 10_000_000,
        cached: 10_000_000,
        output: 30_000_000,
    }
}

/// The priced hosted tool (`code_interpreter` stays unpriced).
fn tools_extra() -> String {
    format!(
        "\n[tools.web_search]\nper_call = \"{}\"\n",
        amount(WEB_SEARCH)
    )
}

async fn start(mut opts: Opts) -> Gateway {
    opts.extra = format!("{}{}", opts.extra, tools_extra());
    Gateway::start(opts).await
}

impl Gateway {
    /// A `POST /v1/responses` of the operator's backend for a guest.
    async fn respond(&self, conversation: &str, body: Value, headers: &[(&str, &str)]) -> Reply {
        let mut b = self
            .server
            .http
            .post(self.server.url("/v1/responses"))
            .bearer_auth(SERVICE)
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

/// What the mock served, by its stats, priced: tokens and hosted calls.
fn served_worth(p: Prices, before: &MockStats, after: &MockStats) -> u64 {
    priced_delta(p, before, after)
        + (after.hosted_tool_calls - before.hosted_tool_calls) * WEB_SEARCH
}

/// Acceptance: the official `openai` client's Responses API, streaming and not, with a priced
/// hosted tool (reserved with the call and charged per call) and an unpriced one (refused
/// before the call); a budget refusal raised once, without retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn official_openai_responses_client() {
    let g = start(Opts {
        conversation_budget: "0.002",
        prices: whole_prices(),
        ..Opts::default()
    })
    .await;
    let prices = format!("{},{},{}", g.prices.input, g.prices.cached, g.prices.output);
    let env = [
        ("SPENDGATE_MODEL", MODEL.to_string()),
        ("SPENDGATE_PRICES", prices),
        ("SPENDGATE_TOOL_PRICE", WEB_SEARCH.to_string()),
    ];
    g.run_checks("test_proxy_responses.py", "/v1", &env, 6)
        .await;
    let stats = g.mock.stats();
    assert_eq!(
        stats.by_shape.get("responses").copied(),
        Some(stats.requests)
    );
    assert!(stats.hosted_tool_calls >= 3, "{stats:?}");
}

/// The output bound is clamped to `run.max_output_tokens`, or inserted; the hosted calls are
/// bounded by `max_tool_calls` (the client's, at most the run's), both forwarded; input the
/// upstream adds out of sight (`previous_response_id`) is reserved at the context bound; an
/// image, a `background` response and a missing `input` are refused before any reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_bounded_before_the_call() {
    let g = start(Opts {
        prices: whole_prices(),
        ..Opts::default()
    })
    .await;
    let r = g
        .respond(
            "b1",
            json!({"model": MODEL, "input": "hi", "max_output_tokens": 5000}),
            &[],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.header("spendgate-max-output-tokens").as_deref(),
        Some("100")
    );
    assert_eq!(last_sent(&g)["max_output_tokens"], 100);
    assert!(last_sent(&g).get("max_tool_calls").is_none());
    let r = g
        .respond("b2", json!({"model": MODEL, "input": "hi"}), &[])
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(last_sent(&g)["max_output_tokens"], 100, "inserted");
    let small = g.reservation(&r.step()).await["reserved_micros"]
        .as_u64()
        .expect("reserved");
    // Hosted calls: the run's 16 at most, or fewer when the client asks.
    let tools = json!([{"type": "web_search"}]);
    let r = g
        .respond(
            "b3",
            json!({"model": MODEL, "input": "hi", "tools": tools, "max_tool_calls": 40}),
            &[],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(last_sent(&g)["max_tool_calls"], 16);
    // The tools' JSON text is prompt too: `[{"type":"web_search"}]`, 23 bytes, 23 tokens of
    // 10 micros with the bytes tokenizer.
    let tools_text = 23 * 10;
    assert_eq!(r.reserved(), small + tools_text + 16 * WEB_SEARCH);
    let r = g
        .respond(
            "b4",
            json!({"model": MODEL, "input": "hi", "tools": tools, "max_tool_calls": 2}),
            &[],
        )
        .await;
    assert_eq!(last_sent(&g)["max_tool_calls"], 2);
    assert_eq!(r.reserved(), small + tools_text + 2 * WEB_SEARCH);
    // Offered, not used: its hold is given back whole, the call charged its tokens alone.
    let r = g
        .respond(
            "b4-unused",
            json!({"model": MODEL, "input": "hi", "tools": tools, "max_tool_calls": 2}),
            &[("x-mock-hosted-tool-calls", "0")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let u = &r.json()["usage"];
    let tokens_only = u["input_tokens"].as_u64().expect("input") * 10
        + u["output_tokens"].as_u64().expect("output") * 30;
    assert_eq!(
        r.header("spendgate-charged-micros").as_deref(),
        Some(tokens_only.to_string().as_str())
    );
    assert_eq!(
        g.server.conversation_used(&g.session, "b4-unused").await,
        tokens_only
    );
    // Unseen input: the whole context bound (2000 tokens) is reserved as prompt.
    let r = g
        .respond(
            "b5",
            json!({"model": MODEL, "input": "hi", "previous_response_id": "resp_earlier"}),
            &[],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.reserved(), 2000 * 10 + 100 * 30);
    assert_eq!(last_sent(&g)["previous_response_id"], "resp_earlier");
    let before = g.mock.stats().requests;
    for body in [
        json!({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]}),
        json!({"model": MODEL, "input": "hi", "background": true}),
        json!({"model": MODEL}),
        json!({"model": MODEL, "input": "hi", "max_output_tokens": 0}),
        json!({"model": MODEL, "input": "hi", "tools": [{"type": "code_interpreter"}]}),
    ] {
        let r = g.respond("b6", body.clone(), &[]).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        assert!(r.json()["error"]["code"].is_string(), "{}", r.text);
    }
    assert_eq!(g.mock.stats().requests, before, "none reached the mock");
    let global = g.global().await;
    assert_eq!(global["reserved_micros"], 0, "nothing left held: {global}");
}

/// Faults settle as for chat completions, hosted calls with them: an answer without usage is
/// charged in full (its hosted calls too); an upstream past its `max_tool_calls` is charged
/// every call it made (an overrun); a stream dropped mid-way is charged in full; a stream past
/// its output bound is cut at it and charged at least what it served; an upstream's 500 is
/// released with its hosted holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_faults_settle_with_their_hosted_calls() {
    let g = start(Opts {
        prices: whole_prices(),
        ..Opts::default()
    })
    .await;
    let body = |stream: bool, calls: u64| {
        json!({"model": MODEL, "input": "hi", "max_output_tokens": 20, "stream": stream,
            "tools": [{"type": "web_search"}], "max_tool_calls": calls})
    };
    for stream in [false, true] {
        let r = g
            .respond(
                if stream { "f1s" } else { "f1" },
                body(stream, 3),
                &[("x-mock-fault", "no_usage")],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let res = g.reservation(&r.step()).await;
        assert_eq!(res["state"], "unknown", "{res}");
        let conv = if stream { "f1s" } else { "f1" };
        let used = g.server.conversation_used(&g.session, conv).await;
        let expected_full = res["reserved_micros"].as_u64().expect("reserved") + 3 * WEB_SEARCH;
        assert_eq!(
            used, expected_full,
            "the call and its hosted holds are charged in full"
        );
    }
    // Past max_tool_calls: 2 allowed, 5 made; every one is charged.
    let before = g.mock.stats();
    let r = g
        .respond(
            "f2",
            body(false, 2),
            &[("x-mock-extra-hosted-tool-calls", "4")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let calls = r.json()["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter(|i| i["type"] == "web_search_call")
        .count() as u64;
    assert_eq!(calls, 5, "one asked for, and 4 past the bound: {}", r.text);
    let after = g.mock.stats();
    let charged: u64 = r
        .header("spendgate-charged-micros")
        .and_then(|c| c.parse().ok())
        .expect("charged");
    assert_eq!(charged, served_worth(g.prices, &before, &after));
    // The tool's part: all 5 calls, over the 2 reserved (an overrun of its hold).
    let u = &r.json()["usage"];
    let model_part = u["input_tokens"].as_u64().expect("input") * 10
        + u["output_tokens"].as_u64().expect("output") * 30;
    assert_eq!(charged - model_part, 5 * WEB_SEARCH);
    // A stream dropped mid-way: the call and its holds in full.
    let r = g
        .respond("f3", body(true, 2), &[("x-mock-fault", "drop_mid_stream")])
        .await;
    assert!(r.text.contains("event: error"), "{}", r.text);
    let res = g.reservation(&r.step()).await;
    assert_eq!(res["state"], "unknown", "{res}");
    // Past the output bound: cut at it, charged at least what was served.
    for (stream, conv) in [(true, "f4"), (false, "f5")] {
        let before = g.mock.stats();
        let r = g
            .respond(
                conv,
                body(stream, 1),
                &[("x-mock-extra-completion-tokens", "300")],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let _ = g.reservation(&r.step()).await;
        let after = g.mock.stats();
        let used = g.server.conversation_used(&g.session, conv).await;
        let worth = served_worth(g.prices, &before, &after);
        assert!(used >= worth, "charged {used} < served {worth}");
        if stream {
            assert!(
                r.text.contains("event: error"),
                "the stream was cut: {}",
                r.text
            );
        } else {
            assert_eq!(r.header("spendgate-output-cut").as_deref(), Some("true"));
            assert_eq!(r.json()["status"], "incomplete");
        }
    }
    // The upstream's 500: nothing done, the call and its hosted holds released.
    let r = g
        .respond("f6", body(false, 2), &[("x-mock-fault", "http_500")])
        .await;
    assert_eq!(r.status, 500);
    assert_eq!(r.header("spendgate-outcome").as_deref(), Some("released"));
    assert_eq!(g.server.conversation_used(&g.session, "f6").await, 0);
    let global = g.global().await;
    assert_eq!(global["reserved_micros"], 0, "nothing left held: {global}");
}

/// Acceptance: 200 concurrent Responses calls, half streamed, each with a hosted tool,
/// against a global budget of 50 such calls: the mock's ground truth (tokens and hosted
/// calls) never exceeds the budget, and the books equal it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_responses_never_overspend_the_global_budget() {
    let body = |stream: bool| {
        json!({"model": MODEL, "input": "hello", "max_output_tokens": 100, "stream": stream,
            "tools": [{"type": "web_search"}], "max_tool_calls": 1})
    };
    // What one call reserves, from a gateway of its own.
    let probe = start(Opts {
        prices: whole_prices(),
        ..Opts::default()
    })
    .await;
    let one = probe.respond("probe", body(false), &[]).await.reserved();
    drop(probe);
    let budget = 50 * one;
    let budget_text = amount(budget);
    let g = Arc::new(
        start(Opts {
            global_budget: Box::leak(budget_text.into_boxed_str()),
            prices: whole_prices(),
            ..Opts::default()
        })
        .await,
    );
    let mut tasks = Vec::new();
    for i in 0..200 {
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            g.respond(
                &format!("conv-{i}"),
                body(i % 2 == 0),
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
                assert_eq!(r.reserved(), one);
                served += 1;
            }
            429 => {
                let code = r.code();
                assert!(
                    code == "budget_exhausted" || code == "budget_held",
                    "{code}: {}",
                    r.text
                );
                refused += 1;
            }
            s => panic!("unexpected {s}: {}", r.text),
        }
    }
    assert_eq!(served + refused, 200);
    assert!(
        served >= 50,
        "the budget covers at least 50 calls: {served}"
    );
    let stats = g.mock.stats();
    assert_eq!(
        stats.requests, served,
        "only admitted calls reach the upstream"
    );
    assert_eq!(
        stats.by_shape.get("responses").copied().unwrap_or(0),
        served
    );
    assert_eq!(stats.hosted_tool_calls, served, "one web search each");
    let worth = served_worth(g.prices, &MockStats::default(), &stats);
    assert!(
        worth <= budget,
        "the mock served {worth} micros, over the budget of {budget}"
    );
    let global = g.global().await;
    assert_eq!(global["used_micros"], worth, "books = ground truth");
    assert_eq!(global["reserved_micros"], 0);
}
