//! Service and admin tokens, as extractors: a handler that takes [`ServiceAuth`] or
//! [`AdminAuth`] runs only for a caller with a valid token, and says so in its signature.
//!
//! The router checks the token of every service and admin route before the body is read
//! ([`credentials_first`]: a caller without credentials holds no request slot while it sends
//! one) and keeps the proof in the request; the handler's extractor takes that proof, so a
//! token is checked once. Routes where a token is optional (a guest's session, usage, the
//! proxy) call [`ServiceAuth::check`] when the request carries one.

use crate::identity;
use crate::state::{AppState, Shared};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use spendgate_wire::error::{ApiError, ApiResult};

/// The bearer token of a request, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    v.strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .map(str::trim)
}

/// Proof that the request carries a valid service token (the operator's backend). Rejects
/// with 401 `unauthorized`.
#[derive(Clone, Copy, Debug)]
pub struct ServiceAuth(());

/// Proof that the request carries a valid admin token. Rejects with 401 `unauthorized`.
#[derive(Clone, Copy, Debug)]
pub struct AdminAuth(());

impl ServiceAuth {
    /// Checks the request's bearer token against the service tokens.
    pub fn check(state: &AppState, headers: &HeaderMap) -> ApiResult<ServiceAuth> {
        check(headers, &state.service_tokens, "service").map(ServiceAuth)
    }
}

impl AdminAuth {
    /// Checks the request's bearer token against the admin tokens.
    pub fn check(state: &AppState, headers: &HeaderMap) -> ApiResult<AdminAuth> {
        check(headers, &state.admin_tokens, "admin").map(AdminAuth)
    }
}

/// The one check of a token against the configured ones (constant time per token).
fn check(headers: &HeaderMap, tokens: &[String], which: &str) -> ApiResult<()> {
    match bearer(headers) {
        Some(t) if identity::token_matches(t, tokens) => Ok(()),
        Some(_) => Err(ApiError::unauthorized(format!("invalid {which} token"))),
        None => Err(ApiError::unauthorized(format!(
            "missing {which} token (Authorization: Bearer ...)"
        ))),
    }
}

impl FromRequestParts<Shared> for ServiceAuth {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ApiError> {
        if let Some(proof) = parts.extensions.get::<ServiceAuth>() {
            return Ok(*proof);
        }
        let proof = ServiceAuth::check(state, &parts.headers)?;
        parts.extensions.insert(proof);
        Ok(proof)
    }
}

impl FromRequestParts<Shared> for AdminAuth {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ApiError> {
        if let Some(proof) = parts.extensions.get::<AdminAuth>() {
            return Ok(*proof);
        }
        let proof = AdminAuth::check(state, &parts.headers)?;
        parts.extensions.insert(proof);
        Ok(proof)
    }
}

/// Service and admin routes check their token before the body is read (before its content
/// type, too): a caller without credentials holds no request slot while it sends one. A path
/// under `/admin/` takes the admin token, any other the service token; the proof is kept for
/// the handler's extractor.
pub async fn credentials_first(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let checked = if parts.uri.path().starts_with("/admin/") {
        AdminAuth::from_request_parts(&mut parts, &state)
            .await
            .map(|_| ())
    } else {
        ServiceAuth::from_request_parts(&mut parts, &state)
            .await
            .map(|_| ())
    };
    match checked {
        Ok(()) => next.run(Request::from_parts(parts, body)).await,
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderValue, StatusCode};
    use std::sync::Arc;

    fn state() -> Shared {
        let config = spendgate_config::load(
            "[server]\nservice_tokens = [\"service-token-0123456789\"]\n\
             admin_tokens = [\"admin-token-0123456789\"]\n",
            &|_| None,
        )
        .expect("config");
        let store = Arc::new(spendgate_store::MemoryStore::new(
            config.policy.clone(),
            Arc::new(spendgate_store::SystemClock),
        ));
        crate::state::build_state(config, store).expect("state")
    }

    fn with_token(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let v = HeaderValue::from_str(&format!("Bearer {token}")).expect("header");
        h.insert(header::AUTHORIZATION, v);
        h
    }

    fn refusal<T>(r: ApiResult<T>) -> (StatusCode, &'static str, String) {
        match r {
            Ok(_) => panic!("accepted"),
            Err(e) => (e.status, e.code.as_str(), e.message),
        }
    }

    /// Each token opens its own API only, and a refusal says whether the token was missing
    /// or wrong (401 `unauthorized`).
    #[tokio::test]
    async fn each_token_opens_its_own_api() {
        let state = state();
        assert!(ServiceAuth::check(&state, &with_token("service-token-0123456789")).is_ok());
        assert!(AdminAuth::check(&state, &with_token("admin-token-0123456789")).is_ok());
        let unauthorized = StatusCode::UNAUTHORIZED;
        assert_eq!(
            refusal(ServiceAuth::check(&state, &HeaderMap::new())),
            (
                unauthorized,
                "unauthorized",
                "missing service token (Authorization: Bearer ...)".into()
            )
        );
        assert_eq!(
            refusal(ServiceAuth::check(
                &state,
                &with_token("admin-token-0123456789")
            )),
            (unauthorized, "unauthorized", "invalid service token".into())
        );
        assert_eq!(
            refusal(AdminAuth::check(
                &state,
                &with_token("service-token-0123456789")
            )),
            (unauthorized, "unauthorized", "invalid admin token".into())
        );
        assert_eq!(
            refusal(AdminAuth::check(&state, &HeaderMap::new())),
            (
                unauthorized,
                "unauthorized",
                "missing admin token (Authorization: Bearer ...)".into()
            )
        );
    }

    /// The extractor takes the proof the router's layer left, and checks the token itself
    /// when there is none.
    #[tokio::test]
    async fn the_extractor_takes_the_layers_proof() {
        let state = state();
        let (mut parts, ()) = axum::http::Request::new(()).into_parts();
        assert!(ServiceAuth::from_request_parts(&mut parts, &state)
            .await
            .is_err());
        parts.headers.extend(with_token("service-token-0123456789"));
        assert!(ServiceAuth::from_request_parts(&mut parts, &state)
            .await
            .is_ok());
        // The proof is kept: the token is not checked again.
        parts.headers.clear();
        assert!(ServiceAuth::from_request_parts(&mut parts, &state)
            .await
            .is_ok());
        assert!(AdminAuth::from_request_parts(&mut parts, &state)
            .await
            .is_err());
    }
}
