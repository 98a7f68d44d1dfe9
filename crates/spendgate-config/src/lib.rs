//! The config file (SPEC §9), in two stages.
//!
//! 1. Raw serde structs that mirror the file exactly (`raw.rs`): `deny_unknown_fields`, every
//!    key with its default, so an empty file is valid. Amounts, rates, windows and enum-like
//!    values stay strings at this stage. These structs are the schema: each key's doc, type,
//!    static range and default stand beside its field (`schema.rs`), and everything else that
//!    knows the keys reads them: the diagnostics, the validator's ranges and choices,
//!    `check-config`'s effective config ([`Config::render_effective`]), the reference
//!    ([`reference_markdown`], `docs/configuration.md`) and the annotated example
//!    ([`example_toml`], `docs/spendgate.example.toml`).
//! 2. [`Config`], a validated value of parsed types ([`Policy`], [`Micros`], [`Rate`],
//!    `SocketAddr`, `IpNet`, `Duration`, resolved [`Secret`]s).
//!
//! Loading is a pure function of the file text and an environment lookup ([`load`]), so tests
//! never touch the process environment. Every error names the key it is about, in TOML path
//! syntax (`limits.global.budgets[1].amount`), and the line it came from; an error serde meets
//! is described from its key path, the schema and the file's spans, never from serde's
//! message.
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
//! [`Policy`]: spendgate_core::Policy
//! [`Micros`]: spendgate_core::Micros
//! [`Rate`]: spendgate_core::Rate

#![warn(clippy::too_many_lines)]

mod diagnostics;
mod docs;
mod error;
mod raw;
mod render;
mod schema;
mod text;
mod types;
mod validate;
mod warnings;

pub use docs::{example_toml, reference_markdown};
pub use error::ConfigError;
pub use types::*;

use diagnostics::{serde_error, syntax_error};
use raw::RawConfig;
use std::path::Path;
use toml::de::DeTable;
use validate::Validator;

// ---------------------------------------------------------------------------------------------
// Named bounds.

/// Connections served at once by one process (most `server.connections_max` may be; the
/// open files limit is raised for this many).
pub const CONNECTIONS_MAX: usize = 16_384;

/// `[server]` capacity defaults (see `spendgate_http::capacity`): requests in flight per class of
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
/// Longest burn-rate window (`alerts.burn_short_s`, `alerts.burn_long_s`): a week.
pub const BURN_WINDOW_S_MAX: u64 = 7 * 86_400;
/// `store.slow_grace_ms` by default: a store call slower than `timeout_ms` under ordinary load
/// is waited for this much longer while the store is not known to be failing. Under the
/// side-by-side load (`scripts/side-by-side.sh`, 2 cores shared with other builds) up to 74
/// admissions a case took longer than 100 ms, the slowest 267 ms; about 4x that. A store that
/// stopped answering costs the calls in flight then `timeout_ms` + this, later ones
/// `timeout_ms`.
pub const SLOW_GRACE_MS_DEFAULT: u64 = 1_000;
const _: () = assert!(SLOW_GRACE_MS_MAX as u128 == spendgate_store::SLOW_GRACE_MAX.as_millis());
/// `history.retention_days` range.
pub const HISTORY_RETENTION_DAYS_MAX: u64 = 36_500;
/// `history.retention_days` by default.
pub const HISTORY_RETENTION_DAYS_DEFAULT: u64 = 90;
/// `history.stream_max_len` by default (the redis crate's `history::STREAM_MAX_LEN_DEFAULT`):
/// at about a thousand records a second, some 15 minutes of drain lag.
pub const HISTORY_STREAM_MAX_LEN_DEFAULT: u64 = 1_000_000;
/// `history.stream_max_len` range.
pub const HISTORY_STREAM_MAX_LEN_MAX: u64 = 100_000_000;
/// `history.drain_lag_alert_s` by default, and its range.
pub const HISTORY_DRAIN_LAG_ALERT_S_DEFAULT: u64 = 60;
pub const HISTORY_DRAIN_LAG_ALERT_S_MAX: u64 = 86_400;
/// `history.rows_max` by default (sqlite and PostgreSQL: reservation records kept at most).
pub const HISTORY_ROWS_MAX_DEFAULT: u64 = 50_000_000;
/// `history.rows_max` range.
pub const HISTORY_ROWS_MAX_MAX: u64 = 10_000_000_000;
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
    let raw: RawConfig = serde_path_to_error::deserialize(deserializer)
        .map_err(|e| serde_error(text, root.get_ref(), e.path()))?;
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

#[cfg(test)]
mod docs_tests;
