//! The ledger's invariants, checked over the whole of it.

use super::model::{CounterKey, ReservationId, ReservationKind, ReservationState};
use super::{HashMap, HashSet, Ledger};
use crate::money::{Micros, MICROS_MAX};

impl Ledger {
    /// Checks I1 and I2 over the whole ledger; returns the first violation found. Used by
    /// tests and debug assertions; O(size of the ledger).
    pub fn check_invariants(&self) -> Result<(), String> {
        // Each run's list of steps holds exactly its step reservations, each once.
        let mut listed = 0usize;
        for (run_id, steps) in &self.run_steps {
            if !self.runs.contains_key(run_id) {
                return Err(format!(
                    "steps are listed for run {}, which does not exist",
                    run_id.0
                ));
            }
            let mut seen: HashSet<&ReservationId> = HashSet::default();
            for s in steps {
                let is_step = self
                    .reservations
                    .get(s)
                    .is_some_and(|r| r.run_id == *run_id && r.kind != ReservationKind::RunHold);
                if !is_step {
                    return Err(format!(
                        "run {} lists {}, not one of its steps",
                        run_id.0, s.0
                    ));
                }
                if !seen.insert(s) {
                    return Err(format!("run {} lists {} twice", run_id.0, s.0));
                }
            }
            listed += steps.len();
        }
        let steps = self
            .reservations
            .values()
            .filter(|r| r.kind != ReservationKind::RunHold && self.runs.contains_key(&r.run_id))
            .count();
        if listed != steps {
            return Err(format!(
                "{listed} steps are listed among runs, {steps} exist"
            ));
        }
        // Per counter: charged, held, and whether an overrun was charged to it (an overrun
        // may take used + reserved past the limit while used is still within it).
        let mut sums: HashMap<&CounterKey, (u64, u64, bool)> = HashMap::default();
        for r in self.reservations.values() {
            for k in &r.counters {
                let e = sums.entry(k).or_default();
                if r.state == ReservationState::Held {
                    e.1 += r.amount.0;
                } else {
                    e.0 += r.charged.0;
                }
                e.2 |= r.overrun;
            }
            let terminal_ok = match r.state {
                ReservationState::Held | ReservationState::Committed => true,
                ReservationState::Released => r.charged == Micros::ZERO,
                ReservationState::Unknown | ReservationState::Expired => r.charged >= r.amount,
            };
            if !terminal_ok {
                return Err(format!(
                    "reservation {:?} in {:?} charged {}",
                    r.id, r.state, r.charged
                ));
            }
        }
        for (k, c) in &self.counters {
            let (charged, held, overran) = sums.get(k).copied().unwrap_or_default();
            if !c.overrun && !overran && c.used.0 + c.reserved.0 > c.limit.0 {
                return Err(format!("I1 violated on {k:?}: {c:?}"));
            }
            if c.reserved.0 != held {
                return Err(format!(
                    "reserved on {k:?} is {} but held reservations sum to {held}",
                    c.reserved
                ));
            }
            // (a counter saturated at MICROS_MAX no longer adds up)
            let expect = i128::from(charged) + i128::from(c.adjusted);
            if c.used < MICROS_MAX && i128::from(c.used.0) != expect {
                return Err(format!(
                    "I2: used on {k:?} is {} but charges sum to {charged} and adjustments to {}",
                    c.used, c.adjusted
                ));
            }
        }
        Ok(())
    }
}
