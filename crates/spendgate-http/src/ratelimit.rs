//! `RateLimit` and `RateLimit-Policy` headers, and the dry-run note of an admission.

use crate::state::AppState;
use axum::http::{HeaderMap, HeaderValue};
use spendgate_core::{RateLeft, Refusal};

/// A limit in dry-run would have refused this admitted request (SPEC §8: computed, logged and
/// counted, not enforced): logs it, counts it in `spendgate_dry_run_refusals_total` and tells
/// the caller in `Spendgate-Dry-Run: <code>; scope=<scope>`. `decided`: this call made the
/// decision; an idempotent replay of an earlier answer (which changed nothing) repeats the
/// header but is not logged or counted again.
pub fn note_dry_run(
    state: &AppState,
    what: &'static str,
    refusal: Option<&Refusal>,
    decided: bool,
    headers: &mut HeaderMap,
) {
    let Some(r) = refusal else { return };
    let scope = r.scope.map(|s| s.name()).unwrap_or("");
    if decided {
        state.metrics.dry_run_refused(what, r.code.name(), r.scope);
        tracing::warn!(
            what,
            code = r.code.name(),
            scope,
            message = %r.message,
            "dry-run: a limit would have refused this request; admitted"
        );
    }
    if let Ok(v) = HeaderValue::from_str(&format!("{}; scope={scope}", r.code.name())) {
        headers.insert("spendgate-dry-run", v);
    }
}

/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers, 08 and later): one list member, the
/// rate policy with the least quota left after this admission, e.g.
/// `RateLimit: "session";r=2;t=20`. The name is one of those in `RateLimit-Policy`.
///
/// For GCRA: `r` is how many more runs that policy would admit right now (the burst left);
/// `t` is the seconds until it regains one more unit of quota, rounded up (at least 1). With
/// `r=0`, `t` is the `Retry-After` an admission at this moment would be refused with.
/// The values come from the rate state the admission itself wrote (an idempotent replay
/// repeats the first answer's values).
fn rate_limit(left: RateLeft, headers: &mut HeaderMap) {
    let value = format!(
        "\"{}\";r={};t={}",
        left.scope.name(),
        left.remaining,
        left.reset_s
    );
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert("ratelimit", v);
    }
}

/// The rate-limit headers of a successful admission (a run through the decision API, or the
/// one-step run of a proxied call): `RateLimit-Policy`, and `RateLimit` when a rate applies.
pub fn rate_limit_headers(state: &AppState, left: Option<RateLeft>, headers: &mut HeaderMap) {
    rate_limit_policy(state, headers);
    if let Some(left) = left {
        rate_limit(left, headers);
    }
}

/// `RateLimit-Policy` (IETF httpapi draft) naming the request-rate policies that apply.
fn rate_limit_policy(state: &AppState, headers: &mut HeaderMap) {
    let p = &state.config.policy;
    let mut parts = Vec::new();
    for (name, sp) in [
        ("session", &p.session),
        ("ip", &p.ip),
        ("global", &p.global),
        // Only when configured (SPEC §4 names no conversation rate); `RateLimit` may name it.
        ("conversation", &p.conversation),
    ] {
        if let Some(r) = sp.rate {
            parts.push(format!(
                "\"{name}\";q={};w={}",
                r.count,
                r.period_ms.div_ceil(1000)
            ));
        }
    }
    if let Ok(v) = HeaderValue::from_str(&parts.join(", ")) {
        if !parts.is_empty() {
            headers.insert("ratelimit-policy", v);
        }
    }
}
