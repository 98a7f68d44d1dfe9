//! The JSON body extractor of the decision and admin API.

use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use spendgate_wire::error::ApiError;

/// Largest decision-API request body.
pub const API_BODY_BYTES_MAX: usize = 256 * 1024;

/// A JSON body parsed strictly; its rejections are `ApiError`s. Keeps the raw bytes, whose
/// digest fingerprints the request when it carries an `Idempotency-Key`.
pub struct Body<T> {
    pub value: T,
    pub raw: Bytes,
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // A body sent slowly holds a request slot: it must keep the minimum rate that the
        // capacity layer puts on every request body (`capacity::RateBody`), else 408.
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if crate::capacity::is_too_slow(&e) {
                ApiError::new(
                    spendgate_wire::error::ErrorCode::RequestTimeout,
                    "the request body arrived too slowly: after a short grace a body must \
                     keep arriving at the gateway's minimum rate",
                )
            } else if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large("request body is too large")
            } else {
                ApiError::invalid(format!("could not read the request body: {e}"))
            }
        })?;
        let value = if bytes.is_empty() {
            serde_json::from_slice(b"{}")
        } else {
            serde_json::from_slice(&bytes)
        }
        .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
        Ok(Body { value, raw: bytes })
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Empty {}
