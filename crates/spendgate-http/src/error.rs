//! The one error type of the HTTP edge, rendered in OpenAI's error shape so that OpenAI client
//! libraries surface refusals as their own errors:
//! `{"error": {"type", "code", "message", "scope", "retry_after_s"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use spendgate_core::{LedgerError, Refusal, RefusalCode, ScopeKind};
use spendgate_store::StoreError;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub scope: Option<ScopeKind>,
    pub retry_after_s: Option<u64>,
    /// A challenge to solve (`challenge_required`).
    pub challenge: Option<serde_json::Value>,
    /// The refusal changed the ledger (a remembered refusal, a used-up challenge, an expiry
    /// swept on the way): its `ledger_seq`, in the body and the `spendgate-ledger-seq` header.
    pub ledger_seq: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            scope: None,
            retry_after_s: None,
            challenge: None,
            ledger_seq: None,
        }
    }
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    pub fn model_not_allowed(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "model_not_allowed", message)
    }
    pub fn payload_too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }
    pub fn store_unavailable() -> ApiError {
        ApiError {
            retry_after_s: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                "the spending ledger cannot be reached; nothing new is admitted",
            )
        }
    }
    pub fn with_ledger_seq(mut self, seq: u64) -> ApiError {
        self.ledger_seq = Some(seq);
        self
    }
    pub fn with_scope(mut self, scope: ScopeKind) -> ApiError {
        self.scope = Some(scope);
        self
    }

    /// The OpenAI error `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 409 | 413 | 431 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            // OpenAI's own type for a spent quota: client libraries do not retry it.
            429 if self.code == "budget_exhausted" => "insufficient_quota",
            // Rate, concurrency and a budget held by calls in flight (`budget_held`): waits.
            429 => "rate_limit_error",
            // Any other refusal of the request as sent (405, 408, 415, 422, ...).
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }
}

impl From<&Refusal> for ApiError {
    fn from(r: &Refusal) -> ApiError {
        let status = match r.code {
            RefusalCode::RateLimited
            | RefusalCode::ConcurrencyLimited
            | RefusalCode::BudgetExhausted
            | RefusalCode::BudgetHeld => StatusCode::TOO_MANY_REQUESTS,
            RefusalCode::RunBoundExceeded | RefusalCode::ContextTooLarge => StatusCode::BAD_REQUEST,
            RefusalCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            RefusalCode::CutoffEngaged => StatusCode::SERVICE_UNAVAILABLE,
        };
        let retry = match status {
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                Some(r.retry_after_s.unwrap_or(1).max(1))
            }
            _ => None,
        };
        ApiError {
            status,
            code: crate::plant::code(r.code.name()),
            message: r.message.clone(),
            scope: r.scope,
            retry_after_s: retry,
            challenge: None,
            ledger_seq: None,
        }
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> ApiError {
        ApiError::from(&r)
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        match e {
            StoreError::Ledger(l, seq) => {
                let mut e = ApiError::from(l);
                e.ledger_seq = seq;
                e
            }
            other => {
                tracing::warn!(error = %other, "store call failed; refusing");
                ApiError::store_unavailable()
            }
        }
    }
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> ApiError {
        match e {
            LedgerError::NotFound(what) => ApiError::not_found(format!("{what} not found")),
            LedgerError::Closed { state, charged } => ApiError::new(
                StatusCode::CONFLICT,
                "reservation_closed",
                format!(
                    "reservation is already {} and was charged {charged}",
                    state.name()
                ),
            ),
            LedgerError::RunClosed(state) => ApiError::new(
                StatusCode::CONFLICT,
                "run_closed",
                format!("run is already {}", format!("{state:?}").to_lowercase()),
            ),
            LedgerError::IdempotencyConflict => ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_conflict",
                "this Idempotency-Key was used with a different request",
            ),
            LedgerError::Invalid(m) => ApiError::invalid(m),
            LedgerError::Full(_) => ApiError::store_unavailable(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({
            "error": {
                "type": self.kind(),
                "code": self.code,
                "message": self.message,
                "param": null,
                "scope": self.scope.map(|s| s.name()),
                "retry_after_s": self.retry_after_s,
            }
        });
        if let Some(c) = self.challenge {
            body["error"]["challenge"] = c.clone();
            body["challenge"] = c;
        }
        if let Some(seq) = self.ledger_seq {
            body["ledger_seq"] = json!(seq);
        }
        let mut resp = (self.status, axum::Json(body)).into_response();
        resp.extensions_mut().insert(ErrorCode(self.code));
        let h = resp.headers_mut();
        if let Some(seq) = self.ledger_seq {
            h.insert("spendgate-ledger-seq", HeaderValue::from(seq));
        }
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                h.insert(header::RETRY_AFTER, v);
            }
        }
        // A spent budget does not come back by retrying: tell OpenAI clients not to hammer it.
        // Everything else that is not a wait (a rate or concurrency limit, a budget held by
        // calls in flight, an outage) is not worth retrying either.
        let retry = matches!(
            self.code,
            "rate_limited" | "concurrency_limited" | "budget_held" | "store_unavailable"
        );
        h.insert(
            "x-should-retry",
            HeaderValue::from_static(if retry { "true" } else { "false" }),
        );
        resp
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// The code of an error answer, kept on the response for the metrics layer.
#[derive(Clone, Copy, Debug)]
pub struct ErrorCode(pub &'static str);

/// A failure to start: the store, the config, the HTTP client.

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("config: {0}")]
    Config(String),
    #[error("http client: {0}")]
    Http(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_client_error_is_an_invalid_request_type() {
        for (status, want) in [
            (StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error"),
            (StatusCode::REQUEST_TIMEOUT, "invalid_request_error"),
            (StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_request_error"),
            (StatusCode::UNAUTHORIZED, "authentication_error"),
            (StatusCode::GATEWAY_TIMEOUT, "server_error"),
            (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
        ] {
            assert_eq!(ApiError::new(status, "x", "m").kind(), want, "{status}");
        }
    }

    #[test]
    fn limits_and_outage_invite_a_retry_and_budgets_do_not() {
        let retry = |e: ApiError| {
            let r = e.into_response();
            r.headers()
                .get("x-should-retry")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let limited = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", "m");
        assert_eq!(retry(limited).as_deref(), Some("true"));
        assert_eq!(
            retry(ApiError::store_unavailable()).as_deref(),
            Some("true")
        );
        let spent = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "budget_exhausted", "m");
        assert_eq!(retry(spent).as_deref(), Some("false"));
    }

    /// A budget refused only by the holds of calls in flight is a wait: 429, a rate-limit
    /// type (OpenAI clients retry it), `x-should-retry: true` and its short `Retry-After`; a
    /// spent budget stays `insufficient_quota`, not retried, until its window's reset.
    #[test]
    fn a_held_budget_invites_a_retry_and_a_spent_one_does_not() {
        let refusal = |code, retry_after_s| Refusal {
            code,
            scope: Some(ScopeKind::Global),
            retry_after_s: Some(retry_after_s),
            message: "m".into(),
        };
        let answer = |r: Refusal| {
            let e = ApiError::from(&r);
            let kind = e.kind();
            let resp = e.into_response();
            let h = |n: &str| {
                resp.headers()
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            (
                resp.status().as_u16(),
                kind,
                h("x-should-retry"),
                h("retry-after"),
            )
        };
        assert_eq!(
            answer(refusal(
                RefusalCode::BudgetHeld,
                spendgate_core::HELD_RETRY_AFTER_S
            )),
            (
                429,
                "rate_limit_error",
                Some("true".into()),
                Some("1".into())
            )
        );
        assert_eq!(
            answer(refusal(RefusalCode::BudgetExhausted, 43_200)),
            (
                429,
                "insufficient_quota",
                Some("false".into()),
                Some("43200".into())
            )
        );
    }

    /// A refusal from a call that changed the ledger first (it expired a lapsed run) carries
    /// that change's `ledger_seq`; one that changed nothing carries none.
    #[test]
    fn a_refusal_after_a_change_carries_its_ledger_seq() {
        let closed = || LedgerError::Closed {
            state: spendgate_core::ReservationState::Expired,
            charged: spendgate_core::Micros(1_000),
        };
        let e = ApiError::from(StoreError::Ledger(closed(), Some(42)));
        assert_eq!(
            (e.status, e.code),
            (StatusCode::CONFLICT, "reservation_closed")
        );
        let r = e.into_response();
        assert_eq!(
            r.headers()
                .get("spendgate-ledger-seq")
                .and_then(|v| v.to_str().ok()),
            Some("42")
        );
        let e = ApiError::from(StoreError::Ledger(closed(), None));
        assert_eq!(e.ledger_seq, None);
        let r = e.into_response();
        assert!(r.headers().get("spendgate-ledger-seq").is_none());
    }
}
