//! The decision API's answers: a grant, a refusal, the ledger's sequence number.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};
use spendgate_core::Refusal;
use spendgate_telemetry::Metrics;
use spendgate_wire::error::ApiError;

/// A 200 answer that changed (or read) the ledger at `seq`: the body carries `ledger_seq`, and
/// so does a header.
pub fn ledger_answer(body: impl Serialize, seq: u64) -> Response {
    let mut body = to_json(body);
    body["ledger_seq"] = json!(seq);
    let mut resp = (StatusCode::OK, Json(body)).into_response();
    seq_header(&mut resp, seq);
    resp
}

/// A typed answer as JSON (an answer struct always serializes; an empty object otherwise).
fn to_json(body: impl Serialize) -> Value {
    serde_json::to_value(body).unwrap_or_else(|_| json!({}))
}

pub fn seq_header(resp: &mut Response, seq: u64) {
    if let Ok(v) = HeaderValue::from_str(&seq.to_string()) {
        resp.headers_mut().insert("spendgate-ledger-seq", v);
    }
}

/// Maps an admission outcome to a response: a grant with `status`, or the refusal.
/// `replayed`: the answer repeats an earlier one (same `Idempotency-Key`), which was counted
/// then: not counted again.
pub fn grant(
    metrics: &Metrics,
    what: &'static str,
    out: Result<impl Serialize, Refusal>,
    status: StatusCode,
    (seq, replayed): (u64, bool),
) -> Response {
    match out {
        Ok(body) => {
            let mut body = to_json(body);
            if !replayed {
                metrics.admitted(what);
            }
            body["ledger_seq"] = json!(seq);
            let mut resp = (status, Json(body)).into_response();
            seq_header(&mut resp, seq);
            resp
        }
        Err(r) => {
            if !replayed {
                metrics.refused(what, r.code.name(), r.scope);
            }
            ApiError::from(&r).with_ledger_seq(seq).into_response()
        }
    }
}
