//! The validated configuration: parsed types, resolved secrets.

use crate::text::MASK;
use crate::{
    ADDRESS_CONNECTIONS_MAX_DEFAULT, ADDRESS_REQUESTS_MAX_DEFAULT, ADMIN_REQUESTS_MAX_DEFAULT,
    BODY_GRACE_MS_DEFAULT, BODY_MIN_BYTES_PER_S_DEFAULT, CONNECTIONS_RESERVED_DEFAULT,
    HEALTH_REQUESTS_MAX_DEFAULT, PUBLIC_REQUESTS_MAX_DEFAULT, SERVICE_REQUESTS_MAX_DEFAULT,
};
use spendgate_core::{ModelPrice, Policy, ScopeKind, ToolPrice};
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

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
    pub history: HistoryConfig,
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
    /// Where `/metrics` is served without a token (`None`: nowhere; on `listen` to the admin
    /// token only).
    pub metrics_listen: Option<SocketAddr>,
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
/// fast a body must arrive (`[server]` keys of the same names; see `spendgate_http::capacity`).
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
            connections_max: crate::CONNECTIONS_MAX,
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
    /// A key of [`Config::upstreams`], or [`MOCK_UPSTREAM`](crate::MOCK_UPSTREAM).
    pub upstream: String,
    pub price: ModelPrice,
    pub tokenizer: Tokenizer,
    /// The model name sent upstream; `None`: the configured name.
    pub upstream_model: Option<String>,
    /// The one output-bound field the forwarded request carries, whatever the client used:
    /// the field this model's upstream honours (an upstream that ignores the other one would
    /// generate past the bound that was reserved).
    pub output_bound_field: OutputBoundField,
    /// Price of a million prompt tokens written to a prompt cache (Anthropic's cache
    /// creation), at least the input price.
    pub cache_write_per_million: spendgate_core::Micros,
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

/// `upstreams.NAME.api`: the API an upstream speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamApi {
    /// OpenAI-compatible (`/chat/completions`, `Authorization: Bearer`).
    OpenAi,
    /// Anthropic's Messages API (`/messages`, `x-api-key`).
    Anthropic,
}

impl UpstreamApi {
    pub fn name(self) -> &'static str {
        match self {
            UpstreamApi::OpenAi => "openai",
            UpstreamApi::Anthropic => "anthropic",
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
    pub api: UpstreamApi,
}

/// `[history]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryConfig {
    /// PostgreSQL (a secret: `postgres://` or `postgresql://`); `None`: none.
    pub url: Option<Secret>,
    /// Records older than this are deleted (sqlite and PostgreSQL).
    pub retention: Duration,
    /// Reservation records kept at most (sqlite and PostgreSQL).
    pub rows_max: u64,
    /// The Redis history stream's cap.
    pub stream_max_len: u64,
    /// The drain lag past which an alert is raised.
    pub drain_lag_alert: Duration,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlertsConfig {
    /// A secret: literal or `env:NAME` (an unset variable is an error).
    pub webhook_url: Option<Secret>,
    /// Fractions of a budget times 1000 (0.5 → 500), strictly ascending, each in 1..=10000.
    pub thresholds_permille: Vec<u32>,
    /// Kinds of scope whose budgets are watched: `global` (default), and `ip`, `session`,
    /// `conversation` (their top spenders, see
    /// `spendgate_telemetry::alerts::SCOPE_ALERT_TOP`). Distinct.
    pub scopes: Vec<ScopeKind>,
    /// The burn-rate alert's two windows (`burn_short_s`, `burn_long_s`; long > short).
    pub burn_short: std::time::Duration,
    pub burn_long: std::time::Duration,
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
