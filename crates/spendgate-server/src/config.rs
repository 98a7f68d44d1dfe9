//! The config file (SPEC §9), in two stages.
//!
//! 1. Raw serde structs that mirror the file exactly: `deny_unknown_fields`, every key with the
//!    SPEC default, so an empty file is valid. Amounts, rates, windows and enum-like values stay
//!    strings at this stage.
//! 2. [`Config`], a validated value of parsed types ([`Policy`], [`Micros`], [`Rate`],
//!    `SocketAddr`, `IpNet`, `Duration`, resolved [`Secret`]s).
//!
//! Loading is a pure function of the file text and an environment lookup ([`load`]), so tests
//! never touch the process environment. Every error names the key it is about, in TOML path
//! syntax (`limits.global.budgets[1].amount`), and the line it came from.
//!
//! Secrets (`service_tokens`, `admin_tokens`, `sessions.keys`, `store.url`,
//! `sessions.verifier_secret`, `upstreams.NAME.api_key`, `alerts.webhook_url`) are either
//! literals or `env:NAME`. An `env:` entry whose variable is unset or empty is dropped from the
//! token and key lists (no service token: the service API is closed; no admin token: the admin
//! API is closed; no session key: the server generates an ephemeral one), is an error for
//! `alerts.webhook_url` (an alert channel the operator asked for must not vanish silently) and
//! is an empty secret elsewhere. Every such variable is listed in [`Config::unset_env`] so that
//! the server can warn about it.
//!
//! Extensions to SPEC §9 (all optional):
//! - `server.public_requests_max`, `service_requests_max`, `admin_requests_max`,
//!   `health_requests_max`: requests in flight per class of caller; `address_requests_max`:
//!   requests in flight per client address prefix without a valid token;
//!   `address_connections_max`: connections per socket peer (trusted proxies exempt);
//!   `connections_max`, `connections_reserved`: connections at once, and those kept for
//!   callers that are not public;
//!   `body_min_bytes_per_s`, `body_grace_ms`: the minimum rate of a request body after its
//!   grace (see `crate::capacity`).
//! - `sessions.verifier_url`, `sessions.verifier_secret`: an external siteverify-style checker
//!   used instead of the built-in proof-of-work challenge.
//! - `identity.ipv6_wider_prefixes` (default `[56, 48]`): wider IPv6 prefixes, limited too, the
//!   k-th one at the `ip` limits multiplied by 4^k.
//! - `store.ledger_id` (default unset): the Redis ledger's id as `spendgate store init` printed
//!   it; `spendgate serve` refuses a redis store without it (SPEC §7: the ledger's identity is
//!   known from outside Redis). `store.witness_path` (default `"spendgate.witness"`, relative
//!   to the working directory; `"off"`): the file of the ledger's high-water mark on this
//!   replica's disk (see RELIABILITY.md).
//! - `models.NAME.upstream_model`: the model name sent upstream (default: NAME).
//! - `models.NAME.output_bound_field` (default `"max_tokens"`, or `"max_completion_tokens"`):
//!   the one output-bound field forwarded, whichever the client sent (the field the model's
//!   upstream honours; OpenAI's reasoning models need `max_completion_tokens`).
//! - `upstreams.NAME.release_on_error` (default `true`): an upstream error response that shows
//!   no work was done (`proxy::NO_WORK_STATUSES`) releases the reservation instead of
//!   charging it.
//! - In `[limits.X]`, `rate = "off"` and `concurrency = "off"` switch that limit off; absent keys
//!   keep their default. A `rate` given without `burst` keeps the scope's default burst (at
//!   most the new count); a scope with no default rate (`conversation`) takes the rate's own
//!   burst, its count capped at 1000. `sessions.create_rate_*` have no burst key: their burst
//!   is their count (capped at 1000), as in their defaults.
//! - `limits.X.dry_run` (default `false`): that scope's limits in dry-run (SPEC §8 "per
//!   limit"); `server.dry_run = true` puts every `[limits.X]` in dry-run. Dry-run covers the
//!   scope limits (rates, concurrency caps, budgets). Run bounds, the spending cutoff, price
//!   checks and session-creation limits stay enforced: they bound one request or are the
//!   operator's own brake, and are not tuned by watching refusals.

use serde::de::{self, Visitor};
use serde::Deserialize;
use spendgate_core::{
    parse_amount, Budget, Micros, ModelPrice, Policy, Rate, ReservationMode, RunBounds, ScopeKind,
    ScopePolicy, ToolPrice, Window,
};
use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

// ---------------------------------------------------------------------------------------------
// Named bounds.

/// `[server]` capacity defaults (see `crate::capacity`): requests in flight per class of
/// caller, per client address prefix, connections per peer, and the minimum body rate.
pub const PUBLIC_REQUESTS_MAX_DEFAULT: u64 = 4_096;
pub const SERVICE_REQUESTS_MAX_DEFAULT: u64 = 4_096;
pub const ADMIN_REQUESTS_MAX_DEFAULT: u64 = 64;
pub const HEALTH_REQUESTS_MAX_DEFAULT: u64 = 256;
pub const ADDRESS_REQUESTS_MAX_DEFAULT: u64 = 64;
pub const ADDRESS_CONNECTIONS_MAX_DEFAULT: u64 = 256;
/// Connections kept for callers that are not public (a valid service or admin token, or a
/// health route) once the others are all taken (a sixteenth of `connections_max` at most
/// when not given).
pub const CONNECTIONS_RESERVED_DEFAULT: u64 = 1_024;
pub const BODY_MIN_BYTES_PER_S_DEFAULT: u64 = 4_096;
pub const BODY_GRACE_MS_DEFAULT: u64 = 2_000;
/// Largest bound of one class's (or one address's) requests in flight.
pub const CLASS_REQUESTS_MAX: u64 = 65_536;
/// `server.body_min_bytes_per_s` range: below the floor a body could hold its request for
/// hours (4 MiB at 256 bytes a second is about 4.5 hours, already long).
pub const BODY_MIN_BYTES_PER_S_FLOOR: u64 = 256;
pub const BODY_MIN_BYTES_PER_S_MAX: u64 = 16 * 1024 * 1024;
/// `server.body_grace_ms` range (below the decision API's request timeout, 15 s, so that a
/// stalled body is answered 408 by its rate, not 504).
pub const BODY_GRACE_MS_MIN: u64 = 100;
pub const BODY_GRACE_MS_MAX: u64 = 10_000;

/// Service and admin tokens shorter than this draw a warning at start and in check-config.
pub const TOKEN_BYTES_ADVISED: usize = 16;

/// Largest config file accepted.
pub const CONFIG_BYTES_MAX: usize = 1 << 20;
/// The built-in mock upstream's name: models may name it without an `[upstreams.mock]` table
/// (and no such table may be configured).
pub const MOCK_UPSTREAM: &str = "mock";
/// `store.timeout_ms` range.
/// (below `API_REQUEST_TIMEOUT`, 15 s: a store call must fail closed with 503
/// `store_unavailable` before the request itself times out)
pub const STORE_TIMEOUT_MS_MAX: u64 = 5_000;
/// `store.slow_grace_ms` range (the store crate's `SLOW_GRACE_MAX`): `timeout_ms` plus it stays
/// below `API_REQUEST_TIMEOUT` too.
pub const SLOW_GRACE_MS_MAX: u64 = 5_000;
/// `store.slow_grace_ms` by default: a store call slower than `timeout_ms` under ordinary load
/// is waited for this much longer while the store is not known to be failing. Under the
/// side-by-side load (`scripts/side-by-side.sh`, 2 cores shared with other builds) up to 74
/// admissions a case took longer than 100 ms, the slowest 267 ms; about 4x that. A store that
/// stopped answering costs the calls in flight then `timeout_ms` + this, later ones
/// `timeout_ms`.
pub const SLOW_GRACE_MS_DEFAULT: u64 = 1_000;
const _: () = assert!(SLOW_GRACE_MS_MAX as u128 == spendgate_store::SLOW_GRACE_MAX.as_millis());
/// `store.lease_ttl_s` range.
pub const LEASE_TTL_S_MAX: u64 = 3_600;
/// `sessions.ttl_s` range: browsers cap a cookie's `Max-Age` at 400 days.
pub const SESSION_TTL_S_MAX: u64 = 400 * 86_400;
/// `upstreams.NAME.timeout_s` range.
pub const UPSTREAM_TIMEOUT_S_MAX: u64 = 3_600;
/// `sessions.challenge_bits` range.
pub const CHALLENGE_BITS_MAX: u64 = 32;
/// Shortest session (HMAC) key accepted.
pub const SESSION_KEY_BYTES_MIN: usize = 16;
/// Longest token, key or budget list.
pub const LIST_LEN_MAX: usize = 64;
/// Longest `server.trusted_proxies` list.
pub const TRUSTED_PROXIES_MAX: usize = 1_024;
/// Most entries in `[models]`, `[tools]` or `[upstreams]`.
pub const TABLE_LEN_MAX: usize = 4_096;
/// Longest model, tool or upstream name.
pub const NAME_BYTES_MAX: usize = 200;
/// Largest `burst` and `concurrency`.
pub const BURST_MAX: u64 = 1_000_000;
/// Most requests a rate may allow per period.
pub const RATE_COUNT_MAX: u64 = 1_000_000_000;
/// Longest burst window of a rate (`interval × burst`): half of 2^53 µs (about 142 years),
/// so the Redis script's sums stay exact.
pub const RATE_WINDOW_US_MAX: u64 = spendgate_core::MICROS_MAX.0 / 2;
pub const CONCURRENCY_MAX: u64 = 1_000_000;
/// Largest alert threshold, as a fraction times 1000 (10 = 1000% of a budget).
pub const THRESHOLD_PERMILLE_MAX: u32 = 10_000;
/// Most wider IPv6 prefixes: with the client's own prefix, what the ledger limits one request
/// by (a longer list would pass here and refuse every IPv6 client).
pub const IPV6_WIDER_MAX: usize = spendgate_core::IP_SCOPES_MAX - 1;
/// Run bounds ranges.
pub const RUN_BYTES_MAX: u64 = 1 << 30;
pub const RUN_TOKENS_MAX: u64 = 100_000_000;
pub const RUN_COUNT_MAX: u64 = 100_000;
pub const RUN_SECONDS_MAX: u64 = 86_400;

const _: () = assert!(LEASE_TTL_S_MAX * 1000 <= u32::MAX as u64);
const _: () = assert!(RUN_COUNT_MAX <= u32::MAX as u64);
const _: () = assert!(CONCURRENCY_MAX <= u32::MAX as u64);
const _: () = assert!(CHALLENGE_BITS_MAX <= u8::MAX as u64);
// 4^IPV6_WIDER_MAX must fit a u64 factor.
const _: () = assert!(2 * IPV6_WIDER_MAX < 64);

/// Written by `render_effective` in place of a literal secret; refused when loaded back, so a
/// copied `check-config` output never turns "***" into a real token.
const MASK: &str = "***";

/// A URL as check-config shows it: user info and query masked (they carry credentials), and
/// with `mask_path` the path too.
fn shown_url(u: &str, mask_path: bool) -> String {
    let Ok(mut url) = reqwest::Url::parse(u) else {
        return MASK.to_string();
    };
    if !url.username().is_empty() || url.password().is_some() {
        let _ = url.set_username(MASK);
        let _ = url.set_password(None);
    }
    if url.query().is_some() {
        url.set_query(Some(MASK));
    }
    if mask_path && url.path() != "/" {
        url.set_path(MASK);
    }
    url.to_string()
}

// ---------------------------------------------------------------------------------------------
// Validated config.

/// The validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub sessions: SessionsConfig,
    pub identity: IdentityConfig,
    /// `[limits.*]`, `[run]`, `sessions.create_rate_*` and `store.lease_ttl_s`.
    pub policy: Policy,
    pub models: BTreeMap<String, ModelConfig>,
    pub tools: BTreeMap<String, ToolPrice>,
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    pub alerts: AlertsConfig,
    /// Every `env:NAME` secret whose variable was unset or empty, in file order.
    pub unset_env: Vec<UnsetEnv>,
}

/// An `env:NAME` secret whose variable was unset (or empty) at load time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnsetEnv {
    /// The key it was given for, e.g. `server.service_tokens` or `upstreams.openai.api_key`.
    pub key: String,
    /// The variable's name.
    pub var: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Empty when no token is set: the service API is then closed.
    pub service_tokens: Vec<Secret>,
    /// Empty when no token is set: the admin API is then closed.
    pub admin_tokens: Vec<Secret>,
    pub browser_direct: bool,
    pub dry_run: bool,
    pub capacity: CapacityConfig,
}

/// How much of the process each class of caller and each client address may hold, and how
/// fast a body must arrive (`[server]` keys of the same names; see `crate::capacity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapacityConfig {
    /// Requests in flight from guests and anyone without a valid service or admin token.
    pub public_requests_max: usize,
    /// Requests in flight with a valid service token (the operator's backend).
    pub service_requests_max: usize,
    /// Requests in flight with a valid admin token.
    pub admin_requests_max: usize,
    /// Requests in flight to `/healthz`, `/readyz` and `/metrics`.
    pub health_requests_max: usize,
    /// Requests in flight without a valid token, per client address prefix (at
    /// `identity.ipv4_prefix` / `ipv6_prefix`; each wider IPv6 prefix at this times its factor).
    pub address_requests_max: usize,
    /// Connections per socket peer (its prefix as above); a trusted proxy is exempt.
    pub address_connections_max: usize,
    /// Connections served at once (at most `listener::CONNECTIONS_MAX`, what the open files
    /// limit is raised for), of which `connections_reserved` are taken only once the others
    /// are all taken and serve no public request.
    pub connections_max: usize,
    pub connections_reserved: usize,
    /// After `body_grace`, a request body must have arrived at this average rate at least.
    pub body_min_bytes_per_s: u64,
    pub body_grace: Duration,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        CapacityConfig {
            public_requests_max: PUBLIC_REQUESTS_MAX_DEFAULT as usize,
            service_requests_max: SERVICE_REQUESTS_MAX_DEFAULT as usize,
            admin_requests_max: ADMIN_REQUESTS_MAX_DEFAULT as usize,
            health_requests_max: HEALTH_REQUESTS_MAX_DEFAULT as usize,
            address_requests_max: ADDRESS_REQUESTS_MAX_DEFAULT as usize,
            address_connections_max: ADDRESS_CONNECTIONS_MAX_DEFAULT as usize,
            connections_max: crate::listener::CONNECTIONS_MAX,
            connections_reserved: CONNECTIONS_RESERVED_DEFAULT as usize,
            body_min_bytes_per_s: BODY_MIN_BYTES_PER_S_DEFAULT,
            body_grace: Duration::from_millis(BODY_GRACE_MS_DEFAULT),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Memory,
    Sqlite,
    Redis,
}

impl StoreKind {
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Sqlite => "sqlite",
            StoreKind::Redis => "redis",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    pub kind: StoreKind,
    /// SQLite file (kind `sqlite`).
    pub path: PathBuf,
    /// Redis URL (kind `redis`); a secret since it may carry a password.
    pub url: Secret,
    /// Redis key prefix (one deployment per prefix).
    pub prefix: String,
    /// The Redis ledger's id, pinned from what `spendgate store init` printed: a replica
    /// refuses a Redis whose ledger id is missing or another. `None`: not pinned, which
    /// `spendgate serve` refuses on a redis store (only `store init` runs without it).
    pub ledger_id: Option<String>,
    /// The witness file of the Redis ledger's high-water mark (relative to the working
    /// directory); `None` (`"off"`): no witness.
    pub witness_path: Option<PathBuf>,
    /// `store.timeout_ms`: the bound of a store call once the store is known to be failing,
    /// and of `/readyz`'s check.
    pub timeout: Duration,
    /// `store.slow_grace_ms`: how much longer than `timeout` a call may wait while the store
    /// is not known to be failing (see `spendgate_store::Timed`).
    pub slow_grace: Duration,
    pub lease_ttl: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChallengeMode {
    Off,
    Always,
    Adaptive,
}

impl ChallengeMode {
    pub fn name(self) -> &'static str {
        match self {
            ChallengeMode::Off => "off",
            ChallengeMode::Always => "always",
            ChallengeMode::Adaptive => "adaptive",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionsConfig {
    /// The first signs, all verify. Empty when no key is set: the server then generates an
    /// ephemeral key (sessions end at restart and are not shared across replicas) and warns.
    pub keys: Vec<Secret>,
    pub ttl: Duration,
    pub secure_cookie: bool,
    pub challenge: ChallengeMode,
    pub challenge_bits: u8,
    /// Extension: an external siteverify-style checker used instead of proof of work.
    pub verifier_url: Option<String>,
    /// The secret sent to `verifier_url`; present exactly when `verifier_url` is.
    pub verifier_secret: Option<Secret>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityConfig {
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
    /// Wider IPv6 prefixes, each with the factor its `ip` limits are multiplied by, widest last.
    pub ipv6_wider: Vec<(u8, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokenizer {
    O200kBase,
    Cl100kBase,
    /// One token per byte: a hard upper bound for any byte-level tokenizer.
    Bytes,
}

impl Tokenizer {
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::O200kBase => "o200k_base",
            Tokenizer::Cl100kBase => "cl100k_base",
            Tokenizer::Bytes => "bytes",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// A key of [`Config::upstreams`], or [`MOCK_UPSTREAM`].
    pub upstream: String,
    pub price: ModelPrice,
    pub tokenizer: Tokenizer,
    /// The model name sent upstream; `None`: the configured name.
    pub upstream_model: Option<String>,
    /// The one output-bound field the forwarded request carries, whatever the client used:
    /// the field this model's upstream honours (an upstream that ignores the other one would
    /// generate past the bound that was reserved).
    pub output_bound_field: OutputBoundField,
}

/// `models.NAME.output_bound_field`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputBoundField {
    /// `max_tokens` (the default: every OpenAI-compatible server reads it).
    MaxTokens,
    /// `max_completion_tokens` (OpenAI's reasoning models refuse `max_tokens`).
    MaxCompletionTokens,
}

impl OutputBoundField {
    pub fn name(self) -> &'static str {
        match self {
            OutputBoundField::MaxTokens => "max_tokens",
            OutputBoundField::MaxCompletionTokens => "max_completion_tokens",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// Without a trailing `/`, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// Empty when absent (or its variable unset): no `Authorization` header.
    pub api_key: Secret,
    pub timeout: Duration,
    /// An upstream error response that shows no work was done releases the reservation.
    pub release_on_error: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlertsConfig {
    /// A secret: literal or `env:NAME` (an unset variable is an error).
    pub webhook_url: Option<Secret>,
    /// Fractions of a budget times 1000 (0.5 → 500), strictly ascending, each in 1..=10000.
    pub thresholds_permille: Vec<u32>,
    /// Kinds of scope whose budgets are watched: `global` (default), and `ip`, `session`,
    /// `conversation` (their top spenders, see `alerts::SCOPE_ALERT_TOP`). Distinct.
    pub scopes: Vec<ScopeKind>,
}

/// A secret value. `Debug` and `Display` print `***`; [`Secret::expose`] gives the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    value: String,
    /// `"env:NAME"` or `"literal"`.
    source: String,
}

impl Secret {
    /// A secret given literally in the file (or built in code).
    pub fn literal(value: impl Into<String>) -> Secret {
        Secret {
            value: value.into(),
            source: "literal".to_string(),
        }
    }

    /// A secret read from the environment variable `var` (empty when unset).
    pub fn from_env(var: &str, value: impl Into<String>) -> Secret {
        Secret {
            value: value.into(),
            source: format!("env:{var}"),
        }
    }

    pub fn expose(&self) -> &str {
        &self.value
    }

    /// `"env:NAME"` or `"literal"`.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The environment variable it came from, if any.
    pub fn env_var(&self) -> Option<&str> {
        self.source.strip_prefix("env:")
    }

    pub fn is_empty(&self) -> bool {
        self.value.is_empty()
    }

    /// Compares `candidate` with the secret in constant time (for a given length). An empty
    /// secret matches nothing.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        !self.value.is_empty() && bool::from(self.value.as_bytes().ct_eq(candidate))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

/// A config error: the key it is about, the problem, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    key: String,
    message: String,
    line: Option<usize>,
    column: Option<usize>,
    origin: Option<PathBuf>,
}

impl ConfigError {
    /// The key in TOML path syntax (`limits.global.budgets[1].amount`); empty for errors that
    /// are about no key (syntax errors, an unreadable file).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The problem, naming the key, without the location.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// 1-based line in the file, when known.
    pub fn line(&self) -> Option<usize> {
        self.line
    }

    /// The file it came from ([`load_file`]).
    pub fn origin(&self) -> Option<&Path> {
        self.origin.as_deref()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.origin, self.line, self.column) {
            (Some(o), Some(l), Some(c)) => write!(f, "{}:{l}:{c}: ", o.display())?,
            (Some(o), Some(l), None) => write!(f, "{}:{l}: ", o.display())?,
            (Some(o), None, _) => write!(f, "{}: ", o.display())?,
            (None, Some(l), Some(c)) => write!(f, "line {l}, column {c}: ")?,
            (None, Some(l), None) => write!(f, "line {l}: ")?,
            (None, None, _) => {}
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

// ---------------------------------------------------------------------------------------------
// Loading.

/// Parses and validates a config file's text. `env` looks up `env:NAME` secrets.
pub fn load(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    if text.len() > CONFIG_BYTES_MAX {
        return Err(ConfigError {
            key: String::new(),
            message: format!(
                "the file is {} bytes; at most {CONFIG_BYTES_MAX} are accepted",
                text.len()
            ),
            line: None,
            column: None,
            origin: None,
        });
    }
    let root = DeTable::parse(text).map_err(|e| syntax_error(text, &e))?;
    let deserializer = toml::Deserializer::from(root.clone());
    let raw = RawConfig::deserialize(deserializer).map_err(|e| serde_error(text, &root, &e))?;
    let mut v = Validator {
        text,
        root: root.get_ref(),
        env,
        unset: Vec::new(),
    };
    v.config(raw)
}

/// Reads and loads a config file; errors name the file.
pub fn load_file(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let with_origin = |mut e: ConfigError| {
        e.origin = Some(path.to_path_buf());
        e
    };
    let bytes = std::fs::read(path).map_err(|e| {
        with_origin(ConfigError {
            key: String::new(),
            message: format!("cannot read the config file: {e}"),
            line: None,
            column: None,
            origin: None,
        })
    })?;
    let text = String::from_utf8(bytes).map_err(|_| {
        with_origin(ConfigError {
            key: String::new(),
            message: "the config file is not valid UTF-8".to_string(),
            line: None,
            column: None,
            origin: None,
        })
    })?;
    load(&text, env).map_err(with_origin)
}

// ---------------------------------------------------------------------------------------------
// Stage one: the file as written.

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawConfig {
    server: RawServer,
    store: RawStore,
    sessions: RawSessions,
    identity: RawIdentity,
    limits: RawLimits,
    run: RawRun,
    models: BTreeMap<String, RawModel>,
    tools: BTreeMap<String, RawTool>,
    upstreams: BTreeMap<String, RawUpstream>,
    alerts: RawAlerts,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawServer {
    listen: String,
    trusted_proxies: Vec<String>,
    service_tokens: Vec<String>,
    admin_tokens: Vec<String>,
    browser_direct: bool,
    dry_run: bool,
    public_requests_max: u64,
    service_requests_max: u64,
    admin_requests_max: u64,
    health_requests_max: u64,
    address_requests_max: u64,
    /// Absent: [`ADDRESS_CONNECTIONS_MAX_DEFAULT`], at most `connections_max`.
    address_connections_max: Option<u64>,
    connections_max: u64,
    /// Absent: [`CONNECTIONS_RESERVED_DEFAULT`], at most a sixteenth of `connections_max`.
    connections_reserved: Option<u64>,
    body_min_bytes_per_s: u64,
    body_grace_ms: u64,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: "127.0.0.1:8080".to_string(),
            trusted_proxies: Vec::new(),
            service_tokens: vec!["env:SPENDGATE_SERVICE_TOKEN".to_string()],
            admin_tokens: vec!["env:SPENDGATE_ADMIN_TOKEN".to_string()],
            browser_direct: false,
            dry_run: false,
            public_requests_max: PUBLIC_REQUESTS_MAX_DEFAULT,
            service_requests_max: SERVICE_REQUESTS_MAX_DEFAULT,
            admin_requests_max: ADMIN_REQUESTS_MAX_DEFAULT,
            health_requests_max: HEALTH_REQUESTS_MAX_DEFAULT,
            address_requests_max: ADDRESS_REQUESTS_MAX_DEFAULT,
            address_connections_max: None,
            connections_max: crate::listener::CONNECTIONS_MAX as u64,
            connections_reserved: None,
            body_min_bytes_per_s: BODY_MIN_BYTES_PER_S_DEFAULT,
            body_grace_ms: BODY_GRACE_MS_DEFAULT,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawStore {
    kind: String,
    path: String,
    url: String,
    prefix: String,
    ledger_id: String,
    witness_path: String,
    timeout_ms: u64,
    slow_grace_ms: u64,
    lease_ttl_s: u64,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            kind: "sqlite".to_string(),
            path: "spendgate.db".to_string(),
            url: "redis://127.0.0.1:6379/0".to_string(),
            prefix: "spendgate".to_string(),
            ledger_id: String::new(),
            witness_path: "spendgate.witness".to_string(),
            timeout_ms: 100,
            slow_grace_ms: SLOW_GRACE_MS_DEFAULT,
            lease_ttl_s: 30,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawSessions {
    keys: Vec<String>,
    ttl_s: u64,
    secure_cookie: bool,
    challenge: String,
    challenge_bits: u64,
    create_rate_per_ip: String,
    create_rate_global: String,
    verifier_url: Option<String>,
    verifier_secret: Option<String>,
}

impl Default for RawSessions {
    fn default() -> Self {
        RawSessions {
            keys: vec!["env:SPENDGATE_SESSION_KEY".to_string()],
            ttl_s: 86_400,
            secure_cookie: true,
            challenge: "off".to_string(),
            challenge_bits: 18,
            create_rate_per_ip: "10/hour".to_string(),
            create_rate_global: "600/minute".to_string(),
            verifier_url: None,
            verifier_secret: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawIdentity {
    ipv4_prefix: u64,
    ipv6_prefix: u64,
    /// Absent: /56 and /48, those wider than `ipv6_prefix`.
    ipv6_wider_prefixes: Option<Vec<u64>>,
}

impl Default for RawIdentity {
    fn default() -> Self {
        RawIdentity {
            ipv4_prefix: 32,
            ipv6_prefix: 64,
            ipv6_wider_prefixes: None,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawLimits {
    global: RawScope,
    ip: RawScope,
    session: RawScope,
    conversation: RawScope,
}

/// One `[limits.X]` section; an absent key keeps the scope's default (`burst` included when
/// only `rate` is given).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawScope {
    rate: Option<String>,
    burst: Option<u64>,
    concurrency: Option<RawCount>,
    budgets: Option<Vec<RawBudget>>,
    dry_run: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBudget {
    amount: RawAmount,
    window: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawRun {
    mode: String,
    max_input_bytes: u64,
    max_context_tokens: u64,
    max_output_tokens: u64,
    max_tool_result_bytes: u64,
    max_model_rounds: u64,
    max_tool_calls: u64,
    max_retries: u64,
    max_seconds: u64,
    max_cost: RawAmount,
    shrink_to_fit: bool,
    min_output_tokens: u64,
}

impl Default for RawRun {
    fn default() -> Self {
        let b = RunBounds::default();
        RawRun {
            mode: "per_step".to_string(),
            max_input_bytes: b.max_input_bytes,
            max_context_tokens: b.max_context_tokens,
            max_output_tokens: b.max_output_tokens,
            max_tool_result_bytes: b.max_tool_result_bytes,
            max_model_rounds: u64::from(b.max_model_rounds),
            max_tool_calls: u64::from(b.max_tool_calls),
            max_retries: u64::from(b.max_retries),
            max_seconds: b.max_seconds,
            max_cost: RawAmount(amount_text(b.max_cost)),
            shrink_to_fit: b.shrink_to_fit,
            min_output_tokens: b.min_output_tokens,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    upstream: Option<String>,
    input_per_million: Option<RawAmount>,
    output_per_million: Option<RawAmount>,
    cached_input_per_million: Option<RawAmount>,
    tokenizer: Option<String>,
    upstream_model: Option<String>,
    output_bound_field: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    per_call: Option<RawAmount>,
    per_unit: Option<RawAmount>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    base_url: Option<String>,
    api_key: Option<String>,
    timeout_s: Option<u64>,
    release_on_error: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawAlerts {
    webhook_url: String,
    thresholds: Vec<f64>,
    scopes: Vec<String>,
}

impl Default for RawAlerts {
    fn default() -> Self {
        RawAlerts {
            webhook_url: String::new(),
            thresholds: vec![0.5, 0.8, 1.0],
            scopes: vec!["global".into()],
        }
    }
}

/// An amount as written: a decimal string (or an integer, which is exact). A float is refused:
/// `0.1` as a float is not 0.1.
#[derive(Debug)]
struct RawAmount(String);

impl<'de> Deserialize<'de> for RawAmount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawAmount;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an amount as a decimal string such as \"0.15\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawAmount, E> {
                Ok(RawAmount(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawAmount, E> {
                Ok(RawAmount(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawAmount, E> {
                Ok(RawAmount(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<RawAmount, E> {
                Err(E::custom(format!(
                    "amount {v} is a float, which is not exact: write it as a decimal string \
                     such as \"{v}\""
                )))
            }
        }
        d.deserialize_any(V)
    }
}

/// A count or `"off"`.
#[derive(Debug, Clone, Copy)]
enum RawCount {
    Off,
    N(u64),
}

impl<'de> Deserialize<'de> for RawCount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawCount;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a positive integer or \"off\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawCount, E> {
                if v == "off" {
                    Ok(RawCount::Off)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawCount, E> {
                Ok(RawCount::N(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawCount, E> {
                u64::try_from(v)
                    .map(RawCount::N)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

// ---------------------------------------------------------------------------------------------
// Key paths and locations.

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

/// A key in TOML path syntax.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct KeyPath(Vec<Seg>);

impl KeyPath {
    fn of(keys: &[&str]) -> KeyPath {
        KeyPath(keys.iter().map(|k| Seg::Key((*k).to_string())).collect())
    }
    fn key(&self, k: &str) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Key(k.to_string()));
        p
    }
    fn idx(&self, i: usize) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Index(i));
        p
    }
    fn parent(&self) -> KeyPath {
        let mut p = self.clone();
        p.0.pop();
        p
    }
    fn last_key(&self) -> Option<&str> {
        match self.0.last() {
            Some(Seg::Key(k)) => Some(k),
            _ => None,
        }
    }
    /// The path without array indices (the list a token came from).
    fn without_indices(&self) -> KeyPath {
        KeyPath(
            self.0
                .iter()
                .filter(|s| matches!(s, Seg::Key(_)))
                .cloned()
                .collect(),
        )
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    f.write_str(&toml_key(k))?;
                }
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// A key as TOML writes it: bare when it can be, quoted otherwise.
fn toml_key(k: &str) -> String {
    let bare = !k.is_empty()
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        k.to_string()
    } else {
        toml_str(k)
    }
}

/// A string as a TOML basic string literal.
fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let bytes = text.as_bytes();
    let offset = offset.min(bytes.len());
    let before = &bytes[..offset];
    let line = before.iter().filter(|b| **b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |p| p + 1);
    // Columns count characters, not bytes.
    let col = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    (line, col)
}

fn contains(outer: &Range<usize>, inner: &Range<usize>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

/// The deepest key whose key or value span contains `span`.
fn path_at(root: &DeTable<'_>, span: &Range<usize>) -> KeyPath {
    fn table(t: &DeTable<'_>, span: &Range<usize>, path: &mut Vec<Seg>, best: &mut Vec<Seg>) {
        for (k, v) in t.iter() {
            path.push(Seg::Key(k.get_ref().to_string()));
            if contains(&k.span(), span) && path.len() > best.len() {
                *best = path.clone();
            }
            value(v, span, path, best);
            path.pop();
        }
    }
    fn value(
        v: &Spanned<DeValue<'_>>,
        span: &Range<usize>,
        path: &mut Vec<Seg>,
        best: &mut Vec<Seg>,
    ) {
        if contains(&v.span(), span) && path.len() > best.len() {
            *best = path.clone();
        }
        match v.get_ref() {
            DeValue::Table(t) => table(t, span, path, best),
            DeValue::Array(a) => {
                for (i, item) in a.iter().enumerate() {
                    path.push(Seg::Index(i));
                    value(item, span, path, best);
                    path.pop();
                }
            }
            _ => {}
        }
    }
    let mut best = Vec::new();
    table(root, span, &mut Vec::new(), &mut best);
    KeyPath(best)
}

/// Where `path` (or its deepest present ancestor) starts in the file.
fn span_of(root: &DeTable<'_>, path: &KeyPath) -> Option<Range<usize>> {
    let mut found = None;
    let mut current: Option<&DeValue<'_>> = None;
    for seg in &path.0 {
        let next = match (seg, current) {
            (Seg::Key(k), None) => root.iter().find(|(key, _)| key.get_ref() == k),
            (Seg::Key(k), Some(DeValue::Table(t))) => t.iter().find(|(key, _)| key.get_ref() == k),
            (Seg::Index(i), Some(DeValue::Array(a))) => {
                let item = a.get(*i);
                if let Some(item) = item {
                    found = Some(item.span());
                    current = Some(item.get_ref());
                    continue;
                }
                None
            }
            _ => None,
        };
        match next {
            Some((key, value)) => {
                found = Some(key.span());
                current = Some(value.get_ref());
            }
            None => break,
        }
    }
    found
}

fn syntax_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let (line, column) = match e.span() {
        Some(s) => {
            let (l, c) = line_col(text, s.start);
            (Some(l), Some(c))
        }
        None => (None, None),
    };
    ConfigError {
        key: String::new(),
        message: format!("invalid TOML: {}", e.message().trim()),
        line,
        column,
        origin: None,
    }
}

/// Rewords a serde error and names the key it is about.
fn serde_error(text: &str, root: &Spanned<DeTable<'_>>, e: &toml::de::Error) -> ConfigError {
    let msg = e.message().trim();
    let span = e.span();
    let at = span
        .as_ref()
        .map(|s| path_at(root.get_ref(), s))
        .unwrap_or_default();
    let line = span.as_ref().map(|s| line_col(text, s.start).0);
    let field = |prefix: &str| {
        msg.strip_prefix(prefix)
            .and_then(|rest| rest.split('`').next())
            .map(str::to_string)
    };
    let (key, message) = if let Some(name) = field("unknown field `") {
        // The span is the unknown key itself; its table is the parent.
        let parent = if at.last_key() == Some(name.as_str()) {
            at.parent()
        } else {
            at.clone()
        };
        let place = if parent.0.is_empty() {
            "at the top level".to_string()
        } else {
            format!("in [{parent}]")
        };
        let expected = msg
            .split_once(", expected ")
            .map(|(_, rest)| format!("; expected {}", rest.replace('`', "\"")))
            .or_else(|| {
                msg.contains("there are no fields")
                    .then(|| "; this table takes no keys".to_string())
            })
            .unwrap_or_default();
        let key = parent.key(&name);
        (
            key.to_string(),
            format!("unknown key {} {place}{expected}", toml_str(&name)),
        )
    } else if let Some(name) = field("missing field `") {
        let key = at.key(&name);
        (key.to_string(), format!("{key}: required key is missing"))
    } else {
        let problem = msg
            .replace("expected u64", "expected a non-negative integer")
            .replace("expected f64", "expected a number")
            .replace("expected a sequence", "expected an array")
            .replace('`', "\"");
        // A secret written with the wrong type (a string where a list belongs) is not echoed:
        // errors reach logs.
        let secret = at.0.iter().rev().find_map(|seg| match seg {
            Seg::Key(k) => Some(SECRET_KEYS.contains(&k.as_str())),
            _ => None,
        });
        let problem = if secret == Some(true) {
            redact_quoted(&problem)
        } else {
            problem
        };
        let problem = match problem.find("expected struct ") {
            Some(i) => format!("{}expected a table", &problem[..i]),
            None => match problem.find("expected a map") {
                Some(i) => format!("{}expected a table", &problem[..i]),
                None => problem,
            },
        };
        if at.0.is_empty() {
            (String::new(), problem)
        } else {
            (at.to_string(), format!("{at}: {problem}"))
        }
    };
    ConfigError {
        key,
        message,
        line,
        column: None,
        origin: None,
    }
}

/// Keys whose values are secrets, or may carry one (a URL's credentials): never echoed in an
/// error.
const SECRET_KEYS: [&str; 8] = [
    "service_tokens",
    "admin_tokens",
    "keys",
    "url",
    "api_key",
    "verifier_secret",
    "verifier_url",
    "webhook_url",
];

/// `problem` with every quoted value replaced by `"…"`.
fn redact_quoted(problem: &str) -> String {
    let mut out = String::with_capacity(problem.len());
    let mut inside = false;
    for c in problem.chars() {
        if c == '"' {
            if inside {
                out.push_str("…\"");
            } else {
                out.push('"');
            }
            inside = !inside;
        } else if !inside {
            out.push(c);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Stage two: validation.

struct Validator<'a, 'i> {
    text: &'a str,
    root: &'a DeTable<'i>,
    env: &'a dyn Fn(&str) -> Option<String>,
    unset: Vec<UnsetEnv>,
}

/// An `env:` or literal secret after lookup.
enum Resolved {
    Set(Secret),
    Unset(String),
}

type R<T> = Result<T, ConfigError>;

impl Validator<'_, '_> {
    fn err(&self, path: &KeyPath, problem: impl fmt::Display) -> ConfigError {
        let line = span_of(self.root, path).map(|s| line_col(self.text, s.start).0);
        ConfigError {
            key: path.to_string(),
            message: format!("{path}: {problem}"),
            line,
            column: None,
            origin: None,
        }
    }

    fn range(&self, path: &KeyPath, v: u64, min: u64, max: u64) -> R<u64> {
        if (min..=max).contains(&v) {
            Ok(v)
        } else {
            Err(self.err(path, format!("{v} is out of range {min}..={max}")))
        }
    }

    fn one_of<T: Copy>(&self, path: &KeyPath, v: &str, options: &[(&str, T)]) -> R<T> {
        options
            .iter()
            .find(|(name, _)| *name == v)
            .map(|(_, t)| *t)
            .ok_or_else(|| {
                let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
                self.err(
                    path,
                    format!("{} is not one of {}", toml_str(v), names.join(", ")),
                )
            })
    }

    fn amount(&self, path: &KeyPath, raw: &RawAmount) -> R<Micros> {
        parse_amount(&raw.0).map_err(|e| self.err(path, e))
    }

    /// A rate, or `None` for `"off"`.
    fn rate(&self, path: &KeyPath, text: &str) -> R<Option<Rate>> {
        if text.trim() == "off" {
            return Ok(None);
        }
        let r = Rate::parse(text).map_err(|e| self.err(path, format!("{e} (or \"off\")")))?;
        if r.count > RATE_COUNT_MAX {
            return Err(self.err(
                path,
                format!("at most {RATE_COUNT_MAX} requests per period"),
            ));
        }
        self.rate_fits(path, &r)?;
        Ok(Some(r))
    }

    /// Every store keeps a rate's state exactly: its burst window (`interval × burst`, in
    /// microseconds) must stay within 2^53 (the Redis script's numbers), so that a config that
    /// passes here never stops a Redis deployment from starting.
    fn rate_fits(&self, path: &KeyPath, r: &Rate) -> R<()> {
        let window = r.interval_us().saturating_mul(r.burst.max(1));
        if window > RATE_WINDOW_US_MAX {
            return Err(self.err(
                path,
                format!(
                    "a burst of {} at {} per {} ms spans {} s; at most {} s",
                    r.burst,
                    r.count,
                    r.period_ms,
                    window / 1_000_000,
                    RATE_WINDOW_US_MAX / 1_000_000
                ),
            ));
        }
        Ok(())
    }

    fn name(&self, path: &KeyPath, what: &str, name: &str) -> R<()> {
        if name.is_empty()
            || name.len() > NAME_BYTES_MAX
            || name.trim() != name
            || name.chars().any(char::is_control)
        {
            return Err(self.err(
                path,
                format!(
                    "{what} name {} must be 1..={NAME_BYTES_MAX} bytes without surrounding \
                     spaces or control characters",
                    toml_str(name)
                ),
            ));
        }
        Ok(())
    }

    /// An http(s) URL that a request can be built from: a host, a valid port, no spaces.
    /// `base`: a base that paths are appended to (no user info, query or fragment, which
    /// would swallow the path or end up in logs).
    fn http_url(&self, path: &KeyPath, url: &str, base: bool) -> R<()> {
        self.http_url_shown(path, url, base, &toml_str(url))
    }

    /// [`Self::http_url`] naming the URL in errors as `shown` (a secret one is not shown).
    fn http_url_shown(&self, path: &KeyPath, url: &str, base: bool, shown: &str) -> R<()> {
        if url.contains(MASK) {
            return Err(self.err(path, masked_problem()));
        }
        let not_url = |why: &str| {
            self.err(
                path,
                format!("{shown} is not an http:// or https:// URL ({why})"),
            )
        };
        if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(not_url("it holds spaces or control characters"));
        }
        let parsed = reqwest::Url::parse(url).map_err(|e| not_url(&e.to_string()))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(not_url("the scheme must be http or https"));
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(not_url("no host"));
        }
        if base
            && (parsed.query().is_some()
                || parsed.fragment().is_some()
                || !parsed.username().is_empty()
                || parsed.password().is_some())
        {
            return Err(not_url(
                "a base URL takes no user info, query or fragment: paths are appended to it",
            ));
        }
        Ok(())
    }

    fn list_len(&self, path: &KeyPath, len: usize, max: usize) -> R<()> {
        if len > max {
            return Err(self.err(
                path,
                format!("has {len} entries; at most {max} are allowed"),
            ));
        }
        Ok(())
    }

    /// Resolves `env:NAME` or takes a literal; records unset variables under `path`'s list.
    fn secret(&mut self, path: &KeyPath, text: &str) -> R<Resolved> {
        if let Some(var) = text.strip_prefix("env:") {
            let valid = var
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                && var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !valid {
                return Err(self.err(
                    path,
                    format!(
                        "{} does not name an environment variable (env:NAME, NAME of letters, \
                         digits and _)",
                        toml_str(text)
                    ),
                ));
            }
            let value = (self.env)(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty());
            return Ok(match value {
                Some(v) => Resolved::Set(Secret::from_env(var, v)),
                None => {
                    self.unset.push(UnsetEnv {
                        key: path.without_indices().to_string(),
                        var: var.to_string(),
                    });
                    Resolved::Unset(var.to_string())
                }
            });
        }
        if text.contains(MASK) {
            return Err(self.err(path, masked_problem()));
        }
        Ok(Resolved::Set(Secret::literal(text)))
    }

    /// A token or key list: unset variables are dropped; empty literals are errors.
    /// Set values shorter than `min_bytes` are errors (the value is never shown).
    fn secret_list(
        &mut self,
        path: &KeyPath,
        texts: &[String],
        what: &str,
        min_bytes: usize,
    ) -> R<Vec<Secret>> {
        self.list_len(path, texts.len(), LIST_LEN_MAX)?;
        let mut out = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            let p = path.idx(i);
            match self.secret(&p, text)? {
                Resolved::Set(s) if s.expose().trim().is_empty() => {
                    return Err(self.err(&p, format!("an empty {what} is not allowed")));
                }
                Resolved::Set(s) if s.expose().len() < min_bytes => {
                    return Err(self.err(
                        &p,
                        format!(
                            "the {what} from {} is {} bytes; at least {min_bytes} are needed",
                            s.source(),
                            s.expose().len()
                        ),
                    ));
                }
                Resolved::Set(s) => out.push(s),
                Resolved::Unset(_) => {}
            }
        }
        Ok(out)
    }

    fn config(&mut self, raw: RawConfig) -> R<Config> {
        let server = self.server(&raw.server)?;
        let (store, lease_ttl_ms) = self.store(&raw.store)?;
        let (sessions, create_per_ip, create_global) = self.sessions(&raw.sessions)?;
        if store.kind == StoreKind::Redis && sessions.keys.is_empty() {
            // Each replica would sign with a key of its own: a session (and a challenge)
            // from one would be refused by the others.
            return Err(self.err(
                &KeyPath::of(&["sessions", "keys"]),
                "no session key is set (or its environment variable is unset): replicas on \
                 one Redis must share one",
            ));
        }
        let identity = self.identity(&raw.identity)?;
        let defaults = Policy::default();
        let limits = &raw.limits;
        let all_dry = server.dry_run;
        let policy = Policy {
            global: self.scope("global", &limits.global, &defaults.global, all_dry)?,
            ip: self.scope("ip", &limits.ip, &defaults.ip, all_dry)?,
            session: self.scope("session", &limits.session, &defaults.session, all_dry)?,
            conversation: self.scope(
                "conversation",
                &limits.conversation,
                &defaults.conversation,
                all_dry,
            )?,
            run: self.run(&raw.run)?,
            mode: self.one_of(
                &KeyPath::of(&["run", "mode"]),
                &raw.run.mode,
                &[
                    ("per_step", ReservationMode::PerStep),
                    ("whole_run", ReservationMode::WholeRun),
                ],
            )?,
            lease_ttl_ms,
            session_create_per_ip: create_per_ip,
            session_create_global: create_global,
        };
        let upstreams = self.upstreams(&raw.upstreams)?;
        let models = self.models(&raw.models, &upstreams)?;
        let tools = self.tools(&raw.tools)?;
        let alerts = self.alerts(&raw.alerts)?;
        Ok(Config {
            server,
            store,
            sessions,
            identity,
            policy,
            models,
            tools,
            upstreams,
            alerts,
            unset_env: std::mem::take(&mut self.unset),
        })
    }

    fn server(&mut self, raw: &RawServer) -> R<ServerConfig> {
        let p = KeyPath::of(&["server"]);
        let listen: SocketAddr = raw.listen.trim().parse().map_err(|_| {
            self.err(
                &p.key("listen"),
                format!(
                    "{} is not an address and port such as \"127.0.0.1:8080\" or \"[::]:8080\"",
                    toml_str(&raw.listen)
                ),
            )
        })?;
        let proxies = p.key("trusted_proxies");
        self.list_len(&proxies, raw.trusted_proxies.len(), TRUSTED_PROXIES_MAX)?;
        let mut trusted_proxies = Vec::new();
        for (i, text) in raw.trusted_proxies.iter().enumerate() {
            let t = text.trim();
            let net = t
                .parse::<ipnet::IpNet>()
                .ok()
                .or_else(|| t.parse::<IpAddr>().ok().map(ipnet::IpNet::from))
                .ok_or_else(|| {
                    self.err(
                        &proxies.idx(i),
                        format!(
                            "{} is not a CIDR such as \"10.0.0.0/8\" or an address",
                            toml_str(text)
                        ),
                    )
                })?;
            // Peers are compared as IPv4 when they are IPv4-mapped IPv6 (SPEC §5), so a
            // mapped CIDR is its IPv4 form: ::ffff:a.b.c.d/N is a.b.c.d/(N-96).
            let net = match net {
                ipnet::IpNet::V6(v6) => match v6.addr().to_ipv4_mapped() {
                    Some(v4) => v6
                        .prefix_len()
                        .checked_sub(96)
                        .and_then(|bits| ipnet::Ipv4Net::new(v4, bits).ok())
                        .map(|n| ipnet::IpNet::V4(n.trunc()))
                        .ok_or_else(|| {
                            self.err(
                                &proxies.idx(i),
                                format!(
                                    "{} is an IPv4-mapped prefix shorter than /96; write its \
                                     IPv4 form (::ffff:a.b.c.d/N is a.b.c.d/(N-96))",
                                    toml_str(text)
                                ),
                            )
                        })?,
                    None => net,
                },
                v4 => v4,
            };
            trusted_proxies.push(net);
        }
        let service_tokens =
            self.secret_list(&p.key("service_tokens"), &raw.service_tokens, "token", 1)?;
        let admin_tokens =
            self.secret_list(&p.key("admin_tokens"), &raw.admin_tokens, "token", 1)?;
        for (i, a) in admin_tokens.iter().enumerate() {
            if service_tokens.iter().any(|s| s.expose() == a.expose()) {
                return Err(self.err(
                    &p.key("admin_tokens").idx(i),
                    "the same token is also a service token; admin tokens must differ",
                ));
            }
        }
        let capacity = self.capacity(&p, raw)?;
        Ok(ServerConfig {
            listen,
            trusted_proxies,
            service_tokens,
            admin_tokens,
            browser_direct: raw.browser_direct,
            dry_run: raw.dry_run,
            capacity,
        })
    }

    fn capacity(&mut self, p: &KeyPath, raw: &RawServer) -> R<CapacityConfig> {
        let class = |this: &Self, key: &str, v: u64| -> R<usize> {
            this.range(&p.key(key), v, 1, CLASS_REQUESTS_MAX)
                .map(|v| v as usize)
        };
        let connections_max = self.range(
            &p.key("connections_max"),
            raw.connections_max,
            2,
            crate::listener::CONNECTIONS_MAX as u64,
        )?;
        // (at most half: the other half at least serves everyone)
        let connections_reserved = match raw.connections_reserved {
            None => CONNECTIONS_RESERVED_DEFAULT.min(connections_max / 16),
            Some(n) => self.range(&p.key("connections_reserved"), n, 0, connections_max / 2)?,
        };
        Ok(CapacityConfig {
            connections_max: connections_max as usize,
            connections_reserved: connections_reserved as usize,
            public_requests_max: class(self, "public_requests_max", raw.public_requests_max)?,
            service_requests_max: class(self, "service_requests_max", raw.service_requests_max)?,
            admin_requests_max: class(self, "admin_requests_max", raw.admin_requests_max)?,
            health_requests_max: class(self, "health_requests_max", raw.health_requests_max)?,
            address_requests_max: class(self, "address_requests_max", raw.address_requests_max)?,
            address_connections_max: match raw.address_connections_max {
                None => ADDRESS_CONNECTIONS_MAX_DEFAULT.min(connections_max) as usize,
                Some(n) => {
                    self.range(&p.key("address_connections_max"), n, 1, connections_max)? as usize
                }
            },
            body_min_bytes_per_s: self.range(
                &p.key("body_min_bytes_per_s"),
                raw.body_min_bytes_per_s,
                BODY_MIN_BYTES_PER_S_FLOOR,
                BODY_MIN_BYTES_PER_S_MAX,
            )?,
            body_grace: Duration::from_millis(self.range(
                &p.key("body_grace_ms"),
                raw.body_grace_ms,
                BODY_GRACE_MS_MIN,
                BODY_GRACE_MS_MAX,
            )?),
        })
    }

    fn store(&mut self, raw: &RawStore) -> R<(StoreConfig, u64)> {
        let p = KeyPath::of(&["store"]);
        let kind = self.one_of(
            &p.key("kind"),
            &raw.kind,
            &[
                ("memory", StoreKind::Memory),
                ("sqlite", StoreKind::Sqlite),
                ("redis", StoreKind::Redis),
            ],
        )?;
        if kind == StoreKind::Sqlite && raw.path.trim().is_empty() {
            return Err(self.err(&p.key("path"), "the sqlite store needs a file path"));
        }
        let url_path = p.key("url");
        let url = match self.secret(&url_path, &raw.url)? {
            Resolved::Set(s) => s,
            Resolved::Unset(var) => {
                if kind == StoreKind::Redis {
                    return Err(self.err(
                        &url_path,
                        format!(
                            "environment variable {var} is unset but the redis store needs its URL"
                        ),
                    ));
                }
                Secret::from_env(&var, "")
            }
        };
        if kind == StoreKind::Redis {
            let ok = [
                "redis://",
                "rediss://",
                "redis+unix://",
                "unix://",
                "valkey://",
                "valkeys://",
            ]
            .iter()
            .any(|s| url.expose().starts_with(s));
            if !ok {
                return Err(self.err(
                    &url_path,
                    "is not a redis:// or rediss:// URL (value not shown: it may hold a password)",
                ));
            }
        }
        let prefix_ok = !raw.prefix.is_empty()
            && raw.prefix.len() <= 64
            && raw
                .prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b));
        if !prefix_ok {
            return Err(self.err(
                &p.key("prefix"),
                format!(
                    "{} must be 1..=64 characters of letters, digits, _, -, . or : (no braces: \
                     keys carry their own hash tag)",
                    toml_str(&raw.prefix)
                ),
            ));
        }
        let ledger_id = match raw.ledger_id.trim() {
            "" => None,
            id if spendgate_redis::is_ledger_id(id) => Some(id.to_string()),
            _ => {
                return Err(self.err(
                    &p.key("ledger_id"),
                    format!(
                        "{} is not a ledger id (`lg-` and 32 hex digits): pin the id that \
                         `spendgate store init` printed",
                        toml_str(&raw.ledger_id)
                    ),
                ))
            }
        };
        let witness_path = match raw.witness_path.as_str() {
            "off" => None,
            w if w.trim().is_empty() => {
                return Err(self.err(
                    &p.key("witness_path"),
                    "is empty: name a file on durable storage, or \"off\"",
                ))
            }
            w => Some(PathBuf::from(w)),
        };
        let timeout_ms = self.range(
            &p.key("timeout_ms"),
            raw.timeout_ms,
            1,
            STORE_TIMEOUT_MS_MAX,
        )?;
        let slow_grace_ms = self.range(
            &p.key("slow_grace_ms"),
            raw.slow_grace_ms,
            0,
            SLOW_GRACE_MS_MAX,
        )?;
        let lease_ttl_s = self.range(&p.key("lease_ttl_s"), raw.lease_ttl_s, 1, LEASE_TTL_S_MAX)?;
        Ok((
            StoreConfig {
                kind,
                path: PathBuf::from(&raw.path),
                url,
                prefix: raw.prefix.clone(),
                ledger_id,
                witness_path,
                timeout: Duration::from_millis(timeout_ms),
                slow_grace: Duration::from_millis(slow_grace_ms),
                lease_ttl: Duration::from_secs(lease_ttl_s),
            },
            lease_ttl_s * 1000,
        ))
    }

    #[allow(clippy::type_complexity)]
    fn sessions(&mut self, raw: &RawSessions) -> R<(SessionsConfig, Option<Rate>, Option<Rate>)> {
        let p = KeyPath::of(&["sessions"]);
        let keys = self.secret_list(
            &p.key("keys"),
            &raw.keys,
            "session key",
            SESSION_KEY_BYTES_MIN,
        )?;
        let ttl_s = self.range(&p.key("ttl_s"), raw.ttl_s, 1, SESSION_TTL_S_MAX)?;
        let challenge = self.one_of(
            &p.key("challenge"),
            &raw.challenge,
            &[
                ("off", ChallengeMode::Off),
                ("always", ChallengeMode::Always),
                ("adaptive", ChallengeMode::Adaptive),
            ],
        )?;
        let bits = self.range(
            &p.key("challenge_bits"),
            raw.challenge_bits,
            1,
            CHALLENGE_BITS_MAX,
        )?;
        let challenge_bits =
            u8::try_from(bits).map_err(|_| self.err(&p.key("challenge_bits"), "out of range"))?;
        let per_ip = self.rate(&p.key("create_rate_per_ip"), &raw.create_rate_per_ip)?;
        let global = self.rate(&p.key("create_rate_global"), &raw.create_rate_global)?;
        let verifier_url = match &raw.verifier_url {
            Some(u) => {
                self.http_url(&p.key("verifier_url"), u, false)?;
                Some(u.clone())
            }
            None => None,
        };
        let secret_path = p.key("verifier_secret");
        let verifier_secret = match &raw.verifier_secret {
            Some(text) => Some(match self.secret(&secret_path, text)? {
                Resolved::Set(s) => s,
                Resolved::Unset(var) => Secret::from_env(&var, ""),
            }),
            None => None,
        };
        match (&verifier_url, &verifier_secret) {
            (Some(_), None) => {
                return Err(self.err(&secret_path, "is required when verifier_url is set"));
            }
            (Some(_), Some(s)) if s.expose().is_empty() => {
                return Err(self.err(
                    &secret_path,
                    "is empty (or its environment variable is unset): the verifier would refuse every session",
                ));
            }
            (None, Some(_)) => {
                return Err(self.err(&secret_path, "is set but verifier_url is not"));
            }
            _ => {}
        }
        Ok((
            SessionsConfig {
                keys,
                ttl: Duration::from_secs(ttl_s),
                secure_cookie: raw.secure_cookie,
                challenge,
                challenge_bits,
                verifier_url,
                verifier_secret,
            },
            per_ip,
            global,
        ))
    }

    fn identity(&self, raw: &RawIdentity) -> R<IdentityConfig> {
        let p = KeyPath::of(&["identity"]);
        let v4 = self.range(&p.key("ipv4_prefix"), raw.ipv4_prefix, 1, 32)?;
        let v6 = self.range(&p.key("ipv6_prefix"), raw.ipv6_prefix, 1, 128)?;
        let wider: Vec<u64> = match &raw.ipv6_wider_prefixes {
            None => [56, 48].into_iter().filter(|w| *w < v6).collect(),
            Some(list) => {
                let wp = p.key("ipv6_wider_prefixes");
                self.list_len(&wp, list.len(), IPV6_WIDER_MAX)?;
                for (i, w) in list.iter().enumerate() {
                    if *w == 0 || *w >= v6 {
                        return Err(self.err(
                            &wp.idx(i),
                            format!("/{w} must be wider than ipv6_prefix /{v6} and at least /1"),
                        ));
                    }
                    if i > 0 && list[i - 1] <= *w {
                        return Err(self.err(
                            &wp.idx(i),
                            "wider prefixes must be listed narrowest first (e.g. [56, 48])",
                        ));
                    }
                }
                list.clone()
            }
        };
        let mut ipv6_wider = Vec::new();
        let mut factor: u64 = 1;
        for w in wider {
            factor = factor.saturating_mul(4);
            // In range by the checks above.
            let w = u8::try_from(w).unwrap_or(u8::MAX);
            ipv6_wider.push((w, factor));
        }
        Ok(IdentityConfig {
            ipv4_prefix: u8::try_from(v4).unwrap_or(32),
            ipv6_prefix: u8::try_from(v6).unwrap_or(128),
            ipv6_wider,
        })
    }

    fn scope(
        &self,
        name: &str,
        raw: &RawScope,
        default: &ScopePolicy,
        all_dry: bool,
    ) -> R<ScopePolicy> {
        let p = KeyPath::of(&["limits", name]);
        let mut rate = match &raw.rate {
            None => default.rate,
            Some(text) => self.rate(&p.key("rate"), text)?.map(|mut r| {
                // A `rate` without `burst` keeps the scope's default burst (at most the new
                // count): a new rate alone must not let one guest start `count` runs at once.
                if let Some(d) = default.rate {
                    r.burst = d.burst.min(r.count).max(1);
                }
                r
            }),
        };
        if let Some(r) = &rate {
            self.rate_fits(&p.key("rate"), r)?;
        }
        if let Some(burst) = raw.burst {
            let burst = self.range(&p.key("burst"), burst, 1, BURST_MAX)?;
            match rate.as_mut() {
                Some(r) => {
                    r.burst = burst;
                    self.rate_fits(&p.key("burst"), r)?;
                }
                None => {
                    return Err(self.err(
                        &p.key("burst"),
                        "is set but this scope has no rate (rate = \"off\")",
                    ))
                }
            }
        }
        let concurrency = match raw.concurrency {
            None => default.concurrency,
            Some(RawCount::Off) => None,
            Some(RawCount::N(n)) => {
                let n = self.range(&p.key("concurrency"), n, 1, CONCURRENCY_MAX)?;
                Some(u32::try_from(n).unwrap_or(u32::MAX))
            }
        };
        let budgets = match &raw.budgets {
            None => default.budgets.clone(),
            Some(list) => {
                let bp = p.key("budgets");
                self.list_len(&bp, list.len(), 4)?;
                let mut out: Vec<Budget> = Vec::new();
                for (i, b) in list.iter().enumerate() {
                    let amount = self.amount(&bp.idx(i).key("amount"), &b.amount)?;
                    let wp = bp.idx(i).key("window");
                    let window = Window::parse(b.window.trim()).ok_or_else(|| {
                        self.err(
                            &wp,
                            format!(
                                "{} is not one of hour, day, month, lifetime",
                                toml_str(&b.window)
                            ),
                        )
                    })?;
                    if out.iter().any(|o| o.window == window) {
                        return Err(self.err(
                            &wp,
                            format!("a second {} budget; one per window", window.name()),
                        ));
                    }
                    out.push(Budget { amount, window });
                }
                out
            }
        };
        Ok(ScopePolicy {
            budgets,
            rate,
            concurrency,
            dry_run: all_dry || raw.dry_run.unwrap_or(default.dry_run),
        })
    }

    fn run(&self, raw: &RawRun) -> R<RunBounds> {
        let p = KeyPath::of(&["run"]);
        let count = |key: &str, v: u64, min: u64| -> R<u32> {
            let v = self.range(&p.key(key), v, min, RUN_COUNT_MAX)?;
            Ok(u32::try_from(v).unwrap_or(u32::MAX))
        };
        let max_cost = self.amount(&p.key("max_cost"), &raw.max_cost)?;
        if max_cost == Micros::ZERO {
            return Err(self.err(
                &p.key("max_cost"),
                "must be more than 0: no run could do anything",
            ));
        }
        let bounds = RunBounds {
            max_input_bytes: self.range(
                &p.key("max_input_bytes"),
                raw.max_input_bytes,
                1,
                RUN_BYTES_MAX,
            )?,
            max_context_tokens: self.range(
                &p.key("max_context_tokens"),
                raw.max_context_tokens,
                1,
                RUN_TOKENS_MAX,
            )?,
            max_output_tokens: self.range(
                &p.key("max_output_tokens"),
                raw.max_output_tokens,
                1,
                RUN_TOKENS_MAX,
            )?,
            max_tool_result_bytes: self.range(
                &p.key("max_tool_result_bytes"),
                raw.max_tool_result_bytes,
                0,
                RUN_BYTES_MAX,
            )?,
            max_model_rounds: count("max_model_rounds", raw.max_model_rounds, 1)?,
            max_tool_calls: count("max_tool_calls", raw.max_tool_calls, 0)?,
            max_retries: count("max_retries", raw.max_retries, 0)?,
            max_seconds: self.range(&p.key("max_seconds"), raw.max_seconds, 1, RUN_SECONDS_MAX)?,
            max_cost,
            shrink_to_fit: raw.shrink_to_fit,
            min_output_tokens: self.range(
                &p.key("min_output_tokens"),
                raw.min_output_tokens,
                1,
                RUN_TOKENS_MAX,
            )?,
        };
        if bounds.min_output_tokens > bounds.max_output_tokens {
            return Err(self.err(
                &p.key("min_output_tokens"),
                format!(
                    "{} is more than max_output_tokens ({})",
                    bounds.min_output_tokens, bounds.max_output_tokens
                ),
            ));
        }
        Ok(bounds)
    }

    fn upstreams(
        &mut self,
        raw: &BTreeMap<String, RawUpstream>,
    ) -> R<BTreeMap<String, UpstreamConfig>> {
        let table = KeyPath::of(&["upstreams"]);
        self.list_len(&table, raw.len(), TABLE_LEN_MAX)?;
        let mut out = BTreeMap::new();
        for (name, u) in raw {
            let p = table.key(name);
            self.name(&p, "upstream", name)?;
            if name == MOCK_UPSTREAM {
                return Err(self.err(
                    &p,
                    "the name \"mock\" is reserved for the built-in mock upstream",
                ));
            }
            let base_url = u
                .base_url
                .as_deref()
                .ok_or_else(|| self.err(&p.key("base_url"), "required key is missing"))?;
            self.http_url(&p.key("base_url"), base_url, true)?;
            let base_url = base_url.trim_end_matches('/').to_string();
            let api_key = match &u.api_key {
                None => Secret::literal(""),
                Some(text) => match self.secret(&p.key("api_key"), text)? {
                    Resolved::Set(s) => s,
                    Resolved::Unset(var) => Secret::from_env(&var, ""),
                },
            };
            let timeout_s = self.range(
                &p.key("timeout_s"),
                u.timeout_s.unwrap_or(60),
                1,
                UPSTREAM_TIMEOUT_S_MAX,
            )?;
            out.insert(
                name.clone(),
                UpstreamConfig {
                    base_url,
                    api_key,
                    timeout: Duration::from_secs(timeout_s),
                    release_on_error: u.release_on_error.unwrap_or(true),
                },
            );
        }
        Ok(out)
    }

    fn models(
        &self,
        raw: &BTreeMap<String, RawModel>,
        upstreams: &BTreeMap<String, UpstreamConfig>,
    ) -> R<BTreeMap<String, ModelConfig>> {
        let table = KeyPath::of(&["models"]);
        self.list_len(&table, raw.len(), TABLE_LEN_MAX)?;
        let mut out = BTreeMap::new();
        for (name, m) in raw {
            let p = table.key(name);
            self.name(&p, "model", name)?;
            let up = p.key("upstream");
            let upstream = m.upstream.as_deref().ok_or_else(|| {
                self.err(
                    &up,
                    "required key is missing: name an [upstreams] entry or \"mock\"",
                )
            })?;
            if upstream != MOCK_UPSTREAM && !upstreams.contains_key(upstream) {
                let known: Vec<&str> = upstreams
                    .keys()
                    .map(String::as_str)
                    .chain([MOCK_UPSTREAM])
                    .collect();
                return Err(self.err(
                    &up,
                    format!(
                        "no upstream {} is configured (known: {})",
                        toml_str(upstream),
                        known.join(", ")
                    ),
                ));
            }
            let price = |key: &str, v: &Option<RawAmount>| -> R<Micros> {
                match v {
                    Some(a) => self.amount(&p.key(key), a),
                    None => Err(self.err(
                        &p.key(key),
                        "required key is missing: a model without a price is never called",
                    )),
                }
            };
            let input = price("input_per_million", &m.input_per_million)?;
            let output = price("output_per_million", &m.output_per_million)?;
            let cached = match &m.cached_input_per_million {
                Some(a) => self.amount(&p.key("cached_input_per_million"), a)?,
                None => input,
            };
            if cached > input {
                return Err(self.err(
                    &p.key("cached_input_per_million"),
                    format!(
                        "{} is more than input_per_million ({}): reservations price every \
                         prompt token at the input price",
                        amount_text(cached),
                        amount_text(input)
                    ),
                ));
            }
            let tokenizer = match &m.tokenizer {
                None => Tokenizer::Bytes,
                Some(t) => self.one_of(
                    &p.key("tokenizer"),
                    t,
                    &[
                        ("o200k_base", Tokenizer::O200kBase),
                        ("cl100k_base", Tokenizer::Cl100kBase),
                        ("bytes", Tokenizer::Bytes),
                    ],
                )?,
            };
            if let Some(um) = &m.upstream_model {
                self.name(&p.key("upstream_model"), "upstream model", um)?;
            }
            let output_bound_field = match &m.output_bound_field {
                None => OutputBoundField::MaxTokens,
                Some(f) => self.one_of(
                    &p.key("output_bound_field"),
                    f,
                    &[
                        ("max_tokens", OutputBoundField::MaxTokens),
                        (
                            "max_completion_tokens",
                            OutputBoundField::MaxCompletionTokens,
                        ),
                    ],
                )?,
            };
            out.insert(
                name.clone(),
                ModelConfig {
                    upstream: upstream.to_string(),
                    price: ModelPrice {
                        input_per_million: input,
                        cached_input_per_million: cached,
                        output_per_million: output,
                    },
                    tokenizer,
                    upstream_model: m.upstream_model.clone(),
                    output_bound_field,
                },
            );
        }
        Ok(out)
    }

    fn tools(&self, raw: &BTreeMap<String, RawTool>) -> R<BTreeMap<String, ToolPrice>> {
        let table = KeyPath::of(&["tools"]);
        self.list_len(&table, raw.len(), TABLE_LEN_MAX)?;
        let mut out = BTreeMap::new();
        for (name, t) in raw {
            let p = table.key(name);
            self.name(&p, "tool", name)?;
            if t.per_call.is_none() && t.per_unit.is_none() {
                return Err(self.err(
                    &p,
                    "needs per_call and/or per_unit: a tool without a price is never called",
                ));
            }
            let per_call = match &t.per_call {
                Some(a) => self.amount(&p.key("per_call"), a)?,
                None => Micros::ZERO,
            };
            let per_unit = match &t.per_unit {
                Some(a) => self.amount(&p.key("per_unit"), a)?,
                None => Micros::ZERO,
            };
            out.insert(name.clone(), ToolPrice { per_call, per_unit });
        }
        Ok(out)
    }

    fn alerts(&mut self, raw: &RawAlerts) -> R<AlertsConfig> {
        let p = KeyPath::of(&["alerts"]);
        let up = p.key("webhook_url");
        let webhook_url = if raw.webhook_url.trim().is_empty() {
            None
        } else {
            // A webhook URL (Slack's among them) carries its credential: a secret.
            let url = match self.secret(&up, &raw.webhook_url)? {
                Resolved::Set(s) => s,
                Resolved::Unset(var) => {
                    return Err(self.err(
                        &up,
                        format!(
                            "environment variable {var} is unset or empty; set it or leave \
                             webhook_url empty for no webhook"
                        ),
                    ));
                }
            };
            let shown = format!(
                "the URL from {} (not shown: it holds a credential)",
                url.source()
            );
            self.http_url_shown(&up, url.expose(), false, &shown)?;
            Some(url)
        };
        let tp = p.key("thresholds");
        self.list_len(&tp, raw.thresholds.len(), 32)?;
        let mut thresholds_permille: Vec<u32> = Vec::new();
        for (i, t) in raw.thresholds.iter().enumerate() {
            let scaled = t * 1000.0;
            let rounded = scaled.round();
            let max = f64::from(THRESHOLD_PERMILLE_MAX);
            if !scaled.is_finite()
                || rounded < 1.0
                || rounded > max
                || (scaled - rounded).abs() > 1e-6
            {
                return Err(self.err(
                    &tp.idx(i),
                    format!(
                        "{t} must be a fraction of a budget in (0, 10] with at most 3 decimals"
                    ),
                ));
            }
            // In 1..=10000 by the check above.
            let permille = rounded as u32;
            if thresholds_permille
                .last()
                .is_some_and(|last| *last >= permille)
            {
                return Err(self.err(&tp.idx(i), "thresholds must be strictly ascending"));
            }
            thresholds_permille.push(permille);
        }
        let sp = p.key("scopes");
        self.list_len(&sp, raw.scopes.len(), 4)?;
        let mut scopes = Vec::new();
        for (i, name) in raw.scopes.iter().enumerate() {
            let kind = match ScopeKind::parse(name) {
                Some(
                    k @ (ScopeKind::Global
                    | ScopeKind::Ip
                    | ScopeKind::Session
                    | ScopeKind::Conversation),
                ) => k,
                _ => {
                    return Err(self.err(
                        &sp.idx(i),
                        format!("{name:?} is not one of global, ip, session, conversation"),
                    ))
                }
            };
            if scopes.contains(&kind) {
                return Err(self.err(&sp.idx(i), format!("{name:?} is listed twice")));
            }
            scopes.push(kind);
        }
        Ok(AlertsConfig {
            scopes,
            webhook_url,
            thresholds_permille,
        })
    }
}

fn masked_problem() -> String {
    format!(
        "contains {}, the mask `spendgate check-config` prints: give the real value or env:NAME",
        toml_str(MASK)
    )
}

/// An amount as the shortest exact decimal: 50 → "50", 0.075 → "0.075".
fn amount_text(m: Micros) -> String {
    let s = m.to_string();
    let s = s.trim_end_matches('0');
    s.strip_suffix('.').unwrap_or(s).to_string()
}

// ---------------------------------------------------------------------------------------------
// Rendering the effective config.

fn rate_text(r: &Rate) -> Option<String> {
    let unit = match r.period_ms {
        1000 => "second",
        60_000 => "minute",
        3_600_000 => "hour",
        86_400_000 => "day",
        _ => return None,
    };
    Some(format!("{}/{unit}", r.count))
}

fn permille_text(p: u32) -> String {
    let s = format!("{}.{:03}", p / 1000, p % 1000);
    let s = s.trim_end_matches('0');
    if s.ends_with('.') {
        format!("{s}0")
    } else {
        s.to_string()
    }
}

/// How a secret is shown: its `env:NAME` reference (and whether it is set) or the mask.
fn secret_shown(s: &Secret) -> (String, &'static str) {
    match s.env_var() {
        Some(var) => (
            toml_str(&format!("env:{var}")),
            if s.is_empty() { "unset" } else { "set" },
        ),
        None if s.is_empty() => (toml_str(""), "empty"),
        None => (toml_str(MASK), "literal, masked"),
    }
}

/// The store URL as check-config shows it: user info and query masked for every scheme
/// (`redis+unix://` and `unix://` URLs carry `user=` and `pass=` in the query, where the redis
/// client reads them), and a value that is not a URL masked whole.
fn url_shown(s: &Secret) -> (String, &'static str) {
    if s.env_var().is_some() {
        return secret_shown(s);
    }
    let v = s.expose();
    if v.is_empty() {
        return (toml_str(v), "");
    }
    let shown = shown_url(v, false);
    if shown == MASK {
        (toml_str(MASK), "not a URL, masked")
    } else if shown.contains(MASK) {
        (toml_str(&shown), "user info and query masked")
    } else {
        (toml_str(&shown), "")
    }
}

struct Out(String);

impl Out {
    fn line(&mut self, s: impl AsRef<str>) {
        self.0.push_str(s.as_ref());
        self.0.push('\n');
    }
    fn kv(&mut self, key: &str, value: impl fmt::Display) {
        self.line(format!("{key} = {value}"));
    }
    fn kv_note(&mut self, key: &str, value: impl fmt::Display, note: &str) {
        if note.is_empty() {
            self.kv(key, value);
        } else {
            self.line(format!("{key} = {value}  # {note}"));
        }
    }
    fn secrets(&mut self, key: &str, list: &[Secret], unset: &[&UnsetEnv], empty_note: &str) {
        if list.is_empty() && unset.is_empty() {
            self.kv_note(key, "[]", empty_note);
            return;
        }
        self.line(format!("{key} = ["));
        for s in list {
            let (v, note) = secret_shown(s);
            self.line(format!("    {v},  # {note}"));
        }
        for u in unset {
            self.line(format!(
                "    {},  # unset: dropped",
                toml_str(&format!("env:{}", u.var))
            ));
        }
        self.line("]");
        if list.is_empty() {
            self.line(format!("# {empty_note}"));
        }
    }
}

impl Config {
    /// The effective config as TOML, for `spendgate check-config`: every key, secrets masked
    /// (`env:NAME` references stay visible, marked set or unset). Loading it back with the same
    /// environment gives an equal `Config`, except where a literal secret or a webhook URL was
    /// masked (loading a mask is refused).
    pub fn render_effective(&self) -> String {
        let mut o = Out(String::new());
        let unset_for = |key: &str| -> Vec<&UnsetEnv> {
            self.unset_env.iter().filter(|u| u.key == key).collect()
        };
        o.line("# spendgate effective configuration (secrets masked)");
        o.line("");
        let s = &self.server;
        o.line("[server]");
        o.kv("listen", toml_str(&s.listen.to_string()));
        let proxies: Vec<String> = s
            .trusted_proxies
            .iter()
            .map(|n| toml_str(&n.to_string()))
            .collect();
        o.kv("trusted_proxies", format!("[{}]", proxies.join(", ")));
        o.secrets(
            "service_tokens",
            &s.service_tokens,
            &unset_for("server.service_tokens"),
            "no service token: the service API is closed",
        );
        o.secrets(
            "admin_tokens",
            &s.admin_tokens,
            &unset_for("server.admin_tokens"),
            "no admin token: the admin API is closed",
        );
        o.kv("browser_direct", s.browser_direct);
        o.kv("dry_run", s.dry_run);
        let c = &s.capacity;
        o.kv("public_requests_max", c.public_requests_max);
        o.kv("service_requests_max", c.service_requests_max);
        o.kv("admin_requests_max", c.admin_requests_max);
        o.kv("health_requests_max", c.health_requests_max);
        o.kv("address_requests_max", c.address_requests_max);
        o.kv("address_connections_max", c.address_connections_max);
        o.kv("connections_max", c.connections_max);
        o.kv("connections_reserved", c.connections_reserved);
        o.kv("body_min_bytes_per_s", c.body_min_bytes_per_s);
        o.kv("body_grace_ms", c.body_grace.as_millis());

        let st = &self.store;
        o.line("");
        o.line("[store]");
        o.kv("kind", toml_str(st.kind.name()));
        o.kv("path", toml_str(&st.path.to_string_lossy()));
        let (url, note) = url_shown(&st.url);
        o.kv_note("url", url, note);
        o.kv("prefix", toml_str(&st.prefix));
        let pin_note = match (&st.ledger_id, st.kind) {
            (None, StoreKind::Redis) => {
                "not pinned: serve refuses; run `spendgate store init` and pin the id it prints"
            }
            _ => "",
        };
        o.kv_note(
            "ledger_id",
            toml_str(st.ledger_id.as_deref().unwrap_or("")),
            pin_note,
        );
        match &st.witness_path {
            Some(w) => o.kv("witness_path", toml_str(&w.to_string_lossy())),
            None => o.kv_note(
                "witness_path",
                toml_str("off"),
                "a rollback of Redis while every replica restarts goes unseen",
            ),
        }
        o.kv("timeout_ms", st.timeout.as_millis());
        o.kv("slow_grace_ms", st.slow_grace.as_millis());
        o.kv("lease_ttl_s", self.policy.lease_ttl_ms / 1000);

        let se = &self.sessions;
        o.line("");
        o.line("[sessions]");
        o.secrets(
            "keys",
            &se.keys,
            &unset_for("sessions.keys"),
            "no session key: an ephemeral key is generated at start",
        );
        o.kv("ttl_s", se.ttl.as_secs());
        o.kv("secure_cookie", se.secure_cookie);
        o.kv("challenge", toml_str(se.challenge.name()));
        o.kv("challenge_bits", se.challenge_bits);
        let rate_or_off = |r: &Option<Rate>| -> String {
            match r {
                None => toml_str("off"),
                Some(r) => match rate_text(r) {
                    Some(t) => toml_str(&t),
                    None => format!(
                        "{}  # not expressible: {} per {} ms",
                        toml_str("off"),
                        r.count,
                        r.period_ms
                    ),
                },
            }
        };
        o.kv(
            "create_rate_per_ip",
            rate_or_off(&self.policy.session_create_per_ip),
        );
        o.kv(
            "create_rate_global",
            rate_or_off(&self.policy.session_create_global),
        );
        if let Some(u) = &se.verifier_url {
            o.kv("verifier_url", toml_str(&shown_url(u, false)));
        }
        if let Some(v) = &se.verifier_secret {
            let (v, note) = secret_shown(v);
            o.kv_note("verifier_secret", v, note);
        }

        let id = &self.identity;
        o.line("");
        o.line("[identity]");
        o.kv("ipv4_prefix", id.ipv4_prefix);
        o.kv("ipv6_prefix", id.ipv6_prefix);
        let wider: Vec<String> = id.ipv6_wider.iter().map(|(p, _)| p.to_string()).collect();
        let factors: Vec<String> = id
            .ipv6_wider
            .iter()
            .map(|(p, f)| format!("/{p} x{f}"))
            .collect();
        o.kv_note(
            "ipv6_wider_prefixes",
            format!("[{}]", wider.join(", ")),
            &format!("ip limits multiplied: {}", factors.join(", ")),
        );

        let scopes = [
            ("global", &self.policy.global),
            ("ip", &self.policy.ip),
            ("session", &self.policy.session),
            ("conversation", &self.policy.conversation),
        ];
        for (name, sp) in scopes {
            o.line("");
            o.line(format!("[limits.{name}]"));
            o.kv("rate", rate_or_off(&sp.rate));
            if let Some(r) = &sp.rate {
                o.kv("burst", r.burst);
            }
            match sp.concurrency {
                Some(c) => o.kv("concurrency", c),
                None => o.kv("concurrency", toml_str("off")),
            }
            let budgets: Vec<String> = sp
                .budgets
                .iter()
                .map(|b| {
                    format!(
                        "{{ amount = {}, window = {} }}",
                        toml_str(&amount_text(b.amount)),
                        toml_str(b.window.name())
                    )
                })
                .collect();
            o.kv("budgets", format!("[{}]", budgets.join(", ")));
            o.kv("dry_run", sp.dry_run);
        }

        let r = &self.policy.run;
        o.line("");
        o.line("[run]");
        o.kv(
            "mode",
            toml_str(match self.policy.mode {
                ReservationMode::PerStep => "per_step",
                ReservationMode::WholeRun => "whole_run",
            }),
        );
        o.kv("max_input_bytes", r.max_input_bytes);
        o.kv("max_context_tokens", r.max_context_tokens);
        o.kv("max_output_tokens", r.max_output_tokens);
        o.kv("max_tool_result_bytes", r.max_tool_result_bytes);
        o.kv("max_model_rounds", r.max_model_rounds);
        o.kv("max_tool_calls", r.max_tool_calls);
        o.kv("max_retries", r.max_retries);
        o.kv("max_seconds", r.max_seconds);
        o.kv("max_cost", toml_str(&amount_text(r.max_cost)));
        o.kv("shrink_to_fit", r.shrink_to_fit);
        o.kv("min_output_tokens", r.min_output_tokens);

        for (name, m) in &self.models {
            o.line("");
            o.line(format!("[models.{}]", toml_str(name)));
            o.kv("upstream", toml_str(&m.upstream));
            o.kv(
                "input_per_million",
                toml_str(&amount_text(m.price.input_per_million)),
            );
            o.kv(
                "output_per_million",
                toml_str(&amount_text(m.price.output_per_million)),
            );
            o.kv(
                "cached_input_per_million",
                toml_str(&amount_text(m.price.cached_input_per_million)),
            );
            o.kv("tokenizer", toml_str(m.tokenizer.name()));
            if let Some(um) = &m.upstream_model {
                o.kv("upstream_model", toml_str(um));
            }
            o.kv("output_bound_field", toml_str(m.output_bound_field.name()));
        }
        for (name, t) in &self.tools {
            o.line("");
            o.line(format!("[tools.{}]", toml_key(name)));
            o.kv("per_call", toml_str(&amount_text(t.per_call)));
            o.kv("per_unit", toml_str(&amount_text(t.per_unit)));
        }
        for (name, u) in &self.upstreams {
            o.line("");
            o.line(format!("[upstreams.{}]", toml_key(name)));
            o.kv("base_url", toml_str(&shown_url(&u.base_url, false)));
            let (k, note) = secret_shown(&u.api_key);
            let note = if u.api_key.is_empty() && u.api_key.env_var().is_none() {
                "no key: no Authorization header"
            } else {
                note
            };
            o.kv_note("api_key", k, note);
            o.kv("timeout_s", u.timeout.as_secs());
            o.kv("release_on_error", u.release_on_error);
        }

        let a = &self.alerts;
        o.line("");
        o.line("[alerts]");
        match &a.webhook_url {
            None => o.kv("webhook_url", toml_str("")),
            Some(u) if u.env_var().is_some() => {
                let (v, note) = secret_shown(u);
                o.kv_note("webhook_url", v, note);
            }
            Some(u) => {
                // Webhook URLs (Slack's among them) carry their credential in the path.
                o.kv_note(
                    "webhook_url",
                    toml_str(&shown_url(u.expose(), true)),
                    "user info, path and query masked",
                );
            }
        }
        let th: Vec<String> = a
            .thresholds_permille
            .iter()
            .map(|p| permille_text(*p))
            .collect();
        o.kv("thresholds", format!("[{}]", th.join(", ")));
        let sc: Vec<String> = a.scopes.iter().map(|k| toml_str(k.name())).collect();
        o.kv("scopes", format!("[{}]", sc.join(", ")));
        o.0
    }

    /// Settings under which nothing (of a kind) can ever be admitted, though each is valid
    /// alone: a whole-run reservation above a budget, a model step whose output bound alone
    /// is above the run's cost bound.
    fn unsatisfiable(&self) -> Vec<String> {
        let mut w = Vec::new();
        let (p, run) = (&self.policy, &self.policy.run);
        if p.mode == spendgate_core::ReservationMode::WholeRun {
            for (name, sp) in [
                ("global", &p.global),
                ("ip", &p.ip),
                ("session", &p.session),
                ("conversation", &p.conversation),
            ] {
                for b in sp.budgets.iter().filter(|b| b.amount < run.max_cost) {
                    w.push(format!(
                        "run.max_cost ({}) is above limits.{name}'s {} budget ({}): in \
                         whole_run mode every run reserves run.max_cost, so none is admitted",
                        run.max_cost,
                        b.window.name(),
                        b.amount
                    ));
                }
            }
        }
        for (name, sp) in [
            ("global", &p.global),
            ("ip", &p.ip),
            ("session", &p.session),
            ("conversation", &p.conversation),
        ] {
            for (i, b) in sp.budgets.iter().enumerate() {
                if b.amount == Micros::ZERO {
                    w.push(format!(
                        "limits.{name}.budgets[{i}]: an amount of 0 admits nothing (it is no \
                         \"unlimited\"; leave the budget out for that)"
                    ));
                }
                if b.window == Window::Lifetime && name != "global" {
                    w.push(format!(
                        "limits.{name}.budgets[{i}]: a lifetime budget keeps one counter per \
                         {name} for ever (no window ends to drop it): the store grows with every \
                         new {name} (memory, and the sqlite file or Redis); prefer a month"
                    ));
                }
            }
        }
        for (name, m) in &self.models {
            let out = if run.shrink_to_fit {
                run.min_output_tokens
            } else {
                run.max_output_tokens
            };
            let least = m.price.bound(0, out);
            if least > run.max_cost {
                w.push(format!(
                    "models.{name}: {out} output tokens alone cost {least}, above run.max_cost \
                     ({}): every call to it is refused (run_bound_exceeded); lower \
                     run.{} or raise run.max_cost",
                    run.max_cost,
                    if run.shrink_to_fit {
                        "min_output_tokens"
                    } else {
                        "max_output_tokens (or set shrink_to_fit)"
                    }
                ));
            }
        }
        w
    }

    /// Warnings for the operator at start: unset variables and what they close.
    pub fn warnings(&self) -> Vec<String> {
        let mut w: Vec<String> = self
            .unset_env
            .iter()
            .map(|u| {
                format!(
                    "{}: environment variable {} is unset or empty",
                    u.key, u.var
                )
            })
            .collect();
        if self.server.service_tokens.is_empty() {
            w.push(
                "server.service_tokens: no service token is set: the service API is closed"
                    .to_string(),
            );
        }
        if self.server.admin_tokens.is_empty() {
            w.push(
                "server.admin_tokens: no admin token is set: the admin API is closed".to_string(),
            );
        }
        if self.store.kind == StoreKind::Redis {
            if self.store.ledger_id.is_none() {
                w.push(
                    "store.ledger_id: not set: `spendgate serve` refuses a redis store without \
                     its ledger pinned; run `spendgate store init` once and pin the id it prints"
                        .to_string(),
                );
            }
            if self.store.witness_path.is_none() {
                w.push(
                    "store.witness_path: \"off\": a Redis rollback (an older snapshot reloaded) \
                     while every replica restarts is admitted; see RELIABILITY.md"
                        .to_string(),
                );
            }
        }
        w.extend(self.unsatisfiable());
        for (i, net) in self.server.trusted_proxies.iter().enumerate() {
            if net.prefix_len() < 8 {
                w.push(format!(
                    "server.trusted_proxies[{i}]: {net} trusts X-Forwarded-For from (nearly) \
                     any address: a client can then name any address and escape its per-address \
                     limits; list only your reverse proxies"
                ));
            }
        }
        for (name, m) in &self.models {
            if m.upstream == MOCK_UPSTREAM {
                w.push(format!(
                    "models.{name}.upstream: \"{MOCK_UPSTREAM}\" is served by `spendgate demo` \
                     only; `spendgate serve` refuses calls to this model (run `spendgate \
                     mock-upstream` and name it in [upstreams.NAME] instead)"
                ));
            }
        }
        for (key, tokens) in [
            ("server.service_tokens", &self.server.service_tokens),
            ("server.admin_tokens", &self.server.admin_tokens),
        ] {
            for (i, t) in tokens.iter().enumerate() {
                let n = t.expose().len();
                if n > 0 && n < TOKEN_BYTES_ADVISED {
                    w.push(format!(
                        "{key}[{i}]: a token of {n} bytes is guessable; use at least \
                         {TOKEN_BYTES_ADVISED} random bytes (the admin and service APIs \
                         share the public listener)"
                    ));
                }
            }
        }
        if self.sessions.keys.is_empty() {
            w.push(
                "sessions.keys: no session key is set: an ephemeral key is generated; sessions \
                 end at restart and are not shared between replicas"
                    .to_string(),
            );
        }
        if self.server.dry_run {
            w.push(
                "server.dry_run: rates, concurrency caps and budgets are computed and logged but NOT enforced"
                    .to_string(),
            );
        } else {
            for (name, sp) in [
                ("global", &self.policy.global),
                ("ip", &self.policy.ip),
                ("session", &self.policy.session),
                ("conversation", &self.policy.conversation),
            ] {
                if sp.dry_run {
                    w.push(format!(
                        "limits.{name}.dry_run: this scope's limits are computed and logged but NOT enforced"
                    ));
                }
            }
        }
        w
    }
}

// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_string())
        }
    }

    fn load_err(text: &str) -> ConfigError {
        match load(text, &no_env) {
            Ok(_) => panic!("expected an error for:\n{text}"),
            Err(e) => e,
        }
    }

    const SPEC_EXAMPLE: &str = r#"
[server]
listen = "127.0.0.1:8080"
trusted_proxies = []                 # CIDRs whose X-Forwarded-For is believed
service_tokens = ["env:SPENDGATE_SERVICE_TOKEN"]
admin_tokens = ["env:SPENDGATE_ADMIN_TOKEN"]
browser_direct = false               # cookie-authenticated /v1/chat/completions
dry_run = false                      # decide, log and count, but do not enforce

[store]
kind = "sqlite"                      # memory | sqlite | redis
path = "spendgate.db"                # sqlite
url = "redis://127.0.0.1:6379/0"     # redis
prefix = "spendgate"                 # redis key prefix (one deployment per prefix)
ledger_id = ""                       # redis: the id `spendgate store init` printed (required to serve)
witness_path = "spendgate.witness"   # redis: the ledger's high-water mark on this replica's disk, or "off"
timeout_ms = 100                     # a failing store's calls refuse (503) after this
slow_grace_ms = 1000                 # a slow call (store answering) may wait this much more
lease_ttl_s = 30                     # concurrency slots and reservations, renewed by heartbeat

[sessions]
keys = ["env:SPENDGATE_SESSION_KEY"] # first signs, all verify
ttl_s = 86400
secure_cookie = true
challenge = "off"                    # off | always | adaptive
challenge_bits = 18
create_rate_per_ip = "10/hour"
create_rate_global = "600/minute"

[identity]
ipv4_prefix = 32
ipv6_prefix = 64

[limits.global]                      # also [limits.ip], [limits.session], [limits.conversation]
rate = "100/second"
burst = 20
concurrency = 64
budgets = [{ amount = "50.00", window = "day" }, { amount = "1000", window = "month" }]

[run]
mode = "per_step"                    # per_step | whole_run
max_input_bytes = 16384
max_context_tokens = 16000
max_output_tokens = 1024
max_tool_result_bytes = 65536
max_model_rounds = 8
max_tool_calls = 16
max_retries = 2
max_seconds = 120
max_cost = "0.20"
shrink_to_fit = false
min_output_tokens = 64

[models."gpt-4o-mini"]
upstream = "openai"
input_per_million = "0.15"
output_per_million = "0.60"
cached_input_per_million = "0.075"
tokenizer = "o200k_base"             # or "bytes": one token per byte, a hard upper bound

[tools.web_search]
per_call = "0.01"                    # and/or per_unit

[upstreams.openai]
base_url = "https://api.openai.com/v1"
api_key = "env:OPENAI_API_KEY"
timeout_s = 60

[alerts]
webhook_url = ""                     # JSON POST; Slack-compatible "text" field
thresholds = [0.5, 0.8, 1.0]
"#;

    const SPEC_ENV: &[(&str, &str)] = &[
        ("SPENDGATE_SERVICE_TOKEN", "svc-token-value-0123456789"),
        ("SPENDGATE_ADMIN_TOKEN", "adm-token-value-0123456789"),
        (
            "SPENDGATE_SESSION_KEY",
            "session-key-value-0123456789abcdef",
        ),
        ("OPENAI_API_KEY", "sk-openai-value-0123456789"),
    ];

    #[test]
    fn urls_must_be_usable_and_are_shown_masked() {
        for (text, key) in [
            (
                "[upstreams.u]\nbase_url = \"http://127.0.0.1:99999/v1\"\n",
                "upstreams.u.base_url",
            ),
            (
                "[upstreams.u]\nbase_url = \"https://api.example.com/v1?x=1\"\n",
                "upstreams.u.base_url",
            ),
            (
                "[upstreams.u]\nbase_url = \"https://user:pw@api.example.com/v1\"\n",
                "upstreams.u.base_url",
            ),
            (
                "[alerts]\nwebhook_url = \"https://\"\n",
                "alerts.webhook_url",
            ),
        ] {
            assert_eq!(load_err(text).key(), key, "{text}");
        }
        assert_eq!(
            shown_url(
                "https://user:s3cret@hooks.example.com/T0/B0/XX?token=abc",
                true
            ),
            "https://***@hooks.example.com/***?***"
        );
        assert_eq!(
            shown_url("https://v.example.com/siteverify?k=1", false),
            "https://v.example.com/siteverify?***"
        );
    }

    #[test]
    fn store_url_query_is_masked_for_every_scheme() {
        for (url, secret, shown) in [
            (
                "redis+unix:///run/redis.sock?db=0&pass=hunter2secret",
                "hunter2secret",
                "redis+unix:///run/redis.sock?***",
            ),
            (
                "unix:///run/redis.sock?user=app&pass=hunter2secret",
                "hunter2secret",
                "unix:///run/redis.sock?***",
            ),
            (
                "unix:///run/redis.sock?pass=hunter2@secret",
                "hunter2",
                "unix:///run/redis.sock?***",
            ),
            (
                "rediss://app:hunter2secret@redis.internal:6380/1?protocol=resp3",
                "hunter2secret",
                "rediss://***@redis.internal:6380/1?***",
            ),
        ] {
            let text = format!(
                "[sessions]\nkeys = [\"session-key-0123456789abcdef\"]\n\n[store]\nkind = \"redis\"\nurl = {}\n",
                toml_str(url)
            );
            let c = load(&text, &no_env).expect("valid");
            assert_eq!(c.store.url.expose(), url);
            let rendered = c.render_effective();
            assert!(
                !rendered.contains(secret),
                "{secret} leaked into:\n{rendered}"
            );
            let line = format!("url = {}  # user info and query masked", toml_str(shown));
            assert!(rendered.contains(&line), "{line} not in:\n{rendered}");
        }
        let (shown, note) = url_shown(&Secret::literal("redis://127.0.0.1:6379/0"));
        assert_eq!((shown.as_str(), note), ("\"redis://127.0.0.1:6379/0\"", ""));
        let (shown, note) = url_shown(&Secret::literal("not a url pass=hunter2"));
        assert_eq!((shown.as_str(), note), ("\"***\"", "not a URL, masked"));
    }

    #[test]
    fn webhook_url_is_a_secret_given_by_env() {
        const HOOK: &str = "https://hooks.example.com/services/T0/B0/hooksecret42";
        const ENV: &[(&str, &str)] = &[("HOOK", HOOK), ("BAD_HOOK", "ftp://x/hooksecret42")];
        let text = "[alerts]\nwebhook_url = \"env:HOOK\"\n";
        let c = load(text, &env_of(ENV)).expect("valid");
        let url = c.alerts.webhook_url.as_ref().expect("a webhook");
        assert_eq!(url.expose(), HOOK);
        assert_eq!(url.env_var(), Some("HOOK"));
        let rendered = c.render_effective();
        assert!(!rendered.contains("hooksecret42"), "{rendered}");
        assert!(
            rendered.contains("webhook_url = \"env:HOOK\"  # set"),
            "{rendered}"
        );
        assert_eq!(load(&rendered, &env_of(ENV)).expect("valid"), c);

        // An unset variable is an error naming the key and the variable.
        let e = load(text, &no_env).expect_err("unset");
        assert_eq!(e.key(), "alerts.webhook_url");
        assert!(e.to_string().contains("HOOK"), "{e}");
        // The value from the environment is validated, and not shown.
        let e =
            load("[alerts]\nwebhook_url = \"env:BAD_HOOK\"\n", &env_of(ENV)).expect_err("not http");
        assert_eq!(e.key(), "alerts.webhook_url");
        assert!(!e.to_string().contains("hooksecret42"), "{e}");
        assert!(e.to_string().contains("env:BAD_HOOK"), "{e}");

        // A literal still works, and check-config still masks it.
        let c = load(&format!("[alerts]\nwebhook_url = \"{HOOK}\"\n"), &no_env).expect("valid");
        assert_eq!(
            c.alerts.webhook_url.as_ref().map(Secret::expose),
            Some(HOOK)
        );
        let rendered = c.render_effective();
        assert!(!rendered.contains("hooksecret42"), "{rendered}");
        assert!(
            rendered.contains("webhook_url = \"https://hooks.example.com/***\""),
            "{rendered}"
        );
        let e = load_err("[alerts]\nwebhook_url = \"ftp://x/hooksecret42\"\n");
        assert_eq!(e.key(), "alerts.webhook_url");
        assert!(!e.to_string().contains("hooksecret42"), "{e}");
    }

    #[test]
    fn rates_a_store_cannot_keep_exactly_are_refused() {
        let e = load_err("[limits.global]\nrate = \"10000000000000000/second\"\n");
        assert_eq!(e.key(), "limits.global.rate");
        let e = load_err("[limits.session]\nrate = \"1/day\"\nburst = 200000\n");
        assert_eq!(e.key(), "limits.session.burst");
        assert!(e.to_string().contains("spans"), "{e}");
        load(
            "[limits.session]\nrate = \"1/day\"\nburst = 1000\n",
            &no_env,
        )
        .expect("valid");
        let e = load_err("[store]\ntimeout_ms = 30000\n");
        assert_eq!(e.key(), "store.timeout_ms");
        let e = load_err("[store]\nslow_grace_ms = 5001\n");
        assert_eq!(e.key(), "store.slow_grace_ms");
        let c = load("[store]\nslow_grace_ms = 0\n", &no_env).expect("no grace is valid");
        assert_eq!(c.store.slow_grace, Duration::ZERO);
        assert!(
            c.render_effective().contains("slow_grace_ms = 0"),
            "check-config shows it"
        );
    }

    #[test]
    fn settings_that_admit_nothing_draw_a_warning() {
        let c = load(
            "[run]\nmode = \"whole_run\"\nmax_cost = \"1.00\"\n[limits.session]\nbudgets = [{ amount = \"0.50\", window = \"day\" }]\n",
            &no_env,
        )
        .expect("valid");
        let w = c.warnings();
        assert!(
            w.iter()
                .any(|w| w.starts_with("run.max_cost") && w.contains("limits.session")),
            "{w:?}"
        );
        let c = load(
            "[models.m]\nupstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"300\"\n",
            &no_env,
        )
        .expect("valid");
        let w = c.warnings();
        assert!(
            w.iter()
                .any(|w| w.starts_with("models.m: 1024 output tokens")),
            "{w:?}"
        );
        assert!(
            w.iter().any(|w| w.starts_with("models.m.upstream")),
            "{w:?}"
        );
        let quiet = load("", &no_env).expect("valid").warnings();
        assert!(
            !quiet
                .iter()
                .any(|w| w.starts_with("run.max_cost") || w.starts_with("models.")),
            "{quiet:?}"
        );
    }

    #[test]
    fn a_redis_ledger_is_pinned_by_id_and_witnessed_by_default() {
        let redis = "[store]\nkind = \"redis\"\n[sessions]\nkeys = [\"0123456789abcdef0123\"]\n";
        let c = load(redis, &no_env).expect("valid: store init runs without a pin");
        assert_eq!(c.store.ledger_id, None);
        assert_eq!(
            c.store.witness_path.as_deref(),
            Some(Path::new("spendgate.witness"))
        );
        assert!(c
            .warnings()
            .iter()
            .any(|w| w.starts_with("store.ledger_id")));
        let c = load(
            &redis.replace(
                "kind = \"redis\"\n",
                "kind = \"redis\"\nledger_id = \"lg-0123456789abcdef0123456789abcdef\"\nwitness_path = \"off\"\n",
            ),
            &no_env,
        )
        .expect("valid");
        assert_eq!(
            c.store.ledger_id.as_deref(),
            Some("lg-0123456789abcdef0123456789abcdef")
        );
        assert_eq!(c.store.witness_path, None);
        assert!(c
            .warnings()
            .iter()
            .any(|w| w.starts_with("store.witness_path")));
        assert!(!c
            .warnings()
            .iter()
            .any(|w| w.starts_with("store.ledger_id")));
        for bad in ["LG-0123", "lg-0123456789ABCDEF0123456789abcdef", "f8-0123"] {
            let e = load_err(&format!("[store]\nledger_id = \"{bad}\"\n"));
            assert_eq!(e.key(), "store.ledger_id");
        }
        let e = load_err("[store]\nwitness_path = \" \"\n");
        assert_eq!(e.key(), "store.witness_path");
        // sqlite: no pin needed, no warning.
        let c = load("", &no_env).expect("valid");
        assert!(!c.warnings().iter().any(|w| w.starts_with("store.")));
    }

    #[test]
    fn replicas_on_redis_need_a_shared_session_key_and_risky_values_warn() {
        let e = load_err("[store]\nkind = \"redis\"\n[sessions]\nkeys = []\n");
        assert_eq!(e.key(), "sessions.keys");
        load(
            "[store]\nkind = \"redis\"\n[sessions]\nkeys = [\"0123456789abcdef0123\"]\n",
            &no_env,
        )
        .expect("valid");
        let c = load(
            "[server]\ntrusted_proxies = [\"0.0.0.0/0\", \"10.0.0.0/8\"]\n[limits.ip]\nbudgets = [{ amount = \"0\", window = \"day\" }]\n",
            &no_env,
        )
        .expect("valid");
        let w = c.warnings();
        assert!(
            w.iter().any(|w| w.starts_with("server.trusted_proxies[0]")),
            "{w:?}"
        );
        assert!(
            !w.iter().any(|w| w.starts_with("server.trusted_proxies[1]")),
            "{w:?}"
        );
        assert!(
            w.iter().any(|w| w.starts_with("limits.ip.budgets[0]")),
            "{w:?}"
        );
        let c = load(
            "[limits.session]
budgets = [{ amount = \"1\", window = \"lifetime\" }]
[limits.global]
budgets = [{ amount = \"1\", window = \"lifetime\" }]
",
            &no_env,
        )
        .expect("valid");
        let w = c.warnings();
        assert!(
            w.iter()
                .any(|w| w.starts_with("limits.session.budgets[0]: a lifetime budget")),
            "{w:?}"
        );
        assert!(
            !w.iter().any(|w| w.starts_with("limits.global.budgets[0]")),
            "{w:?}"
        );
    }

    #[test]
    fn an_empty_verifier_secret_is_refused() {
        let e = load_err(
            "[sessions]\nverifier_url = \"https://v.example.com/siteverify\"\nverifier_secret = \"\"\n",
        );
        assert_eq!(e.key(), "sessions.verifier_secret");
    }

    #[test]
    fn short_tokens_draw_a_warning() {
        let c = load(
            "[server]\nservice_tokens = [\"0123456789abcdef\"]\nadmin_tokens = [\"x\"]\n",
            &no_env,
        )
        .expect("valid");
        let w = c.warnings();
        assert!(
            w.iter()
                .any(|w| w.starts_with("server.admin_tokens[0]: a token of 1 bytes")),
            "{w:?}"
        );
        assert!(
            !w.iter().any(|w| w.starts_with("server.service_tokens[0]")),
            "{w:?}"
        );
    }

    #[test]
    fn dry_run_globally_or_per_limit() {
        let c = load("", &no_env).expect("valid");
        assert!(!c.policy.global.dry_run && !c.policy.ip.dry_run);
        let c = load("[limits.ip]\ndry_run = true\n", &no_env).expect("valid");
        assert!(c.policy.ip.dry_run, "per limit");
        assert!(!c.policy.global.dry_run && !c.policy.session.dry_run);
        assert!(c
            .warnings()
            .iter()
            .any(|w| w.starts_with("limits.ip.dry_run")));
        let c = load("[server]\ndry_run = true\n", &no_env).expect("valid");
        for p in [
            &c.policy.global,
            &c.policy.ip,
            &c.policy.session,
            &c.policy.conversation,
        ] {
            assert!(p.dry_run, "server.dry_run covers every [limits.X]");
        }
        assert!(c.warnings().iter().any(|w| w.starts_with("server.dry_run")));
        let e = load_err("[limits.ip]\ndry_run = \"yes\"\n");
        assert_eq!(e.key(), "limits.ip.dry_run");
    }

    #[test]
    fn empty_file_gives_the_spec_defaults() {
        let c = load("", &no_env).expect("an empty file is valid");
        assert_eq!(c.server.listen, "127.0.0.1:8080".parse().expect("addr"));
        assert!(c.server.trusted_proxies.is_empty());
        assert!(c.server.service_tokens.is_empty(), "env unset: dropped");
        assert!(c.server.admin_tokens.is_empty());
        assert!(!c.server.browser_direct);
        assert!(!c.server.dry_run);

        assert_eq!(c.store.kind, StoreKind::Sqlite);
        assert_eq!(c.store.path, PathBuf::from("spendgate.db"));
        assert_eq!(c.store.url.expose(), "redis://127.0.0.1:6379/0");
        assert_eq!(c.store.prefix, "spendgate");
        assert_eq!(c.store.timeout, Duration::from_millis(100));
        assert_eq!(
            c.store.slow_grace,
            Duration::from_millis(SLOW_GRACE_MS_DEFAULT)
        );
        assert_eq!(c.store.lease_ttl, Duration::from_secs(30));

        assert!(c.sessions.keys.is_empty());
        assert_eq!(c.sessions.ttl, Duration::from_secs(86_400));
        assert!(c.sessions.secure_cookie);
        assert_eq!(c.sessions.challenge, ChallengeMode::Off);
        assert_eq!(c.sessions.challenge_bits, 18);
        assert_eq!(c.sessions.verifier_url, None);
        assert_eq!(c.sessions.verifier_secret, None);

        assert_eq!(c.identity.ipv4_prefix, 32);
        assert_eq!(c.identity.ipv6_prefix, 64);
        assert_eq!(c.identity.ipv6_wider, vec![(56, 4), (48, 16)]);

        // Global and run are SPEC §9; the rest are the core's defaults.
        assert_eq!(c.policy, Policy::default());
        let g = &c.policy.global;
        assert_eq!(
            g.rate,
            Some(Rate {
                count: 100,
                period_ms: 1000,
                burst: 20
            })
        );
        assert_eq!(g.concurrency, Some(64));
        assert_eq!(
            g.budgets,
            vec![
                Budget {
                    amount: Micros(50_000_000),
                    window: Window::Day
                },
                Budget {
                    amount: Micros(1_000_000_000),
                    window: Window::Month
                }
            ]
        );
        assert_eq!(c.policy.mode, ReservationMode::PerStep);
        assert_eq!(c.policy.run.max_cost, Micros(200_000));
        assert_eq!(c.policy.run.max_input_bytes, 16_384);
        assert_eq!(c.policy.run.min_output_tokens, 64);
        assert_eq!(c.policy.lease_ttl_ms, 30_000);
        assert_eq!(c.policy.session_create_per_ip, Rate::parse("10/hour").ok());
        assert_eq!(
            c.policy.session_create_global,
            Rate::parse("600/minute").ok()
        );

        assert!(c.models.is_empty());
        assert!(c.tools.is_empty());
        assert!(c.upstreams.is_empty());
        assert_eq!(c.alerts.webhook_url, None);
        assert_eq!(c.alerts.thresholds_permille, vec![500, 800, 1000]);

        let vars: Vec<&str> = c.unset_env.iter().map(|u| u.var.as_str()).collect();
        assert_eq!(
            vars,
            [
                "SPENDGATE_SERVICE_TOKEN",
                "SPENDGATE_ADMIN_TOKEN",
                "SPENDGATE_SESSION_KEY"
            ]
        );
        assert!(c
            .warnings()
            .iter()
            .any(|w| w.contains("service API is closed")));
    }

    #[test]
    fn the_spec_example_loads() {
        let c = load(SPEC_EXAMPLE, &env_of(SPEC_ENV)).expect("SPEC §9 example is valid");
        assert_eq!(c.server.service_tokens.len(), 1);
        assert_eq!(
            c.server.service_tokens[0].expose(),
            "svc-token-value-0123456789"
        );
        assert_eq!(
            c.server.service_tokens[0].source(),
            "env:SPENDGATE_SERVICE_TOKEN"
        );
        assert_eq!(c.sessions.keys.len(), 1);
        assert!(c.unset_env.is_empty());
        let m = &c.models["gpt-4o-mini"];
        assert_eq!(m.upstream, "openai");
        assert_eq!(m.tokenizer, Tokenizer::O200kBase);
        assert_eq!(
            m.price,
            ModelPrice {
                input_per_million: Micros(150_000),
                cached_input_per_million: Micros(75_000),
                output_per_million: Micros(600_000),
            }
        );
        assert_eq!(m.upstream_model, None);
        assert_eq!(
            c.tools["web_search"],
            ToolPrice {
                per_call: Micros(10_000),
                per_unit: Micros::ZERO
            }
        );
        let u = &c.upstreams["openai"];
        assert_eq!(u.base_url, "https://api.openai.com/v1");
        assert_eq!(u.api_key.expose(), "sk-openai-value-0123456789");
        assert_eq!(u.timeout, Duration::from_secs(60));
        assert!(u.release_on_error);
        // The example restates the defaults for everything else.
        let defaults = load("", &env_of(SPEC_ENV)).expect("defaults");
        assert_eq!(c.policy, defaults.policy);
        assert_eq!(c.server, defaults.server);
        assert_eq!(c.store, defaults.store);
        assert_eq!(c.sessions, defaults.sessions);
        assert_eq!(c.identity, defaults.identity);
        assert_eq!(c.alerts, defaults.alerts);
    }

    /// The capacity keys: defaults, values given, and ranges that name the key.
    #[test]
    fn capacity_keys_have_defaults_and_ranges() {
        let d = load("", &no_env).expect("defaults").server.capacity;
        assert_eq!(d, CapacityConfig::default());
        assert_eq!(d.connections_max, crate::listener::CONNECTIONS_MAX);
        let c = load(
            "[server]\npublic_requests_max = 10\nservice_requests_max = 20\n\
             admin_requests_max = 3\nhealth_requests_max = 4\naddress_requests_max = 5\n\
             address_connections_max = 6\nconnections_max = 100\nconnections_reserved = 50\n\
             body_min_bytes_per_s = 1000\nbody_grace_ms = 500\n",
            &no_env,
        )
        .expect("config")
        .server
        .capacity;
        assert_eq!(
            c,
            CapacityConfig {
                public_requests_max: 10,
                service_requests_max: 20,
                admin_requests_max: 3,
                health_requests_max: 4,
                address_requests_max: 5,
                address_connections_max: 6,
                connections_max: 100,
                connections_reserved: 50,
                body_min_bytes_per_s: 1000,
                body_grace: Duration::from_millis(500),
            }
        );
        // Not given, the reserve follows a smaller connection bound.
        let c = load("[server]\nconnections_max = 100\n", &no_env).expect("config");
        assert_eq!(c.server.capacity.connections_reserved, 6);
        assert_eq!(c.server.capacity.address_connections_max, 100);
        for (text, key) in [
            ("public_requests_max = 0", "server.public_requests_max"),
            (
                "service_requests_max = 100000",
                "server.service_requests_max",
            ),
            ("address_requests_max = 0", "server.address_requests_max"),
            ("connections_max = 100000", "server.connections_max"),
            (
                "connections_max = 100\nconnections_reserved = 51",
                "server.connections_reserved",
            ),
            (
                "connections_max = 100\naddress_connections_max = 101",
                "server.address_connections_max",
            ),
            // A slower body rate would let a body hold its slot for hours.
            ("body_min_bytes_per_s = 10", "server.body_min_bytes_per_s"),
            // A longer grace would outlast the decision API's request timeout.
            ("body_grace_ms = 15000", "server.body_grace_ms"),
        ] {
            let e = load_err(&format!("[server]\n{text}\n"));
            assert_eq!(e.key(), key, "{text}: {e}");
        }
    }

    #[test]
    fn unknown_keys_are_errors_that_name_them() {
        let e = load_err("foo = 1\n");
        assert_eq!(e.key(), "foo");
        assert!(
            e.to_string()
                .contains("unknown key \"foo\" at the top level"),
            "{e}"
        );
        assert_eq!(e.line(), Some(1));

        let e = load_err("[server]\nlisten = \"127.0.0.1:1\"\nfoo = true\n");
        assert_eq!(e.key(), "server.foo");
        assert!(
            e.to_string()
                .starts_with("line 3: unknown key \"foo\" in [server]"),
            "{e}"
        );
        assert!(
            e.to_string().contains("\"listen\""),
            "lists known keys: {e}"
        );

        let e = load_err("[limits.global]\nrate = \"1/second\"\ndry_rn = true\n");
        assert!(
            e.to_string()
                .contains("unknown key \"dry_rn\" in [limits.global]"),
            "{e}"
        );

        let e = load_err("[limits.everyone]\nrate = \"1/second\"\n");
        assert!(
            e.to_string()
                .contains("unknown key \"everyone\" in [limits]"),
            "{e}"
        );

        let e = load_err(
            "[models.\"gpt-4.1\"]\nupstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\nprice = \"1\"\n",
        );
        assert_eq!(e.key(), "models.\"gpt-4.1\".price");
        assert!(
            e.to_string()
                .contains("unknown key \"price\" in [models.\"gpt-4.1\"]"),
            "{e}"
        );

        let e = load_err("[limits.ip]\nbudgets = [{ amount = \"1\", windw = \"day\" }]\n");
        assert!(
            e.to_string()
                .contains("unknown key \"windw\" in [limits.ip.budgets[0]]"),
            "{e}"
        );
    }

    #[test]
    fn bad_values_name_their_key_path() {
        let e = load_err(
            "[limits.global]\nbudgets = [{ amount = \"50\", window = \"day\" }, { amount = \"1.0000001\", window = \"month\" }]\n",
        );
        assert_eq!(e.key(), "limits.global.budgets[1].amount");
        assert!(
            e.message().starts_with(
                "limits.global.budgets[1].amount: amount \"1.0000001\" has more than 6 decimal places"
            ),
            "{e}"
        );
        assert_eq!(e.line(), Some(2));

        let e = load_err("[limits.ip]\nrate = \"10/week\"\n");
        assert_eq!(e.key(), "limits.ip.rate");
        assert!(e.to_string().contains("\"10/week\""), "{e}");

        let e = load_err("[limits.session]\nbudgets = [{ amount = \"1\", window = \"week\" }]\n");
        assert_eq!(e.key(), "limits.session.budgets[0].window");
        assert!(
            e.to_string()
                .contains("not one of hour, day, month, lifetime"),
            "{e}"
        );

        let e = load_err("[limits.session]\nbudgets = [{ amount = 0.1, window = \"day\" }]\n");
        assert_eq!(e.key(), "limits.session.budgets[0].amount");
        assert!(e.to_string().contains("float"), "{e}");

        let e = load_err("[limits.session]\nbudgets = [{ amount = \"1\" }]\n");
        assert_eq!(e.key(), "limits.session.budgets[0].window");
        assert!(e.to_string().contains("required key is missing"), "{e}");

        let e = load_err("[run]\nmax_cost = \"-1\"\n");
        assert_eq!(e.key(), "run.max_cost");

        let e = load_err("[store]\ntimeout_ms = \"fast\"\n");
        assert_eq!(e.key(), "store.timeout_ms");
        assert!(
            e.to_string().contains("expected a non-negative integer"),
            "{e}"
        );

        let e = load_err("[store]\ntimeout_ms = 0\n");
        assert_eq!(e.key(), "store.timeout_ms");
        let e = load_err("[store]\nlease_ttl_s = 3601\n");
        assert_eq!(e.key(), "store.lease_ttl_s");
        let e = load_err("[store]\nkind = \"mysql\"\n");
        assert!(
            e.to_string()
                .contains("store.kind: \"mysql\" is not one of memory, sqlite, redis"),
            "{e}"
        );
        let e = load_err("[store]\nprefix = \"a{b}\"\n");
        assert_eq!(e.key(), "store.prefix");
        let e = load_err("[server]\nlisten = \"localhost\"\n");
        assert_eq!(e.key(), "server.listen");
        let e = load_err("[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"nope\"]\n");
        assert_eq!(e.key(), "server.trusted_proxies[1]");
        let e = load_err("[identity]\nipv4_prefix = 33\n");
        assert_eq!(e.key(), "identity.ipv4_prefix");
        let e = load_err("[identity]\nipv6_prefix = 0\n");
        assert_eq!(e.key(), "identity.ipv6_prefix");
        let e = load_err("[identity]\nipv6_wider_prefixes = [48, 56]\n");
        assert_eq!(e.key(), "identity.ipv6_wider_prefixes[1]");
        // The client's prefix and three wider ones are what the ledger limits a request by.
        let e = load_err("[identity]\nipv6_wider_prefixes = [60, 56, 52, 48]\n");
        assert_eq!(e.key(), "identity.ipv6_wider_prefixes");
        let e = load_err("[sessions]\nchallenge_bits = 33\n");
        assert_eq!(e.key(), "sessions.challenge_bits");
        let e = load_err("[sessions]\nchallenge = \"sometimes\"\n");
        assert_eq!(e.key(), "sessions.challenge");
        let e = load_err("[run]\nmin_output_tokens = 2000\n");
        assert_eq!(e.key(), "run.min_output_tokens");
        let e = load_err("[run]\nmax_model_rounds = 0\n");
        assert_eq!(e.key(), "run.max_model_rounds");
        let e = load_err("[run]\nmode = \"yolo\"\n");
        assert_eq!(e.key(), "run.mode");
        let e = load_err("[alerts]\nthresholds = [0.8, 0.5]\n");
        assert_eq!(e.key(), "alerts.thresholds[1]");
        let e = load_err("[alerts]\nthresholds = [0]\n");
        assert_eq!(e.key(), "alerts.thresholds[0]");
        let e = load_err("[alerts]\nthresholds = [10.5]\n");
        assert_eq!(e.key(), "alerts.thresholds[0]");
        let e = load_err("[alerts]\nwebhook_url = \"ftp://x\"\n");
        assert_eq!(e.key(), "alerts.webhook_url");
        let e = load_err("[limits.global]\nburst = 0\n");
        assert_eq!(e.key(), "limits.global.burst");
        let e = load_err("[limits.conversation]\nburst = 5\n");
        assert!(e.to_string().contains("has no rate"), "{e}");
        let e = load_err("[limits.ip]\nconcurrency = 0\n");
        assert_eq!(e.key(), "limits.ip.concurrency");
        let e = load_err("[limits.ip]\nconcurrency = \"many\"\n");
        assert_eq!(e.key(), "limits.ip.concurrency");
        let e = load_err(
            "[limits.ip]\nbudgets = [{ amount = \"1\", window = \"day\" }, { amount = \"2\", window = \"day\" }]\n",
        );
        assert_eq!(e.key(), "limits.ip.budgets[1].window");
        let e = load_err("[server]\nlisten = 8080\n");
        assert_eq!(e.key(), "server.listen");
        let e = load_err("server = 5\n");
        assert_eq!(e.key(), "server");
        assert!(e.to_string().contains("expected a table"), "{e}");

        let e = load_err("[server\nlisten = 1\n");
        assert_eq!(e.key(), "");
        assert!(e.to_string().starts_with("line 1, column"), "{e}");
    }

    #[test]
    fn limits_keep_defaults_per_key_and_can_be_switched_off() {
        let c = load(
            "[limits.ip]\nrate = \"5/minute\"\n\n[limits.session]\nrate = \"off\"\nconcurrency = \"off\"\nbudgets = []\n\n[limits.global]\nburst = 7\n",
            &no_env,
        )
        .expect("valid");
        let d = Policy::default();
        assert_eq!(
            c.policy.ip.rate,
            Some(Rate {
                count: 5,
                period_ms: 60_000,
                burst: 5
            })
        );
        assert_eq!(c.policy.ip.budgets, d.ip.budgets);
        assert_eq!(c.policy.ip.concurrency, d.ip.concurrency);
        assert_eq!(c.policy.session.rate, None);
        assert_eq!(c.policy.session.concurrency, None);
        assert!(c.policy.session.budgets.is_empty());
        assert_eq!(
            c.policy.global.rate.map(|r| (r.count, r.burst)),
            Some((100, 7))
        );
    }

    #[test]
    fn a_secret_of_the_wrong_type_is_not_echoed() {
        for (toml, key) in [
            (
                "[server]\nadmin_tokens = \"SUPERSECRETADMINTOKEN123456\"\n",
                "server.admin_tokens",
            ),
            (
                "[server]\nservice_tokens = \"SUPERSECRETADMINTOKEN123456\"\n",
                "server.service_tokens",
            ),
            (
                "[sessions]\nkeys = \"SUPERSECRETADMINTOKEN123456\"\n",
                "sessions.keys",
            ),
            (
                "[store]\nurl = [\"redis://:SUPERSECRETADMINTOKEN123456@h\"]\n",
                "store.url",
            ),
        ] {
            let e = load_err(toml);
            assert_eq!(e.key(), key, "{e}");
            assert!(!e.to_string().contains("SUPERSECRET"), "{e}");
            assert!(
                e.to_string().contains("expected"),
                "still says what is wrong: {e}"
            );
        }
        // Other values are still shown.
        let e = load_err("[run]\nmode = 3\n");
        assert!(
            e.to_string().contains("3") || e.to_string().contains("integer"),
            "{e}"
        );
    }

    #[test]
    fn a_rate_without_burst_keeps_the_scope_default_burst() {
        let d = Policy::default();
        let burst_of = |p: &ScopePolicy| p.rate.map(|r| (r.count, r.period_ms, r.burst));
        let c = load(
            "[limits.session]\nrate = \"600/hour\"\n\n[limits.ip]\nrate = \"2/minute\"\n\n\
             [limits.global]\nrate = \"5000/second\"\n\n[limits.conversation]\nrate = \"10/minute\"\n",
            &no_env,
        )
        .expect("valid");
        let session_default = d.session.rate.map(|r| r.burst).unwrap_or(0);
        assert_eq!(session_default, 5);
        // The scope's default burst, not the rate's count: one guest cannot start 600 at once.
        assert_eq!(burst_of(&c.policy.session), Some((600, 3_600_000, 5)));
        // At most the new count.
        assert_eq!(burst_of(&c.policy.ip), Some((2, 60_000, 2)));
        assert_eq!(burst_of(&c.policy.global), Some((5000, 1000, 20)));
        // No default rate to take a burst from: the rate's own.
        assert_eq!(burst_of(&c.policy.conversation), Some((10, 60_000, 10)));
        // An explicit burst still wins, above or below the default.
        let c = load(
            "[limits.session]\nrate = \"600/hour\"\nburst = 50\n",
            &no_env,
        )
        .expect("valid");
        assert_eq!(burst_of(&c.policy.session), Some((600, 3_600_000, 50)));
        // Session creation has no burst key; its burst stays its count, as in its defaults.
        let c = load("[sessions]\ncreate_rate_per_ip = \"20/hour\"\n", &no_env).expect("valid");
        assert_eq!(c.policy.session_create_per_ip.map(|r| r.burst), Some(20));
        assert_eq!(
            d.session_create_per_ip.map(|r| (r.count, r.burst)),
            Some((10, 10))
        );
    }

    #[test]
    fn secrets_resolve_from_env_and_never_show() {
        let text = r#"
[server]
service_tokens = ["env:SVC", "env:MISSING", "literal-service-token"]
admin_tokens = ["env:ADM"]

[store]
kind = "redis"
url = "redis://user:hunter2@redis.internal:6379/0"

[sessions]
keys = ["env:KEY_NEW", "env:KEY_OLD"]
verifier_url = "https://challenges.example.com/siteverify"
verifier_secret = "env:VERIFIER"

[upstreams.local]
base_url = "http://127.0.0.1:11434/v1/"

[upstreams.openai]
base_url = "https://api.openai.com/v1"
api_key = "env:OPENAI_API_KEY"
"#;
        const ENV: &[(&str, &str)] = &[
            ("SVC", "svc-secret-aaaa"),
            ("ADM", "adm-secret-bbbb\n"),
            ("KEY_NEW", "key-new-cccc-cccc-cccc"),
            ("KEY_OLD", "key-old-dddd-dddd-dddd"),
            ("VERIFIER", "verifier-eeee"),
            ("MISSING", "   "),
        ];
        let c = load(text, &env_of(ENV)).expect("valid");
        let svc: Vec<&str> = c.server.service_tokens.iter().map(Secret::expose).collect();
        assert_eq!(svc, ["svc-secret-aaaa", "literal-service-token"]);
        assert_eq!(c.server.service_tokens[1].source(), "literal");
        assert_eq!(
            c.server.admin_tokens[0].expose(),
            "adm-secret-bbbb",
            "trimmed"
        );
        assert!(c.server.admin_tokens[0].matches(b"adm-secret-bbbb"));
        assert!(!c.server.admin_tokens[0].matches(b"adm-secret-bbbc"));
        assert!(!Secret::literal("").matches(b""));
        assert_eq!(c.sessions.keys[0].expose(), "key-new-cccc-cccc-cccc");
        assert_eq!(
            c.sessions.verifier_secret.as_ref().map(Secret::expose),
            Some("verifier-eeee")
        );
        assert_eq!(c.upstreams["local"].base_url, "http://127.0.0.1:11434/v1");
        assert!(c.upstreams["local"].api_key.is_empty());
        let oa = &c.upstreams["openai"].api_key;
        assert!(oa.is_empty(), "unset api_key is an empty secret");
        assert_eq!(oa.env_var(), Some("OPENAI_API_KEY"));
        assert_eq!(
            c.unset_env,
            vec![
                UnsetEnv {
                    key: "server.service_tokens".to_string(),
                    var: "MISSING".to_string()
                },
                UnsetEnv {
                    key: "upstreams.openai.api_key".to_string(),
                    var: "OPENAI_API_KEY".to_string()
                },
            ]
        );

        let rendered = c.render_effective();
        let debug = format!("{c:?}");
        for secret in [
            "svc-secret-aaaa",
            "adm-secret",
            "key-new",
            "key-old",
            "verifier-eeee",
            "literal-service-token",
            "hunter2",
        ] {
            assert!(
                !rendered.contains(secret),
                "{secret} leaked into:\n{rendered}"
            );
            assert!(!debug.contains(secret), "{secret} leaked into Debug");
        }
        assert!(rendered.contains("\"env:SVC\",  # set"), "{rendered}");
        assert!(rendered.contains("\"env:MISSING\",  # unset"), "{rendered}");
        assert!(rendered.contains("\"***\",  # literal"), "{rendered}");
        assert!(
            rendered.contains("api_key = \"env:OPENAI_API_KEY\"  # unset"),
            "{rendered}"
        );
        assert!(
            rendered.contains("redis://***@redis.internal:6379/0"),
            "{rendered}"
        );
        assert_eq!(format!("{}", c.sessions.keys[0]), "***");
        assert_eq!(format!("{:?}", c.sessions.keys[0]), "***");

        // A copied check-config output is refused rather than turned into a "***" token.
        let e = load(&rendered, &env_of(ENV)).expect_err("a mask is not a secret");
        assert_eq!(e.key(), "server.service_tokens[1]");
        assert!(e.to_string().contains("mask"), "{e}");
    }

    #[test]
    fn secret_lists_refuse_empty_and_shared_tokens() {
        let e = load_err("[server]\nservice_tokens = [\"\"]\n");
        assert_eq!(e.key(), "server.service_tokens[0]");
        let e = load_err("[server]\nservice_tokens = [\"env:\"]\n");
        assert_eq!(e.key(), "server.service_tokens[0]");
        let e = load_err(
            "[server]\nservice_tokens = [\"same-token\"]\nadmin_tokens = [\"same-token\"]\n",
        );
        assert_eq!(e.key(), "server.admin_tokens[0]");
        let e = load_err("[store]\nkind = \"redis\"\nurl = \"env:REDIS_URL\"\n");
        assert_eq!(e.key(), "store.url");
        let e = load_err("[store]\nkind = \"redis\"\nurl = \"http://x\"\n");
        assert!(
            !e.to_string().contains("http://x"),
            "a URL may hold a password: {e}"
        );
        let e = load_err("[sessions]\nkeys = [\"short\"]\n");
        assert_eq!(e.key(), "sessions.keys[0]");
        assert!(!e.to_string().contains("short"), "{e}");
        let e = load_err("[sessions]\nverifier_url = \"https://v.example/siteverify\"\n");
        assert_eq!(e.key(), "sessions.verifier_secret");
    }

    #[test]
    fn models_need_an_upstream_and_prices() {
        let model = |body: &str| format!("[models.\"m.1\"]\n{body}\n");
        let e = load_err(&model(
            "upstream = \"openai\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"",
        ));
        assert_eq!(e.key(), "models.\"m.1\".upstream");
        assert!(
            e.to_string()
                .contains("no upstream \"openai\" is configured"),
            "{e}"
        );
        assert_eq!(e.line(), Some(2));

        let e = load_err(&model(
            "input_per_million = \"1\"\noutput_per_million = \"1\"",
        ));
        assert_eq!(e.key(), "models.\"m.1\".upstream");

        let e = load_err(&model("upstream = \"mock\"\ninput_per_million = \"1\""));
        assert_eq!(e.key(), "models.\"m.1\".output_per_million");
        assert!(e.to_string().contains("without a price"), "{e}");

        let e = load_err(&model(
            "upstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\ncached_input_per_million = \"2\"",
        ));
        assert_eq!(e.key(), "models.\"m.1\".cached_input_per_million");

        let e = load_err(&model(
            "upstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\ntokenizer = \"gpt2\"",
        ));
        assert_eq!(e.key(), "models.\"m.1\".tokenizer");

        let c = load(
            &model("upstream = \"mock\"\ninput_per_million = \"1.5\"\noutput_per_million = \"2\"\nupstream_model = \"real-name\""),
            &no_env,
        )
        .expect("the built-in mock needs no [upstreams] table");
        let m = &c.models["m.1"];
        assert_eq!(
            m.price.cached_input_per_million,
            Micros(1_500_000),
            "defaults to input"
        );
        assert_eq!(m.tokenizer, Tokenizer::Bytes, "the conservative default");
        assert_eq!(m.upstream_model.as_deref(), Some("real-name"));
        assert_eq!(m.output_bound_field, OutputBoundField::MaxTokens);

        let e = load_err(&model(
            "upstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\noutput_bound_field = \"max_output\"",
        ));
        assert_eq!(e.key(), "models.\"m.1\".output_bound_field");
        let c = load(
            &model("upstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\noutput_bound_field = \"max_completion_tokens\""),
            &no_env,
        )
        .expect("valid");
        assert_eq!(
            c.models["m.1"].output_bound_field,
            OutputBoundField::MaxCompletionTokens
        );

        let e = load_err("[upstreams.mock]\nbase_url = \"http://127.0.0.1:1\"\n");
        assert_eq!(e.key(), "upstreams.mock");
        let e = load_err("[upstreams.x]\napi_key = \"k\"\n");
        assert_eq!(e.key(), "upstreams.x.base_url");
        let e = load_err("[upstreams.x]\nbase_url = \"https://x\"\ntimeout_s = 0\n");
        assert_eq!(e.key(), "upstreams.x.timeout_s");

        let e = load_err("[tools.fetch]\n");
        assert_eq!(e.key(), "tools.fetch");
        let c = load("[tools.fetch]\nper_unit = \"0.001\"\n", &no_env).expect("valid");
        assert_eq!(
            c.tools["fetch"],
            ToolPrice {
                per_call: Micros::ZERO,
                per_unit: Micros(1_000)
            }
        );
    }

    #[test]
    fn identity_wider_prefixes() {
        let c = load("[identity]\nipv6_prefix = 56\n", &no_env).expect("valid");
        assert_eq!(
            c.identity.ipv6_wider,
            vec![(48, 4)],
            "defaults narrower than the base drop"
        );
        let c = load("[identity]\nipv6_wider_prefixes = [60, 52, 44]\n", &no_env).expect("valid");
        assert_eq!(c.identity.ipv6_wider, vec![(60, 4), (52, 16), (44, 64)]);
        let c = load("[identity]\nipv6_wider_prefixes = []\n", &no_env).expect("valid");
        assert!(c.identity.ipv6_wider.is_empty());
    }

    #[test]
    fn render_effective_round_trips() {
        let env = env_of(SPEC_ENV);
        let mut text = SPEC_EXAMPLE.to_string();
        text.push_str(
            r#"
[limits.ip]
rate = "7/minute"
burst = 3
concurrency = "off"
budgets = [{ amount = "0.000001", window = "hour" }, { amount = "9007199254.740991", window = "lifetime" }]

[limits.conversation]
rate = "off"

[models."llama-3.1-8b"]
upstream = "mock"
input_per_million = "0"
output_per_million = 3
upstream_model = "meta/llama-3.1"
"#,
        );
        let text = text
            .replace(
                "thresholds = [0.5, 0.8, 1.0]",
                "thresholds = [0.333, 0.9, 2.5]",
            )
            .replace(
                "trusted_proxies = []",
                "trusted_proxies = [\"10.0.0.0/8\", \"192.0.2.7\", \"2001:db8::/32\"]",
            )
            .replace("mode = \"per_step\"", "mode = \"whole_run\"")
            .replace("kind = \"sqlite\"", "kind = \"memory\"")
            .replace(
                "ipv6_prefix = 64",
                "ipv6_prefix = 64\nipv6_wider_prefixes = [48]",
            );
        let c = load(&text, &env).expect("valid");
        assert_eq!(c.alerts.thresholds_permille, vec![333, 900, 2500]);
        let rendered = c.render_effective();
        let again = load(&rendered, &env).unwrap_or_else(|e| panic!("{e}\n{rendered}"));
        assert_eq!(again, c, "{rendered}");
        // And with every variable unset (tokens dropped, api_key empty).
        let bare = load(&text, &no_env).expect("valid");
        let rendered = bare.render_effective();
        assert_eq!(load(&rendered, &no_env).expect("valid"), bare, "{rendered}");
        // The defaults, too.
        let d = load("", &no_env).expect("valid");
        assert_eq!(load(&d.render_effective(), &no_env).expect("valid"), d);
    }

    #[test]
    fn load_file_names_the_file() {
        let dir =
            std::env::temp_dir().join(format!("spendgate-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("spendgate.toml");
        std::fs::write(&path, "[run]\nmax_seconds = 0\n").expect("write");
        let e = load_file(&path, &no_env).expect_err("invalid");
        assert_eq!(e.origin(), Some(path.as_path()));
        assert!(
            e.to_string()
                .starts_with(&format!("{}:2: run.max_seconds:", path.display())),
            "{e}"
        );
        std::fs::write(&path, "[run]\nmax_seconds = 10\n").expect("write");
        let c = load_file(&path, &no_env).expect("valid");
        assert_eq!(c.policy.run.max_seconds, 10);
        let missing = load_file(&dir.join("absent.toml"), &no_env).expect_err("missing");
        assert!(missing.to_string().contains("cannot read"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn alert_scopes() {
        let c = load("[alerts]\nscopes = [\"global\", \"ip\"]\n", &no_env).expect("valid");
        assert_eq!(c.alerts.scopes, vec![ScopeKind::Global, ScopeKind::Ip]);
        let d = load("", &no_env).expect("valid");
        assert_eq!(d.alerts.scopes, vec![ScopeKind::Global]);
        let e = load_err("[alerts]\nscopes = [\"ip\", \"run\"]\n");
        assert_eq!(e.key, "alerts.scopes[1]", "{e}");
        let e = load_err("[alerts]\nscopes = [\"ip\", \"ip\"]\n");
        assert_eq!(e.key, "alerts.scopes[1]", "{e}");
    }
}
