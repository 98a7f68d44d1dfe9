//! The routes of the decision, admin and health API, and the layers every route is behind.

use crate::state::Shared;
use crate::{admin, admit, auth, body, health, runs, sessions, steps, usage};
use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Router;
use spendgate_listener::HEADER_BYTES_MAX;
use spendgate_wire::error::{ApiError, ErrorCode};
use std::time::Duration;

/// Time a decision-API request may take end to end: longer than the longest body grace
/// (`spendgate_config::BODY_GRACE_MS_MAX`), so that a stalled body is answered 408 by its rate, not 504
/// by this timeout.
pub const API_REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// The path of the proxy's Anthropic-shaped route (`POST /v1/messages`): every answer on it
/// or under it leaves in Anthropic's error shape ([`provider_errors`]).
pub const MESSAGES_PATH: &str = "/v1/messages";

/// Whether `path` is [`MESSAGES_PATH`] or a path under it.
pub fn is_messages_path(path: &str) -> bool {
    path.strip_prefix(MESSAGES_PATH)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Each route answers errors in its own provider's shape (SPEC §6): an error answer on a
/// [`MESSAGES_PATH`] path, wherever it was made (the capacity layer, the header bound, the
/// fallbacks for an unknown path or method, the JSON rule, the body bound, the handler),
/// leaves in Anthropic's shape (`spendgate_wire::anthropic::reshape`), its status, headers
/// and code kept; every other path keeps OpenAI's. The one answer rewritten after the fact.
/// (An error answer's body is read whole here, so the capacity slot it held is given back
/// as it is rewritten rather than once it is sent: a few hundred bytes in memory.)
async fn provider_errors(req: Request, next: Next) -> Response {
    let anthropic = is_messages_path(req.uri().path());
    let res = next.run(req).await;
    if anthropic {
        spendgate_wire::anthropic::reshape(res).await
    } else {
        res
    }
}

async fn limit_headers(req: Request, next: Next) -> Response {
    let total: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if total > HEADER_BYTES_MAX {
        return ApiError::invalid(format!("request headers are over {HEADER_BYTES_MAX} bytes"))
            .with_status(axum::http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
            .into_response();
    }
    next.run(req).await
}

/// Counts every error answer by status and code (`spendgate_error_answers_total`): store
/// outages, overload and input errors as well as the refusals counted by what they refused.
async fn count_errors(
    axum::extract::State(state): axum::extract::State<Shared>,
    req: Request,
    next: Next,
) -> Response {
    let res = next.run(req).await;
    let status = res.status();
    if status.is_client_error() || status.is_server_error() {
        let code = res
            .extensions()
            .get::<ErrorCode>()
            .map_or("upstream", |c| c.as_str());
        state.metrics.error_answer(status.as_u16(), code);
    }
    res
}

async fn shed(err: tower::BoxError) -> Response {
    if err.is::<tower::timeout::error::Elapsed>() {
        ApiError::new(ErrorCode::Timeout, "request took too long").into_response()
    } else {
        // (the timeout's inner service cannot fail)
        tracing::error!(error = %err, "request failed in the middleware");
        ApiError::new(ErrorCode::InternalError, "the request failed").into_response()
    }
}

/// When a JSON route requires `Content-Type: application/json` (SPEC §6: 415 otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsonRule {
    /// Always, with a body or without: the routes a guest's cookie authenticates. A browser
    /// sends a cross-site `POST` without a preflight only with a "simple" content type
    /// (`text/plain`, a form) or none; it preflights `application/json`, which another site
    /// cannot pass (spendgate answers no CORS). Requiring it means another site cannot have a
    /// visitor's browser create sessions or call the model on the visitor's address, cookie
    /// and quota.
    Always,
    /// When the request announces a body (`Content-Length` above 0, or `Transfer-Encoding`):
    /// the routes of the service and admin tokens, which a browser never sends cross-site. A
    /// `POST` without a body (heartbeat, finish, release) needs no type.
    WithBody,
}

/// Whether `Content-Type` is `application/json` (any parameters, any case).
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// Whether a request says it carries a body.
fn announces_body(headers: &axum::http::HeaderMap) -> bool {
    use axum::http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
    headers.contains_key(TRANSFER_ENCODING)
        || headers
            .get(CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes().iter().any(|b| *b != b'0'))
}

/// 415 for a JSON route called without `Content-Type: application/json` (see [`JsonRule`]),
/// before its body is read.
pub async fn require_json(
    axum::extract::State(rule): axum::extract::State<JsonRule>,
    req: Request,
    next: Next,
) -> Response {
    let needed = rule == JsonRule::Always || announces_body(req.headers());
    if needed && !is_json(req.headers()) {
        return ApiError::invalid("this route takes JSON: send Content-Type: application/json")
            .with_status(axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE)
            .into_response();
    }
    next.run(req).await
}

/// The gateway's routes and `extra` ones (the proxy's, the demo's pages), all behind the same
/// layers: capacity per class of caller and address, header bounds, each path's provider
/// error shape, error counting.
pub fn router(state: Shared, extra: Router<Shared>) -> Router {
    use tower::ServiceBuilder;
    let api_limit =
        body::API_BODY_BYTES_MAX.max(state.config.policy.run.max_input_bytes as usize * 2 + 4096);
    let json = |rule: JsonRule| middleware::from_fn_with_state(rule, require_json);
    let with_body = || json(JsonRule::WithBody);
    let credentialed = Router::new()
        .route("/v1/runs", post(runs::create_run).route_layer(with_body()))
        .route(
            "/v1/runs/{run_id}/steps",
            post(steps::create_step).route_layer(with_body()),
        )
        .route(
            "/v1/runs/{run_id}/heartbeat",
            post(runs::heartbeat).route_layer(with_body()),
        )
        .route(
            "/v1/runs/{run_id}/finish",
            post(runs::finish).route_layer(with_body()),
        )
        .route(
            "/v1/steps/{step_id}/commit",
            post(steps::commit_step).route_layer(with_body()),
        )
        .route(
            "/v1/steps/{step_id}/release",
            post(steps::release_step).route_layer(with_body()),
        )
        .route(
            "/v1/steps/{step_id}/unknown",
            post(steps::unknown_step).route_layer(with_body()),
        )
        .route("/admin/v1/summary", get(admin::summary))
        .route("/admin/v1/scopes", get(admin::scopes))
        .route("/admin/v1/reservations", get(admin::reservations))
        .route("/admin/v1/history", get(crate::history::history))
        .route(
            "/admin/v1/cutoff",
            put(admin::cutoff).route_layer(with_body()),
        )
        .route(
            "/admin/v1/adjustments",
            post(admin::adjust).route_layer(with_body()),
        )
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::credentials_first,
        ));
    let decision = Router::new()
        .route(
            "/v1/sessions",
            post(sessions::create_session).route_layer(json(JsonRule::Always)),
        )
        .route("/v1/usage", get(usage::usage))
        .merge(credentialed)
        .layer(DefaultBodyLimit::max(api_limit))
        .layer(
            ServiceBuilder::new()
                .layer(axum::error_handling::HandleErrorLayer::new(shed))
                .timeout(API_REQUEST_TIMEOUT),
        );
    Router::new()
        .merge(decision)
        .merge(extra)
        .route("/admin/", get(admin::dashboard))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/openapi.json", get(crate::openapi::openapi_json))
        .route("/metrics", get(health::metrics))
        // Every error answer is made in the error shape where it arises, none is rewritten
        // afterwards (but on `MESSAGES_PATH`, by `provider_errors`, into Anthropic's): the handlers' extractors reject with `ApiError` (`body::Body`,
        // `path::{RunIdPath, StepIdPath}`, `query::Query`, the tokens), `shed` answers the
        // timeout, and these two answer what no handler sees. A method a route does not take
        // is answered by the route's own `MethodRouter`, which calls this fallback and then
        // sets `Allow` to the methods it has (axum 0.8: `MethodRouter::call_with_state`), so
        // no layer has to copy it. (After every route: it applies to the routes registered
        // so far.)
        .method_not_allowed_fallback(health::method_not_allowed)
        .fallback(health::fallback)
        .layer(middleware::from_fn(limit_headers))
        // Classifies every request and holds its class's and its address's slots until the
        // answer is sent (one set of bounds for the whole process: the bounds live in the
        // shared state, not in a layer that `Router::layer` would build once per route).
        .layer(middleware::from_fn_with_state(state.clone(), admit::admit))
        // Outside every layer that answers: the provider's error shape of each path.
        .layer(middleware::from_fn(provider_errors))
        .layer(middleware::from_fn_with_state(state.clone(), count_errors))
        .with_state(state)
}

/// The routes of `server.metrics_listen`: `/metrics` without a token, and the health routes,
/// behind the same bounds as the API's listener.
pub fn metrics_router(state: Shared) -> Router {
    Router::new()
        .route("/metrics", get(health::metrics_open))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .method_not_allowed_fallback(health::method_not_allowed)
        .fallback(health::fallback)
        .layer(middleware::from_fn(limit_headers))
        .layer(middleware::from_fn_with_state(state.clone(), admit::admit))
        .layer(middleware::from_fn_with_state(state.clone(), count_errors))
        .with_state(state)
}

// A store call fails closed (503 `store_unavailable`) before the request it serves times out,
// its grace included.
const _: () = assert!(
    ((spendgate_config::STORE_TIMEOUT_MS_MAX + spendgate_config::SLOW_GRACE_MS_MAX) as u128)
        < API_REQUEST_TIMEOUT.as_millis()
);
// A stalled body is answered 408 by its rate, after its grace, before the whole request times
// out (504).
const _: () =
    assert!((spendgate_config::BODY_GRACE_MS_MAX as u128) < API_REQUEST_TIMEOUT.as_millis());

#[cfg(test)]
mod tests {
    use super::is_messages_path;

    #[test]
    fn messages_paths_are_the_route_and_below_it() {
        for p in ["/v1/messages", "/v1/messages/", "/v1/messages/count_tokens"] {
            assert!(is_messages_path(p), "{p}");
        }
        for p in ["/v1/messagesx", "/v1/message", "/v1/chat/completions", "/"] {
            assert!(!is_messages_path(p), "{p}");
        }
    }
}
