//! What the driver saw during a run: every tag it sent upstream and whose it was, every run
//! and session it opened, every answer it got (refusals by code, and any that broke the error
//! contract), the faults it injected, latencies, and the operator's probes during floods.

use crate::schedule::FaultKind;
use hdrhistogram::Histogram;
use reqwest::header::HeaderMap;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

/// How many examples of each kind of violation are kept for the report.
pub const EXAMPLES_MAX: usize = 10;

/// Which way a paid call went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The operator's backend reserved a step and called the upstream itself.
    Decision,
    /// Through spendgate's proxy.
    Proxy,
}

/// A tag sent upstream (`x-mock-tag`): whose call it was.
#[derive(Clone, Debug)]
pub struct TagInfo {
    pub run: String,
    pub route: Route,
    /// The reservation it was served under, when known: a decision step's id, or the
    /// `spendgate-step` header of a proxied call's answer (unknown when no answer came).
    pub step: Option<String>,
}

/// A guest session: its token (to read its usage) and the address it was used from.
#[derive(Clone, Debug)]
pub struct SessionInfo {
    pub token: String,
    pub ip: String,
}

/// The codes a refusal may carry: SPEC §6's list, and the ones the project documents
/// (the proxy's upstream failures, a body read's and a request's deadline, an unknown path).
/// A code added by the project must be added here, with the place it is documented.
pub const CONTRACT_CODES: [&str; 23] = [
    // SPEC §6
    "rate_limited",
    "concurrency_limited",
    "budget_exhausted",
    "run_bound_exceeded",
    "payload_too_large",
    "context_too_large",
    "model_not_allowed",
    "cutoff_engaged",
    "store_unavailable",
    "invalid_request",
    "idempotency_conflict",
    "unauthorized",
    "challenge_required",
    "reservation_closed",
    "run_closed",
    "run_deadline_exceeded",
    // README (refusals): a budget whose room is held by calls in flight
    "budget_held",
    // ARCHITECTURE.md / README: the proxy's upstream failures, deadlines, unknown paths
    "upstream_error",
    "upstream_unreachable",
    "upstream_timeout",
    "request_timeout",
    "timeout",
    "not_found",
];

/// A refusal as the driver read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub code: String,
    pub scope: Option<String>,
    /// `Retry-After`, in seconds (capped where the driver waits on it).
    pub retry_after_s: Option<u64>,
}

/// Reads an error answer: its code and scope, or why it breaks the error contract (the
/// OpenAI error shape `{"error": {"type", "code", "message"}}`, a code of the contract,
/// and `Retry-After` on every 429).
pub fn read_refusal(status: u16, headers: &HeaderMap, body: &Value) -> Result<Refusal, String> {
    let err = body
        .get("error")
        .ok_or_else(|| format!("{status} without the error shape: {}", clip(body)))?;
    let code = err
        .get("code")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{status} without an error code: {}", clip(body)))?;
    if err.get("type").and_then(Value::as_str).is_none()
        || err.get("message").and_then(Value::as_str).is_none()
    {
        return Err(format!("{status} {code} without type or message"));
    }
    if !CONTRACT_CODES.contains(&code) {
        return Err(format!("{status} with a code no contract names: {code:?}"));
    }
    let retry_after_s = headers
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if status == 429 && retry_after_s.is_none() {
        return Err(format!("429 {code} without Retry-After"));
    }
    Ok(Refusal {
        status,
        code: code.to_string(),
        scope: err.get("scope").and_then(Value::as_str).map(str::to_string),
        retry_after_s,
    })
}

fn clip(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 200 {
        format!("{}…", s.chars().take(200).collect::<String>())
    } else {
        s
    }
}

/// Latency histograms, in microseconds (1 µs to 10 min).
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

/// The operator's calls during floods.
#[derive(Debug)]
pub struct Probes {
    pub sent: u64,
    /// Refused for capacity (429 `rate_limited` shed, a 503 other than the store's, no
    /// answer while the replica was up), or not served at all.
    pub refused: u64,
    pub examples: Vec<String>,
    /// Another address's public session creations during floods, and how many were refused
    /// for capacity.
    pub other_sent: u64,
    pub other_refused: u64,
    pub latency: Histogram<u64>,
}

/// Everything recorded during a run.
#[derive(Debug)]
pub struct Record {
    pub tags: HashMap<String, TagInfo>,
    /// Run id → index into `sessions`.
    pub runs: HashMap<String, usize>,
    pub sessions: Vec<SessionInfo>,
    /// Admissions by what was admitted (`run`, `decision step`, `proxied step`, `session`).
    pub admitted: BTreeMap<&'static str, u64>,
    /// Refusals by `code` (and `code/scope` for budgets).
    pub refused: BTreeMap<String, u64>,
    /// Error answers that broke the contract.
    pub bad_answers: u64,
    pub bad_examples: Vec<String>,
    /// Upstream error answers the proxy passed through (the upstream's, not spendgate's).
    pub relayed: u64,
    /// Calls to spendgate that got no answer (a replica killed, a connection dropped).
    pub no_answer: u64,
    /// Faults injected, by kind (scheduled events, and per-request ones by call).
    pub injected: BTreeMap<FaultKind, u64>,
    /// Upstream calls made while a window of that kind was open, by kind.
    pub upstream_faulted: BTreeMap<FaultKind, u64>,
    /// Flood connections opened and refused.
    pub flood_opened: u64,
    pub flood_failed: u64,
    pub lat_api: Histogram<u64>,
    pub lat_proxy: Histogram<u64>,
    pub probes: Probes,
    /// A global adjustment the operator booked (the squeeze), in micros; `None` when not
    /// booked (or not known to be: then `squeeze_unknown`).
    pub squeeze: Option<i64>,
    pub squeeze_unknown: bool,
    /// Faults that could not be injected or undone (a replica that did not come back).
    pub fault_errors: Vec<String>,
}

impl Default for Record {
    fn default() -> Self {
        Record {
            tags: HashMap::new(),
            runs: HashMap::new(),
            sessions: Vec::new(),
            admitted: BTreeMap::new(),
            refused: BTreeMap::new(),
            bad_answers: 0,
            bad_examples: Vec::new(),
            relayed: 0,
            no_answer: 0,
            injected: BTreeMap::new(),
            upstream_faulted: BTreeMap::new(),
            flood_opened: 0,
            flood_failed: 0,
            lat_api: histogram(),
            lat_proxy: histogram(),
            probes: Probes {
                sent: 0,
                refused: 0,
                examples: Vec::new(),
                other_sent: 0,
                other_refused: 0,
                latency: histogram(),
            },
            squeeze: None,
            squeeze_unknown: false,
            fault_errors: Vec::new(),
        }
    }
}

impl Record {
    pub fn admit(&mut self, what: &'static str) {
        *self.admitted.entry(what).or_insert(0) += 1;
    }

    pub fn inject(&mut self, kind: FaultKind) {
        *self.injected.entry(kind).or_insert(0) += 1;
    }

    /// Counts an error answer: by code when it keeps the contract, else as a violation.
    pub fn answer(&mut self, what: &str, read: &Result<Refusal, String>) {
        match read {
            Ok(r) => {
                let key = match (&r.code[..], &r.scope) {
                    ("budget_exhausted", Some(s)) => format!("budget_exhausted/{s}"),
                    _ => r.code.clone(),
                };
                *self.refused.entry(key).or_insert(0) += 1;
            }
            Err(e) => {
                self.bad_answers += 1;
                if self.bad_examples.len() < EXAMPLES_MAX {
                    self.bad_examples.push(format!("{what}: {e}"));
                }
            }
        }
    }

    pub fn latency(h: &mut Histogram<u64>, d: std::time::Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1);
        let _ = h.record(us.min(h.high()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(retry: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(r) = retry {
            h.insert(
                reqwest::header::RETRY_AFTER,
                reqwest::header::HeaderValue::from_str(r).expect("value"),
            );
        }
        h
    }

    #[test]
    fn refusals_must_keep_the_contract() {
        let ok = json!({"error": {"type": "insufficient_quota", "code": "budget_exhausted",
            "message": "spent", "scope": "session"}});
        let r = read_refusal(429, &headers(Some("30")), &ok).expect("contract");
        assert_eq!(
            (r.code.as_str(), r.scope.as_deref()),
            ("budget_exhausted", Some("session"))
        );
        assert!(
            read_refusal(429, &headers(None), &ok).is_err(),
            "429 without Retry-After"
        );
        let made_up = json!({"error": {"type": "x", "code": "quota_exceeded", "message": "m"}});
        assert!(read_refusal(429, &headers(Some("1")), &made_up).is_err());
        assert!(read_refusal(500, &headers(None), &json!({"detail": "boom"})).is_err());
        let internal =
            json!({"error": {"type": "server_error", "code": "internal_error", "message": "m"}});
        assert!(read_refusal(500, &headers(None), &internal).is_err());
    }
}
