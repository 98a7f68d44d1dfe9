//! Starts `spendgate serve` processes on free ports with a config in a temp dir.

use serde_json::{json, Value};
use spendgate_testkit::{free_port, wait_for_port, ChildGuard};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// `[limits.ip]` that never binds, for tests about other limits. A macro so that test
/// configs can `concat!` it into their constants.
macro_rules! open_ip_limits {
    () => {
        r#"
[limits.ip]
rate = "100000/second"
burst = 100000
concurrency = 1000
budgets = []
"#
    };
}

/// `[limits.ip]` and `[limits.session]` that never bind (see [`open_ip_limits`]).
macro_rules! open_guest_limits {
    () => {
        concat!(
            open_ip_limits!(),
            r#"
[limits.session]
rate = "100000/second"
burst = 100000
concurrency = 1000
budgets = []
"#
        )
    };
}

/// The acceptance config of issues 2 and 3: a global day budget of `$amount` (plus any
/// `$global_extra` lines of `[limits.global]`), rates and concurrency that never bind, one
/// active run per conversation, and a tool `web_search` at 0.01 a call.
macro_rules! tool_budget_config {
    ($amount:literal, $global_extra:literal) => {
        concat!(
            r#"
[limits.global]
rate = "100000/second"
burst = 100000
concurrency = 1000
budgets = [{ amount = "#,
            "\"",
            $amount,
            "\"",
            r#", window = "day" }]
"#,
            $global_extra,
            "\n",
            open_guest_limits!(),
            r#"
[limits.conversation]
concurrency = 1
budgets = []

[run]
max_tool_calls = 1000
max_cost = "100"

[tools.web_search]
per_call = "0.01"
"#
        )
    };
}

pub const SERVICE: &str = "test-service-token-0123456789";
pub const ADMIN: &str = "test-admin-token-0123456789";
pub const SESSION_KEY: &str = "test-session-key-0123456789abcdef";

pub struct Server {
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub child: Option<ChildGuard>,
    pub http: reqwest::Client,
    config: PathBuf,
    /// Environment variables the process starts with, besides the test's own.
    env: Vec<(String, String)>,
}

/// A config with the test tokens and the given extra TOML (appended; it must not repeat
/// `[server]`/`[sessions]` keys set here).
/// `[sessions]` keys of the test configs besides `keys` and `secure_cookie`.
pub const DEFAULT_SESSIONS: &str =
    "create_rate_per_ip = \"100000/second\"\ncreate_rate_global = \"100000/second\"";

pub fn config_text_with_sessions(port: u16, store: &str, sessions: &str, extra: &str) -> String {
    config_text_full(port, "", store, sessions, extra)
}

/// [`config_text_with_sessions`] with more `[server]` keys.
pub fn config_text_full(
    port: u16,
    server: &str,
    store: &str,
    sessions: &str,
    extra: &str,
) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
service_tokens = ["{SERVICE}"]
admin_tokens = ["{ADMIN}"]
trusted_proxies = ["127.0.0.1/32"]
{server}

[sessions]
keys = ["{SESSION_KEY}"]
secure_cookie = false
{sessions}

[store]
{store}
{extra}
"#
    )
}

/// The sqlite store's `timeout_ms` in tests that are not about timeouts: an fsync on this
/// machine's disk has stalled for up to 200 ms while the suite loads both cores, and the
/// default (100 ms) then refuses with 503 `store_unavailable`, as designed.
const SQLITE_TEST_TIMEOUT_MS: u64 = 5_000;

/// A fresh directory and the `[store]` keys of a sqlite file in it.
pub fn sqlite_dir() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = format!(
        "kind = \"sqlite\"\npath = \"{}\"\ntimeout_ms = {SQLITE_TEST_TIMEOUT_MS}",
        dir.path().join("spendgate.db").display()
    );
    (dir, store)
}

impl Server {
    /// `extra` is appended to the config: `[limits.*]`, `[run]`, `[tools.*]` sections and a
    /// `lease_ttl_s = N` line that belongs to `[store]` (put it first).
    pub fn start(extra: &str) -> Server {
        let (dir, store) = sqlite_dir();
        Server::start_in(dir, &store, extra)
    }

    /// A replica on a Redis store.
    pub fn start_redis(url: &str, prefix: &str, extra: &str) -> Server {
        Server::start_redis_with_env(url, prefix, extra, &[])
    }

    /// A replica on a Redis store, started with these environment variables, after `spendgate
    /// store init` (with them too) for the prefix.
    pub fn start_redis_with_env(
        url: &str,
        prefix: &str,
        extra: &str,
        env: &[(&str, &str)],
    ) -> Server {
        Server::start_redis_full(url, prefix, extra, env, true)
    }

    /// As [`Server::start_redis_with_env`], without `store init` (a replica on what Redis holds).
    pub fn start_redis_replica(
        url: &str,
        prefix: &str,
        extra: &str,
        env: &[(&str, &str)],
    ) -> Server {
        Server::start_redis_full(url, prefix, extra, env, false)
    }

    fn start_redis_full(
        url: &str,
        prefix: &str,
        extra: &str,
        env: &[(&str, &str)],
        init: bool,
    ) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let ledger = if init {
            // As an operator: `store init` with the pin the config already holds, if any.
            let path = dir.path().join("init.toml");
            let store = redis_store_keys(url, prefix, pinned_ledger(url, prefix).as_deref(), None);
            std::fs::write(
                &path,
                config_text_with_sessions(0, &store, DEFAULT_SESSIONS, extra),
            )
            .expect("write init config");
            let ledger = store_init(&path, &env);
            pin_ledger(url, prefix, &ledger);
            ledger
        } else {
            pinned_ledger(url, prefix)
                .unwrap_or_else(|| panic!("no ledger pinned for {url} {prefix}: start_redis first"))
        };
        Server::start_redis_pinned(dir, url, prefix, &ledger, extra, env)
    }

    /// A replica pinned to `ledger`, with its witness file in `dir` (kept across
    /// [`Server::spawn`]s, as a replica's durable disk).
    pub fn start_redis_pinned(
        dir: tempfile::TempDir,
        url: &str,
        prefix: &str,
        ledger: &str,
        extra: &str,
        env: Vec<(String, String)>,
    ) -> Server {
        let witness = dir.path().join("spendgate.witness");
        let store = redis_store_keys(url, prefix, Some(ledger), Some(&witness));
        let config = |port| config_text_with_sessions(port, &store, DEFAULT_SESSIONS, extra);
        Server::start_config(dir, config, env)
    }

    /// A server on sqlite with its own `[sessions]` settings.
    pub fn start_with_sessions(sessions: &str, extra: &str) -> Server {
        let (dir, store) = sqlite_dir();
        Server::start_full(dir, &store, sessions, extra, Vec::new())
    }

    /// A server on sqlite whose `/v1/chat/completions` also takes a guest's cookie alone
    /// (`server.browser_direct = true`).
    pub fn start_browser_direct(extra: &str) -> Server {
        let (dir, store) = sqlite_dir();
        let config = |port| {
            config_text_full(
                port,
                "browser_direct = true",
                &store,
                DEFAULT_SESSIONS,
                extra,
            )
        };
        Server::start_config(dir, config, Vec::new())
    }

    fn start_in(dir: tempfile::TempDir, store: &str, extra: &str) -> Server {
        Server::start_full(dir, store, DEFAULT_SESSIONS, extra, Vec::new())
    }

    fn start_full(
        dir: tempfile::TempDir,
        store: &str,
        sessions: &str,
        extra: &str,
        env: Vec<(String, String)>,
    ) -> Server {
        let config = |port| config_text_with_sessions(port, store, sessions, extra);
        Server::start_config(dir, config, env)
    }

    pub fn start_config(
        dir: tempfile::TempDir,
        config_text: impl FnOnce(u16) -> String,
        env: Vec<(String, String)>,
    ) -> Server {
        let port = free_port();
        let config = dir.path().join("spendgate.toml");
        std::fs::write(&config, config_text(port)).expect("write config");
        spendgate_http::install_crypto();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .expect("client");
        let mut s = Server {
            dir,
            port,
            child: None,
            http,
            config,
            env,
        };
        s.spawn();
        s
    }

    pub fn config_path(&self) -> &std::path::Path {
        &self.config
    }

    pub fn spawn(&mut self) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_spendgate"));
        cmd.arg("serve")
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "warn")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        let child = ChildGuard::spawn(cmd).expect("spawn spendgate");
        if wait_for_port(self.port, Duration::from_secs(20)).is_err() {
            panic!("spendgate did not start:\n{}", child.output());
        }
        self.child = Some(child);
    }

    /// SIGKILL, like a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("kill");
        }
    }

    /// SIGTERM, graceful.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        c.terminate().expect("terminate")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.url(path))
            .bearer_auth(SERVICE)
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn admin_get(&self, path: &str) -> Value {
        let r = self
            .http
            .get(self.url(path))
            .bearer_auth(ADMIN)
            .send()
            .await
            .expect("send");
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.expect("json")
    }

    pub async fn session(&self) -> String {
        let r = self
            .http
            .post(self.url("/v1/sessions"))
            .json(&json!({}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 201);
        let v: Value = r.json().await.expect("json");
        v["session"].as_str().expect("session").to_string()
    }

    /// Opens a run; panics unless admitted.
    pub async fn run(&self, session: &str, ip: &str, conversation: &str) -> String {
        let (s, v) = self
            .post("/v1/runs", json!({"session": session, "client_ip": ip, "conversation": conversation, "input_text": "hi"}))
            .await;
        assert_eq!(s, 201, "run refused: {v}");
        v["run_id"].as_str().expect("run_id").to_string()
    }

    /// Reserves a step of tool `tool` in `run`; panics unless granted. Returns its id.
    pub async fn tool_step(&self, run: &str, tool: &str) -> String {
        let (s, v) = self
            .post(
                &format!("/v1/runs/{run}/steps"),
                json!({"kind": "tool", "tool": tool}),
            )
            .await;
        assert_eq!(s, 201, "step refused: {v}");
        v["step_id"].as_str().expect("step_id").to_string()
    }

    /// Commits `step` with `units`; panics unless it answers 200. Returns the answer.
    pub async fn commit_units(&self, step: &str, units: u64) -> Value {
        let (s, v) = self
            .post(&format!("/v1/steps/{step}/commit"), json!({"units": units}))
            .await;
        assert_eq!(s, 200, "commit failed: {v}");
        v
    }

    /// Asserts the server is closed: `/readyz` fails and a run is refused 503
    /// `store_unavailable` (`session` a valid guest token).
    pub async fn assert_closed(&self, session: &str, why: &str) {
        let r = self
            .http
            .get(self.url("/readyz"))
            .send()
            .await
            .expect("readyz");
        assert_eq!(r.status().as_u16(), 503, "{why}: not ready");
        let (status, v) = self
            .post("/v1/runs", json!({"session": session, "client_ip": "10.250.0.1", "conversation": "closed", "input_text": "x"}))
            .await;
        assert_eq!((status, code(&v)), (503, "store_unavailable"), "{why}: {v}");
    }

    /// What a conversation's budget was charged (`GET /v1/usage`, the service token), once
    /// nothing of it is held (bounded wait).
    pub async fn conversation_used(&self, session: &str, conversation: &str) -> u64 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let v: Value = self
                .http
                .get(self.url("/v1/usage"))
                .bearer_auth(SERVICE)
                .query(&[
                    ("session", session),
                    ("client_ip", "10.1.2.3"),
                    ("conversation", conversation),
                ])
                .send()
                .await
                .expect("usage")
                .json()
                .await
                .expect("usage json");
            let line = v["scopes"]
                .as_array()
                .and_then(|s| s.iter().find(|l| l["kind"] == "conversation").cloned())
                .unwrap_or_else(|| panic!("no conversation scope: {v}"));
            if line["reserved_micros"] == 0 || std::time::Instant::now() > deadline {
                return line["used_micros"].as_u64().expect("used_micros");
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    pub async fn global_usage(&self) -> Value {
        let s = self.admin_get("/admin/v1/summary").await;
        s["global"][0].clone()
    }

    /// The `/metrics` text (with the admin token: the public listener serves it to no one
    /// else).
    pub async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics body")
    }
}

pub fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

// ---------------------------------------------------------------------------------------
// Real clients (Python).

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python that has the official `openai` package (and `selenium`, for the page test):
/// `SPENDGATE_TEST_PYTHON`, else the workspace's `.venv` (both made by `scripts/test.sh`).
pub fn test_python() -> PathBuf {
    if let Some(p) = std::env::var_os("SPENDGATE_TEST_PYTHON") {
        let p = PathBuf::from(p);
        assert!(
            p.exists(),
            "SPENDGATE_TEST_PYTHON={} does not exist; install the client with: \
             python3 -m venv .venv && .venv/bin/pip install openai",
            p.display()
        );
        return p;
    }
    let venv = workspace_root().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with the `openai` package: set SPENDGATE_TEST_PYTHON, or at the workspace \
         root run: python3 -m venv .venv && .venv/bin/pip install openai"
    );
    venv
}

/// Runs `cmd` to its end, for at most `limit` (then it is killed): whether it exited with
/// success, and everything it printed.
pub fn run_to_end(cmd: Command, limit: Duration) -> (bool, String) {
    let mut child = ChildGuard::spawn(cmd).expect("spawn");
    let deadline = std::time::Instant::now() + limit;
    while child.is_running() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = child.exit_status();
    (status.is_some_and(|s| s.success()), child.output())
}

/// `spendgate demo` on a free port with its ledger in `dir`, started and listening.
pub fn start_demo(dir: &std::path::Path) -> (ChildGuard, u16) {
    let port = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spendgate"));
    cmd.arg("demo")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--db")
        .arg(dir.join("demo.db"))
        .env("RUST_LOG", "warn")
        .env_remove("SPENDGATE_CONFIG");
    let child = ChildGuard::spawn(cmd).expect("spawn spendgate demo");
    if wait_for_port(port, Duration::from_secs(30)).is_err() {
        panic!("spendgate demo did not start:\n{}", child.output());
    }
    (child, port)
}

/// `spendgate store init --config PATH`, as an operator runs it once for a new Redis
/// deployment (it leaves a prefix that already holds a ledger alone): the ledger id it
/// prints to pin.
pub fn store_init(config: &std::path::Path, env: &[(String, String)]) -> String {
    let (ok, out) = spendgate_store_cmd(&["init"], config, env);
    assert!(ok, "store init: {out}");
    printed_ledger_id(&out).unwrap_or_else(|| panic!("store init printed no ledger id: {out}"))
}

/// `spendgate store ARGS --config PATH`: whether it succeeded, and what it printed (stdout
/// then stderr).
pub fn spendgate_store_cmd(
    args: &[&str],
    config: &std::path::Path,
    env: &[(String, String)],
) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_spendgate"))
        .arg("store")
        .args(args)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "warn")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("run spendgate store");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The id in the `ledger_id = "..."` line `store init` prints last.
pub fn printed_ledger_id(out: &str) -> Option<String> {
    out.lines()
        .rev()
        .find_map(|l| l.strip_prefix("ledger_id = \""))
        .and_then(|l| l.strip_suffix('"'))
        .map(str::to_string)
}

/// The `[store]` keys of a replica on a Redis ledger.
pub fn redis_store_keys(
    url: &str,
    prefix: &str,
    ledger: Option<&str>,
    witness: Option<&std::path::Path>,
) -> String {
    let mut s = format!("kind = \"redis\"\nurl = \"{url}\"\nprefix = \"{prefix}\"");
    if let Some(l) = ledger {
        s.push_str(&format!("\nledger_id = \"{l}\""));
    }
    if let Some(w) = witness {
        s.push_str(&format!("\nwitness_path = \"{}\"", w.display()));
    }
    s
}

/// The ledger id pinned for each (url, prefix) by the replicas started on it, as the
/// operator's config holds it.
fn pins() -> &'static std::sync::Mutex<std::collections::BTreeMap<(String, String), String>> {
    static PINS: std::sync::OnceLock<
        std::sync::Mutex<std::collections::BTreeMap<(String, String), String>>,
    > = std::sync::OnceLock::new();
    PINS.get_or_init(Default::default)
}

pub fn pinned_ledger(url: &str, prefix: &str) -> Option<String> {
    let pins = pins().lock().unwrap_or_else(|p| p.into_inner());
    pins.get(&(url.to_string(), prefix.to_string())).cloned()
}

fn pin_ledger(url: &str, prefix: &str, ledger: &str) {
    let mut pins = pins().lock().unwrap_or_else(|p| p.into_inner());
    pins.insert((url.to_string(), prefix.to_string()), ledger.to_string());
}
