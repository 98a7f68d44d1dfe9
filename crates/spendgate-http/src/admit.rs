//! The capacity layer: every request classed and admitted to its class's and its address's
//! bounds (see [`crate::capacity`]) before its body is read.

use crate::capacity::{refusal, Class, Full, RateBody};
use crate::state::{AppState, Shared};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use spendgate_listener::holding::Holding;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The class of a request, from its path and whether it carries a valid token: two digests
/// per configured token at most, no body read, no store call. On `/v1/messages` the service
/// token may come as `x-api-key`, as Anthropic's clients send their key.
pub fn classify(state: &AppState, path: &str, headers: &axum::http::HeaderMap) -> Class {
    if matches!(path, "/healthz" | "/readyz" | "/metrics" | "/openapi.json") {
        return Class::Health;
    }
    let api_key = || {
        (path == crate::router::MESSAGES_PATH)
            .then(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .flatten()
            .map(str::trim)
    };
    let Some(token) = crate::auth::bearer(headers).or_else(api_key) else {
        return Class::Public;
    };
    if path.starts_with("/admin/") {
        if crate::identity::token_matches(token, &state.admin_tokens) {
            return Class::Admin;
        }
    } else if crate::identity::token_matches(token, &state.service_tokens) {
        return Class::Service;
    }
    Class::Public
}

/// The middleware: classify, take the slots or refuse, bound the body's rate, and keep the
/// slots until the answer has been sent.
pub async fn admit(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let class = if spendgate_wire::plant::on(spendgate_wire::plant::Plant::SharedCapacity) {
        Class::Public
    } else {
        classify(&state, req.uri().path(), req.headers())
    };
    if class == Class::Public
        && req
            .extensions()
            .get::<spendgate_listener::Reserved>()
            .is_some()
    {
        return refusal(Full::Connections);
    }
    let prefixes = if class.per_address()
        && !spendgate_wire::plant::on(spendgate_wire::plant::Plant::SharedCapacity)
    {
        address_prefixes(&state, &req)
    } else {
        Vec::new()
    };
    let held = match state.capacity.hold(class, &prefixes) {
        Ok(held) => held,
        Err(full) => {
            tracing::debug!(class = class.name(), ?full, "refused for capacity");
            return refusal(full);
        }
    };
    let cap = &state.capacity;
    let tripped = Arc::new(AtomicBool::new(false));
    let req = req.map(|body| {
        axum::body::Body::new(RateBody::new(
            body,
            cap.body_min_bytes_per_s,
            cap.body_grace,
            tripped.clone(),
        ))
    });
    let mut res = next.run(req).await;
    if tripped.load(Ordering::Relaxed) {
        // The rest of the body is not read: the connection cannot carry another request.
        res.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    res.map(|body| axum::body::Body::new(Holding::new(body, held)))
}

/// The client's address prefixes with their factors (none when the connection's address is
/// unknown, as in a router driven without a listener).
fn address_prefixes(state: &AppState, req: &Request) -> Vec<(String, u64)> {
    let Some(ConnectInfo(peer)) = req.extensions().get::<ConnectInfo<SocketAddr>>() else {
        return Vec::new();
    };
    let ip = crate::client::client_ip_of(state, *peer, req.headers());
    crate::client::ip_scopes(state, ip)
        .into_iter()
        .map(|s| (s.prefix, s.factor))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Bodies
