//! The system under test: a private `redis-server` (AOF, `appendfsync always`), R replicas of
//! the real `spendgate serve` binary on it, and the mock upstream in this process. Everything
//! on loopback, every child killed when dropped.

use crate::ChaosError;
use spendgate_core::Micros;
use spendgate_mock_upstream::{MockConfig, MockUpstream};
use spendgate_testkit::{free_port, ChildGuard, RedisOptions, RedisServer};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The operator's backend token, the admin token and the session key of every replica.
pub const SERVICE_TOKEN: &str = "chaos-service-token-0123456789";
pub const ADMIN_TOKEN: &str = "chaos-admin-token-0123456789";
const SESSION_KEY: &str = "chaos-session-key-0123456789abcdef";
/// The one model, and its prices per million tokens (so 10, 30 and 5 micros a token).
pub const MODEL: &str = "chaos-model";
pub const INPUT_PER_MILLION: &str = "10";
pub const OUTPUT_PER_MILLION: &str = "30";
pub const CACHED_PER_MILLION: &str = "5";
/// `store.lease_ttl_s`: short, so that the end of a run waits little for leases.
pub const LEASE_TTL: Duration = Duration::from_secs(4);
/// `store.timeout_ms`.
pub const STORE_TIMEOUT_MS: u64 = 100;
/// `upstreams.*.timeout_s`: a hanging upstream is cut (and charged in full) after it.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);
/// `run.max_output_tokens`: the output bound the proxy forwards.
pub const MAX_OUTPUT_TOKENS: u64 = 64;
/// `run.max_seconds`.
pub const RUN_MAX_SECONDS: u64 = 60;
/// How long a replica or Redis may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts to start a replica at the beginning (each on a new port).
const START_ATTEMPTS: usize = 3;
/// The line a replica prints when a planted bug is switched on (`spendgate_http::plant`).
const PLANT_BANNER: &str = "PLANTED BUG ACTIVE";

/// The budgets of a run, all `lifetime` windows (a run may cross midnight).
#[derive(Clone, Copy, Debug)]
pub struct Budgets {
    pub global: Micros,
    pub ip: Micros,
    pub session: Micros,
}

/// A decimal amount in currency units, as the config reads it.
fn amount(m: Micros) -> String {
    format!("{}.{:06}", m.0 / 1_000_000, m.0 % 1_000_000)
}

/// The config every replica reads (each with its own `listen`).
/// `store` holds the ledger's pin and the replica's witness path (`ledger_id = ...`,
/// `witness_path = ...` lines); empty for `store init`, which runs before there is a pin.
pub fn config_text(port: u16, redis_url: &str, mock_port: u16, b: &Budgets, store: &str) -> String {
    let (global, ip, session) = (amount(b.global), amount(b.ip), amount(b.session));
    format!(
        r#"[server]
listen = "127.0.0.1:{port}"
service_tokens = ["{SERVICE_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]

[store]
kind = "redis"
url = "{redis_url}"
prefix = "chaos"
timeout_ms = {STORE_TIMEOUT_MS}
lease_ttl_s = {lease}
{store}
[sessions]
keys = ["{SESSION_KEY}"]
secure_cookie = false
create_rate_per_ip = "1000/second"
create_rate_global = "10000/second"

[limits.global]
rate = "100000/second"
burst = 100000
concurrency = 100000
budgets = [{{ amount = "{global}", window = "lifetime" }}]

[limits.ip]
rate = "100000/second"
burst = 100000
concurrency = 1000
budgets = [{{ amount = "{ip}", window = "lifetime" }}]

[limits.session]
rate = "100000/second"
burst = 100000
concurrency = 1000
budgets = [{{ amount = "{session}", window = "lifetime" }}]

[limits.conversation]
concurrency = 1
budgets = []

[run]
max_output_tokens = {MAX_OUTPUT_TOKENS}
max_context_tokens = 4000
max_model_rounds = 16
max_retries = 4
max_seconds = {RUN_MAX_SECONDS}
max_cost = "0.05"

[models."{MODEL}"]
upstream = "chaosmock"
input_per_million = "{INPUT_PER_MILLION}"
output_per_million = "{OUTPUT_PER_MILLION}"
cached_input_per_million = "{CACHED_PER_MILLION}"
tokenizer = "bytes"

[upstreams.chaosmock]
base_url = "http://127.0.0.1:{mock_port}/v1"
api_key = "chaos-upstream-key"
timeout_s = {upstream}
"#,
        lease = LEASE_TTL.as_secs(),
        upstream = UPSTREAM_TIMEOUT.as_secs(),
    )
}

/// One replica: its port and config, and its process while it runs.
pub struct Replica {
    pub port: u16,
    config: PathBuf,
    child: Option<ChildGuard>,
    /// Earlier processes of this replica (killed), kept for their logs.
    dead: Vec<ChildGuard>,
}

impl Replica {
    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn is_up(&self) -> bool {
        self.child.is_some()
    }
}

/// `spendgate store init` with the config `text` (written to `path`): a deployment's ledger is
/// created once, before its replicas. Answers the `ledger_id = "..."` line it printed, which
/// every replica's config pins.
fn init_ledger(spendgate: &Path, path: &Path, text: &str) -> Result<String, ChaosError> {
    std::fs::write(path, text)
        .map_err(|e| ChaosError::Setup(format!("writing {}: {e}", path.display())))?;
    let out = Command::new(spendgate)
        .args(["store", "init", "--config"])
        .arg(path)
        .env_remove("SPENDGATE_PLANT")
        .output()
        .map_err(|e| ChaosError::Setup(format!("{}: {e}", spendgate.display())))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(ChaosError::Setup(format!(
            "spendgate store init failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("ledger_id = "))
        .map(str::to_string)
        .ok_or_else(|| {
            ChaosError::Setup(format!(
                "spendgate store init printed no ledger id: {stdout}"
            ))
        })
}

/// Redis, the replicas and the mock of one run.
pub struct Cluster {
    pub redis: Mutex<RedisServer>,
    pub replicas: Vec<Mutex<Replica>>,
    pub mock: MockUpstream,
    pub mock_port: u16,
    mock_task: tokio::task::JoinHandle<std::io::Result<()>>,
    spendgate: PathBuf,
    plant: Option<String>,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.mock_task.abort();
    }
}

impl Cluster {
    /// Starts Redis, initialises the ledger, starts the mock and `n` replicas and waits until
    /// every replica is ready.
    pub async fn start(
        spendgate: &Path,
        redis_binary: Option<PathBuf>,
        n: usize,
        budgets: &Budgets,
        plant: Option<String>,
    ) -> Result<Cluster, ChaosError> {
        let dir = tempfile::Builder::new()
            .prefix("spendgate-chaos-")
            .tempdir()
            .map_err(|e| ChaosError::Setup(format!("temp dir: {e}")))?;
        let redis = tokio::task::spawn_blocking(move || {
            RedisServer::start(RedisOptions {
                appendonly: true,
                binary: redis_binary,
                ..RedisOptions::default()
            })
        })
        .await
        .map_err(|e| ChaosError::Setup(format!("redis: {e}")))?
        .map_err(|e| ChaosError::Setup(format!("redis-server: {e}")))?;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| ChaosError::Setup(format!("mock listener: {e}")))?;
        let mock_port = listener
            .local_addr()
            .map_err(|e| ChaosError::Setup(format!("mock listener: {e}")))?
            .port();
        let mock = MockUpstream::new(MockConfig::default());
        let mock_task = tokio::spawn(mock.clone().serve(listener));

        let redis_url = redis.url();
        let pin = init_ledger(
            spendgate,
            &dir.path().join("init.toml"),
            &config_text(0, &redis_url, mock_port, budgets, ""),
        )?;
        let write_config = move |i: usize, port: u16, dir: &Path| -> Result<PathBuf, ChaosError> {
            let config = dir.join(format!("replica-{i}.toml"));
            let witness = dir.join(format!("replica-{i}.witness"));
            let store = format!(
                "{pin}\nwitness_path = {:?}\n",
                witness.display().to_string()
            );
            std::fs::write(
                &config,
                config_text(port, &redis_url, mock_port, budgets, &store),
            )
            .map_err(|e| ChaosError::Setup(format!("writing {}: {e}", config.display())))?;
            Ok(config)
        };
        let mut replicas = Vec::new();
        for i in 0..n {
            let port = free_port();
            replicas.push(Mutex::new(Replica {
                port,
                config: write_config(i, port, dir.path())?,
                child: None,
                dead: Vec::new(),
            }));
        }
        let cluster = Cluster {
            redis: Mutex::new(redis),
            replicas,
            mock,
            mock_port,
            mock_task,
            spendgate: spendgate.to_path_buf(),
            plant,
            _dir: dir,
        };
        for i in 0..n {
            // A free port may be taken by another process before the replica binds it: a
            // replica that does not come up is tried again on another port.
            let mut attempt = 0;
            loop {
                attempt += 1;
                match cluster.start_replica(i).await {
                    Ok(()) => break,
                    Err(e) if attempt >= START_ATTEMPTS => return Err(e),
                    Err(_) => {
                        cluster.kill_replica(i);
                        let port = free_port();
                        let config = write_config(i, port, cluster._dir.path())?;
                        let mut r = lock(&cluster.replicas[i]);
                        r.port = port;
                        r.config = config;
                    }
                }
            }
        }
        Ok(cluster)
    }

    /// Starts replica `i` (again) on its port and waits until it is ready.
    pub async fn start_replica(&self, i: usize) -> Result<(), ChaosError> {
        let (base, config) = {
            let r = lock(&self.replicas[i]);
            (r.base(), r.config.clone())
        };
        let mut cmd = Command::new(&self.spendgate);
        cmd.args(["serve", "--config"]).arg(&config);
        cmd.env("RUST_LOG", "warn");
        cmd.env_remove("SPENDGATE_PLANT");
        if let Some(p) = &self.plant {
            cmd.env("SPENDGATE_PLANT", p);
        }
        let child = ChildGuard::spawn(cmd)
            .map_err(|e| ChaosError::Setup(format!("starting replica {i}: {e}")))?;
        lock(&self.replicas[i]).child = Some(child);
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| ChaosError::Setup(format!("http client: {e}")))?;
        let until = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = http.get(format!("{base}/readyz")).send().await {
                if r.status().as_u16() == 200 {
                    break;
                }
            }
            let exited = {
                let mut r = lock(&self.replicas[i]);
                r.child.as_mut().is_some_and(|c| !c.is_running())
            };
            if exited || Instant::now() > until {
                return Err(ChaosError::Setup(format!(
                    "replica {i} did not become ready: {}",
                    self.replica_output(i)
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if self.plant.is_some() && !self.replica_output(i).contains(PLANT_BANNER) {
            return Err(ChaosError::Setup(format!(
                "replica {i} did not announce its planted bug: {} was built without the \
                 `planted-bugs` feature (a workspace build has it: `cargo build -p \
                 spendgate -p spendgate-chaos`)",
                self.spendgate.display()
            )));
        }
        Ok(())
    }

    /// SIGKILL replica `i` (its process is kept for its log).
    pub fn kill_replica(&self, i: usize) {
        let mut r = lock(&self.replicas[i]);
        if let Some(mut c) = r.child.take() {
            let _ = c.kill();
            r.dead.push(c);
        }
    }

    /// The output of replica `i`'s processes so far.
    pub fn replica_output(&self, i: usize) -> String {
        let r = lock(&self.replicas[i]);
        r.dead
            .iter()
            .chain(r.child.as_ref())
            .map(ChildGuard::output)
            .collect::<Vec<_>>()
            .join("\n--- restarted ---\n")
    }

    /// Every replica's output, each headed by its number.
    pub fn logs(&self) -> String {
        (0..self.replicas.len())
            .map(|i| format!("=== replica {i} ===\n{}", self.replica_output(i)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn bases(&self) -> Vec<String> {
        self.replicas.iter().map(|r| lock(r).base()).collect()
    }

    /// Runs `f` on Redis on the blocking pool (the testkit's calls wait on the process).
    pub async fn with_redis<T: Send + 'static>(
        self: &std::sync::Arc<Self>,
        f: impl FnOnce(&mut RedisServer) -> Result<T, spendgate_testkit::TestkitError> + Send + 'static,
    ) -> Result<T, ChaosError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || f(&mut lock(&me.redis)))
            .await
            .map_err(|e| ChaosError::Fault(format!("redis task: {e}")))?
            .map_err(|e| ChaosError::Fault(format!("redis: {e}")))
    }
}

/// Locks a mutex; a holder that panicked left nothing half-changed here (plain fields).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config the replicas read is one the server accepts, and says what the driver
    /// assumes (prices, lifetime budgets, the bound).
    #[test]
    fn the_replica_config_is_valid() {
        let b = Budgets {
            global: Micros(1_000_000_000),
            ip: Micros(150_000),
            session: Micros(40_000),
        };
        let text = config_text(
            18080,
            "redis://127.0.0.1:6399/0",
            18090,
            &b,
            "ledger_id = \"lg-0123456789abcdef0123456789abcdef\"\n",
        );
        let cfg = spendgate_config::load(&text, &|_| None).expect("valid config");
        let m = &cfg.models[MODEL];
        assert_eq!(m.price.input_per_million.0, 10_000_000);
        assert_eq!(m.price.output_per_million.0, 30_000_000);
        assert_eq!(cfg.store.lease_ttl, LEASE_TTL);
        assert!(text.contains("amount = \"0.040000\", window = \"lifetime\""));
    }
}
