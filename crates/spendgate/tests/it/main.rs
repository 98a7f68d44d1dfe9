//! Integration tests of the `spendgate` binary: real processes, real HTTP, real SQLite files.

// Scenario tests read top to bottom as one story; the 100-line bound is for production code.
#![allow(clippy::too_many_lines)]

#[macro_use]
mod harness;

mod agents;
mod alerts;
mod capacity;
mod cli;
mod clients;
mod decision_api;
mod drift;
mod history;
mod history_pg;
mod holds;
mod metrics;
mod proxy;
mod replicas;
mod sessions;
mod streams;
