//! spendgate-server: the HTTP shell around the core. It parses, calls the core through a
//! store, and maps answers and errors; it holds no limit of its own (SPEC I4).

pub mod admin;
pub mod alerts;
pub mod api;
pub mod challenge;
pub mod config;
pub mod error;
pub mod identity;
pub mod listener;
pub mod metrics;
pub mod ops;
pub mod pace;
pub mod plant;
pub mod proxy;
pub mod tokens;

use crate::api::{AppState, Shared};
use crate::config::{Config, StoreKind};
use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Router;
use spendgate_store::{
    MemoryStore, SqliteOptions, SqliteStore, Store, StoreError, SystemClock, Timed,
};
use std::sync::Arc;
use std::time::Duration;

/// Requests handled at once by one process; past it, new requests are shed with 429
/// `rate_limited` (scope `global`, `Retry-After: OVERLOAD_RETRY_AFTER_S`).
pub const CONCURRENT_REQUESTS_MAX: usize = 8192;
/// Open files a gateway wants: every client connection ([`listener::CONNECTIONS_MAX`]), as many
/// to upstreams, and room for the store, the alert webhook and logs.
pub const OPEN_FILES_WANTED: u64 = 2 * listener::CONNECTIONS_MAX as u64 + 1024;

/// Raises this process's soft limit on open files to [`OPEN_FILES_WANTED`] (at most the hard
/// limit; never lowers it), so the gateway's own connection bound is what binds, not a
/// distribution's default of 1,024 (past it `accept` fails and clients see resets). Returns
/// the soft limit now in force (`None`: unlimited).
pub fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let now = getrlimit(Resource::Nofile);
    let current = now.current?;
    let target = now
        .maximum
        .map_or(OPEN_FILES_WANTED, |hard| hard.min(OPEN_FILES_WANTED));
    if target <= current {
        return Some(current);
    }
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(target),
            maximum: now.maximum,
        },
    ) {
        Ok(()) => Some(target),
        Err(e) => {
            tracing::warn!(error = %e, current, target, "could not raise the open files limit");
            Some(current)
        }
    }
}
/// `Retry-After` of a request shed because the process is at `CONCURRENT_REQUESTS_MAX`.
pub const OVERLOAD_RETRY_AFTER_S: u64 = 1;
/// Total bytes of request headers accepted (names and values).
pub const HEADER_BYTES_MAX: usize = 16 * 1024;
/// Time a decision-API request may take end to end: longer than `api::BODY_READ_TIMEOUT`, so
/// that a body sent slowly is answered 408 by the body read, not 504 by this timeout.
pub const API_REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// How often expired leases are swept.
pub const SWEEP_EVERY: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("config: {0}")]
    Config(String),
    #[error("http client: {0}")]
    Http(String),
}

/// Opens the configured store (wrapped in the `store.timeout_ms` bound).
pub async fn open_store(config: &Config) -> Result<Arc<dyn Store>, ServerError> {
    let policy = config.policy.clone();
    let inner: Arc<dyn Store> = match config.store.kind {
        StoreKind::Memory => Arc::new(MemoryStore::new(policy, Arc::new(SystemClock))),
        StoreKind::Sqlite => {
            let opts = SqliteOptions::new(config.store.path.clone());
            Arc::new(SqliteStore::open(opts, policy, Arc::new(SystemClock))?)
        }
        StoreKind::Redis => open_redis(config, policy).await?,
    };
    Ok(Arc::new(Timed::new(inner, config.store.timeout)))
}

/// The Redis options of a config.
pub fn redis_options(config: &Config) -> spendgate_redis::RedisOptions {
    spendgate_redis::RedisOptions {
        url: config.store.url.expose().to_string(),
        prefix: config.store.prefix.clone(),
        timeout: config.store.timeout,
        clock: spendgate_redis::ClockSource::Server,
    }
}

/// Shortest timeout of an operator's `spendgate store` command: `store.timeout_ms` bounds the
/// gateway's calls on the request path (fail closed), but a command run once by hand (a TLS
/// handshake, a script load) may take longer and must not fail for it.
pub const STORE_COMMAND_TIMEOUT_MIN: std::time::Duration = std::time::Duration::from_secs(5);

/// [`redis_options`] for an operator's `spendgate store` command.
pub fn redis_command_options(config: &Config) -> spendgate_redis::RedisOptions {
    let mut o = redis_options(config);
    o.timeout = o.timeout.max(STORE_COMMAND_TIMEOUT_MIN);
    o
}

async fn open_redis(
    config: &Config,
    policy: spendgate_core::Policy,
) -> Result<Arc<dyn Store>, ServerError> {
    // `rediss://` urls: TLS with the system's roots (or `SSL_CERT_FILE`), through rustls.
    install_crypto();
    Ok(Arc::new(
        spendgate_redis::RedisStore::open(redis_options(config), policy).await?,
    ))
}

/// Installs the TLS crypto provider (ring) for outgoing HTTPS and `rediss://`; idempotent.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Builds the shared state: tokens, session keys (an ephemeral one when none is configured).
pub fn build_state(config: Config, store: Arc<dyn Store>) -> Result<Shared, ServerError> {
    plant::announce().map_err(ServerError::Config)?;
    let mut keys: Vec<Vec<u8>> = config
        .sessions
        .keys
        .iter()
        .map(|k| k.expose().as_bytes().to_vec())
        .filter(|k| !k.is_empty())
        .collect();
    if keys.is_empty() {
        // `Config::warnings` tells the operator (sessions end at restart, replicas do not
        // share them).
        keys.push(rand::random::<[u8; 32]>().to_vec());
    }
    let keys = identity::SessionKeys::new(keys)
        .ok_or_else(|| {
            ServerError::Config("sessions.keys: every key must be at least 16 bytes".into())
        })?
        .with_max_ttl(config.sessions.ttl.as_secs());
    let service_tokens = config
        .server
        .service_tokens
        .iter()
        .map(|t| t.expose().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    let admin_tokens = config
        .server
        .admin_tokens
        .iter()
        .map(|t| t.expose().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    install_crypto();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(proxy::UPSTREAM_IDLE_CONNECTIONS_MAX)
        .connect_timeout(Duration::from_secs(5))
        // A redirect is answered to the client as an upstream error, never followed (a 307
        // or 308 would send a paid request again, to wherever it points).
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| ServerError::Http(e.to_string()))?;
    let upstreams = config
        .upstreams
        .iter()
        .map(|(name, u)| {
            let up = proxy::Upstream {
                base_url: u.base_url.clone(),
                api_key: u.api_key.expose().to_string(),
                timeout: u.timeout,
                release_on_error: u.release_on_error,
            };
            (name.clone(), up)
        })
        .collect();
    let webhook = config
        .alerts
        .webhook_url
        .as_ref()
        .map(|u| u.expose().to_string());
    let alerts = alerts::Alerts::start(http.clone(), webhook);
    Ok(Arc::new(AppState {
        alerts,
        upstreams,
        config: Arc::new(config),
        store,
        keys,
        service_tokens,
        admin_tokens,
        metrics: metrics::Metrics::default(),
        http,
    }))
}

async fn limit_headers(req: Request, next: Next) -> Response {
    let total: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if total > HEADER_BYTES_MAX {
        return error::ApiError::new(
            axum::http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request",
            format!("request headers are over {HEADER_BYTES_MAX} bytes"),
        )
        .into_response();
    }
    next.run(req).await
}

/// Service and admin routes check their token before the body is read: a caller without
/// credentials holds no request slot while it sends one. (The handlers check again.)
async fn credentials_first(
    axum::extract::State(state): axum::extract::State<Shared>,
    req: Request,
    next: Next,
) -> Response {
    let checked = if req.uri().path().starts_with("/admin/") {
        api::require_admin(&state, req.headers())
    } else {
        api::require_service(&state, req.headers())
    };
    match checked {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
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
            .get::<error::ErrorCode>()
            .map_or("upstream", |c| c.0);
        state.metrics.error_answer(status.as_u16(), code);
    }
    res
}

/// Bytes of a plain-text error body kept as the message of its JSON form.
const PLAIN_ERROR_BYTES_MAX: usize = 1024;

/// Every error answer of the decision and admin API in OpenAI's shape: the framework's own
/// refusals (a path or query that does not parse, a method the route does not take) come as
/// plain text or empty, which OpenAI-style clients cannot read.
async fn json_errors(req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    let status = res.status();
    let json = res
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if json || !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let (parts, body) = res.into_parts();
    let text = axum::body::to_bytes(body, PLAIN_ERROR_BYTES_MAX)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let code = match status.as_u16() {
        401 => "unauthorized",
        404 => "not_found",
        413 => "payload_too_large",
        s if s >= 500 => "internal_error",
        _ => "invalid_request",
    };
    let mut r = error::ApiError::new(status, code, message).into_response();
    for name in [axum::http::header::ALLOW, axum::http::header::RETRY_AFTER] {
        if let Some(v) = parts.headers.get(&name) {
            r.headers_mut().insert(name, v.clone());
        }
    }
    r
}

async fn shed(err: tower::BoxError) -> Response {
    if err.is::<tower::timeout::error::Elapsed>() {
        error::ApiError::new(
            axum::http::StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            "request took too long",
        )
        .into_response()
    } else {
        overloaded()
    }
}

/// The answer to a request shed at `CONCURRENT_REQUESTS_MAX`: a global rate refusal (SPEC §6:
/// 429 with `Retry-After`; 503 is only for `store_unavailable` and `cutoff_engaged`). Nothing
/// was admitted; `x-should-retry: false` keeps OpenAI client libraries from adding their
/// automatic retries to a flood (the caller may still come back after `Retry-After`).
fn overloaded() -> Response {
    let mut res = error::ApiError {
        retry_after_s: Some(OVERLOAD_RETRY_AFTER_S),
        ..error::ApiError::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            "the gateway is at its bound of requests in flight; retry later",
        )
    }
    .with_scope(spendgate_core::ScopeKind::Global)
    .into_response();
    res.headers_mut().insert(
        "x-should-retry",
        axum::http::HeaderValue::from_static("false"),
    );
    res
}

pub fn router(state: Shared) -> Router {
    use tower::ServiceBuilder;
    let api_limit =
        api::API_BODY_BYTES_MAX.max(state.config.policy.run.max_input_bytes as usize * 2 + 4096);
    let credentialed = Router::new()
        .route("/v1/runs", post(api::create_run))
        .route("/v1/runs/{run_id}/steps", post(api::create_step))
        .route("/v1/runs/{run_id}/heartbeat", post(api::heartbeat))
        .route("/v1/runs/{run_id}/finish", post(api::finish))
        .route("/v1/steps/{step_id}/commit", post(api::commit_step))
        .route("/v1/steps/{step_id}/release", post(api::release_step))
        .route("/v1/steps/{step_id}/unknown", post(api::unknown_step))
        .route("/admin/v1/summary", get(admin::summary))
        .route("/admin/v1/scopes", get(admin::scopes))
        .route("/admin/v1/reservations", get(admin::reservations))
        .route("/admin/v1/cutoff", put(admin::cutoff))
        .route("/admin/v1/adjustments", post(admin::adjust))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            credentials_first,
        ));
    let decision = Router::new()
        .route("/v1/sessions", post(api::create_session))
        .route("/v1/usage", get(api::usage))
        .merge(credentialed)
        .layer(middleware::from_fn(json_errors))
        .layer(DefaultBodyLimit::max(api_limit))
        .layer(
            ServiceBuilder::new()
                .layer(axum::error_handling::HandleErrorLayer::new(shed))
                .timeout(API_REQUEST_TIMEOUT),
        );
    let proxy_routes = Router::new()
        .route("/v1/chat/completions", post(proxy::chat_completions))
        .layer(DefaultBodyLimit::max(proxy::PROXY_BODY_BYTES_MAX));
    Router::new()
        .merge(decision)
        .merge(proxy_routes)
        .route("/admin/", get(admin::dashboard))
        .route("/healthz", get(api::healthz))
        .route("/readyz", get(api::readyz))
        .route("/metrics", get(api::metrics))
        // (after every route: it applies to the routes registered so far)
        .method_not_allowed_fallback(api::method_not_allowed)
        .fallback(api::fallback)
        .layer(middleware::from_fn(limit_headers))
        // (one semaphore for the whole process: `Router::layer` builds the layer's service
        // once per route, and a plain concurrency limit would then bound each route apart)
        .layer(
            ServiceBuilder::new()
                .layer(axum::error_handling::HandleErrorLayer::new(shed))
                .load_shed()
                .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                    CONCURRENT_REQUESTS_MAX,
                )),
        )
        .layer(middleware::from_fn_with_state(state.clone(), count_errors))
        .with_state(state)
}

/// Serves until `shutdown` completes, then drains in-flight requests.
pub async fn serve(
    state: Shared,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let sweeper = spendgate_store::spawn_sweeper(state.store.clone(), SWEEP_EVERY);
    let checker = alerts::spawn_checker(
        state.store.clone(),
        state.alerts.clone(),
        state.config.alerts.thresholds_permille.clone(),
        state.config.alerts.scopes.clone(),
    );
    let longest_upstream = state
        .upstreams
        .values()
        .map(|u| u.timeout)
        .max()
        .unwrap_or_default();
    let app = router(state);
    let idle = listener::idle_time(longest_upstream);
    let listener = listener::Bounded::new(listener, listener::CONNECTIONS_MAX, idle);
    let result =
        listener::serve(listener, app, shutdown, listener::HEADER_READ_TIMEOUT, idle).await;
    sweeper.abort();
    checker.abort();
    result
}

// A store call fails closed (503 `store_unavailable`) before the request it serves times out.
const _: () = assert!((config::STORE_TIMEOUT_MS_MAX as u128) < API_REQUEST_TIMEOUT.as_millis());
// A slow body is answered 408 by the body read before the whole request times out (504).
const _: () = assert!(api::BODY_READ_TIMEOUT.as_millis() < API_REQUEST_TIMEOUT.as_millis());
