//! Where the money went: after a scripted load on sqlite, `spendgate report` over the usage
//! history (from the admin API and from the store's file) answers the ledger's used spend to
//! the micro, `/admin/v1/history` the same, and `spendgate tune`'s snippet, merged into the
//! config, passes `check-config`.

use crate::harness::*;
use serde_json::{json, Value};

const LOAD: &str = r#"
[limits.global]
rate = "100000/second"
burst = 100000
budgets = [{ amount = "100", window = "day" }]

[limits.ip]
rate = "100000/second"
burst = 100000
budgets = []

[limits.session]
rate = "100000/second"
burst = 100000
concurrency = 100
budgets = []

[run]
max_model_rounds = 10
max_tool_calls = 10
max_output_tokens = 1000

[models."m-big"]
upstream = "mock"
input_per_million = "3.00"
output_per_million = "15.00"
tokenizer = "bytes"

[models."m-small"]
upstream = "mock"
input_per_million = "0.15"
output_per_million = "0.60"
tokenizer = "bytes"

[tools.search]
per_call = "0.01"
"#;

const SESSIONS: usize = 8;

/// Runs of 8 sessions from 4 addresses: model steps of two models committed with usage,
/// released, or left unknown; tool steps committed; every run finished.
async fn scripted_load(server: &Server) {
    for i in 0..SESSIONS {
        let s = server.session().await;
        for r in 0..=(i % 3) {
            let ip = format!("192.0.2.{}", 10 + i % 4);
            let run = server.run(&s, &ip, &format!("conv-{i}-{r}")).await;
            let steps = format!("/v1/runs/{run}/steps");
            for k in 0..(1 + (i + r) % 4) {
                let model = if (i + k) % 2 == 0 { "m-big" } else { "m-small" };
                let (st, v) = server
                    .post(
                        &steps,
                        json!({"kind": "model", "model": model, "prompt_tokens": 100 + 10 * i, "max_output_tokens": 500}),
                    )
                    .await;
                assert_eq!(st, 201, "{v}");
                let step = v["step_id"].as_str().expect("step_id").to_owned();
                let (path, body) = match (i + r + k) % 5 {
                    0 => (format!("/v1/steps/{step}/release"), json!({})),
                    1 => (format!("/v1/steps/{step}/unknown"), json!({})),
                    _ => (
                        format!("/v1/steps/{step}/commit"),
                        json!({"usage": {"prompt_tokens": 100 + 10 * i, "completion_tokens": 20 * (k + 1) + i}}),
                    ),
                };
                let (st, v) = server.post(&path, body).await;
                assert_eq!(st, 200, "{path}: {v}");
            }
            if i % 2 == 0 {
                let step = server.tool_step(&run, "search").await;
                server.commit_units(&step, 1).await;
            }
            let (st, v) = server
                .post(&format!("/v1/runs/{run}/finish"), json!({}))
                .await;
            assert_eq!(st, 200, "{v}");
        }
    }
}

fn run_ok(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spendgate"))
        .env_remove("SPENDGATE_CONFIG")
        .env_remove("SPENDGATE_ADMIN_TOKEN")
        .args(args)
        .output()
        .expect("run spendgate");
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn total(report: &Value) -> u64 {
    report["totals"]["charged_micros"].as_u64().expect("totals")
}

/// `spendgate report` over the history, and `/admin/v1/history`, answer the ledger's used
/// spend to the micro; `tune`'s snippet passes `check-config`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_answer_the_ledgers_totals_and_tune_suggests_a_valid_config() {
    let mut server = Server::start(LOAD);
    scripted_load(&server).await;
    let used = server.global_usage().await["used_micros"]
        .as_u64()
        .expect("used");
    assert!(used > 0);
    let url = server.url("");
    let config = server
        .config_path()
        .to_str()
        .expect("utf-8 path")
        .to_owned();
    let admin = ["--url", url.as_str(), "--admin-token", ADMIN];
    let report = |source: &[&str], by: &str, extra: &[&str]| -> Value {
        let mut args = vec![
            "report",
            "--since",
            "yesterday",
            "--by",
            by,
            "--format",
            "json",
        ];
        args.extend_from_slice(source);
        args.extend_from_slice(extra);
        serde_json::from_str(&run_ok(&args)).expect("report --format json is JSON")
    };
    let file = ["--config", config.as_str()];
    let check_reports = |source: &[&str]| {
        let by_model = report(source, "model", &[]);
        let by_tool = report(source, "tool", &[]);
        assert_eq!(
            total(&by_model) + total(&by_tool),
            used,
            "{source:?}: by model {by_model} and by tool {by_tool}"
        );
        let models: Vec<&str> = by_model["rows"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|r| r["key"].as_str().expect("key"))
            .collect();
        assert_eq!(models, ["m-big", "m-small"], "ranked by charge");
        assert!(by_model["rows"][0]["reservations"].as_u64() > Some(0));
        let by_session = report(source, "session", &["--top", "10"]);
        assert_eq!(by_session["rows"].as_array().map(Vec::len), Some(SESSIONS));
        assert_eq!(total(&by_session), used, "{by_session}");
        let by_day = report(source, "day", &[]);
        assert_eq!(total(&by_day), used, "{by_day}");
        assert_eq!(by_day["truncated"], false);
    };
    check_reports(&admin);
    // The admin API answers the same groups.
    let api = server
        .admin_get("/admin/v1/history?by=session&top=10&since=0")
        .await;
    let rows = api["rows"].as_array().expect("rows");
    let sum: u64 = rows
        .iter()
        .map(|r| r["charged_micros"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(sum, used, "{api}");
    assert_eq!(api["source"], "sqlite");
    // Raw records page through: every reservation once.
    let mut cursor = String::new();
    let mut charged = 0;
    for _ in 0..100 {
        let page = server
            .admin_get(&format!("/admin/v1/history?since=0&limit=7{cursor}"))
            .await;
        for r in page["reservations"].as_array().expect("records") {
            charged += r["charged_micros"].as_u64().unwrap_or(0);
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = format!("&cursor={}", c.replace(':', "%3A")),
            None => break,
        }
    }
    assert_eq!(charged, used);
    // A table and CSV render too.
    let table = run_ok(&[
        "report",
        "--since",
        "yesterday",
        "--by",
        "model",
        "--url",
        &url,
        "--admin-token",
        ADMIN,
    ]);
    assert!(
        table.contains("m-big") && table.contains("total"),
        "{table}"
    );
    let csv = run_ok(&[
        "report",
        "--since",
        "today",
        "--by",
        "session",
        "--format",
        "csv",
        "--url",
        &url,
        "--admin-token",
        ADMIN,
    ]);
    assert!(
        csv.starts_with("key,reservations,reserved_micros,charged_micros,"),
        "{csv}"
    );

    check_tune(&server, &admin);
    // A running server holds its sqlite file: reading it says to use the admin API.
    let held = std::process::Command::new(env!("CARGO_BIN_EXE_spendgate"))
        .args([
            "report",
            "--since",
            "yesterday",
            "--by",
            "model",
            "--config",
            &config,
        ])
        .env_remove("SPENDGATE_ADMIN_TOKEN")
        .output()
        .expect("run");
    assert!(!held.status.success());
    assert!(
        String::from_utf8_lossy(&held.stderr).contains("--url"),
        "{held:?}"
    );
    // Stopped, its file answers the same.
    assert!(server.terminate().success());
    check_reports(&file);
    let from_file = run_ok(&["tune", "--since", "yesterday", "--config", &config]);
    assert!(
        from_file.starts_with(&format!("{} runs ended", runs_in_load())),
        "{from_file}"
    );
}

/// `tune --since yesterday` suggests a value for every `[run]` bound and every scope kind's
/// rate and budget; its snippet, merged into the server's config, passes `check-config`.
fn check_tune(server: &Server, admin: &[&str]) {
    let config = server.config_path().to_str().expect("utf-8 path");
    let mut args = vec!["tune", "--since", "yesterday", "--config", config];
    args.extend_from_slice(admin);
    let out = run_ok(&args);
    assert!(
        out.starts_with(&format!("{} runs ended", runs_in_load())),
        "{out}"
    );
    for key in [
        "max_input_bytes",
        "max_context_tokens",
        "max_output_tokens",
        "max_tool_result_bytes",
        "max_model_rounds",
        "max_tool_calls",
        "max_retries",
        "max_seconds",
        "max_cost",
    ] {
        assert!(out.contains(&format!("run.{key} ")), "{key}: {out}");
        assert!(
            out.contains(&format!("\n{key} = ")),
            "{key} in the snippet: {out}"
        );
    }
    for kind in ["global", "ip", "session", "conversation"] {
        assert!(
            out.contains(&format!("[limits.{kind}]\nbudgets = [{{ amount = ")),
            "{kind}: {out}"
        );
    }
    let snippet = &out[out.find("[run]\n").expect("a snippet")..];
    let mut merged: toml::Table =
        toml::from_str(&std::fs::read_to_string(config).expect("config")).expect("toml");
    let ours: toml::Table = toml::from_str(snippet).expect("the snippet is TOML");
    merge(&mut merged, ours);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tuned.toml");
    std::fs::write(&path, toml::to_string(&merged).expect("toml")).expect("write");
    let checked = run_ok(&["check-config", "--config", path.to_str().expect("utf-8")]);
    assert!(checked.contains("max_cost"), "{checked}");
}

fn runs_in_load() -> usize {
    (0..SESSIONS).map(|i| 1 + i % 3).sum()
}

/// `ours`' keys over `base`'s, table by table.
fn merge(base: &mut toml::Table, ours: toml::Table) {
    for (k, v) in ours {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}
