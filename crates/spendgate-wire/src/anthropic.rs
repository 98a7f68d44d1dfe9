//! The error answer in Anthropic's shape, what every answer on `/v1/messages` leaves in (SPEC
//! §6: each route answers errors in its own provider's error shape):
//! `{"type": "error", "error": {"type", "message"}}`, with spendgate's `code`, `scope` and
//! `retry_after_s` beside them, so that Anthropic's client libraries raise spendgate's
//! refusals as their own errors.
//!
//! Every error of the HTTP edge is first an [`ApiError`](crate::error::ApiError) answer in
//! OpenAI's shape, marked with its [`ErrorCode`]; [`reshape`] turns such an answer into this
//! shape, its status and headers kept. The router applies it to every answer on the path
//! (`spendgate_http::router`), the capacity layer's and the fallbacks' included.

use crate::error::ErrorCode;
use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};

/// Largest error answer rewritten into Anthropic's shape (an `ApiError` answer is a few
/// hundred bytes; a challenge a few more).
pub const ERROR_BODY_BYTES_MAX: usize = 64 * 1024;

/// Anthropic's error `type` for an answer's status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, with
/// spendgate's `code`, `scope` and `retry_after_s` beside them (the last two, and
/// `ledger_seq`, taken from `openai`, the same error in OpenAI's shape, when there is one).
pub fn error_body(status: StatusCode, code: &str, message: &str, openai: &Value) -> Value {
    let e = &openai["error"];
    let mut body = json!({
        "type": "error",
        "error": {
            "type": error_type(status),
            "message": message,
            "code": code,
            "scope": e.get("scope").cloned().unwrap_or(Value::Null),
            "retry_after_s": e.get("retry_after_s").cloned().unwrap_or(Value::Null),
        },
    });
    if let Some(seq) = openai.get("ledger_seq") {
        body["ledger_seq"] = seq.clone();
    }
    body
}

/// `resp` in Anthropic's shape when it is spendgate's own error answer (one that carries its
/// [`ErrorCode`]: refusals, bad requests, capacity, unknown routes, upstream failures), with
/// its status and headers (`retry-after`, `x-should-retry`, `connection`); any other answer
/// (a success, an upstream's own error answer) as it came.
pub async fn reshape(resp: Response) -> Response {
    let Some(code) = resp.extensions().get::<ErrorCode>().copied() else {
        return resp;
    };
    let (mut parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, ERROR_BODY_BYTES_MAX)
        .await
        .unwrap_or_default();
    let openai: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let message = openai["error"]["message"]
        .as_str()
        .unwrap_or("the request failed")
        .to_string();
    let code_text = openai["error"]["code"]
        .as_str()
        .unwrap_or(code.as_str())
        .to_string();
    let body = error_body(parts.status, &code_text, &message, &openai);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ApiError;
    use axum::response::IntoResponse;

    #[test]
    fn errors_take_anthropics_types() {
        assert_eq!(
            error_type(StatusCode::TOO_MANY_REQUESTS),
            "rate_limit_error"
        );
        assert_eq!(
            error_type(StatusCode::UNSUPPORTED_MEDIA_TYPE),
            "invalid_request_error"
        );
        assert_eq!(error_type(StatusCode::SERVICE_UNAVAILABLE), "api_error");
        let b = error_body(
            StatusCode::BAD_REQUEST,
            "context_too_large",
            "m",
            &Value::Null,
        );
        assert_eq!(b["type"], "error");
        assert_eq!(b["error"]["code"], "context_too_large");
    }

    /// An `ApiError` answer keeps its status, headers, code and fields; another answer is
    /// left alone.
    #[test]
    fn reshape_keeps_status_headers_and_fields() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let e = ApiError {
                retry_after_s: Some(3),
                ..ApiError::new(ErrorCode::RateLimited, "slow down")
            }
            .with_scope(spendgate_core::ScopeKind::Ip);
            // (as the capacity layer sets it: a header set after the error was rendered)
            let mut resp = e.into_response();
            resp.headers_mut()
                .insert("x-should-retry", HeaderValue::from_static("false"));
            let r = reshape(resp).await;
            assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(
                r.extensions().get::<ErrorCode>(),
                Some(&ErrorCode::RateLimited)
            );
            assert_eq!(r.headers()["retry-after"], "3");
            assert_eq!(r.headers()["x-should-retry"], "false");
            let bytes = axum::body::to_bytes(r.into_body(), ERROR_BODY_BYTES_MAX)
                .await
                .expect("body");
            let v: Value = serde_json::from_slice(&bytes).expect("json");
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["type"], "rate_limit_error");
            assert_eq!(v["error"]["code"], "rate_limited");
            assert_eq!(v["error"]["message"], "slow down");
            assert_eq!(v["error"]["scope"], "ip");
            assert_eq!(v["error"]["retry_after_s"], 3);
            let ok = reshape((StatusCode::BAD_REQUEST, "upstream's own").into_response()).await;
            let bytes = axum::body::to_bytes(ok.into_body(), ERROR_BODY_BYTES_MAX)
                .await
                .expect("body");
            assert_eq!(&bytes[..], b"upstream's own");
        });
    }
}
