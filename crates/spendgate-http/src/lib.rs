//! spendgate-http: the HTTP shell around the core. It parses, calls the core through a store,
//! and maps answers and errors; it holds no limit of its own (SPEC I4).
//!
//! What is here: the shared state ([`state`]), the extractors and helpers every handler uses
//! (tokens in [`auth`], the caller in [`client`], bodies in [`body`], typed [`path`] ids
//! and [`query`] strings, [`idempotency`], [`ids`], [`ratelimit`] headers, [`answer`]
//! helpers), the decision API ([`sessions`], [`runs`], [`steps`], [`usage`], and the
//! [`challenge`] and [`identity`] behind sessions), the [`admin`] API and dashboard,
//! [`health`] (and the `/metrics` route), fair [`capacity`] ([`admit`] puts every request in
//! its class), the [`openapi`] document, the [`router`](mod@router) with its layers, and
//! [`serve`](mod@serve) (the background tasks, and the bounded listener set from the config).
//!
//! Below it: the error answer and the typed answers are `spendgate-wire`'s, the bounded
//! listener (connections, timeouts, the protocol's own refusals, the open files limit) is
//! `spendgate-listener`'s; the metrics, alerts, the timed store and policy drift are
//! `spendgate-telemetry`'s (the state holds them and the handlers serve them). The proxy
//! (`spendgate-proxy`) builds on this crate; the `spendgate` binary wires both.
//!
//! Modules depend on each other one way only: the handlers on the helpers, the helpers on
//! [`state`], `spendgate_wire::error` and [`config`], never back; and this
//! crate on the ones below it, never back.

#![warn(clippy::too_many_lines)]

pub mod admin;
pub mod admit;
pub mod answer;
pub mod auth;
pub mod body;
pub mod capacity;
pub mod challenge;
pub mod client;
pub mod drain;
pub mod error;
pub mod health;
pub mod history;
pub mod idempotency;
pub mod identity;
pub mod ids;
pub mod openapi;
pub mod path;
pub mod plant;
pub mod query;
pub mod ratelimit;
pub mod router;
pub mod runs;
pub mod serve;
pub mod sessions;
pub mod state;
pub mod steps;
pub mod store;
pub mod tls;
pub mod usage;

pub use spendgate_config as config;

pub use drain::{spawn_history, HistorySetup, HistoryTasks};
pub use error::ServerError;
pub use router::{router, API_REQUEST_TIMEOUT};
pub use serve::{serve, SWEEP_EVERY};
pub use state::{build_state, AppState, Shared, Upstream};
pub use store::{
    open_store, open_store_with_witness, redis_command_options, redis_options, OpenedStore,
    STORE_COMMAND_TIMEOUT_MIN,
};
pub use tls::install_crypto;
