//! `POST /v1/sessions`: a guest session, behind its creation rates and the challenge.

use crate::auth::{bearer, ServiceAuth};
use crate::body::Body;
use crate::challenge;
use crate::client::{client_ip_of, cookie_name, ip_scopes, parse_ip};
use crate::state::Shared;
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::Value;
use spendgate_config::ChallengeMode;
use spendgate_core::{rfc3339, Refusal, UnixMs};
use spendgate_store::clock::now_unix;
use spendgate_wire::answers::{ErrorBody, SessionAnswer};
use spendgate_wire::error::{ApiError, ApiResult};
use std::net::SocketAddr;

// ---------------------------------------------------------------------------------------
// Sessions

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionBody {
    /// The challenge answered (as it was given).
    #[schema(value_type = Option<Object>)]
    pub challenge: Option<Value>,
    pub solution: Option<String>,
    /// The guest's address, from the operator's backend (service token) only: a guest must
    /// not choose the address its creations are counted under.
    pub client_ip: Option<String>,
}

/// A guest session: the token in the body and a cookie; or 403 `challenge_required` with a
/// challenge to solve and post back.
#[utoipa::path(post, path = "/v1/sessions", tag = "sessions",
    request_body = CreateSessionBody,
    responses(
        (status = 201, description = "a session", body = SessionAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 403, description = "challenge_required", body = ErrorBody),
        (status = 413, description = "payload_too_large", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 429, description = "a rate, concurrency or budget limit (Retry-After)", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ))]
pub async fn create_session(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body<CreateSessionBody>,
) -> ApiResult<Response> {
    let ip = match &body.value.client_ip {
        None => client_ip_of(&state, peer, &headers),
        Some(given) => {
            if bearer(&headers).is_none() {
                return Err(ApiError::invalid(
                    "client_ip is taken only from the operator's backend (with a service \
                     token); a guest's address is the connection's",
                ));
            }
            ServiceAuth::check(&state, &headers)?;
            parse_ip(given)?
        }
    };
    let ips = ip_scopes(&state, ip);
    let refused = |r: &Refusal, seq: u64| {
        state.metrics.refused("session", r.code.name(), r.scope);
        ApiError::from(r).with_ledger_seq(seq)
    };
    let mode = state.config.sessions.challenge;
    if mode != ChallengeMode::Off {
        // Ask first, applying nothing: a creation that its rate would refuse is refused
        // before a challenge is checked (no verifier call, no solution used up), and whether
        // one is needed follows this client's own prefixes and the global bucket.
        let asked = state.store.create_session(ips.clone(), true).await?;
        let pressure = match &asked.value {
            Ok(g) => g.pressure,
            Err(r) => return Err(refused(r, asked.seq)),
        };
        let needed = challenge::needed(mode, pressure);
        let answer = challenge::Answer {
            challenge: body.value.challenge.as_ref(),
            solution: body.value.solution.as_deref(),
        };
        challenge::check(&state, ip, answer, needed).await?;
    }
    let applied = state.store.create_session(ips, false).await?;
    if let Err(r) = &applied.value {
        return Err(refused(r, applied.seq));
    }
    let ttl = state.config.sessions.ttl.as_secs();
    let (token, session) = state.keys.issue(now_unix(), ttl);
    state.metrics.admitted("session");
    let expires_at = rfc3339(UnixMs(session.expires_unix * 1000));
    let cookie = format!(
        "{}={token}; {}HttpOnly; SameSite=Lax; Path=/; Max-Age={ttl}",
        cookie_name(&state.config),
        if state.config.sessions.secure_cookie {
            "Secure; "
        } else {
            ""
        },
    );
    let mut resp = (
        StatusCode::CREATED,
        Json(SessionAnswer {
            session: token,
            expires_at,
            ledger_seq: applied.seq,
        }),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    Ok(resp)
}
