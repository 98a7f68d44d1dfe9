//! Who a request comes from: its session cookie, its address (through trusted proxies),
//! and the conversation it names.

use crate::identity;
use crate::state::AppState;
use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};
use spendgate_config::Config;
use spendgate_core::IpScope;
use spendgate_wire::error::{ApiError, ApiResult};
use std::net::{IpAddr, SocketAddr};

/// Longest conversation id.
pub const CONVERSATION_ID_BYTES_MAX: usize = 100;

pub fn cookie_name(config: &Config) -> &'static str {
    if config.sessions.secure_cookie {
        "__Host-spendgate_session"
    } else {
        "spendgate_session"
    }
}

pub fn session_from_cookie(state: &AppState, headers: &HeaderMap) -> Option<String> {
    let name = cookie_name(&state.config);
    for v in headers.get_all(header::COOKIE) {
        let Ok(s) = v.to_str() else { continue };
        for part in s.split(';') {
            if let Some((k, val)) = part.trim().split_once('=') {
                if k == name {
                    return Some(val.to_string());
                }
            }
        }
    }
    None
}

pub fn client_ip_of(state: &AppState, peer: SocketAddr, headers: &HeaderMap) -> IpAddr {
    let xff = forwarded_for(headers);
    identity::client_addr(peer, xff.as_deref(), &state.config.server.trusted_proxies)
}

/// Every `X-Forwarded-For` line, in order, as one list (RFC 9110 §5.3): a proxy may add a
/// line of its own instead of appending to the one the client sent, and the client's line
/// must not be read as the proxy's. An entry that is not text counts as one unreadable hop
/// (only that entry: a proxy that appends to the client's line puts the client's bytes and
/// the address it saw on one line, and that address must still be read).
fn forwarded_for(headers: &HeaderMap) -> Option<String> {
    let mut lines = headers.get_all("x-forwarded-for").iter().peekable();
    lines.peek()?;
    Some(
        lines
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(|entry| match std::str::from_utf8(entry) {
                Ok(text) if !text.contains(|c: char| c.is_control()) => text,
                _ => "?",
            })
            .collect::<Vec<_>>()
            .join(","),
    )
}

pub fn ip_scopes(state: &AppState, ip: IpAddr) -> Vec<IpScope> {
    let id = &state.config.identity;
    identity::ip_scopes(ip, id.ipv4_prefix, id.ipv6_prefix, &id.ipv6_wider)
}

pub fn parse_ip(s: &str) -> ApiResult<IpAddr> {
    s.trim()
        .parse::<IpAddr>()
        .map_err(|_| ApiError::invalid(format!("client_ip {s:?} is not an IP address")))
}

/// The conversation scope of a conversation a guest names itself (browser-direct, or usage
/// read with its cookie): its own, never another guest's. The id it sends is namespaced by
/// its session (the id hashed to a fixed length), so guests who pick the same id (`chat-1`)
/// neither share a conversation's budget nor take its one generation slot from each other.
/// Ids the operator's backend sends with a service token are its own namespace, as given.
pub fn guest_conversation(session_id: &str, conversation: &str) -> String {
    let digest = Sha256::digest(conversation.as_bytes());
    format!("{session_id}:{}", hex::encode(&digest[..12]))
}

pub fn check_conversation(c: &str) -> ApiResult<()> {
    if c.is_empty() || c.len() > CONVERSATION_ID_BYTES_MAX || c.chars().any(char::is_control) {
        return Err(ApiError::invalid(format!(
            "conversation must be 1 to {CONVERSATION_ID_BYTES_MAX} bytes without control characters"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    /// An entry that is not text is one unreadable hop; the entries around it (on the same
    /// line, as a proxy that appends writes them) are still read.
    #[test]
    fn forwarded_for_reads_each_entry() {
        let mut h = HeaderMap::new();
        let line = HeaderValue::from_bytes(b"\xff, 9.9.9.9").expect("obs-text is a header value");
        h.append("x-forwarded-for", line);
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        assert_eq!(forwarded_for(&h).as_deref(), Some("?, 9.9.9.9,10.0.0.1"));
        let trusted: Vec<ipnet::IpNet> = vec!["127.0.0.0/8".parse().expect("net")];
        let peer: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let addr = identity::client_addr(peer, forwarded_for(&h).as_deref(), &trusted);
        assert_eq!(addr.to_string(), "10.0.0.1");
        let trusted: Vec<ipnet::IpNet> = vec![
            "127.0.0.0/8".parse().expect("net"),
            "10.0.0.0/8".parse().expect("net"),
        ];
        let addr = identity::client_addr(peer, forwarded_for(&h).as_deref(), &trusted);
        assert_eq!(
            addr.to_string(),
            "9.9.9.9",
            "the proxy-appended address is read"
        );
        assert_eq!(forwarded_for(&HeaderMap::new()), None);
    }
}
