//! Policy drift across replicas (issue 18): replicas on one ledger with different limits
//! each enforce their own on the shared counters. Each replica publishes a fingerprint of its
//! effective policy in the store at start and every [`PUBLISH_EVERY`]
//! (`Command::Announce`); a fingerprint that differs from the others among the live replicas
//! is reported in `/admin/v1/summary` (`policy_drift`), in `/metrics`
//! (`spendgate_policy_drift`, `spendgate_policy_fingerprints`) and as an alert, once per
//! drift episode across replicas.

use crate::alerts::Alerts;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use spendgate_config::Config;
use spendgate_core::{fingerprint_counts, ReplicaSeen, REPLICA_STALE_MS};
use spendgate_store::Store;
use std::sync::Arc;
use std::time::Duration;

/// How often a replica publishes its fingerprint (and looks for drift). A replica is live
/// for `REPLICA_STALE_MS` after it last published: several periods, so that one slow or
/// failed call does not make it vanish.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(3);
const _: () = assert!(PUBLISH_EVERY.as_millis() * 4 <= REPLICA_STALE_MS as u128);
/// Hex digits of a fingerprint (64 bits of SHA-256: tells configs apart, reads in a label).
pub const FINGERPRINT_HEX: usize = 16;
/// Bytes of the host name kept in a replica id.
const HOST_BYTES_MAX: usize = 64;

/// This process as the store knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replica {
    /// `HOST:PID:RANDOM` (host name cut to the id's characters).
    pub id: String,
    /// [`policy_fingerprint`] of the config it runs.
    pub fingerprint: String,
}

impl Replica {
    pub fn of(config: &Config) -> Replica {
        Replica {
            id: replica_id(),
            fingerprint: policy_fingerprint(config),
        }
    }
}

/// A hash of everything that decides what is admitted and what is charged: the core policy
/// (every scope's budgets, rates, concurrency and dry-run, run bounds, reservation mode,
/// lease, session creation rates), the address prefixes counted, the prices and tokenizers
/// of models and tools, and which upstream errors release. A pure function of the validated
/// config (serialized in a fixed order), so every process with the same config agrees.
pub fn policy_fingerprint(config: &Config) -> String {
    let models: Vec<Value> = config
        .models
        .iter()
        .map(|(name, m)| {
            json!([
                name,
                m.price,
                m.tokenizer.name(),
                m.output_bound_field.name(),
                m.upstream
            ])
        })
        .collect();
    let tools: Vec<Value> = config
        .tools
        .iter()
        .map(|(name, price)| json!([name, price]))
        .collect();
    let upstreams: Vec<Value> = config
        .upstreams
        .iter()
        .map(|(name, u)| json!([name, u.release_on_error]))
        .collect();
    let id = &config.identity;
    let canonical = json!([
        "spendgate-policy-1",
        config.policy,
        [id.ipv4_prefix, id.ipv6_prefix, id.ipv6_wider],
        models,
        tools,
        upstreams,
    ]);
    let digest = Sha256::digest(canonical.to_string().as_bytes());
    let mut hex = hex::encode(digest);
    hex.truncate(FINGERPRINT_HEX);
    hex
}

/// A fresh replica id: the host name, the process id and 32 random bits (two processes on
/// one host, or one restarted, are two replicas).
pub fn replica_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let mut host: String = host
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        .take(HOST_BYTES_MAX)
        .collect();
    if host.is_empty() {
        host.push_str("replica");
    }
    let random: [u8; 4] = rand::random();
    format!("{host}:{}:{}", std::process::id(), hex::encode(random))
}

/// What the live replicas enforce, as one replica sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyView {
    pub replica: Replica,
    /// Live replicas by id (this one included, even when the store has not heard of it).
    pub replicas: Vec<ReplicaSeen>,
    /// The distinct fingerprints with how many live replicas publish each.
    pub fingerprints: Vec<(String, usize)>,
}

impl PolicyView {
    pub fn of(replica: &Replica, live: Vec<ReplicaSeen>) -> PolicyView {
        let mut replicas = live;
        if !replicas.iter().any(|r| r.replica == replica.id) {
            // (not published yet, or its last announcements failed: it is live all the same)
            replicas.push(ReplicaSeen {
                replica: replica.id.clone(),
                fingerprint: replica.fingerprint.clone(),
                seen: spendgate_core::UnixMs(0),
            });
            replicas.sort_by(|a, b| a.replica.cmp(&b.replica));
        }
        let fingerprints = fingerprint_counts(&replicas);
        PolicyView {
            replica: replica.clone(),
            replicas,
            fingerprints,
        }
    }

    /// Whether live replicas enforce different policies.
    pub fn drift(&self) -> bool {
        self.fingerprints.len() > 1
    }
}

/// Publishes `replica`'s fingerprint now and every [`PUBLISH_EVERY`]; when the live replicas
/// enforce different policies, logs it and alerts (once per drift episode across replicas:
/// see [`Alerts::policy_drift`]); logs when it ends.
pub fn spawn_publisher(
    store: Arc<dyn Store>,
    alerts: Alerts,
    replica: Replica,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PUBLISH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sent_here = std::collections::HashSet::new();
        let mut drifting = false;
        loop {
            tick.tick().await;
            let live = match store
                .announce(replica.id.clone(), replica.fingerprint.clone())
                .await
            {
                Ok(live) => live,
                Err(e) => {
                    // (the store's outage is alerted by the checker; a replica that cannot
                    // publish is stale to the others after REPLICA_STALE_MS)
                    tracing::debug!(error = %e, "could not publish the policy fingerprint");
                    continue;
                }
            };
            let view = PolicyView::of(&replica, live);
            if view.drift() {
                if !drifting {
                    tracing::warn!(
                        fingerprint = %replica.fingerprint,
                        fingerprints = ?view.fingerprints,
                        "replicas on this ledger enforce different policies"
                    );
                }
                alerts
                    .policy_drift(&store, &mut sent_here, &view.fingerprints, &replica.id)
                    .await;
            } else if drifting {
                tracing::info!(fingerprint = %replica.fingerprint, "policy drift ended");
            }
            drifting = view.drift();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        spendgate_config::load(text, &|_| None).expect("config")
    }

    /// The same config gives the same fingerprint (whatever else differs: listen address,
    /// tokens, store); any limit, price or bound gives another.
    #[test]
    fn the_fingerprint_follows_the_limits_and_prices_only() {
        let base = "[limits.global]\nbudgets = [{ amount = \"50.00\", window = \"day\" }]\n";
        let a = policy_fingerprint(&config(base));
        assert_eq!(a.len(), FINGERPRINT_HEX);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(a, policy_fingerprint(&config(base)));
        let elsewhere = format!("[server]\nlisten = \"127.0.0.1:9999\"\n{base}");
        assert_eq!(a, policy_fingerprint(&config(&elsewhere)));
        for other in [
            "[limits.global]\nbudgets = [{ amount = \"50.01\", window = \"day\" }]\n".to_string(),
            format!("{base}[run]\nmax_cost = \"0.21\"\n"),
            format!("{base}[limits.session]\nrate = \"5/minute\"\n"),
            format!("{base}[tools.search]\nper_call = \"0.01\"\n"),
            format!("[store]\nlease_ttl_s = 31\n{base}"),
            // Dry-run, of a scope or of a single limit, changes what is enforced.
            format!("{base}dry_run = true\n"),
            "[limits.global]\nbudgets = [{ amount = \"50.00\", window = \"day\", dry_run = true }]\n"
                .to_string(),
            format!("{base}rate_dry_run = true\n"),
            format!("{base}concurrency_dry_run = true\n"),
            "[limits.global]\nbudgets = []\nunbudgeted = true\n".to_string(),
        ] {
            assert_ne!(a, policy_fingerprint(&config(&other)), "{other}");
        }
        // Single limits in dry-run are told apart from each other.
        let rate = policy_fingerprint(&config(&format!("{base}rate_dry_run = true\n")));
        let cap = policy_fingerprint(&config(&format!("{base}concurrency_dry_run = true\n")));
        assert_ne!(rate, cap);
        // And a budget explicitly enforced is the same policy as one that says nothing.
        let explicit =
            "[limits.global]\nbudgets = [{ amount = \"50.00\", window = \"day\", dry_run = false }]\n";
        assert_eq!(a, policy_fingerprint(&config(explicit)));
    }

    #[test]
    fn replica_ids_are_accepted_by_the_store_and_differ() {
        let (a, b) = (replica_id(), replica_id());
        assert_ne!(a, b);
        for id in [&a, &b] {
            spendgate_core::replicas::check_replica(id, "abc").expect("a valid id");
        }
    }

    #[test]
    fn a_view_counts_fingerprints_and_includes_itself() {
        let me = Replica {
            id: "b".into(),
            fingerprint: "f1".into(),
        };
        let seen = |id: &str, fp: &str| ReplicaSeen {
            replica: id.into(),
            fingerprint: fp.into(),
            seen: spendgate_core::UnixMs(1_000),
        };
        let v = PolicyView::of(&me, vec![seen("a", "f1")]);
        assert_eq!(v.fingerprints, vec![("f1".to_string(), 2)]);
        assert!(!v.drift());
        let v = PolicyView::of(&me, vec![seen("a", "f2"), seen("b", "f1"), seen("c", "f2")]);
        assert_eq!(
            v.fingerprints,
            vec![("f1".to_string(), 1), ("f2".to_string(), 2)]
        );
        assert!(v.drift());
    }
}
