//! `GET /v1/usage`: a caller's spend by scope and window.

use crate::auth::{bearer, ServiceAuth};
use crate::client::{
    check_conversation, client_ip_of, guest_conversation, ip_scopes, parse_ip, session_from_cookie,
};
use crate::query::Query;
use crate::state::Shared;
use axum::extract::{ConnectInfo, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use spendgate_core::{rfc3339, Ledger, ScopeKind, UsageLine};
use spendgate_store::clock::now_unix;
use spendgate_wire::answers::{ErrorBody, UsageAnswer, UsageScope};
use spendgate_wire::error::{ApiError, ApiResult};
use std::net::SocketAddr;

// ---------------------------------------------------------------------------------------
// Usage

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    pub session: Option<String>,
    pub client_ip: Option<String>,
    pub conversation: Option<String>,
}

pub fn usage_scopes(lines: &[UsageLine]) -> Vec<UsageScope> {
    lines
        .iter()
        .map(|l| UsageScope {
            kind: l.scope.kind.name(),
            id: (l.scope.kind != ScopeKind::Global).then(|| l.scope.id.clone()),
            window: l.window.window.name(),
            window_id: l.window.to_string(),
            limit_micros: l.limit.0,
            used_micros: l.used.0,
            reserved_micros: l.reserved.0,
            remaining_micros: l.limit.saturating_sub(l.used).saturating_sub(l.reserved).0,
            overrun: l.overrun,
            resets_at: l.resets_at.map(rfc3339),
        })
        .collect()
}

/// Every budget that applies to a caller, global included: a guest by its cookie, or the
/// service for `?session=`.
#[utoipa::path(get, path = "/v1/usage", tag = "usage",
    params(UsageQuery),
    responses(
        (status = 200, description = "the budgets", body = UsageAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security((), ("service" = [])))]
pub async fn usage(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Query(q): Query<UsageQuery>,
) -> ApiResult<Response> {
    let service = bearer(&headers).is_some();
    let (token, ip) = if service {
        ServiceAuth::check(&state, &headers)?;
        let token = q
            .session
            .clone()
            .ok_or_else(|| ApiError::invalid("?session= is required with a service token"))?;
        let ip = q.client_ip.as_deref().map(parse_ip).transpose()?;
        (token, ip)
    } else {
        let token = session_from_cookie(&state, &headers)
            .ok_or_else(|| ApiError::unauthorized("no session cookie and no service token"))?;
        (token, Some(client_ip_of(&state, peer, &headers)))
    };
    if let Some(c) = &q.conversation {
        check_conversation(c)?;
    }
    let session = state.keys.verify(&token, now_unix())?;
    // A guest's conversations are named as the proxy names them (`proxy::caller`): its own
    // namespace, and without one named, the session itself (the conversation a
    // browser-direct call without `Spendgate-Conversation` is billed to).
    let conversation = match &q.conversation {
        Some(c) if !service => Some(guest_conversation(&session.id, c)),
        None if !service => Some(session.id.clone()),
        other => other.clone(),
    };
    let ips = ip.map(|ip| ip_scopes(&state, ip)).unwrap_or_default();
    let scopes = Ledger::request_scopes(&session.id, &ips, conversation.as_deref());
    let lines = state.store.usage(scopes).await?;
    Ok(Json(UsageAnswer {
        scopes: usage_scopes(&lines),
    })
    .into_response())
}
