//! Reads: usage of scopes, listings of reservations and counters.

use super::messages::UsageLine;
use super::model::{
    run_scopes, Counter, CounterKey, Reservation, ReservationId, ReservationState, Run, RunId,
};
use super::Ledger;
use crate::scope::{IpScope, Policy, ScopeKey, ScopeKind};
use crate::window::UnixMs;

impl Ledger {
    /// Every budget counter that applies to these scopes in the current windows.
    pub fn usage(
        &self,
        policy: &Policy,
        now: UnixMs,
        scopes: &[(ScopeKey, u64)],
    ) -> Vec<UsageLine> {
        let now = now.max(self.clock);
        Self::budget_counters(policy, scopes, now)
            .into_iter()
            .map(|(k, limit)| {
                let c = self.counter_view(&k, limit);
                UsageLine {
                    resets_at: k.window.resets_at(),
                    scope: k.scope,
                    window: k.window,
                    limit,
                    used: c.used,
                    reserved: c.reserved,
                    overrun: c.overrun,
                }
            })
            .collect()
    }

    /// The scope list of a request, in the order usage is reported.
    pub fn request_scopes(
        session: &str,
        ips: &[IpScope],
        conversation: Option<&str>,
    ) -> Vec<(ScopeKey, u64)> {
        let mut v = run_scopes(session, ips, conversation.unwrap_or(""));
        if conversation.is_none() {
            v.pop();
        }
        v
    }

    pub fn reservations(&self, state: Option<ReservationState>, limit: usize) -> Vec<Reservation> {
        let mut v: Vec<&Reservation> = self
            .reservations
            .values()
            .filter(|r| state.is_none_or(|s| r.state == s))
            .collect();
        // (the newest `limit` in O(n), not a sort of every reservation: a dashboard listing
        // runs on the store's writer, between admissions)
        first_in_order(&mut v, limit, |a, b| {
            b.created.cmp(&a.created).then_with(|| a.id.cmp(&b.id))
        });
        v.into_iter().take(limit).cloned().collect()
    }

    pub fn reservation(&self, id: &ReservationId) -> Option<&Reservation> {
        self.reservations.get(id)
    }

    pub fn run(&self, id: &RunId) -> Option<&Run> {
        self.runs.get(id)
    }

    /// The counters of one scope kind with the most used, for the current windows and all.
    pub fn top_counters(&self, kind: Option<ScopeKind>, top: usize) -> Vec<(CounterKey, Counter)> {
        let mut v: Vec<(&CounterKey, &Counter)> = self
            .counters
            .iter()
            .filter(|(k, _)| kind.is_none_or(|kd| k.scope.kind == kd))
            .collect();
        let order = |a: &(&CounterKey, &Counter), b: &(&CounterKey, &Counter)| {
            (b.1.used.add_capped(b.1.reserved))
                .cmp(&a.1.used.add_capped(a.1.reserved))
                .then_with(|| a.0.cmp(b.0))
        };
        first_in_order(&mut v, top, order);
        v.into_iter()
            .take(top)
            .map(|(k, c)| (k.clone(), *c))
            .collect()
    }

    pub fn counter(&self, key: &CounterKey) -> Option<Counter> {
        self.counters.get(key).copied()
    }
}

/// Leaves in `v` its first `n` elements in `order`, sorted: the selection in linear time,
/// then only those sorted (the ledger may hold millions of counters, and this runs on a
/// store's one writer).
fn first_in_order<T>(v: &mut Vec<T>, n: usize, order: impl Fn(&T, &T) -> std::cmp::Ordering) {
    if n < v.len() {
        if n == 0 {
            v.clear();
            return;
        }
        v.select_nth_unstable_by(n - 1, &order);
        v.truncate(n);
    }
    v.sort_by(&order);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_in_order_selects_and_sorts() {
        let desc = |a: &u32, b: &u32| b.cmp(a);
        let all: Vec<u32> = (0..1000).map(|i| (i * 7919) % 1000).collect();
        for n in [0, 1, 2, 10, 999, 1000, 5000] {
            let mut v = all.clone();
            first_in_order(&mut v, n, desc);
            let mut want = all.clone();
            want.sort_by(desc);
            want.truncate(n);
            assert_eq!(v, want, "n = {n}");
        }
    }
}
