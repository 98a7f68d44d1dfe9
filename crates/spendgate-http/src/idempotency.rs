//! `Idempotency-Key`: a retried admission gets the first answer.

use axum::http::HeaderMap;
use bytes::Bytes;
use serde_json::Value;
use sha2::{Digest, Sha256};
use spendgate_core::IdempotencyKey;
use spendgate_wire::error::{ApiError, ApiResult};

/// Largest `Idempotency-Key`.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 100;

pub fn idempotency(
    headers: &HeaderMap,
    namespace: &str,
    body: &Bytes,
) -> ApiResult<Option<IdempotencyKey>> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let k = v
        .to_str()
        .map_err(|_| ApiError::invalid("Idempotency-Key must be visible ASCII"))?;
    if k.is_empty() || k.len() > IDEMPOTENCY_KEY_BYTES_MAX {
        return Err(ApiError::invalid(format!(
            "Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_BYTES_MAX} characters"
        )));
    }
    // Hash the key so that the stored key length is fixed whatever the client sends.
    let h = hex::encode(&Sha256::digest(format!("{namespace}\n{k}"))[..16]);
    // The body as data, not as bytes: the same request serialised again (other spacing, other
    // key order) is the same request. Digested only when a key is given: most carry none.
    let canonical = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| serde_json::to_vec(&v).ok());
    Ok(Some(IdempotencyKey {
        key: format!("{namespace}:{h}"),
        fingerprint: hex::encode(Sha256::digest(canonical.as_deref().unwrap_or(body))),
    }))
}
