//! Who is calling: the operator's backend (service token, the guest named in headers) or a
//! guest with its cookie (browser-direct), and the run the call belongs to.

use axum::http::{header, HeaderMap};
use spendgate_core::IpScope;
use spendgate_http::auth::ServiceAuth;
use spendgate_http::client::{
    check_conversation, client_ip_of, guest_conversation, ip_scopes, parse_ip, session_from_cookie,
};
use spendgate_http::AppState;
use spendgate_store::clock::now_unix;
use spendgate_wire::error::{ApiError, ApiResult};
use std::net::SocketAddr;

/// Who is calling and which run the call belongs to.
pub(crate) struct Caller {
    pub(crate) session: String,
    pub(crate) ips: Vec<IpScope>,
    pub(crate) conversation: String,
    pub(crate) run: Option<String>,
    pub(crate) retry: bool,
    /// A guest calling with its cookie (browser-direct): it wrote the whole history, so the
    /// input bound covers every message, not only the last user message.
    pub(crate) guest: bool,
}

pub(crate) fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

pub(crate) fn caller(state: &AppState, peer: SocketAddr, headers: &HeaderMap) -> ApiResult<Caller> {
    let run = header_str(headers, "spendgate-run").map(str::to_string);
    let retry = matches!(header_str(headers, "spendgate-retry"), Some("1" | "true"));
    if headers.contains_key(header::AUTHORIZATION) {
        ServiceAuth::check(state, headers)?;
        let token = header_str(headers, "spendgate-session")
            .ok_or_else(|| ApiError::invalid("Spendgate-Session header is required"))?;
        let session = state.keys.verify(token, now_unix())?;
        let ip = parse_ip(
            header_str(headers, "spendgate-client-ip")
                .ok_or_else(|| ApiError::invalid("Spendgate-Client-Ip header is required"))?,
        )?;
        let conversation = header_str(headers, "spendgate-conversation")
            .ok_or_else(|| ApiError::invalid("Spendgate-Conversation header is required"))?
            .to_string();
        check_conversation(&conversation)?;
        return Ok(Caller {
            session: session.id,
            ips: ip_scopes(state, ip),
            conversation,
            run,
            retry,
            guest: false,
        });
    }
    if !state.config.server.browser_direct {
        return Err(ApiError::unauthorized(
            "missing service token (Authorization: Bearer ...)",
        ));
    }
    let token = session_from_cookie(state, headers).ok_or_else(|| {
        ApiError::unauthorized("no session cookie; create one with POST /v1/sessions")
    })?;
    if run.is_some() {
        // Runs are opened by the operator's backend: a guest attaches to none.
        return Err(ApiError::unauthorized(
            "Spendgate-Run needs a service token (Authorization: Bearer ...)",
        ));
    }
    let session = state.keys.verify(&token, now_unix())?;
    let ip = client_ip_of(state, peer, headers);
    // A guest's conversation is its own (see `spendgate_http::client::guest_conversation`); without one named,
    // the session is the conversation.
    let conversation = match header_str(headers, "spendgate-conversation") {
        Some(c) => {
            check_conversation(c)?;
            guest_conversation(&session.id, c)
        }
        None => session.id.clone(),
    };
    Ok(Caller {
        session: session.id,
        ips: ip_scopes(state, ip),
        conversation,
        run,
        retry,
        guest: true,
    })
}
