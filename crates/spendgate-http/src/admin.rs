//! Admin API (admin token) and the operator dashboard page.

use crate::auth::AdminAuth;
use crate::body::Body;
use crate::query::Query;
use crate::state::Shared;
use crate::usage::usage_scopes;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use spendgate_core::{rfc3339, ReservationState, ScopeKey, ScopeKind, UnixMs, MICROS_MAX};
use spendgate_telemetry::{Forecast, PolicyView};
use spendgate_wire::answers::{
    AdjustAnswer, AdminReservationRow, AdminReservationsAnswer, AdminScopeRow, AdminScopesAnswer,
    AdminSummaryAnswer, BurnAnswer, BurnRateAnswer, CutoffAnswer, CutoffState, ErrorBody,
    FingerprintCount, PolicyAnswer, ReplicaRow,
};
use spendgate_wire::error::{ApiError, ApiResult};

/// Most rows an admin listing returns.
pub const ADMIN_ROWS_MAX: usize = 1000;
/// Longest adjustment or cutoff reason.
pub const REASON_BYTES_MAX: usize = 500;

/// The ledger at a glance: holds, charges, the cutoff, the global budgets, policy drift.
#[utoipa::path(get, path = "/admin/v1/summary", tag = "admin",
    responses(
        (status = 200, description = "the summary", body = AdminSummaryAnswer),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("admin" = [])))]
pub async fn summary(_auth: AdminAuth, State(state): State<Shared>) -> ApiResult<Response> {
    let s = state.store.summary().await?;
    let global = state.store.usage(vec![(ScopeKey::global(), 1)]).await?;
    let policy = PolicyView::of(&state.replica, state.store.replicas().await?);
    Ok(Json(AdminSummaryAnswer {
        ledger_seq: s.seq,
        store: state.store.kind(),
        cutoff: CutoffState {
            engaged: s.cutoff.is_some(),
            reason: s.cutoff,
        },
        runs_active: s.runs_active,
        reservations: s.reservations.into_iter().collect(),
        held_micros: s.held_micros.0,
        charged_micros: s.charged_micros.0,
        overruns: s.overruns,
        dry_run: state.config.server.dry_run,
        dry_run_limits: dry_run_limits(&state.config.policy),
        global: usage_scopes(&global),
        policy_drift: policy.drift(),
        policy: policy_answer(policy),
        burn: state.burn.forecasts().iter().map(burn_answer).collect(),
    })
    .into_response())
}

/// A global budget's burn as the summary shows it.
fn burn_answer(f: &Forecast) -> BurnAnswer {
    let line = &f.line;
    BurnAnswer {
        window: line.window.window.name(),
        window_id: line.window.to_string(),
        limit_micros: line.limit.0,
        used_micros: line.used.0,
        resets_at: line.resets_at.map(rfc3339),
        sampled_at: rfc3339(UnixMs(f.at_ms)),
        would_exhaust: f.would_exhaust(),
        rates: f
            .rates
            .iter()
            .map(|r| BurnRateAnswer {
                over_s: r.over_s,
                watched_s: r.watched_s,
                micros_per_s: r.micros_per_s,
                projected_micros: r.projected_micros,
                exhausted_in_s: r.exhausted_in_s,
                exhausted_at: r
                    .exhausted_in_s
                    .filter(|s| *s < 1e12)
                    .map(|s| rfc3339(UnixMs(f.at_ms.saturating_add((s * 1000.0) as u64)))),
            })
            .collect(),
    }
}

/// The replicas' policies as the summary shows them.
fn policy_answer(v: PolicyView) -> PolicyAnswer {
    PolicyAnswer {
        replica: v.replica.id,
        fingerprint: v.replica.fingerprint,
        fingerprints: v
            .fingerprints
            .into_iter()
            .map(|(fingerprint, replicas)| FingerprintCount {
                fingerprint,
                replicas,
            })
            .collect(),
        replicas: v
            .replicas
            .into_iter()
            .map(|r| ReplicaRow {
                seen: (r.seen.0 > 0).then(|| rfc3339(r.seen)),
                replica: r.replica,
                fingerprint: r.fingerprint,
            })
            .collect(),
    }
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ScopesQuery {
    pub kind: Option<String>,
    pub top: Option<usize>,
}

/// The busiest counters, of one kind of scope or all.
#[utoipa::path(get, path = "/admin/v1/scopes", tag = "admin",
    params(ScopesQuery),
    responses(
        (status = 200, description = "the counters", body = AdminScopesAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("admin" = [])))]
pub async fn scopes(
    _auth: AdminAuth,
    State(state): State<Shared>,
    Query(q): Query<ScopesQuery>,
) -> ApiResult<Response> {
    let kind = match q.kind.as_deref() {
        None | Some("") => None,
        Some(k) => Some(
            ScopeKind::parse(k)
                .ok_or_else(|| ApiError::invalid(format!("unknown scope kind {k:?}")))?,
        ),
    };
    let top = q.top.unwrap_or(20).min(ADMIN_ROWS_MAX);
    let rows = state.store.top_counters(kind, top).await?;
    let rows: Vec<_> = rows
        .into_iter()
        .map(|(k, c)| AdminScopeRow {
            scope: k.scope.to_string(),
            kind: k.scope.kind.name(),
            window: k.window.to_string(),
            limit_micros: c.limit.0,
            used_micros: c.used.0,
            reserved_micros: c.reserved.0,
            overrun: c.overrun,
            resets_at: k.window.resets_at().map(rfc3339),
        })
        .collect();
    Ok(Json(AdminScopesAnswer { scopes: rows }).into_response())
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ReservationsQuery {
    pub state: Option<String>,
    pub limit: Option<usize>,
}

/// Reservations, in one state or all.
#[utoipa::path(get, path = "/admin/v1/reservations", tag = "admin",
    params(ReservationsQuery),
    responses(
        (status = 200, description = "the reservations", body = AdminReservationsAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("admin" = [])))]
pub async fn reservations(
    _auth: AdminAuth,
    State(state): State<Shared>,
    Query(q): Query<ReservationsQuery>,
) -> ApiResult<Response> {
    let st = match q.state.as_deref() {
        None | Some("") => None,
        Some(s) => Some(
            ReservationState::parse(s)
                .ok_or_else(|| ApiError::invalid(format!("unknown state {s:?}")))?,
        ),
    };
    let rows = state
        .store
        .reservations(st, q.limit.unwrap_or(100).min(ADMIN_ROWS_MAX))
        .await?;
    let rows: Vec<_> = rows
        .into_iter()
        .map(|r| AdminReservationRow {
            kind: match &r.kind {
                spendgate_core::ReservationKind::Model { model, .. } => format!("model:{model}"),
                spendgate_core::ReservationKind::Tool { tool, .. } => format!("tool:{tool}"),
                spendgate_core::ReservationKind::RunHold => "run_hold".to_string(),
            },
            retry: matches!(
                r.kind,
                spendgate_core::ReservationKind::Model { retry: true, .. }
            ),
            id: r.id.0,
            run_id: r.run_id.0,
            state: r.state.name(),
            reserved_micros: r.amount.0,
            charged_micros: r.charged.0,
            overrun: r.overrun,
            created: rfc3339(r.created),
            resolved_at: r.resolved_at.map(rfc3339),
        })
        .collect();
    Ok(Json(AdminReservationsAnswer { reservations: rows }).into_response())
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CutoffBody {
    pub engaged: bool,
    #[serde(default)]
    pub reason: String,
}

/// Engages or lifts the spending cutoff: while engaged nothing new is admitted (503).
#[utoipa::path(put, path = "/admin/v1/cutoff", tag = "admin",
    request_body = CutoffBody,
    responses(
        (status = 200, description = "the cutoff, as set", body = CutoffAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 413, description = "payload_too_large", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("admin" = [])))]
pub async fn cutoff(
    _auth: AdminAuth,
    State(state): State<Shared>,
    body: Body<CutoffBody>,
) -> ApiResult<Response> {
    let b = body.value;
    if b.reason.len() > REASON_BYTES_MAX {
        return Err(ApiError::invalid(format!(
            "reason is over {REASON_BYTES_MAX} bytes"
        )));
    }
    let reason = if b.reason.is_empty() {
        "engaged by an operator".to_string()
    } else {
        b.reason
    };
    tracing::warn!(engaged = b.engaged, reason = %reason, "spending cutoff changed");
    let applied = state.store.set_cutoff(b.engaged, reason.clone()).await?;
    Ok(Json(CutoffAnswer {
        engaged: b.engaged,
        reason: b.engaged.then_some(reason),
        ledger_seq: applied.seq,
    })
    .into_response())
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdjustBody {
    pub scope: String,
    pub amount_micros: i64,
    pub reason: String,
}

/// Credits or charges a scope's budget, with a reason.
#[utoipa::path(post, path = "/admin/v1/adjustments", tag = "admin",
    request_body = AdjustBody,
    params(("Idempotency-Key" = Option<String>, Header, description = "applies once")),
    responses(
        (status = 200, description = "the scope's budgets after it", body = AdjustAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 409, description = "idempotency_conflict, reservation_closed, run_closed", body = ErrorBody),
        (status = 413, description = "payload_too_large", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("admin" = [])))]
pub async fn adjust(
    _auth: AdminAuth,
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Body<AdjustBody>,
) -> ApiResult<Response> {
    let (b, raw) = (body.value, body.raw);
    let mut scope = ScopeKey::parse(&b.scope).ok_or_else(|| {
        ApiError::invalid(format!(
            "scope {:?} is not global, ip:P, session:ID or conversation:ID",
            b.scope
        ))
    })?;
    // The id as admissions name the scope, or a refusal: an adjustment to a counter no
    // admission checks would be accepted and do nothing.
    match scope.kind {
        ScopeKind::Ip => {
            let id = &state.config.identity;
            scope.id = crate::identity::counted_prefix(
                &scope.id,
                id.ipv4_prefix,
                id.ipv6_prefix,
                &id.ipv6_wider,
            )
            .map_err(ApiError::invalid)?;
        }
        ScopeKind::Session => {
            if !crate::identity::is_session_id(&scope.id) {
                return Err(ApiError::invalid(format!(
                    "session scope {:?} is not a session id (32 hex digits; GET \
                     /admin/v1/scopes?kind=session lists them)",
                    scope.id
                )));
            }
        }
        ScopeKind::Conversation => crate::client::check_conversation(&scope.id)?,
        ScopeKind::Global | ScopeKind::Run => {}
    }
    if b.amount_micros.unsigned_abs() > MICROS_MAX.0 {
        return Err(ApiError::invalid("amount_micros is out of range"));
    }
    if b.reason.is_empty() || b.reason.len() > REASON_BYTES_MAX {
        return Err(ApiError::invalid(format!(
            "reason is required, at most {REASON_BYTES_MAX} bytes"
        )));
    }

    // A wider address prefix is limited at a multiple of the configured amounts.
    let factor = match scope.kind {
        ScopeKind::Ip => {
            let id = &state.config.identity;
            crate::identity::prefix_factor(&scope.id, id.ipv6_prefix, &id.ipv6_wider)
        }
        _ => 1,
    };
    // With an Idempotency-Key the adjustment applies once: a retry after a timeout (which
    // may have applied it) repeats the answer instead of charging or crediting twice.
    let once = crate::idempotency::idempotency(&headers, "adjust", &raw)?.map(|k| k.key);
    let keyed = once.is_some();
    let applied = state
        .store
        .adjust(scope.clone(), factor, b.amount_micros, once)
        .await;
    match &applied {
        Ok(a) => tracing::warn!(scope = %scope, amount = b.amount_micros, reason = %b.reason,
            ledger_seq = a.seq, repeated = a.value.repeated, "ledger adjustment"),
        Err(e) if keyed => tracing::warn!(scope = %scope, amount = b.amount_micros,
            reason = %b.reason, error = %e,
            "ledger adjustment failed; it may have applied: retry with the same Idempotency-Key"),
        Err(e) => tracing::warn!(scope = %scope, amount = b.amount_micros, reason = %b.reason,
            error = %e, "ledger adjustment failed; it may have applied: check the scope's usage \
            before retrying (an Idempotency-Key makes a retry safe)"),
    }
    let applied = applied?;
    Ok(Json(AdjustAnswer {
        scopes: usage_scopes(&applied.value.lines),
        repeated: applied.value.repeated,
        ledger_seq: applied.seq,
    })
    .into_response())
}

/// The operator dashboard page.
const DASHBOARD_HTML: &str = include_str!("dashboard.html");

/// The dashboard's Content-Security-Policy: its own inline script and style only (by digest),
/// calls to its own origin only, and never inside a frame (the page engages the cutoff: a
/// framing site must not overlay it to steer an operator's clicks).
static DASHBOARD_CSP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; \
         img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        inline_digests(DASHBOARD_HTML, "script"),
        inline_digests(DASHBOARD_HTML, "style"),
    )
});

/// The CSP sources (`'sha256-...'`) of every inline `<TAG>...</TAG>` element of `html`;
/// `'none'` when it has none.
fn inline_digests(html: &str, tag: &str) -> String {
    use base64::Engine;
    use sha2::{Digest, Sha256};
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut sources = Vec::new();
    let mut rest = html;
    while let Some(start) = rest.find(&open) {
        let body = &rest[start + open.len()..];
        let Some(end) = body.find(&close) else {
            break;
        };
        let digest = Sha256::digest(&body.as_bytes()[..end]);
        sources.push(format!(
            "'sha256-{}'",
            base64::engine::general_purpose::STANDARD.encode(digest)
        ));
        rest = &body[end + close.len()..];
    }
    if sources.is_empty() {
        "'none'".to_string()
    } else {
        sources.join(" ")
    }
}

pub async fn dashboard() -> Response {
    let mut resp = (
        [
            (header::CACHE_CONTROL, "no-store"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        Html(DASHBOARD_HTML),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&DASHBOARD_CSP) {
        resp.headers_mut()
            .insert(header::CONTENT_SECURITY_POLICY, v);
    }
    resp
}

/// The limits in dry-run: a scope kind's name when all its limits are (`limits.X.dry_run`, or
/// all with `server.dry_run`), else each single limit in dry-run (`session.rate`,
/// `ip.concurrency`, `global.budgets.month`).
fn dry_run_limits(p: &spendgate_core::Policy) -> Vec<String> {
    let mut out = Vec::new();
    for kind in [
        ScopeKind::Global,
        ScopeKind::Ip,
        ScopeKind::Session,
        ScopeKind::Conversation,
    ] {
        let Some(sp) = p.for_kind(kind) else {
            continue;
        };
        let name = kind.name();
        if sp.dry_run {
            out.push(name.to_string());
            continue;
        }
        if sp.rate_dry_run {
            out.push(format!("{name}.rate"));
        }
        if sp.concurrency_dry_run {
            out.push(format!("{name}.concurrency"));
        }
        for b in sp.budgets.iter().filter(|b| b.dry_run) {
            out.push(format!("{name}.budgets.{}", b.window.name()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dashboard's one inline script and one inline style are allowed by digest; a page
    /// edit that adds or changes one is covered by the digests computed from it.
    #[test]
    fn the_dashboard_policy_names_its_inline_script_and_style() {
        let csp = DASHBOARD_CSP.as_str();
        assert_eq!(csp.matches("'sha256-").count(), 2, "{csp}");
        assert!(csp.contains("frame-ancestors 'none'") && csp.starts_with("default-src 'none'"));
        assert_eq!(inline_digests("<p>no script</p>", "script"), "'none'");
        // The digest of `alert(1)`, as a browser computes it.
        assert_eq!(
            inline_digests("<script>alert(1)</script>", "script"),
            "'sha256-bhHHL3z2vDgxUt0W3dWQOrprscmda2Y5pLsLg4GF+pI='"
        );
    }
}
