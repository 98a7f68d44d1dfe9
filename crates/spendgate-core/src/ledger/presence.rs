//! Replica presence, kept beside the ledger (not part of it: no record, no sequence number).

use super::error::LedgerError;
use super::Ledger;
use crate::replicas::ReplicaSeen;
use crate::window::UnixMs;

impl Ledger {
    /// Records a replica's policy fingerprint as seen at `now` (never before the ledger's
    /// clock) and answers every live replica. Changes no record and no sequence number.
    pub fn announce(
        &mut self,
        now: UnixMs,
        replica: &str,
        fingerprint: &str,
    ) -> Result<Vec<ReplicaSeen>, LedgerError> {
        Ok(self
            .replicas
            .announce(now.max(self.clock), replica, fingerprint)?)
    }

    /// Every replica live at `now` (never before the ledger's clock).
    pub fn replicas_live(&self, now: UnixMs) -> Vec<ReplicaSeen> {
        self.replicas.live(now.max(self.clock))
    }
}
