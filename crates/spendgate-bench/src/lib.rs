//! spendgate-bench: the load drivers of the benchmarks (`spendgate-load` for the decision
//! API, `spendgate-proxy-load` for the proxy) and their open-loop pacing. It drives a
//! spendgate process over HTTP and depends on no product crate; nothing of the product
//! depends on it.

#![warn(clippy::too_many_lines)]

pub mod pace;

/// Installs the TLS crypto provider (ring) for the drivers' HTTPS clients; idempotent.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
