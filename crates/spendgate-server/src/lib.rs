//! spendgate-server: the HTTP shell around the core. It parses, calls the core through a
//! store, and maps answers and errors; it holds no limit of its own (SPEC I4).

pub mod admin;
pub mod alerts;
pub mod api;
pub mod capacity;
pub mod challenge;
pub mod drift;
pub mod error;
pub mod identity;
pub mod listener;
pub mod metrics;
pub mod ops;
pub mod plant;
pub mod proxy;

pub use spendgate_config as config;
pub use spendgate_tokens as tokens;

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
/// Total bytes of request headers accepted (names and values).
pub const HEADER_BYTES_MAX: usize = 16 * 1024;
/// Time a decision-API request may take end to end: longer than the longest body grace
/// (`config::BODY_GRACE_MS_MAX`), so that a stalled body is answered 408 by its rate, not 504
/// by this timeout.
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

/// Opens the configured store, wrapped in its bounds ([`Timed`]): `store.timeout_ms`, and
/// `store.slow_grace_ms` more for a slow call while the store is not known to be failing.
pub async fn open_store(config: &Config) -> Result<Arc<dyn Store>, ServerError> {
    Ok(open_store_with_witness(config).await?.store)
}

/// An opened store and, for a Redis store with `store.witness_path`, its witness, to flush at
/// a clean shutdown ([`spendgate_redis::Witness::flush`]).
pub struct OpenedStore {
    pub store: Arc<dyn Store>,
    pub witness: Option<spendgate_redis::Witness>,
}

/// [`open_store`], keeping the Redis store's witness.
pub async fn open_store_with_witness(config: &Config) -> Result<OpenedStore, ServerError> {
    let policy = config.policy.clone();
    let (inner, witness): (Arc<dyn Store>, _) = match config.store.kind {
        StoreKind::Memory => (
            Arc::new(MemoryStore::new(policy, Arc::new(SystemClock))),
            None,
        ),
        StoreKind::Sqlite => {
            let opts = SqliteOptions::new(config.store.path.clone());
            (
                Arc::new(SqliteStore::open(opts, policy, Arc::new(SystemClock))?),
                None,
            )
        }
        StoreKind::Redis => {
            let store = open_redis(config, policy).await?;
            let witness = store.witness();
            (store, witness)
        }
    };
    Ok(OpenedStore {
        store: Arc::new(Timed::with_grace(
            inner,
            config.store.timeout,
            config.store.slow_grace,
        )),
        witness,
    })
}

/// The Redis options of a replica's config.
pub fn redis_options(config: &Config) -> spendgate_redis::RedisOptions {
    spendgate_redis::RedisOptions {
        url: config.store.url.expose().to_string(),
        prefix: config.store.prefix.clone(),
        timeout: config.store.timeout,
        slow_grace: config.store.slow_grace,
        clock: spendgate_redis::ClockSource::Server,
        ledger_id: config.store.ledger_id.clone(),
        witness: config.store.witness_path.clone(),
    }
}

/// Shortest timeout of an operator's `spendgate store` command: `store.timeout_ms` bounds the
/// gateway's calls on the request path (fail closed), but a command run once by hand (a TLS
/// handshake, a script load) may take longer and must not fail for it.
pub const STORE_COMMAND_TIMEOUT_MIN: std::time::Duration = std::time::Duration::from_secs(5);

/// [`redis_options`] for an operator's `spendgate store` command (which writes no witness:
/// replicas keep theirs, and adopt what the command wrote in Redis).
pub fn redis_command_options(config: &Config) -> spendgate_redis::RedisOptions {
    let mut o = redis_options(config);
    o.timeout = o.timeout.max(STORE_COMMAND_TIMEOUT_MIN);
    o.witness = None;
    o
}

async fn open_redis(
    config: &Config,
    policy: spendgate_core::Policy,
) -> Result<Arc<spendgate_redis::RedisStore>, ServerError> {
    if config.store.ledger_id.is_none() {
        return Err(ServerError::Config(
            "store.ledger_id is not set: a redis store serves only the ledger it is pinned to. \
             Run `spendgate store init --config FILE` once (it creates the ledger, or names \
             the one the prefix holds) and pin the id it prints: [store] ledger_id = \"lg-...\""
                .into(),
        ));
    }
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
    let capacity = capacity::Capacity::new(&config.server.capacity);
    let replica = drift::Replica::of(&config);
    Ok(Arc::new(AppState {
        replica,
        alerts,
        upstreams,
        config: Arc::new(config),
        store,
        keys,
        service_tokens,
        admin_tokens,
        metrics: metrics::Metrics::default(),
        http,
        capacity,
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
        // (the timeout's inner service cannot fail)
        tracing::error!(error = %err, "request failed in the middleware");
        error::ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "the request failed",
        )
        .into_response()
    }
}

/// When a JSON route requires `Content-Type: application/json` (SPEC §6: 415 otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum JsonRule {
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
async fn require_json(
    axum::extract::State(rule): axum::extract::State<JsonRule>,
    req: Request,
    next: Next,
) -> Response {
    let needed = rule == JsonRule::Always || announces_body(req.headers());
    if needed && !is_json(req.headers()) {
        return error::ApiError::new(
            axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request",
            "this route takes JSON: send Content-Type: application/json",
        )
        .into_response();
    }
    next.run(req).await
}

pub fn router(state: Shared) -> Router {
    router_with(state, Router::new())
}

/// The gateway's routes and `extra` ones (the demo's pages), all behind the same layers:
/// capacity per class of caller and address, header bounds, error counting.
pub fn router_with(state: Shared, extra: Router<Shared>) -> Router {
    use tower::ServiceBuilder;
    let api_limit =
        api::API_BODY_BYTES_MAX.max(state.config.policy.run.max_input_bytes as usize * 2 + 4096);
    let json = |rule: JsonRule| middleware::from_fn_with_state(rule, require_json);
    let with_body = || json(JsonRule::WithBody);
    let credentialed = Router::new()
        .route("/v1/runs", post(api::create_run).route_layer(with_body()))
        .route(
            "/v1/runs/{run_id}/steps",
            post(api::create_step).route_layer(with_body()),
        )
        .route(
            "/v1/runs/{run_id}/heartbeat",
            post(api::heartbeat).route_layer(with_body()),
        )
        .route(
            "/v1/runs/{run_id}/finish",
            post(api::finish).route_layer(with_body()),
        )
        .route(
            "/v1/steps/{step_id}/commit",
            post(api::commit_step).route_layer(with_body()),
        )
        .route(
            "/v1/steps/{step_id}/release",
            post(api::release_step).route_layer(with_body()),
        )
        .route(
            "/v1/steps/{step_id}/unknown",
            post(api::unknown_step).route_layer(with_body()),
        )
        .route("/admin/v1/summary", get(admin::summary))
        .route("/admin/v1/scopes", get(admin::scopes))
        .route("/admin/v1/reservations", get(admin::reservations))
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
            credentials_first,
        ));
    let decision = Router::new()
        .route(
            "/v1/sessions",
            post(api::create_session).route_layer(json(JsonRule::Always)),
        )
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
        .route(
            "/v1/chat/completions",
            post(proxy::chat_completions).route_layer(json(JsonRule::Always)),
        )
        .layer(DefaultBodyLimit::max(proxy::PROXY_BODY_BYTES_MAX));
    Router::new()
        .merge(decision)
        .merge(proxy_routes)
        .merge(extra)
        .route("/admin/", get(admin::dashboard))
        .route("/healthz", get(api::healthz))
        .route("/readyz", get(api::readyz))
        .route("/metrics", get(api::metrics))
        // (after every route: it applies to the routes registered so far)
        .method_not_allowed_fallback(api::method_not_allowed)
        .fallback(api::fallback)
        .layer(middleware::from_fn(limit_headers))
        // Classifies every request and holds its class's and its address's slots until the
        // answer is sent (one set of bounds for the whole process: the bounds live in the
        // shared state, not in a layer that `Router::layer` would build once per route).
        .layer(middleware::from_fn_with_state(
            state.clone(),
            capacity::admit,
        ))
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
    let publisher = drift::spawn_publisher(
        state.store.clone(),
        state.alerts.clone(),
        state.replica.clone(),
    );
    let longest_upstream = state
        .upstreams
        .values()
        .map(|u| u.timeout)
        .max()
        .unwrap_or_default();
    let peers = listener::PeerBound::of(&state.config);
    let cap = state.config.server.capacity;
    let app = router(state);
    let idle = listener::idle_time(longest_upstream);
    let listener = listener::Bounded::new(
        listener,
        cap.connections_max,
        cap.connections_reserved,
        idle,
        peers,
    );
    let result =
        listener::serve(listener, app, shutdown, listener::HEADER_READ_TIMEOUT, idle).await;
    sweeper.abort();
    checker.abort();
    publisher.abort();
    result
}

// A store call fails closed (503 `store_unavailable`) before the request it serves times out,
// its grace included.
const _: () = assert!(
    ((config::STORE_TIMEOUT_MS_MAX + config::SLOW_GRACE_MS_MAX) as u128)
        < API_REQUEST_TIMEOUT.as_millis()
);
// A stalled body is answered 408 by its rate, after its grace, before the whole request times
// out (504).
const _: () = assert!((config::BODY_GRACE_MS_MAX as u128) < API_REQUEST_TIMEOUT.as_millis());
