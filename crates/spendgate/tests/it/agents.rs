//! The reference agents (examples/), each run as README says against `spendgate demo`: a
//! multi-step run (several model rounds through the proxy, one paid `web_search` step) that
//! the run's round bound stops, whose spend the agent prints from `GET /v1/usage`. Checked
//! against the server's own records: the run and its reservations in the usage history, and
//! the guest's budget in `GET /v1/usage`.
//!
//! What they need (`openai`, `anthropic`, httpx, setuptools and wheel in
//! `SPENDGATE_TEST_PYTHON`; Node 20 with `npm ci` done in clients/typescript and in
//! examples/typescript-agent) is installed by scripts/test.sh. A missing one fails with the
//! command that installs it; nothing is skipped.

use crate::clients::{install_python_client, python_has};
use crate::harness::{run_to_end, start_demo, test_python, workspace_root};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// How long one agent may take (nine rounds of a 16-token answer at the mock's pace, on a
/// busy machine).
const AGENT_TIME_MAX: Duration = Duration::from_secs(120);
/// How long the demo may take to print its banner once it listens.
const BANNER_TIME_MAX: Duration = Duration::from_secs(10);
/// The demo's `[run] max_model_rounds` (its default): the bound that stops each agent.
const DEMO_MAX_MODEL_ROUNDS: u64 = 8;
/// The demo's `[tools.web_search] per_call`, in micros.
const WEB_SEARCH_MICROS: u64 = 1000;
/// The most reservation records the test reads back (a few runs' worth).
const RESERVATIONS_READ_MAX: u32 = 1000;

/// The value after `marker` on the first line of `output` that has it, up to `end`.
fn printed(output: &str, marker: &str, end: char) -> Option<String> {
    let line = output.lines().find(|l| l.contains(marker))?;
    let rest = &line[line.find(marker)? + marker.len()..];
    Some(rest.split(end).next()?.trim().to_string())
}

/// The demo's base URL, service token and admin token, read from its banner.
struct Demo {
    base: String,
    service: String,
    admin: String,
}

fn demo_banner(demo: &spendgate_testkit::ChildGuard, port: u16) -> Demo {
    let deadline = Instant::now() + BANNER_TIME_MAX;
    loop {
        let out = demo.output();
        if let (Some(service), Some(admin)) = (
            printed(&out, "(service token: ", ')'),
            printed(&out, "(admin token: ", ')'),
        ) {
            return Demo {
                base: format!("http://127.0.0.1:{port}"),
                service,
                admin,
            };
        }
        assert!(Instant::now() < deadline, "no demo banner:\n{out}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

async fn get(url: &str, token: &str, query: &[(&str, &str)]) -> Value {
    spendgate_http::install_crypto();
    let r = reqwest::Client::new()
        .get(url)
        .bearer_auth(token)
        .query(query)
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert!(r.status().is_success(), "GET {url}: {}", r.status());
    r.json().await.expect("a JSON answer")
}

/// Starts the demo, runs the agent `cmd` (given the demo's URL and service token in
/// `SPENDGATE_URL` and `SPENDGATE_TOKEN`) to its end, and checks its run in the server's
/// records.
async fn agent_completes_a_bounded_run(name: &str, mut cmd: Command) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (demo, port) = start_demo(dir.path());
    let d = demo_banner(&demo, port);
    cmd.env("SPENDGATE_URL", &d.base)
        .env("SPENDGATE_TOKEN", &d.service);
    let (ok, out) = tokio::task::spawn_blocking(move || run_to_end(cmd, AGENT_TIME_MAX))
        .await
        .expect("the agent's runner");
    let context = format!("--- {name}:\n{out}\n--- spendgate demo:\n{}", demo.output());
    assert!(
        ok,
        "the {name} agent failed (or ran past {AGENT_TIME_MAX:?})\n{context}"
    );

    // What the agent printed: its guest, its run, each round, and its spend.
    let guest = printed(&out, "guest session ", ' ').expect("the agent prints its session");
    let run_id = printed(&out, "run ", ':').expect("the agent prints its run");
    let spent: u64 = printed(&out, "spent ", ' ')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the agent prints its spend\n{context}"));
    assert!(
        out.contains("round 1: tool_")
            && out.contains("web_search: charged 1000 micros")
            && out.contains(&format!(
                "round {}: refused, run_bound_exceeded",
                DEMO_MAX_MODEL_ROUNDS + 1
            )),
        "the agent did not call the tool and stop at the round bound\n{context}"
    );

    // The run, as the usage history recorded it: the bound's rounds, one tool call, the
    // refusal that stopped it, finished, and its cost what the agent spent.
    let runs = get(
        &format!("{}/admin/v1/history", d.base),
        &d.admin,
        &[("kind", "runs")],
    )
    .await;
    let run = runs["runs"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["id"] == run_id.as_str()))
        .unwrap_or_else(|| panic!("run {run_id} is not in the history: {runs}\n{context}"));
    assert_eq!(run["ended"], "finished", "{run}");
    assert_eq!(run["rounds"], DEMO_MAX_MODEL_ROUNDS, "{run}");
    assert_eq!(run["tool_calls"], 1, "{run}");
    assert_eq!(
        run["refused"],
        serde_json::json!(["run_bound_exceeded"]),
        "{run}"
    );
    assert_eq!(run["cost_micros"], spent, "{run}\n{context}");

    // Its reservations: every model round and the tool call committed, charged `spent`.
    let limit = RESERVATIONS_READ_MAX.to_string();
    let history = get(
        &format!("{}/admin/v1/history", d.base),
        &d.admin,
        &[("kind", "reservations"), ("limit", &limit)],
    )
    .await;
    let steps: Vec<&Value> = history["reservations"]
        .as_array()
        .expect("reservations")
        .iter()
        .filter(|r| r["run_id"] == run_id.as_str())
        .collect();
    let of = |class: &str, name: &str| {
        steps
            .iter()
            .filter(|r| r["class"] == class && r["name"] == name)
            .collect::<Vec<_>>()
    };
    let models = of("model", "demo-mini");
    let tools = of("tool", "web_search");
    assert_eq!(models.len() as u64, DEMO_MAX_MODEL_ROUNDS, "{steps:?}");
    assert_eq!(tools.len(), 1, "{steps:?}");
    assert_eq!(tools[0]["charged_micros"], WEB_SEARCH_MICROS, "{steps:?}");
    assert!(steps.iter().all(|r| r["state"] == "committed"), "{steps:?}");
    let charged: u64 = steps
        .iter()
        .map(|r| r["charged_micros"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(charged, spent, "{steps:?}");
    assert_eq!(steps.len() as u64, DEMO_MAX_MODEL_ROUNDS + 1, "{steps:?}");

    // The guest's spend in GET /v1/usage: what the agent printed, the run's whole cost.
    let usage = get(
        &format!("{}/v1/usage", d.base),
        &d.service,
        &[("session", &guest)],
    )
    .await;
    let used = usage["scopes"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["kind"] == "session"))
        .and_then(|s| s["used_micros"].as_u64())
        .unwrap_or_else(|| panic!("no session scope in {usage}"));
    assert!(used > WEB_SEARCH_MICROS, "{usage}");
    assert_eq!(used, spent, "{usage}\n{context}");
}

/// A Python agent: `python examples/NAME/agent.py` with `pip install ./clients/python` done
/// (into a fresh directory, on `PYTHONPATH`) and `modules` importable.
fn python_agent(example: &str, modules: &str, dir: &Path) -> Command {
    let python = test_python();
    assert!(
        python_has(&python, &format!("{modules}, httpx, setuptools, wheel")),
        "{} lacks one of {modules}, httpx, setuptools, wheel (the reference agents need \
         them): scripts/test.sh installs them, or run: {} -m pip install 'openai>=1.40,<3' \
         'anthropic>=0.40,<1' 'httpx>=0.24,<1' 'setuptools>=61' wheel",
        python.display(),
        python.display()
    );
    let site = install_python_client(&python, dir);
    let mut cmd = Command::new(&python);
    cmd.arg(
        workspace_root()
            .join("examples")
            .join(example)
            .join("agent.py"),
    )
    .env("PYTHONPATH", site)
    .env("PYTHONDONTWRITEBYTECODE", "1");
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_agent_completes_a_bounded_run_against_the_demo() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cmd = python_agent("python-agent", "openai", dir.path());
    agent_completes_a_bounded_run("python-agent", cmd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_agent_completes_a_bounded_run_against_the_demo() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cmd = python_agent("anthropic-agent", "anthropic", dir.path());
    agent_completes_a_bounded_run("anthropic-agent", cmd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typescript_agent_completes_a_bounded_run_against_the_demo() {
    let root = workspace_root();
    let example = root.join("examples/typescript-agent");
    crate::clients::require_node("the TypeScript agent's tests");
    assert!(
        root.join("clients/typescript/dist/index.js").is_file(),
        "clients/typescript is not built: scripts/test.sh builds it, or run: \
         (cd clients/typescript && npm ci)"
    );
    assert!(
        example.join("node_modules/openai").is_dir(),
        "examples/typescript-agent has no node_modules: scripts/test.sh installs them, or run: \
         (cd examples/typescript-agent && npm ci)"
    );
    let mut cmd = Command::new("node");
    cmd.arg("agent.mjs").current_dir(&example);
    agent_completes_a_bounded_run("typescript-agent", cmd).await;
}
