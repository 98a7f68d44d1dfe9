//! Service and admin tokens.

use crate::error::{ApiError, ApiResult};
use crate::identity;
use crate::state::AppState;
use axum::http::{header, HeaderMap};

/// The bearer token of a request, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    v.strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .map(str::trim)
}

/// The request carries a valid service token (the operator's backend).
pub fn require_service(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    match bearer(headers) {
        Some(t) if identity::token_matches(t, &state.service_tokens) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("invalid service token")),
        None => Err(ApiError::unauthorized(
            "missing service token (Authorization: Bearer ...)",
        )),
    }
}

/// The request carries a valid admin token.
pub fn require_admin(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    match bearer(headers) {
        Some(t) if identity::token_matches(t, &state.admin_tokens) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("invalid admin token")),
        None => Err(ApiError::unauthorized(
            "missing admin token (Authorization: Bearer ...)",
        )),
    }
}
