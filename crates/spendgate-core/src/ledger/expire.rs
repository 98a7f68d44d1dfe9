//! Time: the ledger's clock, leases that run out, records that are purged, and the sweep.

use super::messages::Applied;
use super::model::{RunId, RunState};
use super::records::Entity;
use super::{Ledger, Timer, COMPACT_EVERY_MS, EXPIRIES_PER_CALL_MAX, SWEEP_EXPIRIES_MAX};
use crate::money::Micros;
use crate::window::UnixMs;

impl Ledger {
    /// Moves the clock forward (never back: a clock that steps back is held at the last value)
    /// and processes due expiries. Returns the effective `now`.
    pub(super) fn advance(&mut self, now: UnixMs) -> (UnixMs, bool) {
        let now = now.max(self.clock);
        if now != self.clock {
            self.clock = now;
            self.touch(Entity::Meta);
        }
        let changed = self.expire_due(now, EXPIRIES_PER_CALL_MAX) > 0;
        (now, changed)
    }

    /// [`Ledger::advance`], then the run the call is about: its lease may have run out behind
    /// more due timers than one call processes (`EXPIRIES_PER_CALL_MAX`); it expires now,
    /// before the call looks at it, so no call acts on a run whose lease is over (I6), whatever
    /// the backlog and whenever the sweeper last ran.
    pub(super) fn advance_for(&mut self, now: UnixMs, run_id: &RunId) -> (UnixMs, bool) {
        let (now, changed) = self.advance(now);
        (now, self.lapse(run_id, now) || changed)
    }

    /// Expires `run_id` when it is active and its lease is over; whether it did.
    pub(super) fn lapse(&mut self, run_id: &RunId, now: UnixMs) -> bool {
        let lapsed = self
            .runs
            .get(run_id)
            .is_some_and(|r| r.state == RunState::Active && r.lease_until <= now);
        if lapsed {
            self.end_run(run_id, now, RunState::Expired);
            self.bump();
        }
        lapsed
    }

    /// Processes up to `max` due timers: expires runs whose lease ran out (charging their held
    /// reservations in full and freeing their slots), purges old records.
    pub(super) fn expire_due(&mut self, now: UnixMs, max: usize) -> usize {
        let mut done = 0;
        while done < max {
            let Some((at, _)) = self.timers.first() else {
                break;
            };
            if *at > now {
                break;
            }
            let Some((_, timer)) = self.timers.pop_first() else {
                break;
            };
            match timer {
                Timer::Lease(run_id) => {
                    if self
                        .runs
                        .get(&run_id)
                        .is_some_and(|r| r.state == RunState::Active)
                    {
                        self.end_run(&run_id, now, RunState::Expired);
                        self.bump();
                        done += 1;
                    }
                }
                // Dropping records is a change of the ledger too: `ledger_seq` moves with it.
                Timer::Purge(run_id) => {
                    self.purge_run(&run_id);
                    self.bump();
                    done += 1;
                }
                Timer::Idempotency(key) => {
                    if self.idempotency.get(&key).is_some_and(|r| r.expires <= now) {
                        self.idempotency.remove(&key);
                        self.touch(Entity::Idempotency(key));
                        self.bump();
                        done += 1;
                    }
                }
            }
        }
        done
    }

    /// Runs due expiries (at most [`SWEEP_EXPIRIES_MAX`]) and drops idle rate state and
    /// counters of long-ended windows.
    /// Called periodically by the store's sweeper; idempotent. Returns whether anything changed.
    pub fn sweep(&mut self, now: UnixMs) -> Applied<usize> {
        // Not `advance`: it would process (up to a batch of) the due timers itself and leave
        // none for the count below.
        let now = now.max(self.clock);
        if now != self.clock {
            self.clock = now;
            self.touch(Entity::Meta);
        }
        let mut n = self.expire_due(now, SWEEP_EXPIRIES_MAX);
        // Counters of windows that ended more than RECORD_RETENTION_MS ago and hold nothing.
        let mut stale = Vec::new();
        for (end, key) in &self.ending {
            if *end > now {
                break;
            }
            if self
                .counters
                .get(key)
                .is_none_or(|c| c.reserved == Micros::ZERO)
            {
                stale.push((*end, key.clone()));
            }
        }
        for (end, key) in stale {
            self.ending.remove(&(end, key.clone()));
            if self.counters.remove(&key).is_some() {
                n += 1;
                self.touch(Entity::Counter(key));
            }
        }
        // Dropping idle rate state scans every rate: at most once per COMPACT_EVERY_MS, so a
        // frequent sweeper does not stall the store (idle state decides nothing: dropping it
        // early or late changes no answer).
        if self
            .compacted
            .is_some_and(|c| now.0 < c.0.saturating_add(COMPACT_EVERY_MS))
        {
            return Applied {
                value: n,
                seq: self.seq,
                changed: n > 0,
            };
        }
        self.compacted = Some(now);
        let now_us = now.0.saturating_mul(1000);
        let idle: Vec<String> = self
            .rates
            .iter()
            .filter(|(_, t)| **t <= now_us)
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            self.rates.remove(&k);
            self.touch(Entity::Rate(k));
        }
        Applied {
            value: n,
            seq: self.seq,
            changed: n > 0,
        }
    }
}
