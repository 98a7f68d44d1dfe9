//! The one error answer of the HTTP edge (the API's, the proxy's and the listener's refusals),
//! rendered in OpenAI's error shape so that OpenAI client libraries surface refusals as their
//! own errors: `{"error": {"type", "code", "message", "scope", "retry_after_s"}}`.
//!
//! [`ErrorCode`] is the one list of the codes the server answers with (docs/errors.md lists
//! the same, a test holds them equal): each with its HTTP status and OpenAI error `type`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;
use spendgate_core::{LedgerError, Refusal, RefusalCode, ScopeKind};
use spendgate_store::StoreError;

/// Every error code the server emits. The wire string is the serde name (snake case), the
/// same as [`ErrorCode::as_str`] (a test holds them equal); never the `Debug` text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    RateLimited,
    ConcurrencyLimited,
    BudgetExhausted,
    BudgetHeld,
    RunBoundExceeded,
    PayloadTooLarge,
    ContextTooLarge,
    ModelNotAllowed,
    CutoffEngaged,
    StoreUnavailable,
    InvalidRequest,
    IdempotencyConflict,
    Unauthorized,
    ChallengeRequired,
    ReservationClosed,
    RunClosed,
    NotFound,
    RequestTimeout,
    Timeout,
    InternalError,
    RunDeadlineExceeded,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
}

impl ErrorCode {
    /// Every code, in docs/errors.md's order.
    pub const ALL: [ErrorCode; 24] = [
        ErrorCode::RateLimited,
        ErrorCode::ConcurrencyLimited,
        ErrorCode::BudgetExhausted,
        ErrorCode::BudgetHeld,
        ErrorCode::RunBoundExceeded,
        ErrorCode::PayloadTooLarge,
        ErrorCode::ContextTooLarge,
        ErrorCode::ModelNotAllowed,
        ErrorCode::CutoffEngaged,
        ErrorCode::StoreUnavailable,
        ErrorCode::InvalidRequest,
        ErrorCode::IdempotencyConflict,
        ErrorCode::Unauthorized,
        ErrorCode::ChallengeRequired,
        ErrorCode::ReservationClosed,
        ErrorCode::RunClosed,
        ErrorCode::NotFound,
        ErrorCode::RequestTimeout,
        ErrorCode::Timeout,
        ErrorCode::InternalError,
        ErrorCode::RunDeadlineExceeded,
        ErrorCode::UpstreamError,
        ErrorCode::UpstreamTimeout,
        ErrorCode::UpstreamUnreachable,
    ];

    /// The wire string (`"code"` in the error body, the metrics label).
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::ConcurrencyLimited => "concurrency_limited",
            ErrorCode::BudgetExhausted => "budget_exhausted",
            ErrorCode::BudgetHeld => "budget_held",
            ErrorCode::RunBoundExceeded => "run_bound_exceeded",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::ContextTooLarge => "context_too_large",
            ErrorCode::ModelNotAllowed => "model_not_allowed",
            ErrorCode::CutoffEngaged => "cutoff_engaged",
            ErrorCode::StoreUnavailable => "store_unavailable",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::IdempotencyConflict => "idempotency_conflict",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::ChallengeRequired => "challenge_required",
            ErrorCode::ReservationClosed => "reservation_closed",
            ErrorCode::RunClosed => "run_closed",
            ErrorCode::NotFound => "not_found",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::Timeout => "timeout",
            ErrorCode::InternalError => "internal_error",
            ErrorCode::RunDeadlineExceeded => "run_deadline_exceeded",
            ErrorCode::UpstreamError => "upstream_error",
            ErrorCode::UpstreamTimeout => "upstream_timeout",
            ErrorCode::UpstreamUnreachable => "upstream_unreachable",
        }
    }

    /// The HTTP status of an answer with this code. `invalid_request` also answers the
    /// protocol's own refusals (405, 414, 415, 431: [`ApiError::with_status`]).
    pub const fn status(self) -> StatusCode {
        match self {
            ErrorCode::RateLimited
            | ErrorCode::ConcurrencyLimited
            | ErrorCode::BudgetExhausted
            | ErrorCode::BudgetHeld => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::RunBoundExceeded
            | ErrorCode::ContextTooLarge
            | ErrorCode::ModelNotAllowed
            | ErrorCode::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::CutoffEngaged | ErrorCode::StoreUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ErrorCode::IdempotencyConflict
            | ErrorCode::ReservationClosed
            | ErrorCode::RunClosed => StatusCode::CONFLICT,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::ChallengeRequired => StatusCode::FORBIDDEN,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorCode::Timeout | ErrorCode::RunDeadlineExceeded | ErrorCode::UpstreamTimeout => {
                StatusCode::GATEWAY_TIMEOUT
            }
            ErrorCode::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::UpstreamError | ErrorCode::UpstreamUnreachable => StatusCode::BAD_GATEWAY,
        }
    }

    /// The OpenAI error `type` of this code.
    pub const fn kind(self) -> &'static str {
        match self {
            ErrorCode::Unauthorized => "authentication_error",
            ErrorCode::ChallengeRequired => "permission_error",
            ErrorCode::NotFound => "not_found_error",
            // OpenAI's own type for a spent quota: client libraries do not retry it.
            ErrorCode::BudgetExhausted => "insufficient_quota",
            // Rate, concurrency and a budget held by calls in flight: waits.
            ErrorCode::RateLimited | ErrorCode::ConcurrencyLimited | ErrorCode::BudgetHeld => {
                "rate_limit_error"
            }
            ErrorCode::RunBoundExceeded
            | ErrorCode::PayloadTooLarge
            | ErrorCode::ContextTooLarge
            | ErrorCode::ModelNotAllowed
            | ErrorCode::InvalidRequest
            | ErrorCode::IdempotencyConflict
            | ErrorCode::ReservationClosed
            | ErrorCode::RunClosed
            | ErrorCode::RequestTimeout => "invalid_request_error",
            ErrorCode::CutoffEngaged
            | ErrorCode::StoreUnavailable
            | ErrorCode::Timeout
            | ErrorCode::InternalError
            | ErrorCode::RunDeadlineExceeded
            | ErrorCode::UpstreamError
            | ErrorCode::UpstreamTimeout
            | ErrorCode::UpstreamUnreachable => "server_error",
        }
    }

    /// Whether the answer invites a retry (`x-should-retry`): a wait (a rate or concurrency
    /// limit, a budget held by calls in flight, an outage), not a spent budget.
    pub const fn retry(self) -> bool {
        matches!(
            self,
            ErrorCode::RateLimited
                | ErrorCode::ConcurrencyLimited
                | ErrorCode::BudgetHeld
                | ErrorCode::StoreUnavailable
        )
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<RefusalCode> for ErrorCode {
    fn from(c: RefusalCode) -> ErrorCode {
        match c {
            RefusalCode::RateLimited => ErrorCode::RateLimited,
            RefusalCode::ConcurrencyLimited => ErrorCode::ConcurrencyLimited,
            RefusalCode::BudgetExhausted => ErrorCode::BudgetExhausted,
            RefusalCode::BudgetHeld => ErrorCode::BudgetHeld,
            RefusalCode::RunBoundExceeded => ErrorCode::RunBoundExceeded,
            RefusalCode::ContextTooLarge => ErrorCode::ContextTooLarge,
            RefusalCode::PayloadTooLarge => ErrorCode::PayloadTooLarge,
            RefusalCode::CutoffEngaged => ErrorCode::CutoffEngaged,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
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
    /// An answer with `code`, at the code's own status.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status: code.status(),
            code,
            message: message.into(),
            scope: None,
            retry_after_s: None,
            challenge: None,
            ledger_seq: None,
        }
    }
    /// The same answer at another status: `invalid_request` for the protocol's refusals
    /// (405, 414, 415, 431).
    pub fn with_status(mut self, status: StatusCode) -> ApiError {
        self.status = status;
        self
    }
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidRequest, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::Unauthorized, message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::NotFound, message)
    }
    pub fn model_not_allowed(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::ModelNotAllowed, message)
    }
    pub fn payload_too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::PayloadTooLarge, message)
    }
    pub fn store_unavailable() -> ApiError {
        ApiError {
            retry_after_s: Some(1),
            ..ApiError::new(
                ErrorCode::StoreUnavailable,
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

    /// The OpenAI error `type` of this answer.
    fn kind(&self) -> &'static str {
        self.code.kind()
    }
}

impl From<&Refusal> for ApiError {
    fn from(r: &Refusal) -> ApiError {
        let code = ErrorCode::from(r.code);
        let status = code.status();
        let retry = match status {
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                Some(r.retry_after_s.unwrap_or(1).max(1))
            }
            _ => None,
        };
        ApiError {
            status,
            code,
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
                ErrorCode::ReservationClosed,
                format!(
                    "reservation is already {} and was charged {charged}",
                    state.name()
                ),
            ),
            LedgerError::RunClosed(state) => ApiError::new(
                ErrorCode::RunClosed,
                format!("run is already {}", run_state_name(state)),
            ),
            LedgerError::IdempotencyConflict => ApiError::new(
                ErrorCode::IdempotencyConflict,
                "this Idempotency-Key was used with a different request",
            ),
            LedgerError::Invalid(m) => ApiError::invalid(m),
            LedgerError::Full(_) => ApiError::store_unavailable(),
        }
    }
}

/// A run's state as the wire names it (its serde name; never its `Debug` text).
pub fn run_state_name(state: spendgate_core::RunState) -> &'static str {
    match state {
        spendgate_core::RunState::Active => "active",
        spendgate_core::RunState::Finished => "finished",
        spendgate_core::RunState::Expired => "expired",
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({
            "error": {
                "type": self.kind(),
                "code": crate::plant::code(self.code),
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
        resp.extensions_mut().insert(self.code);
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
        let retry = self.code.retry();
        h.insert(
            "x-should-retry",
            HeaderValue::from_static(if retry { "true" } else { "false" }),
        );
        resp
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusals of the request as sent are `invalid_request_error` whatever their
    /// status; the gateway's own failures are `server_error`.
    #[test]
    fn every_client_error_is_an_invalid_request_type() {
        for status in [
            StatusCode::METHOD_NOT_ALLOWED,
            StatusCode::URI_TOO_LONG,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        ] {
            let e = ApiError::invalid("m").with_status(status);
            assert_eq!((e.status, e.kind()), (status, "invalid_request_error"));
        }
        for (code, want) in [
            (ErrorCode::RequestTimeout, "invalid_request_error"),
            (ErrorCode::Unauthorized, "authentication_error"),
            (ErrorCode::Timeout, "server_error"),
            (ErrorCode::StoreUnavailable, "server_error"),
        ] {
            assert_eq!(ApiError::new(code, "m").kind(), want, "{code}");
        }
    }

    /// The wire string is the serde name, it reads back as the same code, and no two codes
    /// share one; every status is an error status and its type is one OpenAI names.
    #[test]
    fn every_code_round_trips_by_its_wire_name() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            let wire = serde_json::to_value(code).expect("serialize");
            assert_eq!(wire, json!(code.as_str()), "{code:?}");
            let back: ErrorCode = serde_json::from_value(wire).expect("deserialize");
            assert_eq!(back, code);
            assert!(seen.insert(code.as_str()), "{code} twice");
            assert!(code.status().is_client_error() || code.status().is_server_error());
            assert!(
                [
                    "invalid_request_error",
                    "authentication_error",
                    "permission_error",
                    "not_found_error",
                    "insufficient_quota",
                    "rate_limit_error",
                    "server_error",
                ]
                .contains(&code.kind()),
                "{code}"
            );
        }
        assert!(serde_json::from_value::<ErrorCode>(json!("quota_exceeded")).is_err());
    }

    /// docs/errors.md documents exactly the codes of the enum, in its order (one
    /// `### \`code\`` heading each).
    #[test]
    fn the_error_reference_lists_every_code() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/errors.md");
        let text = std::fs::read_to_string(path).expect("docs/errors.md");
        let documented: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("### `"))
            .filter_map(|l| l.strip_suffix('`'))
            .collect();
        let codes: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(documented, codes);
    }

    /// The contract's statuses: 429 for every limit and budget, 503 only for an outage and
    /// the cutoff, 504 for a deadline.
    #[test]
    fn each_code_answers_its_contract_status() {
        for code in ErrorCode::ALL {
            let s = code.status().as_u16();
            match s {
                503 => assert!(matches!(
                    code,
                    ErrorCode::StoreUnavailable | ErrorCode::CutoffEngaged
                )),
                429 => assert!(
                    code.as_str().ends_with("_limited") || code.as_str().starts_with("budget_")
                ),
                _ => {}
            }
            let r = ApiError::new(code, "m").into_response();
            assert_eq!(r.status(), code.status(), "{code}");
            assert_eq!(r.extensions().get::<ErrorCode>(), Some(&code));
        }
        assert_eq!(ErrorCode::RunDeadlineExceeded.status().as_u16(), 504);
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
        let limited = ApiError::new(ErrorCode::RateLimited, "m");
        assert_eq!(retry(limited).as_deref(), Some("true"));
        assert_eq!(
            retry(ApiError::store_unavailable()).as_deref(),
            Some("true")
        );
        let spent = ApiError::new(ErrorCode::BudgetExhausted, "m");
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
            (StatusCode::CONFLICT, ErrorCode::ReservationClosed)
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
