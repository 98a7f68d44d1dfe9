//! TLS for outgoing HTTPS (upstreams, the alert webhook, the verifier) and `rediss://`.

/// Installs the TLS crypto provider (ring) for outgoing HTTPS and `rediss://`; idempotent.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
