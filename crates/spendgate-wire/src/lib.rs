//! spendgate-wire: what the HTTP edge puts on the wire, apart from the code that decides it.
//! The [`error`] answer (every refusal's code, status, OpenAI error `type` and JSON shape)
//! and its [`anthropic`] shape (for `/v1/messages`),
//! the typed [`answers`] of the decision, admin and health API (the schemas
//! `docs/openapi.json` publishes), and the [`plant`]ed-bug switches (test-only; the error
//! shape reads one).
//!
//! It sits below the listener (`spendgate-listener`, whose protocol refusals use the error
//! shape), the HTTP surface (`spendgate-http`) and the proxy (`spendgate-proxy`), and
//! depends only on the core and the store's error: no handler code.

pub mod answers;
pub mod anthropic;
pub mod error;
pub mod plant;
