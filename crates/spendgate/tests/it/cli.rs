//! The `spendgate` command line: `check-config` validates, names bad keys and masks secrets;
//! `serve` refuses to start on a bad config before binding a port.

use std::process::Command;

fn spendgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_spendgate"))
}

#[test]
fn check_config_prints_the_effective_config_with_secrets_masked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ok.toml");
    std::fs::write(
        &path,
        "[server]\nservice_tokens = [\"env:SG_TEST_TOKEN\"]\n[limits.global]\nbudgets = [{ amount = \"2.50\", window = \"day\" }]\n",
    )
    .expect("write");
    let out = spendgate()
        .args(["check-config", "--config"])
        .arg(&path)
        .env("SG_TEST_TOKEN", "super-secret-value-123")
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains("super-secret-value-123"),
        "secret leaked:\n{stdout}"
    );
    assert!(stdout.contains("SG_TEST_TOKEN"), "{stdout}");
    assert!(stdout.contains("2.5"), "effective budget shown:\n{stdout}");
    // Warnings go to stderr (stdout stays the config): no admin token here.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: server.admin_tokens: no admin token is set"),
        "{stderr}"
    );
    assert!(!stdout.contains("warning:"), "{stdout}");
}

#[test]
fn bad_configs_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (text, key) in [
        ("[server]\nlisten_on = \"x\"\n", "listen_on"),
        ("[limits.global]\nbudgets = [{ amount = \"1.0000001\", window = \"day\" }]\n", "limits.global.budgets[0].amount"),
        ("[run]\nmode = \"sometimes\"\n", "run.mode"),
        // No global budget, not said explicitly: the error names the key and the opt-out.
        ("[limits.global]\nbudgets = []\n", "limits.global.budgets"),
        ("[limits.global]\nbudgets = []\n", "limits.global.unbudgeted = true"),
        ("[limits.ip]\nconcurrency = \"off\"\nconcurrency_dry_run = true\n", "limits.ip.concurrency_dry_run"),
        ("[models.\"m\"]\nupstream = \"nowhere\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\n", "upstream"),
    ] {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, text).expect("write");
        for cmd in ["check-config", "serve"] {
            let out = spendgate().args([cmd, "--config"]).arg(&path).output().expect("run");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{cmd} accepted {text:?}");
            assert!(stderr.contains(key), "{cmd}: error for {text:?} does not name {key}: {stderr}");
        }
    }
}

/// A service without a global budget is what the config says explicitly: `unbudgeted = true`
/// is accepted by `check-config` (with a warning), and shown in its output.
#[test]
fn no_global_budget_is_accepted_only_when_said() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("unbudgeted.toml");
    std::fs::write(&path, "[limits.global]\nbudgets = []\nunbudgeted = true\n").expect("write");
    let out = spendgate()
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("unbudgeted = true"), "{stdout}");
    assert!(
        stderr.contains("warning: limits.global.unbudgeted: no global budget"),
        "{stderr}"
    );
}

/// A redis store needs its ledger pinned: `serve` refuses to start without `store.ledger_id`
/// (naming the key and `spendgate store init`); `check-config` shows the new keys and warns.
#[test]
fn a_redis_replica_without_a_pinned_ledger_does_not_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("redis.toml");
    let base = "[sessions]\nkeys = [\"session-key-0123456789abcdef\"]\n[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:1/0\"\n";
    std::fs::write(&path, base).expect("write");
    let (ok, out) = crate::harness::run_to_end(
        {
            let mut c = spendgate();
            c.args(["serve", "--config"]).arg(&path);
            c
        },
        std::time::Duration::from_secs(20),
    );
    assert!(!ok, "serve started without a pinned ledger: {out}");
    assert!(
        out.contains("store.ledger_id") && out.contains("spendgate store init"),
        "{out}"
    );
    let out = spendgate()
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("ledger_id = \"\"  # not pinned"),
        "{stdout}"
    );
    assert!(
        stdout.contains("witness_path = \"spendgate.witness\""),
        "{stdout}"
    );
    assert!(
        stderr.contains("warning: store.ledger_id: not set"),
        "{stderr}"
    );

    let pinned = format!(
        "{base}ledger_id = \"lg-0123456789abcdef0123456789abcdef\"\nwitness_path = \"off\"\n"
    );
    std::fs::write(&path, pinned).expect("write");
    let out = spendgate()
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        stdout.contains("ledger_id = \"lg-0123456789abcdef0123456789abcdef\"\n"),
        "{stdout}"
    );
    assert!(stdout.contains("witness_path = \"off\"  #"), "{stdout}");
    assert!(stderr.contains("warning: store.witness_path"), "{stderr}");
    for (bad, key) in [
        ("ledger_id = \"lg-123\"\n", "store.ledger_id"),
        ("witness_path = \"\"\n", "store.witness_path"),
    ] {
        std::fs::write(&path, format!("{base}{bad}")).expect("write");
        for cmd in ["check-config", "serve"] {
            let out = spendgate()
                .args([cmd, "--config"])
                .arg(&path)
                .output()
                .expect("run");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{cmd} accepted {bad:?}");
            assert!(stderr.contains(key), "{cmd}: {stderr}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_and_tune_read_a_running_gateway() {
    use crate::harness::*;
    use serde_json::json;
    let server = Server::start("[run]\nmax_tool_calls = 10\n\n[tools.t]\nper_call = \"0.01\"\n");
    let s = server.session().await;
    let run = server.run(&s, "192.0.2.77", "report").await;
    for units in [0, 0] {
        let (st, v) = server
            .post(
                &format!("/v1/runs/{run}/steps"),
                json!({"kind": "tool", "tool": "t"}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let step = v["step_id"].as_str().expect("step");
        let (st, _) = server
            .post(&format!("/v1/steps/{step}/commit"), json!({"units": units}))
            .await;
        assert_eq!(st, 200);
    }
    let (st, _) = server
        .post(&format!("/v1/runs/{run}/finish"), json!({}))
        .await;
    assert_eq!(st, 200);
    let run_cmd = |args: &[&str]| {
        let out = spendgate()
            .args(args)
            .args(["--url", &server.url(""), "--admin-token", ADMIN])
            .output()
            .expect("run");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let report = run_cmd(&["report"]);
    assert!(
        report.contains("global") && report.contains("0.020000"),
        "{report}"
    );
    let tune = run_cmd(&["tune"]);
    assert!(tune.starts_with("1 runs observed"), "{tune}");
    assert!(
        tune.contains("run.max_tool_calls = 3"),
        "p99 of 2 tool calls plus half: {tune}"
    );
    // Sampling over several polls counts each reservation once.
    let started = std::time::Instant::now();
    let watched = run_cmd(&["tune", "--watch-seconds", "2"]);
    assert!(started.elapsed() >= std::time::Duration::from_secs(2));
    assert_eq!(watched, tune);
    let bad = spendgate()
        .args(["report", "--url", &server.url(""), "--admin-token", "wrong"])
        .output()
        .expect("run");
    assert!(!bad.status.success());
}

/// `spendgate config example` prints docs/spendgate.example.toml and `config reference`
/// docs/configuration.md, as checked in; the example passes `check-config`.
#[test]
fn config_example_and_reference_are_the_checked_in_docs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for (what, file) in [
        ("example", "docs/spendgate.example.toml"),
        ("reference", "docs/configuration.md"),
    ] {
        let out = spendgate().args(["config", what]).output().expect("run");
        assert!(out.status.success(), "config {what}");
        let want = std::fs::read_to_string(root.join(file)).expect("read the docs file");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            want,
            "`spendgate config {what}` differs from {file}: regenerate it with SPENDGATE_BLESS=1 cargo test -p spendgate-config"
        );
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("example.toml");
    let out = spendgate()
        .args(["config", "example"])
        .output()
        .expect("run");
    std::fs::write(&path, &out.stdout).expect("write");
    let check = spendgate()
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    assert!(
        check.status.success(),
        "the example is refused: {}",
        String::from_utf8_lossy(&check.stderr)
    );
}
