//! Replicas publish a fingerprint of their policy in the store (issue 18: replicas on one
//! ledger with different limits must be visible). Presence, not ledger: an announcement
//! changes no `ledger_seq`; entries live `REPLICA_STALE_MS` from the last announcement (the
//! store's clock); at most `REPLICAS_MAX` are kept.

use crate::support::{policy, seq, START};
use crate::Backend;
use spendgate_core::{
    fingerprint_counts, LedgerError, ReplicaSeen, REPLICAS_MAX, REPLICA_STALE_MS,
};
use spendgate_store::{Store, StoreError};
use std::sync::Arc;

async fn announce(s: &Arc<dyn Store>, replica: &str, fingerprint: &str) -> Vec<ReplicaSeen> {
    s.announce(replica.into(), fingerprint.into())
        .await
        .unwrap_or_else(|e| panic!("announce {replica}: {e}"))
}

fn ids(v: &[ReplicaSeen]) -> Vec<&str> {
    v.iter().map(|r| r.replica.as_str()).collect()
}

pub async fn replicas_publish_policy_fingerprints(b: &dyn Backend) {
    let s = b.open(policy(), START).await;
    let seq0 = seq(&s).await;
    assert!(s.replicas().await.expect("replicas").is_empty());
    let one = announce(&s, "host-a:1:aa", "f00d").await;
    assert_eq!(
        one,
        vec![ReplicaSeen {
            replica: "host-a:1:aa".into(),
            fingerprint: "f00d".into(),
            seen: START,
        }]
    );
    b.advance(1_000);
    let two = announce(&s, "host-b:2:bb", "beef").await;
    assert_eq!(ids(&two), vec!["host-a:1:aa", "host-b:2:bb"]);
    assert_eq!(two[1].seen, START.plus_ms(1_000));
    assert_eq!(s.replicas().await.expect("replicas"), two);
    assert_eq!(
        fingerprint_counts(&two),
        vec![("beef".to_string(), 1), ("f00d".to_string(), 1)],
        "two policies on one ledger"
    );
    // Another handle on the same data (another replica's connection) sees them too.
    if let Some(other) = b.replica(&s).await {
        assert_eq!(other.replicas().await.expect("replicas"), two);
    }
    assert_eq!(seq(&s).await, seq0, "presence is not a ledger change");

    // a announces again with b's policy; b goes quiet and is stale REPLICA_STALE_MS after it
    // was last seen.
    b.advance(REPLICA_STALE_MS - 1_000);
    let v = announce(&s, "host-a:1:aa", "beef").await;
    assert_eq!(ids(&v), vec!["host-a:1:aa", "host-b:2:bb"]);
    assert_eq!(fingerprint_counts(&v), vec![("beef".to_string(), 2)]);
    b.advance(1_000);
    let v = s.replicas().await.expect("replicas");
    assert_eq!(ids(&v), vec!["host-a:1:aa"], "b is stale");
    assert_eq!(v[0].seen, START.plus_ms(REPLICA_STALE_MS));

    // Bad ids and fingerprints are refused, and change nothing.
    for (id, fp) in [("", "f"), ("a b", "f"), ("a", "f|1"), ("a", "")] {
        match s.announce(id.into(), fp.into()).await {
            Err(StoreError::Ledger(LedgerError::Invalid(_), _)) => {}
            other => panic!("announce {id:?} {fp:?}: {other:?}"),
        }
    }
    assert_eq!(
        ids(&s.replicas().await.expect("replicas")),
        vec!["host-a:1:aa"]
    );

    // Bounded: past REPLICAS_MAX the least recently seen go.
    for i in 0..REPLICAS_MAX + 2 {
        b.advance(1);
        announce(&s, &format!("r{i:03}"), "f").await;
    }
    let v = s.replicas().await.expect("replicas");
    assert_eq!(v.len(), REPLICAS_MAX);
    assert!(!ids(&v).contains(&"host-a:1:aa"), "the oldest went first");
    // (host-a and 130 more: the three least recently seen went)
    assert!(!ids(&v).contains(&"r001"), "then the next oldest");
    assert!(ids(&v).contains(&"r002"));
    assert_eq!(seq(&s).await, seq0);
}
