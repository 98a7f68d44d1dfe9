//! Serving: the background tasks and the bounded listener.

use crate::state::Shared;
use axum::Router;
use spendgate_listener::{idle_time, Bounded, PeerBound, HEADER_READ_TIMEOUT};
use spendgate_telemetry::{alerts, drift};
use std::future::Future;
use std::time::Duration;

/// How often expired leases are swept.
pub const SWEEP_EVERY: Duration = Duration::from_millis(500);

/// Serves `app` (the [`router`](crate::router::router) with the proxy's routes) until
/// `shutdown` completes, then drains in-flight requests. Runs the lease sweeper, the alert
/// checker and the policy publisher meanwhile, and `server.metrics_listen`'s listener when
/// one is configured (bound here: an address that cannot be bound fails the start).
pub async fn serve(
    state: Shared,
    app: Router,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let metrics = match state.config.server.metrics_listen {
        Some(addr) => Some(spawn_metrics_listener(&state, addr)?),
        None => None,
    };
    let sweeper = spendgate_store::spawn_sweeper(state.store.clone(), SWEEP_EVERY);
    let checker = alerts::spawn_checker(
        state.store.clone(),
        state.alerts.clone(),
        state.config.alerts.thresholds_permille.clone(),
        state.config.alerts.scopes.clone(),
        state.burn.clone(),
    );

    let publisher = drift::spawn_publisher(
        state.store.clone(),
        state.alerts.clone(),
        state.replica.clone(),
    );
    let result = serve_bounded(&state, app, listener, shutdown).await;
    sweeper.abort();
    checker.abort();
    publisher.abort();
    if let Some(m) = metrics {
        m.abort();
    }
    result
}

/// Serves [`metrics_router`](crate::router::metrics_router) on `addr` until aborted.
fn spawn_metrics_listener(
    state: &Shared,
    addr: std::net::SocketAddr,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = spendgate_listener::bind(addr)?;
    tracing::info!(%addr, "metrics listening (no token)");
    let app = crate::router::metrics_router(state.clone());
    let state = state.clone();
    Ok(tokio::spawn(async move {
        let forever = std::future::pending::<()>();
        if let Err(e) = serve_bounded(&state, app, listener, forever).await {
            tracing::error!(error = %e, "the metrics listener stopped");
        }
    }))
}

/// Serves `app` on `listener` in the bounds of `state`'s config (connections at once and per
/// peer, header and idle times) until `shutdown` completes, with no background task.
pub async fn serve_bounded(
    state: &Shared,
    app: Router,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let longest_upstream = state
        .upstreams
        .values()
        .map(|u| u.timeout)
        .max()
        .unwrap_or_default();
    let peers = PeerBound::of(&state.config);
    let cap = state.config.server.capacity;
    let idle = idle_time(longest_upstream);
    let listener = Bounded::new(
        listener,
        cap.connections_max,
        cap.connections_reserved,
        idle,
        peers,
    );
    spendgate_listener::serve(listener, app, shutdown, HEADER_READ_TIMEOUT, idle).await
}
