//! Integration tests of the `spendgate` binary: real processes, real HTTP, real SQLite files.

#[macro_use]
mod harness;

mod alerts;
mod capacity;
mod cli;
mod decision_api;
mod drift;
mod holds;
mod proxy;
mod replicas;
mod sessions;
mod streams;
