//! The published API document against a live server: `GET /openapi.json` is
//! `docs/openapi.json`, and schemathesis (from PyPI, in the test virtualenv) finds no server
//! error outside the contract's 503s and no answer that does not match the document.

use spendgate_testkit::{free_port, wait_for_port, ChildGuard};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const SERVICE: &str = "openapi-service-token-0123456789";
const ADMIN: &str = "openapi-admin-token-0123456789";

/// Longest a schemathesis pass may take (two passes: the whole run stays under 2 minutes).
const PASS_TIME_MAX: Duration = Duration::from_secs(50);
/// Examples per operation: enough for every route's shapes, bounded for the time limit.
const MAX_EXAMPLES: u32 = 25;

fn config(port: u16, dir: &std::path::Path) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
service_tokens = ["{SERVICE}"]
admin_tokens = ["{ADMIN}"]

[sessions]
keys = ["openapi-session-key-0123456789abcdef"]
secure_cookie = false
create_rate_per_ip = "100000/second"
create_rate_global = "100000/second"

[store]
kind = "sqlite"
path = "{db}"
timeout_ms = 5000

[limits.global]
budgets = [{{ amount = "100", window = "day" }}]

[models."m-1"]
upstream = "mock"
input_per_million = "1.00"
output_per_million = "2.00"
tokenizer = "bytes"

[tools.web_search]
per_call = "0.01"
"#,
        db = dir.join("spendgate.db").display()
    )
}

struct Live {
    _dir: tempfile::TempDir,
    _child: ChildGuard,
    port: u16,
}

fn start() -> Live {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let path = dir.path().join("spendgate.toml");
    std::fs::write(&path, config(port, dir.path())).expect("write config");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spendgate"));
    cmd.arg("serve")
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "warn");
    let child = ChildGuard::spawn(cmd).expect("spawn spendgate");
    if wait_for_port(port, Duration::from_secs(20)).is_err() {
        panic!("spendgate did not start:\n{}", child.output());
    }
    Live {
        _dir: dir,
        _child: child,
        port,
    }
}

fn docs_openapi() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json")
}

/// The live server serves the checked-in document, byte for byte, unauthenticated.
#[tokio::test]
async fn the_served_document_is_the_checked_in_one() {
    spendgate_http::install_crypto();
    let live = start();
    let url = format!("http://127.0.0.1:{}/openapi.json", live.port);
    let r = reqwest::get(&url).await.expect("get");
    assert_eq!(r.status(), 200);
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    assert_eq!(ct.as_deref(), Some("application/json"));
    let served = r.text().await.expect("body");
    let file = std::fs::read_to_string(docs_openapi()).expect("docs/openapi.json");
    assert!(
        served == file,
        "GET /openapi.json differs from docs/openapi.json: \
         run `SPENDGATE_BLESS=1 cargo test -p spendgate-http openapi` and commit it"
    );
}

/// Runs one schemathesis pass over the paths `include` matches, with `token`; the output
/// when it fails.
fn schemathesis(python: &str, port: u16, include: &str, token: &str) -> Result<(), String> {
    // (its example database and reports go to a fresh directory, not the source tree)
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(python);
    cmd.current_dir(work.path())
        .args(["-m", "schemathesis.cli", "run"])
        .arg(format!("http://127.0.0.1:{port}/openapi.json"))
        .args([
            "--checks",
            "not_a_server_error,response_schema_conformance,content_type_conformance",
        ])
        .arg(format!("--max-examples={MAX_EXAMPLES}"))
        .arg(format!("--include-path-regex={include}"))
        .arg(format!("--header=Authorization: Bearer {token}"))
        .arg(format!("--max-time={}", PASS_TIME_MAX.as_secs() - 10))
        .args(["--request-timeout=10", "--no-color", "--seed=19"])
        .env("PYTHONUNBUFFERED", "1")
        .env("SCHEMATHESIS_TELEMETRY", "false");
    let out_path = std::env::temp_dir().join(format!("spendgate-schemathesis-{port}.log"));
    let out = std::fs::File::create(&out_path).map_err(|e| e.to_string())?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    cmd.stdout(out).stderr(err);
    let mut child = cmd.spawn().map_err(|e| format!("spawn {python}: {e}"))?;
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(s);
        }
        if started.elapsed() > PASS_TIME_MAX {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let log = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    match status {
        Some(s) if s.success() => {
            // (what it covered, shown with `--nocapture`)
            let summary: Vec<&str> = log.lines().rev().take(30).collect();
            let summary: Vec<&str> = summary.into_iter().rev().collect();
            eprintln!("schemathesis on {include}:\n{}", summary.join("\n"));
            Ok(())
        }
        Some(s) => Err(format!("schemathesis failed ({s}) on {include}:\n{log}")),
        None => Err(format!(
            "schemathesis took over {PASS_TIME_MAX:?} on {include}:\n{log}"
        )),
    }
}

/// schemathesis against a live server: the decision API and operations with the service
/// token, then the admin API with the admin token (last: it may engage the cutoff, after
/// which new admissions are refused 503 `cutoff_engaged`, as the contract says).
#[test]
fn schemathesis_finds_no_server_error_and_no_answer_off_the_document() {
    let Ok(python) = std::env::var("SPENDGATE_TEST_PYTHON") else {
        panic!("SPENDGATE_TEST_PYTHON is not set: scripts/test.sh makes the virtualenv");
    };
    let found = Command::new(&python)
        .args(["-c", "import schemathesis"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "{python} has no schemathesis: scripts/test.sh installs it (pip install schemathesis==4.32.5)"
    );
    let live = start();
    schemathesis(
        &python,
        live.port,
        "^/(v1/|healthz|readyz|openapi)",
        SERVICE,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    schemathesis(&python, live.port, "^/(admin/|metrics)", ADMIN).unwrap_or_else(|e| panic!("{e}"));
}
