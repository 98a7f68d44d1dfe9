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
//!   grace (see `spendgate_http::capacity`).
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
//!   no work was done (`spendgate_proxy::NO_WORK_STATUSES`) releases the reservation instead of
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

#![warn(clippy::too_many_lines)]

mod bounds;
mod diagnostics;
mod error;
mod raw;
mod render;
mod text;
mod types;
mod validate;
mod warnings;

pub use bounds::{
    ADDRESS_CONNECTIONS_MAX_DEFAULT, ADDRESS_REQUESTS_MAX_DEFAULT, ADMIN_REQUESTS_MAX_DEFAULT,
    BODY_GRACE_MS_DEFAULT, BODY_GRACE_MS_MAX, BODY_GRACE_MS_MIN, BODY_MIN_BYTES_PER_S_DEFAULT,
    BODY_MIN_BYTES_PER_S_FLOOR, BODY_MIN_BYTES_PER_S_MAX, BURST_MAX, CHALLENGE_BITS_MAX,
    CLASS_REQUESTS_MAX, CONCURRENCY_MAX, CONFIG_BYTES_MAX, CONNECTIONS_MAX,
    CONNECTIONS_RESERVED_DEFAULT, HEALTH_REQUESTS_MAX_DEFAULT, IPV6_WIDER_MAX, LEASE_TTL_S_MAX,
    LIST_LEN_MAX, MOCK_UPSTREAM, NAME_BYTES_MAX, PUBLIC_REQUESTS_MAX_DEFAULT, RATE_COUNT_MAX,
    RATE_WINDOW_US_MAX, RUN_BYTES_MAX, RUN_COUNT_MAX, RUN_SECONDS_MAX, RUN_TOKENS_MAX,
    SERVICE_REQUESTS_MAX_DEFAULT, SESSION_KEY_BYTES_MIN, SESSION_TTL_S_MAX, SLOW_GRACE_MS_DEFAULT,
    SLOW_GRACE_MS_MAX, STORE_TIMEOUT_MS_MAX, TABLE_LEN_MAX, THRESHOLD_PERMILLE_MAX,
    TOKEN_BYTES_ADVISED, TRUSTED_PROXIES_MAX, UPSTREAM_TIMEOUT_S_MAX,
};
pub use error::ConfigError;
pub use types::{
    AlertsConfig, CapacityConfig, ChallengeMode, Config, IdentityConfig, ModelConfig,
    OutputBoundField, Secret, ServerConfig, SessionsConfig, StoreConfig, StoreKind, Tokenizer,
    UnsetEnv, UpstreamConfig,
};

use diagnostics::{serde_error, syntax_error};
use raw::RawConfig;
use serde::Deserialize;
use std::path::Path;
use toml::de::DeTable;
use validate::Validator;

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

#[cfg(test)]
mod tests;
