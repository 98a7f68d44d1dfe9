//! Typed path parameters: the run or step id a route names, checked while the request is
//! extracted, so a handler receives a [`RunId`] or [`ReservationId`] and every refusal is an
//! [`ApiError`] in the error shape (never axum's plain-text rejection).

use crate::ids::check_id;
use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use spendgate_core::{ReservationId, RunId};
use spendgate_wire::error::{ApiError, ErrorCode};

/// The `{run_id}` of a route: a run id that could exist (see [`check_id`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunIdPath(pub RunId);

/// The `{step_id}` of a route: a step id that could exist (see [`check_id`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepIdPath(pub ReservationId);

/// The one path parameter of the route, checked as an id of `what`: a segment that does not
/// decode (not UTF-8 once percent-decoded) is `invalid_request` 400 with axum's text, which
/// names the parameter; one that decodes but no id could be is `not_found` 404, as an id
/// never made is. A route without exactly one parameter is a wiring bug: 500.
async fn id_segment<S: Send + Sync>(
    parts: &mut Parts,
    state: &S,
    what: &str,
) -> Result<String, ApiError> {
    let Path(id) = Path::<String>::from_request_parts(parts, state)
        .await
        .map_err(|e| {
            if e.status().is_server_error() {
                let error = e.body_text();
                tracing::error!(%error, "a route's path parameters do not fit its extractor");
                ApiError::new(ErrorCode::InternalError, "the request failed")
            } else {
                ApiError::invalid(e.body_text())
            }
        })?;
    check_id(what, &id)?;
    Ok(id)
}

impl<S: Send + Sync> FromRequestParts<S> for RunIdPath {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Ok(RunIdPath(RunId(id_segment(parts, state, "run").await?)))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for StepIdPath {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Ok(StepIdPath(ReservationId(
            id_segment(parts, state, "step").await?,
        )))
    }
}
