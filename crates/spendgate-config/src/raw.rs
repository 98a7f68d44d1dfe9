//! Stage one: the file as written (serde structs that mirror it, SPEC defaults).

use crate::bounds::{
    ADDRESS_REQUESTS_MAX_DEFAULT, ADMIN_REQUESTS_MAX_DEFAULT, BODY_GRACE_MS_DEFAULT,
    BODY_MIN_BYTES_PER_S_DEFAULT, HEALTH_REQUESTS_MAX_DEFAULT, PUBLIC_REQUESTS_MAX_DEFAULT,
    SERVICE_REQUESTS_MAX_DEFAULT, SLOW_GRACE_MS_DEFAULT,
};
use crate::text::amount_text;
use serde::de::{self, Visitor};
use serde::Deserialize;
use spendgate_core::RunBounds;
use std::collections::BTreeMap;
use std::fmt;

// ---------------------------------------------------------------------------------------------
// Stage one: the file as written.

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawConfig {
    pub(crate) server: RawServer,
    pub(crate) store: RawStore,
    pub(crate) sessions: RawSessions,
    pub(crate) identity: RawIdentity,
    pub(crate) limits: RawLimits,
    pub(crate) run: RawRun,
    pub(crate) models: BTreeMap<String, RawModel>,
    pub(crate) tools: BTreeMap<String, RawTool>,
    pub(crate) upstreams: BTreeMap<String, RawUpstream>,
    pub(crate) alerts: RawAlerts,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawServer {
    pub(crate) listen: String,
    pub(crate) trusted_proxies: Vec<String>,
    pub(crate) service_tokens: Vec<String>,
    pub(crate) admin_tokens: Vec<String>,
    pub(crate) browser_direct: bool,
    pub(crate) dry_run: bool,
    pub(crate) public_requests_max: u64,
    pub(crate) service_requests_max: u64,
    pub(crate) admin_requests_max: u64,
    pub(crate) health_requests_max: u64,
    pub(crate) address_requests_max: u64,
    /// Absent: [`ADDRESS_CONNECTIONS_MAX_DEFAULT`], at most `connections_max`.
    pub(crate) address_connections_max: Option<u64>,
    pub(crate) connections_max: u64,
    /// Absent: [`CONNECTIONS_RESERVED_DEFAULT`], at most a sixteenth of `connections_max`.
    pub(crate) connections_reserved: Option<u64>,
    pub(crate) body_min_bytes_per_s: u64,
    pub(crate) body_grace_ms: u64,
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
            connections_max: crate::bounds::CONNECTIONS_MAX as u64,
            connections_reserved: None,
            body_min_bytes_per_s: BODY_MIN_BYTES_PER_S_DEFAULT,
            body_grace_ms: BODY_GRACE_MS_DEFAULT,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawStore {
    pub(crate) kind: String,
    pub(crate) path: String,
    pub(crate) url: String,
    pub(crate) prefix: String,
    pub(crate) ledger_id: String,
    pub(crate) witness_path: String,
    pub(crate) timeout_ms: u64,
    pub(crate) slow_grace_ms: u64,
    pub(crate) lease_ttl_s: u64,
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
pub(crate) struct RawSessions {
    pub(crate) keys: Vec<String>,
    pub(crate) ttl_s: u64,
    pub(crate) secure_cookie: bool,
    pub(crate) challenge: String,
    pub(crate) challenge_bits: u64,
    pub(crate) create_rate_per_ip: String,
    pub(crate) create_rate_global: String,
    pub(crate) verifier_url: Option<String>,
    pub(crate) verifier_secret: Option<String>,
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
pub(crate) struct RawIdentity {
    pub(crate) ipv4_prefix: u64,
    pub(crate) ipv6_prefix: u64,
    /// Absent: /56 and /48, those wider than `ipv6_prefix`.
    pub(crate) ipv6_wider_prefixes: Option<Vec<u64>>,
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
pub(crate) struct RawLimits {
    pub(crate) global: RawScope,
    pub(crate) ip: RawScope,
    pub(crate) session: RawScope,
    pub(crate) conversation: RawScope,
}

/// One `[limits.X]` section; an absent key keeps the scope's default (`burst` included when
/// only `rate` is given).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawScope {
    pub(crate) rate: Option<String>,
    pub(crate) burst: Option<u64>,
    pub(crate) concurrency: Option<RawCount>,
    pub(crate) budgets: Option<Vec<RawBudget>>,
    pub(crate) dry_run: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBudget {
    pub(crate) amount: RawAmount,
    pub(crate) window: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRun {
    pub(crate) mode: String,
    pub(crate) max_input_bytes: u64,
    pub(crate) max_context_tokens: u64,
    pub(crate) max_output_tokens: u64,
    pub(crate) max_tool_result_bytes: u64,
    pub(crate) max_model_rounds: u64,
    pub(crate) max_tool_calls: u64,
    pub(crate) max_retries: u64,
    pub(crate) max_seconds: u64,
    pub(crate) max_cost: RawAmount,
    pub(crate) shrink_to_fit: bool,
    pub(crate) min_output_tokens: u64,
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
pub(crate) struct RawModel {
    pub(crate) upstream: Option<String>,
    pub(crate) input_per_million: Option<RawAmount>,
    pub(crate) output_per_million: Option<RawAmount>,
    pub(crate) cached_input_per_million: Option<RawAmount>,
    pub(crate) tokenizer: Option<String>,
    pub(crate) upstream_model: Option<String>,
    pub(crate) output_bound_field: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTool {
    pub(crate) per_call: Option<RawAmount>,
    pub(crate) per_unit: Option<RawAmount>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawUpstream {
    pub(crate) base_url: Option<String>,
    pub(crate) api_key: Option<String>,
    pub(crate) timeout_s: Option<u64>,
    pub(crate) release_on_error: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawAlerts {
    pub(crate) webhook_url: String,
    pub(crate) thresholds: Vec<f64>,
    pub(crate) scopes: Vec<String>,
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
pub(crate) struct RawAmount(pub(crate) String);

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
pub(crate) enum RawCount {
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
