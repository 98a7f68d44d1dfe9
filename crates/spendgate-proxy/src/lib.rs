//! The proxy (SPEC §6): `POST /v1/chat/completions`, `POST /v1/responses` ([`responses`]: hosted
//! tools priced and reserved with the call) and `POST /v1/embeddings` (OpenAI's shapes) and
//! `POST /v1/messages` (Anthropic's, [`messages`]; every error on its path in Anthropic's shape, by the
//! router's layer, `spendgate_http::router`): bounds
//! the prompt, clamps the output, reserves, forwards (streams pass through as they arrive), and
//! reconciles from the upstream's `usage`. Whatever cannot be known is charged in full.
//!
//! It counts the output it relays ([`OutputCounter`], with the model's tokenizer) and
//! enforces the bound it forwarded: a stream past it is cut there (nothing more is relayed,
//! what the upstream had sent is read and counted for at most [`CUT_DRAIN_MAX`], the
//! connection is closed and the client's stream ends with an error event); a whole answer
//! past it is cut to it (`finish_reason: "length"`, header `spendgate-output-cut: true`).
//! No charge is below the output counted ([`settlement`]).
//!
//! Terminal states:
//! - upstream answered with usage (streamed or not) → `committed` at the observed usage (its
//!   completion tokens never below the output counted);
//! - upstream answered an error status that says no work was done ([`NO_WORK_STATUSES`]: a
//!   refusal, 500, 503; or a redirect, which is not followed) and the upstream is configured
//!   `release_on_error` → `released`; any other error status (a gateway's 502 or 504, which
//!   may follow the work) → `unknown`;
//! - connection lost, timeout, client gone mid-stream, an answer without usage → `unknown`,
//!   charged in full; unless a usage chunk had already been read whole, which is trusted.
//!   A stream's usage is trusted at its end only after `[DONE]` or a final (choices-less)
//!   usage chunk, with no content and no error event after it; a usage read but not trusted,
//!   or the output counted past the bound, that costs more than the reservation is committed
//!
//! The flow of one call, of any shape, is [`chat::proxy`]: parse, plan, admit, forward, relay,
//! settle, each its own function; the pieces it is made of are [`caller`] (who calls),
//! [`prompt`] (what the prompt costs), [`guard`] (the step's hold until it is settled),
//! [`upstream`] (forwarding and error answers), [`answer`] (a whole answer, counted and cut)
//! and [`sse`] (a stream, relayed, counted and cut). Another API shape is added beside
//! [`chat`], from the same pieces.

#![warn(clippy::too_many_lines)]

pub mod answer;
pub mod bounds;
pub mod caller;
pub mod chat;
pub mod embeddings;
pub mod guard;
pub mod messages;
pub mod prompt;
pub mod responses;
pub mod sse;
pub mod upstream;

#[cfg(test)]
mod tests;

use axum::extract::DefaultBodyLimit;
use axum::routing::post;
use axum::Router;
use spendgate_http::router::{require_json, JsonRule, MESSAGES_PATH};
use spendgate_http::Shared;

pub use bounds::{
    LEASE_RENEWAL_MIN, MESSAGES_MAX, NO_WORK_STATUSES, PROXY_BODY_BYTES_MAX, SETTLE_RETRIES_MAX,
    SETTLE_RETRY_PAUSES, SSE_LINE_BYTES_MAX, UPSTREAM_BODY_BYTES_MAX,
};
pub use chat::chat_completions;
pub use prompt::{prompt_texts, prompt_tokens, PromptTexts};
pub use spendgate_http::state::UPSTREAM_IDLE_CONNECTIONS_MAX;
pub use sse::{CUT_DRAIN_BYTES_MAX, CUT_DRAIN_MAX};

/// The proxy's routes, to merge with [`spendgate_http::router`]'s (the layers there apply):
/// `POST /v1/chat/completions`, `POST /v1/embeddings`, `POST /v1/responses` and
/// `POST /v1/messages` (at [`MESSAGES_PATH`], whose answers the router's layer turns into
/// Anthropic's error shape), JSON only, with their own body bound.
pub fn routes() -> Router<Shared> {
    let json = || axum::middleware::from_fn_with_state(JsonRule::Always, require_json);
    Router::new()
        .route(
            "/v1/chat/completions",
            post(chat_completions).route_layer(json()),
        )
        .route("/v1/embeddings", post(chat::embeddings).route_layer(json()))
        .route(
            "/v1/responses",
            post(chat::responses_route).route_layer(json()),
        )
        .route(MESSAGES_PATH, post(messages::messages).route_layer(json()))
        .layer(DefaultBodyLimit::max(PROXY_BODY_BYTES_MAX))
}
