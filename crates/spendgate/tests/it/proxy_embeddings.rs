//! SPEC §6 `POST /v1/embeddings` against a real `spendgate serve` in front of the mock.

use super::*;

/// An embeddings model on the OpenAI-shaped upstream: 10 micros an input token.
const EMBED: &str = "embed-mock";
const EMBED_INPUT: u64 = 10_000_000;

fn embed_opts(global_budget: &'static str) -> Opts {
    Opts {
        global_budget,
        conversation_budget: "0.005",
        extra: format!(
            "\n[models.{EMBED}]\nupstream = \"up\"\ninput_per_million = \"{}\"\n\
             output_per_million = \"0\"\ntokenizer = \"bytes\"\n",
            amount(EMBED_INPUT)
        ),
        ..Opts::default()
    }
}

impl Gateway {
    async fn embed(&self, conversation: &str, body: Value) -> Reply {
        let b = self
            .server
            .http
            .post(self.server.url("/v1/embeddings"))
            .bearer_auth(SERVICE)
            .header("spendgate-session", &self.session)
            .header("spendgate-client-ip", "10.1.2.3")
            .header("spendgate-conversation", conversation)
            .header("x-mock-latency-ms", "50")
            .json(&body);
        Self::send(b).await
    }
}

/// Acceptance: the official `openai` client's embeddings through the proxy: charged from
/// usage at the input price, a batch reserved as a whole, a batch over the context bound
/// never reaching the mock, a budget refusal raised once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn official_openai_client_embeddings() {
    let g = Gateway::start(embed_opts("1000")).await;
    let env = [
        ("SPENDGATE_MODEL", EMBED.to_string()),
        ("SPENDGATE_INPUT_PRICE", EMBED_INPUT.to_string()),
    ];
    g.run_checks("test_proxy_embeddings.py", "/v1", &env, 4)
        .await;
    let stats = g.mock.stats();
    assert_eq!(
        stats.by_shape.get("embeddings").copied(),
        Some(stats.requests)
    );
}

/// Acceptance: 200 concurrent embeddings calls against a global budget of 50 calls' bounds:
/// only admitted calls reach the mock, what it served never exceeds the budget, and the books
/// equal its ground truth.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_embeddings_never_overspend_the_global_budget() {
    // "hello, embeddings" is 17 bytes: reserved 17 × 10 = 170 micros; the mock reports 5.
    let g = Arc::new(Gateway::start(embed_opts("0.0085")).await); // 50 × 170
    let mut tasks = Vec::new();
    for i in 0..200 {
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            g.embed(
                &format!("conv-{i}"),
                json!({"model": EMBED, "input": "hello, embeddings"}),
            )
            .await
        }));
    }
    let (mut served, mut refused) = (0u64, 0u64);
    for t in tasks {
        let r = t.await.expect("task");
        match r.status {
            200 => {
                assert_eq!(r.reserved(), 170);
                served += 1;
            }
            429 => {
                assert!(matches!(
                    r.code().as_str(),
                    "budget_exhausted" | "budget_held"
                ));
                refused += 1;
            }
            s => panic!("unexpected {s}: {}", r.text),
        }
    }
    assert_eq!(served + refused, 200);
    // 50 holds fit at once; a call charged its usage (50 micros) before the last were
    // admitted gives back the rest of its hold, which may admit a few more.
    assert!(
        served >= 50,
        "the budget covers at least 50 such calls: {served}"
    );
    let stats = g.mock.stats();
    assert_eq!(
        stats.requests, served,
        "only admitted calls reach the upstream"
    );
    let worth = stats.prompt_tokens * EMBED_INPUT / 1_000_000;
    assert!(
        worth <= 8_500,
        "the mock served {worth} micros, over the budget"
    );
    let global = g.global().await;
    assert_eq!(global["used_micros"], worth, "books = ground truth");
    assert_eq!(global["reserved_micros"], 0);
}
