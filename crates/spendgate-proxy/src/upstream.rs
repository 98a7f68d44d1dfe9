//! Talking to the upstream: the headers passed each way, reading an answer in its bounds,
//! and the answers of a call that failed.

use crate::bounds::UPSTREAM_BODY_BYTES_MAX;
use crate::guard::StepGuard;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use spendgate_core::{Applied, Command, LedgerError, ReservationId, Resolution, Resolved, RunId};
use spendgate_http::AppState;
use spendgate_store::StoreError;
use spendgate_wire::error::{ApiError, ErrorCode};

/// Response headers passed through from the upstream, every value of a repeated one (`vary`,
/// `link`, `www-authenticate`). Not passed: hop-by-hop headers (those named in the upstream's
/// `Connection` too), length headers, cookies, and `spendgate-*`, which are ours alone (an
/// upstream's `spendgate-outcome` must not pass for spendgate's).
pub(crate) fn pass_headers(from: &reqwest::header::HeaderMap, to: &mut HeaderMap) {
    let named: Vec<String> = from
        .get_all(reqwest::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    for (k, v) in from {
        let name = k.as_str();
        if matches!(
            name,
            "connection"
                | "keep-alive"
                | "proxy-authenticate"
                | "proxy-authorization"
                | "proxy-connection"
                | "transfer-encoding"
                | "content-length"
                | "te"
                | "trailer"
                | "upgrade"
                | "set-cookie"
        ) || name.starts_with("spendgate-")
            || named.iter().any(|n| n == name)
        {
            continue;
        }
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(k.as_ref()),
            HeaderValue::from_bytes(v.as_bytes()),
        ) {
            to.append(n, v);
        }
    }
}

/// After a refusal or a store error before forwarding: nothing was sent upstream, so the
/// call's steps that may have been reserved are released, and a one-step run finished, in
/// one store call (best effort: what stays held expires and is charged in full).
pub(crate) async fn abandon(state: &AppState, steps: &[ReservationId], run: Option<&RunId>) {
    let mut cmds: Vec<Command> = steps
        .iter()
        .map(|step| Command::Resolve {
            step: step.clone(),
            how: Resolution::Release,
        })
        .collect();
    if let Some(run) = run {
        cmds.push(Command::Finish { run: run.clone() });
    }
    for answer in state.store.execute_many(cmds).await {
        match answer {
            Ok(_) | Err(StoreError::Ledger(LedgerError::NotFound(_), _)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "could not release an abandoned proxy step or finish its run")
            }
        }
    }
}

/// Request headers passed to the upstream besides the body and its key (the mock's controls).
pub(crate) const FORWARDED_HEADERS: &[&str] = &[
    "x-mock-fault",
    "x-mock-completion-tokens",
    "x-mock-extra-completion-tokens",
    "x-mock-reported-completion-tokens",
    "x-mock-latency-ms",
    "x-mock-linger-ms",
    "x-mock-cached-tokens",
    "x-mock-cache-write-tokens",
    "x-mock-running-usage",
    "x-mock-running-cached-tokens",
    "x-mock-tokens-per-second",
    "x-mock-stamp",
    "x-mock-tag",
    "x-mock-hosted-tool-calls",
    "x-mock-extra-hosted-tool-calls",
    "x-mock-reasoning-tokens",
];

/// Only spendgate's own step headers of an answer's headers.
pub(crate) fn extra_only(headers: HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (k, v) in &headers {
        if k.as_str().starts_with("spendgate-") {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

/// Resolves the step and answers an error about the upstream, in the OpenAI shape, with the
/// step's headers (`x-should-retry: false`: each retry would be another paid attempt).
pub(crate) async fn fail(
    guard: StepGuard,
    how: Resolution,
    mut headers: HeaderMap,
    code: ErrorCode,
    message: &str,
) -> Response {
    if let Some(a) = guard.resolve(how).await {
        note_resolution(&a, &mut headers);
    }
    // Only the step's own headers: an upstream's content type or length must not survive.
    headers.remove(header::CONTENT_TYPE);
    headers.remove(header::CONTENT_LENGTH);
    let mut r = ApiError::new(code, message).into_response();
    r.headers_mut().extend(headers);
    r
}

/// Hides the upstream's key should an error body echo it back.
pub(crate) fn redact(body: Bytes, key: &str) -> Bytes {
    if key.len() < 4 || body.len() < key.len() {
        return body;
    }
    let k = key.as_bytes();
    if !body.windows(k.len()).any(|w| w == k) {
        return body;
    }
    let text = String::from_utf8_lossy(&body).replace(key, "***");
    Bytes::from(text)
}

pub(crate) fn note_resolution(a: &Applied<Resolved>, headers: &mut HeaderMap) {
    if let Ok(v) = HeaderValue::from_str(&a.value.charged.0.to_string()) {
        headers.insert("spendgate-charged-micros", v);
    }
    headers.insert(
        "spendgate-outcome",
        HeaderValue::from_static(a.value.state.name()),
    );
}

/// Reads a whole body of at most [`UPSTREAM_BODY_BYTES_MAX`] by `deadline`; `None` when it
/// is cut off, too large or too slow.
pub(crate) async fn read_capped(
    resp: reqwest::Response,
    deadline: tokio::time::Instant,
    stop: impl std::future::Future<Output = ()>,
) -> Option<Bytes> {
    let mut s = resp.bytes_stream();
    let mut buf = Vec::new();
    tokio::pin!(stop);
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout_at(deadline, s.next()) => next,
            _ = &mut stop => return None,
        };
        match next {
            Ok(Some(Ok(chunk))) => {
                if buf.len() + chunk.len() > UPSTREAM_BODY_BYTES_MAX {
                    return None;
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(Some(Err(_))) | Err(_) => return None,
            Ok(None) => return Some(Bytes::from(buf)),
        }
    }
}
