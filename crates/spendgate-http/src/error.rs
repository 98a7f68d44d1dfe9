//! The start-up failure of the HTTP surface. The error answer of a request (`ApiError`,
//! `ErrorCode`) is `spendgate_wire::error`'s.

use spendgate_store::StoreError;

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
