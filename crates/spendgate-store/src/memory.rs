//! `memory`: the ledger in process memory behind a mutex. For tests and throwaway runs; it
//! keeps nothing across restarts.

use crate::{Clock, Store, StoreError};
use async_trait::async_trait;
use spendgate_core::{Command, Ledger, Policy, Reply};
use std::sync::{Arc, Mutex};

pub struct MemoryStore {
    policy: Policy,
    clock: Arc<dyn Clock>,
    ledger: Mutex<Ledger>,
}

impl MemoryStore {
    pub fn new(policy: Policy, clock: Arc<dyn Clock>) -> MemoryStore {
        MemoryStore {
            policy,
            clock,
            ledger: Mutex::new(Ledger::new()),
        }
    }

    /// Runs `f` over the ledger (for tests that check invariants directly).
    pub fn inspect<T>(&self, f: impl FnOnce(&Ledger) -> T) -> T {
        let guard = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        f(&guard)
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
        // A poisoned lock means a panic mid-operation; the ledger's operations check before
        // they write, so the state is still whole.
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.clock.now();
        crate::apply_to(&mut ledger, &self.policy, now, &cmd)
    }
    async fn execute_many(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        cmds.iter()
            .map(|cmd| crate::apply_to(&mut ledger, &self.policy, self.clock.now(), cmd))
            .collect()
    }
    async fn ready(&self) -> Result<(), StoreError> {
        Ok(())
    }
    fn kind(&self) -> &'static str {
        "memory"
    }
}
