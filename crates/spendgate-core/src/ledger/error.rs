//! Errors of a ledger call: the request was wrong, or the ledger is full.

use super::model::{ReservationState, RunState};
use super::ID_BYTES_MAX;
use crate::money::Micros;
use crate::replicas::InvalidReplica;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("{0} not found")]
    NotFound(String),
    #[error("reservation is already {state:?} (charged {charged}); this transition is refused")]
    Closed {
        state: ReservationState,
        charged: Micros,
    },
    #[error("run is {0:?}")]
    RunClosed(RunState),
    #[error("idempotency key reused with a different request")]
    IdempotencyConflict,
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("ledger is full ({0} records); nothing new is admitted")]
    Full(usize),
}

pub(super) fn check_id(what: &str, id: &str) -> Result<(), LedgerError> {
    if id.is_empty() || id.len() > ID_BYTES_MAX {
        return Err(LedgerError::Invalid(format!(
            "{what} must be 1 to {ID_BYTES_MAX} bytes"
        )));
    }
    Ok(())
}

impl From<InvalidReplica> for LedgerError {
    fn from(e: InvalidReplica) -> LedgerError {
        LedgerError::Invalid(e.0)
    }
}
