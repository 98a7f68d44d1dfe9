//! `memory`: the ledger in process memory behind a mutex. For tests and throwaway runs; it
//! keeps nothing across restarts.
//!
//! With a history ([`MemoryStore::with_history`]) it keeps the usage history in memory too:
//! the last [`MEMORY_HISTORY_MAX`] records (reservations, runs and adjustments together; the
//! oldest is dropped first) and the refusal counts of the last [`MEMORY_REFUSAL_MINUTES_MAX`]
//! minute, code and scope kind entries (the oldest minute first).

use crate::history::{page_of, HistoryFilter, HistoryReader, HistoryTap, Page};
use crate::{Clock, Store, StoreError};
use async_trait::async_trait;
use spendgate_core::history::{
    AdjustmentRecord, HistoryEvent, RefusalMinute, ReservationRecord, RunRecord,
};
use spendgate_core::{Command, Ledger, Policy, Reply, UnixMs};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

/// Records (reservations, runs, adjustments) a memory store's history keeps at most; past it
/// the oldest is dropped.
pub const MEMORY_HISTORY_MAX: usize = 100_000;
/// Refusal counts (minute, code, scope kind) a memory store's history keeps at most; past it
/// the oldest minute's are dropped.
pub const MEMORY_REFUSAL_MINUTES_MAX: usize = 10_000;

pub struct MemoryStore {
    policy: Policy,
    clock: Arc<dyn Clock>,
    ledger: Mutex<Ledger>,
    history: Option<Arc<MemoryHistory>>,
    tap: RwLock<Option<Arc<dyn HistoryTap>>>,
}

impl MemoryStore {
    pub fn new(policy: Policy, clock: Arc<dyn Clock>) -> MemoryStore {
        MemoryStore {
            policy,
            clock,
            ledger: Mutex::new(Ledger::new()),
            history: None,
            tap: RwLock::new(None),
        }
    }

    /// A memory store that keeps a usage history (bounded: see the module).
    pub fn with_history(policy: Policy, clock: Arc<dyn Clock>) -> MemoryStore {
        MemoryStore {
            ledger: Mutex::new(Ledger::new().with_history()),
            history: Some(Arc::new(MemoryHistory::new(MEMORY_HISTORY_MAX))),
            ..MemoryStore::new(policy, clock)
        }
    }

    /// Runs `f` over the ledger (for tests that check invariants directly).
    pub fn inspect<T>(&self, f: impl FnOnce(&Ledger) -> T) -> T {
        let guard = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        f(&guard)
    }

    /// Hands what the last call made to the history and the tap (under the ledger's lock, so
    /// in the order the ledger made it).
    fn drain(&self, ledger: &mut Ledger) {
        let Some(history) = &self.history else {
            return;
        };
        let events = ledger.take_history();
        if events.is_empty() {
            return;
        }
        history.add(&events);
        let tap = self.tap.read().unwrap_or_else(|p| p.into_inner());
        if let Some(tap) = tap.as_ref() {
            tap.seen(&events);
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
        // A poisoned lock means a panic mid-operation; the ledger's operations check before
        // they write, so the state is still whole.
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.clock.now();
        let reply = crate::apply_to(&mut ledger, &self.policy, now, &cmd);
        self.drain(&mut ledger);
        reply
    }
    async fn execute_many(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        cmds.iter()
            .map(|cmd| {
                let reply = crate::apply_to(&mut ledger, &self.policy, self.clock.now(), cmd);
                self.drain(&mut ledger);
                reply
            })
            .collect()
    }
    async fn ready(&self) -> Result<(), StoreError> {
        Ok(())
    }
    fn kind(&self) -> &'static str {
        "memory"
    }
    fn history(&self) -> Option<Arc<dyn HistoryReader>> {
        self.history.clone().map(|h| h as Arc<dyn HistoryReader>)
    }
    fn tap_history(&self, tap: Arc<dyn HistoryTap>) {
        *self.tap.write().unwrap_or_else(|p| p.into_inner()) = Some(tap);
    }
}

/// A memory store's history: the last records, by key, in the order they were first made.
pub struct MemoryHistory {
    max: usize,
    state: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    records: HashMap<String, HistoryEvent>,
    /// Keys in the order they were first made (the front is dropped first).
    order: VecDeque<String>,
    refusals: BTreeMap<RefusalMinute, u64>,
}

impl MemoryHistory {
    /// A history of `max` records at most (at least 1).
    pub fn new(max: usize) -> MemoryHistory {
        MemoryHistory {
            max: max.max(1),
            state: Mutex::new(Kept::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Kept> {
        // (plain maps, whole whatever panicked while holding them)
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `events`: a reservation's second record merges into its first (the larger
    /// charge), a run's or an adjustment's is kept once, refusal counts add up.
    pub fn add(&self, events: &[HistoryEvent]) {
        let mut kept = self.lock();
        for e in events {
            if let HistoryEvent::Refusals { at, count } = e {
                *kept.refusals.entry(*at).or_insert(0) += count;
                while kept.refusals.len() > MEMORY_REFUSAL_MINUTES_MAX {
                    kept.refusals.pop_first();
                }
                continue;
            }
            let key = e.key();
            match (kept.records.get_mut(&key), e) {
                (Some(HistoryEvent::Reservation(old)), HistoryEvent::Reservation(new)) => {
                    old.merge(new)
                }
                (Some(_), _) => {}
                (None, _) => {
                    kept.records.insert(key.clone(), e.clone());
                    kept.order.push_back(key);
                }
            }
            while kept.order.len() > self.max {
                if let Some(old) = kept.order.pop_front() {
                    kept.records.remove(&old);
                }
            }
        }
    }
}

#[async_trait]
impl HistoryReader for MemoryHistory {
    async fn reservations(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<ReservationRecord>, StoreError> {
        let items = self
            .lock()
            .records
            .values()
            .filter_map(|e| match e {
                HistoryEvent::Reservation(r) if filter.selects(r) => {
                    Some((r.resolved_at, r.id.0.clone(), r.clone()))
                }
                _ => None,
            })
            .collect();
        page_of(items, after, limit)
    }

    async fn runs(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<RunRecord>, StoreError> {
        let items = self
            .lock()
            .records
            .values()
            .filter_map(|e| match e {
                HistoryEvent::Run(r) if filter.selects_run(r) => {
                    Some((r.ended_at, r.id.0.clone(), r.clone()))
                }
                _ => None,
            })
            .collect();
        page_of(items, after, limit)
    }

    async fn refusals(
        &self,
        since: UnixMs,
        until: UnixMs,
    ) -> Result<Vec<(RefusalMinute, u64)>, StoreError> {
        Ok(self
            .lock()
            .refusals
            .iter()
            .filter(|(m, _)| m.minute >= since && m.minute < until)
            .map(|(m, n)| (*m, *n))
            .collect())
    }

    async fn adjustments(
        &self,
        since: UnixMs,
        until: UnixMs,
        limit: usize,
    ) -> Result<Vec<AdjustmentRecord>, StoreError> {
        let items = self
            .lock()
            .records
            .values()
            .filter_map(|e| match e {
                HistoryEvent::Adjustment(a) if a.at >= since && a.at < until => {
                    Some((a.at, a.id.clone(), a.clone()))
                }
                _ => None,
            })
            .collect();
        Ok(page_of(items, None, limit)?.items)
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_core::history::StepClass;
    use spendgate_core::{Micros, RefusalCode, ReservationId, ReservationState, RunId};

    fn record(id: &str, at: u64, charged: u64) -> HistoryEvent {
        HistoryEvent::Reservation(ReservationRecord {
            id: ReservationId(id.into()),
            run_id: RunId("r".into()),
            session: "s".into(),
            conversation: "c".into(),
            address: "a".into(),
            class: StepClass::Tool,
            name: "t".into(),
            retry: false,
            usage: None,
            units: None,
            result_bytes: None,
            reserved: Micros(10),
            charged: Micros(charged),
            state: ReservationState::Committed,
            created: UnixMs(0),
            resolved_at: UnixMs(at),
            overrun: false,
            result_too_large: false,
            counters: vec![],
        })
    }

    #[tokio::test]
    async fn keeps_the_last_records_merged_and_pages_them_in_time_order() {
        let h = MemoryHistory::new(3);
        h.add(&[record("a", 5, 1), record("b", 1, 2), record("c", 3, 3)]);
        h.add(&[record("b", 1, 9), record("b", 1, 4)]);
        h.add(&[record("d", 2, 4)]);
        let all = HistoryFilter::period(UnixMs(0), UnixMs(100));
        let first = h.reservations(&all, None, 2).await.expect("page");
        let ids: Vec<(&str, u64)> = first
            .items
            .iter()
            .map(|r| (r.id.0.as_str(), r.charged.0))
            .collect();
        // ("a", the oldest made, was dropped; "b" kept its larger charge)
        assert_eq!(ids, [("b", 9), ("d", 4)]);
        let next = first.next.expect("a second page");
        let second = h.reservations(&all, Some(&next), 2).await.expect("page");
        assert_eq!(second.items.len(), 1);
        assert_eq!(second.items[0].id.0, "c");
        assert!(second.next.is_none());
        assert!(h.reservations(&all, Some("x"), 2).await.is_err());
        let m = RefusalMinute::of(UnixMs(61_000), RefusalCode::RateLimited, None);
        h.add(&[
            HistoryEvent::Refusals { at: m, count: 2 },
            HistoryEvent::Refusals { at: m, count: 3 },
        ]);
        let counts = h.refusals(UnixMs(60_000), UnixMs(120_000)).await;
        assert_eq!(counts.expect("counts"), [(m, 5)]);
    }
}
