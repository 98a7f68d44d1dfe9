//! The query-string extractor of the decision and admin API: axum's [`Query`](axum::extract::Query)
//! whose rejection is an [`ApiError`] in the error shape.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use spendgate_wire::error::ApiError;

/// A query string parsed into `T` (strictly when `T` denies unknown fields). A parameter
/// that does not parse, or one `T` does not know, is `invalid_request` 400 with axum's text,
/// which names the parameter (`Failed to deserialize query string: limit: invalid digit
/// found in string`).
#[derive(Clone, Debug)]
pub struct Query<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::try_from_uri(&parts.uri)
            .map(|axum::extract::Query(v)| Query(v))
            .map_err(|e| ApiError::invalid(e.body_text()))
    }
}
