//! Alerts (SPEC §8): a log line and a webhook POST (JSON with a Slack-compatible `text`) when
//! global spend (or, with `alerts.scopes`, any ip, session or conversation's) crosses a
//! configured threshold, once per scope, threshold and window across all replicas; when a
//! global budget burns fast enough to be spent before its window resets ([`crate::burn`], once
//! per budget window across replicas, `alert:burn:global:WINDOW`); also on overruns, expired
//! reservations and store outages.
//!
//! "Once across all replicas" uses the store itself: the replica that first marks
//! `alert:global:WINDOW:THRESHOLD` (for another scope `alert:KIND:DIGEST:WINDOW:THRESHOLD`,
//! DIGEST a hash of the scope's id) used (a single-use key, `Command::ConsumeOnce`) sends it;
//! the others see the key taken. Overruns and expiries are reported by the replica that saw
//! them; store outages by each replica (the store cannot arbitrate while it is down), once per
//! outage. Policy drift (live replicas publishing different policy fingerprints) once per
//! drift episode across replicas: `alert:drift:DIGEST`, DIGEST a hash of the set of
//! fingerprints.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use spendgate_core::{rfc3339, ReservationState, ScopeKey, ScopeKind, UsageLine, WindowId};
use spendgate_store::Store;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Alerts waiting to be sent; past it new ones are logged and dropped.
pub const ALERT_QUEUE_MAX: usize = 256;
/// Time one webhook POST may take.
pub const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(5);
/// How often global spend is checked against the thresholds.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Expired reservations are looked for every this many checks.
pub const SUMMARY_EVERY_CHECKS: u64 = 5;
/// Threshold alerts one replica remembers having sent itself (cleared when full).
pub const SENT_HERE_MAX: usize = 1024;
/// Scopes of one kind (the top spenders) checked when `alerts.scopes` names it.
pub const SCOPE_ALERT_TOP: usize = 100;
/// Scopes other than global are checked every this many checks (finding the top spenders
/// scans every counter of the kind on the store's writer).
pub const SCOPE_CHECK_EVERY_CHECKS: u64 = 10;
/// Threshold alerts on scopes other than global sent per scope check at most (under an attack
/// thousands of addresses may cross at once); the rest are sent by later checks.
pub const SCOPE_ALERTS_PER_CHECK_MAX: usize = 20;
/// How long past its window's reset a sent alert's key is remembered.
const ALERT_KEY_GRACE_MS: u64 = 86_400_000;
/// How long a `lifetime` budget's alert key is remembered (the window never resets; the key
/// is a record in the store, so not forever: a crossing is repeated at most this often).
const LIFETIME_ALERT_KEY_MS: u64 = 90 * 86_400_000;
/// Overrun alerts one replica sends per [`OVERRUN_ALERT_PERIOD`] at most; the rest are
/// counted and reported with the next one sent (an upstream that over-reports on every call
/// must not flood the webhook or push other alerts out of the queue).
pub const OVERRUN_ALERTS_PER_PERIOD: u32 = 10;
pub const OVERRUN_ALERT_PERIOD: Duration = Duration::from_secs(60);
/// Expired reservations are alerted at most once per this period across replicas.
pub const EXPIRED_ALERT_PERIOD_MS: u64 = 60_000;
/// How long a policy drift's key is remembered: a drift between the same fingerprints is
/// alerted once in this time across replicas (one that lasts, again a day later).
pub const DRIFT_ALERT_KEY_TTL_MS: u64 = 86_400_000;
/// Expired reservations (the newest) listed per expiry check, to tell new expiries from the
/// ones seen before. Small: every replica lists them every few seconds while expired records
/// are kept, and on Redis one listing is one script that holds the server. The listing is
/// the newest by creation, and a reservation expires soon after its holder stops, so new
/// expiries are among them unless this many newer ones expired too (then the count's growth
/// still tells, unless purges hide it: the alert is a signal, the books are in the store).
pub const EXPIRED_LISTING_MAX: usize = 100;

#[derive(Clone)]
pub struct Alerts {
    pub(crate) tx: mpsc::Sender<Value>,
    store_down: Arc<AtomicBool>,
    /// Overrun alerts: (start of the current period, sent in it, not sent since the last one).
    overruns: Arc<std::sync::Mutex<(std::time::Instant, u32, u64)>>,
}

impl Alerts {
    /// Starts the sender task; alerts go to the log always and to `webhook_url` when set.
    pub fn start(http: reqwest::Client, webhook_url: Option<String>) -> Alerts {
        let (tx, mut rx) = mpsc::channel::<Value>(ALERT_QUEUE_MAX);
        tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                let Some(url) = &webhook_url else { continue };
                let sent = http
                    .post(url)
                    .timeout(WEBHOOK_TIMEOUT)
                    .json(&event)
                    .send()
                    .await;
                if let Err(e) = sent.and_then(|r| r.error_for_status()) {
                    // (the URL is a secret: Slack-style webhooks carry their key in the path)
                    tracing::warn!(error = %e.without_url(), "alert webhook failed");
                }
            }
        });
        Alerts {
            tx,
            store_down: Arc::new(AtomicBool::new(false)),
            overruns: Arc::new(std::sync::Mutex::new((std::time::Instant::now(), 0, 0))),
        }
    }

    pub fn emit(&self, kind: &str, text: String, detail: Value) {
        let event = Self::event(kind, text, detail);
        if self.tx.try_send(event).is_err() {
            tracing::warn!(alert = kind, "alert queue full; webhook not sent");
        }
    }

    /// Logs an alert and makes its webhook event.
    pub(crate) fn event(kind: &str, text: String, mut detail: Value) -> Value {
        tracing::warn!(alert = kind, "{text}");
        detail["event"] = json!(kind);
        detail["text"] = json!(format!("spendgate: {text}"));
        detail
    }

    /// An overrun (usage above the reservation, charged in full). Bounded per replica:
    /// [`OVERRUN_ALERTS_PER_PERIOD`], the rest counted into the next alert.
    pub fn overrun(&self, step: &str, reserved: u64, charged: u64) {
        let suppressed = {
            let Ok(mut o) = self.overruns.lock() else {
                return;
            };
            let now = std::time::Instant::now();
            if now.duration_since(o.0) >= OVERRUN_ALERT_PERIOD {
                (o.0, o.1) = (now, 0);
            }
            if o.1 >= OVERRUN_ALERTS_PER_PERIOD {
                o.2 = o.2.saturating_add(1);
                tracing::warn!(
                    step,
                    reserved,
                    charged,
                    "overrun (alert suppressed: too many)"
                );
                return;
            }
            o.1 += 1;
            std::mem::take(&mut o.2)
        };
        let more = if suppressed > 0 {
            format!(" ({suppressed} more since the last overrun alert)")
        } else {
            String::new()
        };
        self.emit(
            "overrun",
            format!(
                "overrun on step {step}: charged {charged} micros against {reserved} reserved{more}"
            ),
            json!({"step": step, "reserved_micros": reserved, "charged_micros": charged,
                   "suppressed_since_last": suppressed}),
        );
    }

    /// Live replicas on this ledger enforce different policies (`fingerprints`: each with
    /// its replica count; `replica`: this one). Sent once per drift episode (the set of
    /// fingerprints) across replicas, for [`DRIFT_ALERT_KEY_TTL_MS`]; whether this replica
    /// sent it.
    pub async fn policy_drift(
        &self,
        store: &Arc<dyn Store>,
        sent_here: &mut std::collections::HashSet<String>,
        fingerprints: &[(String, usize)],
        replica: &str,
    ) -> bool {
        let mut h = Sha256::new();
        for (fp, _) in fingerprints {
            h.update(fp.as_bytes());
            h.update(b"\n");
        }
        let key = format!("alert:drift:{}", hex::encode(&h.finalize()[..16]));
        if sent_here.contains(&key) {
            return false;
        }
        // Room in the queue first (the key is used up in the shared store): else a later
        // look sends it.
        let Ok(slot) = self.tx.try_reserve() else {
            return false;
        };
        if !first_to_send(store, sent_here, key, DRIFT_ALERT_KEY_TTL_MS).await {
            return false;
        }
        let list: Vec<String> = fingerprints
            .iter()
            .map(|(fp, n)| format!("{fp} ({n} replica{})", if *n == 1 { "" } else { "s" }))
            .collect();
        slot.send(Alerts::event(
            "policy_drift",
            format!(
                "replicas on this ledger enforce different policies: {}",
                list.join(", ")
            ),
            json!({
                "fingerprints": fingerprints.iter()
                    .map(|(fp, n)| json!({"fingerprint": fp, "replicas": n}))
                    .collect::<Vec<_>>(),
                "replica": replica,
            }),
        ));
        true
    }

    pub fn expired(&self, n: usize) {
        self.emit(
            "expired",
            format!("{n} reservation(s) expired (holder gone); charged in full"),
            json!({"expired_reservations": n}),
        );
    }

    /// Reports the store going down (once per outage) and coming back.
    pub fn store_state(&self, up: bool) {
        let was_down = self.store_down.swap(!up, Ordering::Relaxed);
        if !up && !was_down {
            self.emit(
                "store_unavailable",
                "the store is unavailable: nothing new is admitted".into(),
                json!({}),
            );
        } else if up && was_down {
            self.emit(
                "store_recovered",
                "the store is reachable again".into(),
                json!({}),
            );
        }
    }
}

/// The thresholds (per mille) that `line` has crossed.
pub fn crossed(line: &UsageLine, thresholds_permille: &[u32]) -> Vec<u32> {
    crossed_amounts(line.used.0, line.limit.0, thresholds_permille)
}

/// The thresholds (per mille) that `used` of `limit` has crossed (none without a limit).
pub fn crossed_amounts(used: u64, limit: u64, thresholds_permille: &[u32]) -> Vec<u32> {
    if limit == 0 {
        return Vec::new();
    }
    let used = u128::from(used) * 1000;
    thresholds_permille
        .iter()
        .copied()
        .filter(|t| used >= u128::from(limit) * u128::from(*t))
        .collect()
}

/// Whether this replica sends the alert of `key`: once across replicas by the store; but a
/// dedupe call whose outcome is unknown (a timeout may have consumed the key) must not lose
/// the alert: this replica sends it then, once, and remembers it locally.
pub(crate) async fn first_to_send(
    store: &Arc<dyn Store>,
    sent_here: &mut std::collections::HashSet<String>,
    key: String,
    ttl_ms: u64,
) -> bool {
    let send = match store.consume_once(key.clone(), ttl_ms).await {
        Ok(a) => a.value && !sent_here.contains(&key),
        Err(e) => {
            tracing::warn!(error = %e, "alert dedupe failed; sending from this replica");
            !sent_here.contains(&key)
        }
    };
    if send {
        if sent_here.len() >= SENT_HERE_MAX {
            sent_here.clear();
        }
        sent_here.insert(key);
    }
    send
}

/// A scope's spend in a window that crossed a threshold.
struct Crossing<'a> {
    scope: &'a ScopeKey,
    window: WindowId,
    used: u64,
    limit: u64,
    permille: u32,
}

impl Crossing<'_> {
    /// Sends the alert unless another replica (or this one) already did for this scope,
    /// window and threshold; whether it was sent.
    async fn send_once(
        &self,
        store: &Arc<dyn Store>,
        alerts: &Alerts,
        sent_here: &mut std::collections::HashSet<String>,
    ) -> bool {
        let (kind, t) = (self.scope.kind.name(), self.permille);
        let key = match self.scope.kind {
            ScopeKind::Global => format!("alert:global:{}:{t}", self.window),
            // Outside ids are hashed to a fixed length (a single-use key is bounded).
            _ => {
                let digest = hex::encode(&Sha256::digest(self.scope.id.as_bytes())[..16]);
                format!("alert:{kind}:{digest}:{}:{t}", self.window)
            }
        };
        // Room in the queue first: the key is used up in the shared store, so an alert
        // dropped after that would be sent by no replica. Without room, a later check (of
        // this replica or another) sends it.
        let Ok(slot) = alerts.tx.try_reserve() else {
            tracing::debug!(
                scope = kind,
                threshold = t,
                "alert queue full; threshold alert deferred"
            );
            return false;
        };
        // Remember the key past the window's reset (the window's id is in the key anyway).
        let resets_at = self.window.resets_at();
        if !first_to_send(store, sent_here, key, key_ttl_ms(resets_at)).await {
            return false;
        }
        let who = match self.scope.kind {
            ScopeKind::Global => kind.to_string(),
            _ => format!("{kind} {}", self.scope.id),
        };
        let mut detail = json!({
            "scope": kind,
            "window": self.window.to_string(),
            "threshold": f64::from(t) / 1000.0,
            "used_micros": self.used,
            "limit_micros": self.limit,
            "resets_at": resets_at.map(rfc3339),
        });
        if self.scope.kind != ScopeKind::Global {
            detail["id"] = json!(self.scope.id);
        }
        slot.send(Alerts::event(
            "threshold",
            format!(
                "{who} spend for {} crossed {}%: {} of {} micros",
                self.window,
                f64::from(t) / 10.0,
                self.used,
                self.limit
            ),
            detail,
        ));
        true
    }
}

/// How long a window's alert key must be remembered: past the window's reset.
pub(crate) fn key_ttl_ms(resets_at: Option<spendgate_core::UnixMs>) -> u64 {
    match resets_at {
        Some(r) => {
            r.0.saturating_sub(now_ms())
                .saturating_add(ALERT_KEY_GRACE_MS)
        }
        None => LIFETIME_ALERT_KEY_MS,
    }
}

/// What the expiry check saw last: the ids of the expired reservations the store listed, and
/// their count (`None` before the first look: what expired before this replica started is
/// not news).
#[derive(Default)]
struct ExpiredSeen {
    last: Option<(std::collections::HashSet<String>, u64)>,
}

impl ExpiredSeen {
    /// Alerts when reservations expired since the last check. The store holds an expired
    /// record until its run is purged ([`spendgate_core::RECORD_RETENTION_MS`] after it
    /// ended), so the count of expired records also falls as old ones go: new expiries are
    /// the listed ids not listed last time (or the count's growth, should more have expired
    /// than [`EXPIRED_LISTING_MAX`]). One replica per [`EXPIRED_ALERT_PERIOD_MS`] reports
    /// what it saw.
    async fn check(&mut self, store: &Arc<dyn Store>, alerts: &Alerts, now_ms: u64) {
        let Ok(summary) = store.summary().await else {
            return;
        };
        let count = summary.reservations.get("expired").copied().unwrap_or(0);
        let ids: std::collections::HashSet<String> = if count == 0 {
            Default::default()
        } else {
            let listed = store
                .reservations(Some(ReservationState::Expired), EXPIRED_LISTING_MAX)
                .await;
            let Ok(listed) = listed else {
                return;
            };
            listed.into_iter().map(|r| r.id.0).collect()
        };
        let new = match &self.last {
            None => 0,
            Some((seen, seen_count)) => {
                let unseen = ids.difference(seen).count() as u64;
                unseen.max(count.saturating_sub(*seen_count))
            }
        };
        self.last = Some((ids, count));
        if new == 0 {
            return;
        }
        let key = format!("alert:expired:{}", now_ms / EXPIRED_ALERT_PERIOD_MS);
        match store.consume_once(key, 2 * EXPIRED_ALERT_PERIOD_MS).await {
            Ok(a) if a.value => alerts.expired(new as usize),
            Ok(_) => {}
            Err(e) => tracing::warn!(
                error = %e,
                expired = new,
                "reservations expired; the alert could not be deduplicated"
            ),
        }
    }
}

/// Checks spend against the thresholds every `CHECK_EVERY`: global spend when `scopes` holds
/// `Global`, and the top spenders of every other kind it holds; sends each crossing once per
/// scope, threshold and window across replicas. Feeds `burn` the global budgets' spend and,
/// with `Global` watched, sends the burn-rate alert ([`crate::burn`]).
pub fn spawn_checker(
    store: Arc<dyn Store>,
    alerts: Alerts,
    thresholds_permille: Vec<u32>,
    scopes: Vec<ScopeKind>,
    burn: Arc<crate::Burn>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut checks = SUMMARY_EVERY_CHECKS - 1;
        let mut expired_seen = ExpiredSeen::default();
        let mut sent_here: std::collections::HashSet<String> = std::collections::HashSet::new();
        loop {
            tick.tick().await;
            let lines = match store.usage(vec![(ScopeKey::global(), 1)]).await {
                Ok(l) => {
                    alerts.store_state(true);
                    l
                }
                Err(e) if e.is_unavailable() => {
                    alerts.store_state(false);
                    continue;
                }
                Err(_) => continue,
            };
            burn.observe(now_ms(), &lines);
            checks += 1;
            if checks.is_multiple_of(SUMMARY_EVERY_CHECKS) {
                expired_seen.check(&store, &alerts, now_ms()).await;
            }
            if scopes.contains(&ScopeKind::Global) {
                for line in &lines {
                    for t in crossed(line, &thresholds_permille) {
                        let c = Crossing {
                            scope: &line.scope,
                            window: line.window,
                            used: line.used.0,
                            limit: line.limit.0,
                            permille: t,
                        };
                        c.send_once(&store, &alerts, &mut sent_here).await;
                    }
                }
                crate::burn::check(&store, &alerts, &mut sent_here, &burn.forecasts()).await;
            }
            if checks.is_multiple_of(SCOPE_CHECK_EVERY_CHECKS) {
                check_scopes(
                    &store,
                    &alerts,
                    &thresholds_permille,
                    &scopes,
                    &mut sent_here,
                )
                .await;
            }
        }
    })
}

/// The threshold alerts of the top spenders of every kind in `scopes` other than global.
async fn check_scopes(
    store: &Arc<dyn Store>,
    alerts: &Alerts,
    thresholds_permille: &[u32],
    scopes: &[ScopeKind],
    sent_here: &mut std::collections::HashSet<String>,
) {
    let mut sent = 0usize;
    for kind in scopes.iter().filter(|k| **k != ScopeKind::Global) {
        let Ok(top) = store.top_counters(Some(*kind), SCOPE_ALERT_TOP).await else {
            continue;
        };
        for (key, counter) in &top {
            for t in crossed_amounts(counter.used.0, counter.limit.0, thresholds_permille) {
                if sent >= SCOPE_ALERTS_PER_CHECK_MAX {
                    return;
                }
                let c = Crossing {
                    scope: &key.scope,
                    window: key.window,
                    used: counter.used.0,
                    limit: counter.limit.0,
                    permille: t,
                };
                if c.send_once(store, alerts, sent_here).await {
                    sent += 1;
                }
            }
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_core::{Micros, UnixMs, Window};

    /// A burst of overruns sends at most `OVERRUN_ALERTS_PER_PERIOD` alerts per period; the
    /// rest are counted into the next one sent.
    #[tokio::test]
    async fn overrun_alerts_are_bounded_and_count_the_rest() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let alerts = Alerts::start(reqwest::Client::new(), None);
        for i in 0..OVERRUN_ALERTS_PER_PERIOD + 5 {
            alerts.overrun(&format!("s{i}"), 1, 2);
        }
        let o = *alerts.overruns.lock().expect("lock");
        assert_eq!((o.1, o.2), (OVERRUN_ALERTS_PER_PERIOD, 5));
        // A new period: the next alert goes out and carries the five.
        alerts.overruns.lock().expect("lock").0 -= OVERRUN_ALERT_PERIOD;
        alerts.overrun("next", 1, 2);
        let o = *alerts.overruns.lock().expect("lock");
        assert_eq!((o.1, o.2), (1, 0));
    }

    /// Alerts whose queue the test drains itself (no sender task).
    fn held_queue() -> (Alerts, mpsc::Receiver<Value>) {
        let (tx, rx) = mpsc::channel::<Value>(ALERT_QUEUE_MAX);
        let alerts = Alerts {
            tx,
            store_down: Arc::new(AtomicBool::new(false)),
            overruns: Arc::new(std::sync::Mutex::new((std::time::Instant::now(), 0, 0))),
        };
        (alerts, rx)
    }

    fn events(rx: &mut mpsc::Receiver<Value>, kind: &str) -> Vec<Value> {
        let mut got = Vec::new();
        while let Ok(v) = rx.try_recv() {
            if v["event"] == kind {
                got.push(v);
            }
        }
        got
    }

    /// A threshold alert is not marked sent (in the store shared by replicas) while the queue
    /// has no room for it: it waits for a later check instead of being lost.
    #[tokio::test]
    async fn a_threshold_alert_waits_for_room_in_the_queue() {
        let (alerts, mut rx) = held_queue();
        let store: Arc<dyn Store> = Arc::new(spendgate_store::MemoryStore::new(
            spendgate_core::Policy::default(),
            Arc::new(spendgate_store::SystemClock),
        ));
        for i in 0..ALERT_QUEUE_MAX {
            alerts.emit("filler", format!("filler {i}"), json!({}));
        }
        let global = ScopeKey::global();
        let crossing = Crossing {
            scope: &global,
            window: Window::Day.at(UnixMs(now_ms())),
            used: 800,
            limit: 1000,
            permille: 800,
        };
        let mut sent_here = std::collections::HashSet::new();
        assert!(
            !crossing.send_once(&store, &alerts, &mut sent_here).await,
            "a full queue: not sent"
        );
        // The webhook sender takes one: the next check sends the alert, once.
        assert!(rx.recv().await.is_some());
        assert!(crossing.send_once(&store, &alerts, &mut sent_here).await);
        let t = events(&mut rx, "threshold");
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(
            (t[0]["threshold"].as_f64(), t[0]["used_micros"].as_u64()),
            (Some(0.8), Some(800))
        );
        assert!(
            !crossing.send_once(&store, &alerts, &mut sent_here).await,
            "once"
        );
        assert!(events(&mut rx, "threshold").is_empty());
    }

    /// A reservation that expires as an older expired one is purged leaves the count of
    /// expired records unchanged; it is alerted all the same.
    #[tokio::test]
    async fn an_expiry_coinciding_with_a_purge_is_alerted() {
        use spendgate_core::{
            IpScope, ReservationId, RunId, RunRequest, StepKind, StepRequest, ToolPrice,
            RECORD_RETENTION_MS,
        };
        let (alerts, mut rx) = held_queue();
        // 2026-11-30T12:00:00Z
        let t0 = UnixMs(1_796_040_000_000);
        let clock = spendgate_store::ManualClock::new(t0);
        use spendgate_store::Clock;
        let policy = spendgate_core::Policy::default();
        let lease = policy.lease_ttl_ms;
        let store: Arc<dyn Store> = Arc::new(spendgate_store::MemoryStore::new(
            policy,
            Arc::new(clock.clone()),
        ));
        // A run with one held step, left to expire.
        let open = |run: &'static str| {
            let store = store.clone();
            async move {
                let req = RunRequest {
                    run_id: RunId(run.into()),
                    session: format!("session-{run}"),
                    ips: vec![IpScope {
                        prefix: "192.0.2.1/32".into(),
                        factor: 1,
                    }],
                    conversation: format!("conversation-{run}"),
                    input_bytes: 10,
                };
                let admitted = store.admit_run(req, None).await.expect("store");
                assert!(admitted.value.is_ok(), "{admitted:?}");
                let step = StepRequest {
                    run_id: RunId(run.into()),
                    step_id: ReservationId(format!("{run}-step")),
                    kind: StepKind::Tool {
                        tool: "t".into(),
                        price: ToolPrice {
                            per_call: Micros(10_000),
                            per_unit: Micros(0),
                        },
                        units: 0,
                    },
                };
                let reserved = store.reserve_step(step, None).await.expect("store");
                assert!(reserved.value.is_ok(), "{reserved:?}");
            }
        };
        let mut seen = ExpiredSeen::default();
        open("a").await;
        seen.check(&store, &alerts, clock.now().0).await;
        clock.advance_ms(lease + 1000);
        store.sweep().await.expect("sweep");
        let expired_a = clock.now();
        seen.check(&store, &alerts, clock.now().0).await;
        let e = events(&mut rx, "expired");
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0]["expired_reservations"], 1);
        // Run b's lease runs out exactly when run a's records are purged: one sweep does both.
        clock.set(UnixMs(expired_a.0 + RECORD_RETENTION_MS - lease));
        open("b").await;
        clock.set(UnixMs(expired_a.0 + RECORD_RETENTION_MS));
        store.sweep().await.expect("sweep");
        let summary = store.summary().await.expect("summary");
        assert_eq!(
            summary.reservations.get("expired"),
            Some(&1),
            "a purged, b expired"
        );
        seen.check(&store, &alerts, clock.now().0).await;
        let e = events(&mut rx, "expired");
        assert_eq!(e.len(), 1, "b's expiry is alerted: {e:?}");
        assert_eq!(e[0]["expired_reservations"], 1);
        // Nothing new: no alert.
        clock.advance_ms(EXPIRED_ALERT_PERIOD_MS);
        seen.check(&store, &alerts, clock.now().0).await;
        assert!(events(&mut rx, "expired").is_empty());
    }

    /// A policy drift is alerted once across replicas (two replicas' alerts on one store),
    /// and again for another set of fingerprints (another episode).
    #[tokio::test]
    async fn a_policy_drift_is_alerted_once_across_replicas() {
        let store: Arc<dyn Store> = Arc::new(spendgate_store::MemoryStore::new(
            spendgate_core::Policy::default(),
            Arc::new(spendgate_store::SystemClock),
        ));
        let (a, mut rx_a) = held_queue();
        let (b, mut rx_b) = held_queue();
        let (mut sent_a, mut sent_b) = (Default::default(), Default::default());
        let two = vec![("f1".to_string(), 1), ("f2".to_string(), 2)];
        assert!(a.policy_drift(&store, &mut sent_a, &two, "ra").await);
        assert!(!a.policy_drift(&store, &mut sent_a, &two, "ra").await);
        assert!(!b.policy_drift(&store, &mut sent_b, &two, "rb").await);
        let got = events(&mut rx_a, "policy_drift");
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0]["fingerprints"][1]["replicas"], 2);
        assert_eq!(got[0]["replica"], "ra");
        assert!(events(&mut rx_b, "policy_drift").is_empty());
        let three = vec![("f1".to_string(), 1), ("f3".to_string(), 2)];
        assert!(b.policy_drift(&store, &mut sent_b, &three, "rb").await);
        assert_eq!(events(&mut rx_b, "policy_drift").len(), 1);
    }

    #[test]
    fn crossing() {
        let line = UsageLine {
            scope: ScopeKey::global(),
            window: Window::Day.at(UnixMs(0)),
            limit: Micros(1000),
            used: Micros(800),
            reserved: Micros(100),
            overrun: false,
            resets_at: None,
        };
        assert_eq!(crossed(&line, &[500, 800, 1000]), vec![500, 800]);
        let zero = UsageLine {
            limit: Micros(0),
            ..line
        };
        assert!(crossed(&zero, &[500]).is_empty());
    }
}
