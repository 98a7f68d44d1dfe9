//! Running totals behind the summary, kept as reservations change.

use super::messages::Summary;
use super::model::{Reservation, ReservationKind, ReservationState, RunState};
use super::Ledger;
use crate::money::{Micros, MICROS_MAX};
use crate::window::UnixMs;
use std::collections::HashMap as StdHashMap;

/// Running totals behind [`Ledger::summary`], kept as records change so a summary (read by
/// `/metrics`, the dashboard and the alert checker) never scans the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Stats {
    pub(super) by_state: [u64; 5],
    pub(super) held: u64,
    pub(super) charged: u64,
    pub(super) overruns: u64,
    pub(super) runs_active: u64,
}

fn state_index(s: ReservationState) -> usize {
    match s {
        ReservationState::Held => 0,
        ReservationState::Committed => 1,
        ReservationState::Released => 2,
        ReservationState::Unknown => 3,
        ReservationState::Expired => 4,
    }
}

const STATES: [ReservationState; 5] = [
    ReservationState::Held,
    ReservationState::Committed,
    ReservationState::Released,
    ReservationState::Unknown,
    ReservationState::Expired,
];

impl Stats {
    /// Adds (`add`) or removes a reservation's share of the totals.
    pub(super) fn count(&mut self, r: &Reservation, add: bool) {
        let step = |v: &mut u64, by: u64| {
            *v = if add {
                v.saturating_add(by)
            } else {
                v.saturating_sub(by)
            };
        };
        step(&mut self.by_state[state_index(r.state)], 1);
        if r.kind == ReservationKind::RunHold {
            return;
        }
        if r.state == ReservationState::Held {
            step(&mut self.held, r.amount.0);
        }
        step(&mut self.charged, r.charged.0);
        step(&mut self.overruns, u64::from(r.overrun));
    }
}

impl Ledger {
    /// Totals of the ledger, from running counts (O(1)).
    pub fn summary(&self, now: UnixMs) -> Summary {
        let _ = now;
        let st = &self.stats;
        let mut reservations = StdHashMap::new();
        for state in STATES {
            let n = st.by_state[state_index(state)];
            if n > 0 {
                reservations.insert(state.name().to_string(), n);
            }
        }
        debug_assert!(
            self.summary_matches_scan(st),
            "running totals drifted from the records"
        );
        Summary {
            seq: self.seq,
            cutoff: self.cutoff.clone(),
            runs_active: st.runs_active,
            reservations,
            held_micros: Micros(st.held.min(MICROS_MAX.0)),
            charged_micros: Micros(st.charged.min(MICROS_MAX.0)),
            overruns: st.overruns,
        }
    }

    /// Recomputes the totals by scanning (debug builds check the running ones against it on
    /// ledgers small enough to scan).
    fn summary_matches_scan(&self, st: &Stats) -> bool {
        if self.reservations.len() > 10_000 {
            return true;
        }
        let mut scan = Stats::default();
        for r in self.reservations.values() {
            scan.count(r, true);
        }
        scan.runs_active = self
            .runs
            .values()
            .filter(|r| r.state == RunState::Active)
            .count() as u64;
        scan == *st
    }
}
