//! Health, readiness, metrics, and the answers to routes and methods that do not exist.

use crate::auth::AdminAuth;
use crate::state::Shared;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use spendgate_core::ScopeKey;
use spendgate_telemetry::metrics::render_policy;
use spendgate_telemetry::PolicyView;
use spendgate_wire::answers::{ErrorBody, HealthAnswer, ReadyAnswer};
use spendgate_wire::error::ApiError;

// ---------------------------------------------------------------------------------------
// Operations

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "up", body = HealthAnswer)))]
pub async fn healthz() -> Response {
    Json(HealthAnswer { status: "ok" }).into_response()
}

/// The store is reachable.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "ready", body = ReadyAnswer),
        (status = 503, description = "store_unavailable", body = ErrorBody),
    ))]
pub async fn readyz(State(state): State<Shared>) -> Response {
    match state.store.ready().await {
        Ok(()) => Json(ReadyAnswer {
            status: "ready",
            store: state.store.kind(),
        })
        .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "not ready");
            let mut resp = ApiError::store_unavailable().into_response();
            *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            resp
        }
    }
}

/// Prometheus text format: to the admin token on the API's listener; without one on
/// `server.metrics_listen` only ([`metrics_open`]).
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses(
        (status = 200, description = "the metrics", body = String, content_type = "text/plain"),
        (status = 401, description = "unauthorized", body = ErrorBody),
    ),
    security(("admin" = [])))]
pub async fn metrics(_auth: AdminAuth, State(state): State<Shared>) -> Response {
    metrics_open(State(state)).await
}

/// `/metrics` on `server.metrics_listen`, the private listener: no token.
pub async fn metrics_open(State(state): State<Shared>) -> Response {
    let summary = state.store.summary().await.ok();
    let global = state
        .store
        .usage(vec![(ScopeKey::global(), 1)])
        .await
        .unwrap_or_default();
    let burn = state.burn.forecasts();
    let mut text = state.metrics.render(summary.as_ref(), &global, &burn);
    if let Ok(live) = state.store.replicas().await {
        let view = PolicyView::of(&state.replica, live);
        let me = (
            state.replica.id.as_str(),
            state.replica.fingerprint.as_str(),
        );
        render_policy(&mut text, &view.fingerprints, me);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Any route that does not exist: a 404 in the error shape (Anthropic's under
/// `/v1/messages`, by the router's `provider_errors`).
pub async fn fallback() -> ApiError {
    ApiError::not_found("no such route")
}

/// A method a route does not take, on any route: a 405 in the error shape (the router adds the
/// `Allow` header, and its `provider_errors` gives `/v1/messages` Anthropic's shape).
pub async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::invalid(format!("this path does not take {method}"))
        .with_status(StatusCode::METHOD_NOT_ALLOWED)
}
