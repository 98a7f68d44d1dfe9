//! Which gateway replicas share a ledger, and a fingerprint of the policy each one enforces
//! (issue 18: replicas on one ledger with different limits each enforce their own on the
//! shared counters; publishing the fingerprints makes that drift visible).
//!
//! Each replica announces itself every few seconds ([`Command::Announce`]); the store keeps,
//! per replica id, the fingerprint and when it last heard of it (the store's clock). Entries
//! older than [`REPLICA_STALE_MS`] are no longer live and are dropped; at most
//! [`REPLICAS_MAX`] are kept (past it, the least recently seen other than the announcer goes).
//! This is presence, not money: it is not part of the ledger's records (no `ledger_seq`, not
//! written to disk by sqlite, not rolled back or reset with a Redis ledger), and an announcer
//! republishes within seconds after a restart.
//!
//! [`Command::Announce`]: crate::Command::Announce

use crate::window::UnixMs;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Replicas remembered at most (`ledger.lua` holds the same bound).
pub const REPLICAS_MAX: usize = 128;
/// A replica not heard of for this long is no longer live (`ledger.lua` holds the same).
pub const REPLICA_STALE_MS: u64 = 15_000;
/// Longest policy fingerprint accepted.
pub const FINGERPRINT_BYTES_MAX: usize = 64;
/// Longest replica id accepted.
pub const REPLICA_ID_BYTES_MAX: usize = 128;

/// One live replica: its id, its policy's fingerprint and when the store last heard of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaSeen {
    pub replica: String,
    pub fingerprint: String,
    pub seen: UnixMs,
}

/// A replica id or policy fingerprint that is refused (the ledger answers it as an invalid
/// request: [`LedgerError::Invalid`]).
///
/// [`LedgerError::Invalid`]: crate::LedgerError::Invalid
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidReplica(pub String);

/// Checks a replica id (letters, digits, `.`, `-`, `_`, `:`) and a fingerprint (letters and
/// digits): both end up in keys, logs and metric labels.
pub fn check_replica(replica: &str, fingerprint: &str) -> Result<(), InvalidReplica> {
    let id_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':');
    if replica.is_empty() || replica.len() > REPLICA_ID_BYTES_MAX || !replica.chars().all(id_char) {
        return Err(InvalidReplica(format!(
            "replica id must be 1 to {REPLICA_ID_BYTES_MAX} bytes of letters, digits, '.', '-', '_' or ':'"
        )));
    }
    if fingerprint.is_empty()
        || fingerprint.len() > FINGERPRINT_BYTES_MAX
        || !fingerprint.chars().all(|c| c.is_ascii_alphanumeric())
    {
        return Err(InvalidReplica(format!(
            "policy fingerprint must be 1 to {FINGERPRINT_BYTES_MAX} letters or digits"
        )));
    }
    Ok(())
}

/// The replicas a store heard of (not persisted).
#[derive(Debug, Default)]
pub struct ReplicaTable {
    /// replica id → (fingerprint, last seen)
    by_id: BTreeMap<String, (String, UnixMs)>,
}

fn live_at(seen: UnixMs, now: UnixMs) -> bool {
    seen.0.saturating_add(REPLICA_STALE_MS) > now.0
}

impl ReplicaTable {
    /// Records `replica` with `fingerprint` as seen at `now`, drops what is stale and what is
    /// over [`REPLICAS_MAX`], and answers every live replica (by id).
    pub fn announce(
        &mut self,
        now: UnixMs,
        replica: &str,
        fingerprint: &str,
    ) -> Result<Vec<ReplicaSeen>, InvalidReplica> {
        check_replica(replica, fingerprint)?;
        self.by_id.retain(|_, (_, seen)| live_at(*seen, now));
        self.by_id
            .insert(replica.to_string(), (fingerprint.to_string(), now));
        while self.by_id.len() > REPLICAS_MAX {
            // (ties: the first by id; the Redis script may pick another of equals)
            let oldest = self
                .by_id
                .iter()
                .filter(|(id, _)| id.as_str() != replica)
                .min_by_key(|(_, (_, seen))| *seen)
                .map(|(id, _)| id.clone());
            let Some(oldest) = oldest else { break };
            self.by_id.remove(&oldest);
        }
        debug_assert!(self.by_id.len() <= REPLICAS_MAX);
        Ok(self.live(now))
    }

    /// Every replica live at `now`, by id.
    pub fn live(&self, now: UnixMs) -> Vec<ReplicaSeen> {
        self.by_id
            .iter()
            .filter(|(_, (_, seen))| live_at(*seen, now))
            .map(|(replica, (fingerprint, seen))| ReplicaSeen {
                replica: replica.clone(),
                fingerprint: fingerprint.clone(),
                seen: *seen,
            })
            .collect()
    }
}

/// The distinct fingerprints among `replicas`, each with how many replicas publish it, by
/// fingerprint. More than one: replicas on this ledger enforce different policies (drift).
pub fn fingerprint_counts(replicas: &[ReplicaSeen]) -> Vec<(String, usize)> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for r in replicas {
        *counts.entry(r.fingerprint.as_str()).or_insert(0) += 1;
    }
    counts
        .into_iter()
        .map(|(fp, n)| (fp.to_string(), n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_replicas_go_and_the_table_stays_bounded() {
        let mut t = ReplicaTable::default();
        let a = t.announce(UnixMs(1_000), "a", "f1").expect("valid");
        assert_eq!(a.len(), 1);
        t.announce(UnixMs(2_000), "b", "f2").expect("valid");
        let live = t.live(UnixMs(2_000));
        assert_eq!(
            fingerprint_counts(&live),
            vec![("f1".into(), 1), ("f2".into(), 1)]
        );
        // a is stale REPLICA_STALE_MS after it was seen; b still lives.
        let live = t.live(UnixMs(1_000 + REPLICA_STALE_MS));
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].replica, "b");
        // Over the bound, the least recently seen goes, never the announcer.
        let mut t = ReplicaTable::default();
        for i in 0..REPLICAS_MAX as u64 + 3 {
            t.announce(UnixMs(10_000 + i), &format!("r{i}"), "f")
                .expect("valid");
        }
        let live = t.live(UnixMs(10_000 + REPLICAS_MAX as u64 + 3));
        assert_eq!(live.len(), REPLICAS_MAX);
        assert!(live.iter().all(|r| r.replica != "r0" && r.replica != "r2"));
        assert!(live.iter().any(|r| r.replica == "r3"));
    }

    #[test]
    fn ids_and_fingerprints_are_checked() {
        assert!(check_replica("host-1:42:ab.cd_e", "0123abcdef").is_ok());
        for (id, fp) in [("", "f"), ("a b", "f"), ("a", ""), ("a", "f|1"), ("é", "f")] {
            assert!(check_replica(id, fp).is_err(), "{id:?} {fp:?}");
        }
        assert!(check_replica(&"x".repeat(REPLICA_ID_BYTES_MAX + 1), "f").is_err());
        assert!(check_replica("a", &"f".repeat(FINGERPRINT_BYTES_MAX + 1)).is_err());
    }
}
