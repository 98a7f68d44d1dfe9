//! The durable form of the ledger: which entities changed, their records, and a ledger
//! rebuilt from them.

use super::messages::IdempotencyRecord;
use super::model::{
    stale_from, Counter, CounterKey, Reservation, ReservationId, ReservationKind, Run, RunId,
    RunState,
};
use super::stats::Stats;
use super::{Ledger, Timer, RECORD_RETENTION_MS};
use crate::window::UnixMs;
use serde::{Deserialize, Serialize};

/// A record that changed and must be written by a durable store.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Entity {
    Meta,
    Counter(CounterKey),
    Rate(String),
    Run(RunId),
    Reservation(ReservationId),
    Idempotency(String),
}

/// The durable form of one entity (what a store writes and reads back).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    Meta {
        seq: u64,
        cutoff: Option<String>,
        clock: UnixMs,
    },
    Counter(CounterKey, Counter),
    Rate(String, u64),
    Run(Run),
    Reservation(Reservation),
    Idempotency(IdempotencyRecord),
}

/// A [`Record`] borrowed from the ledger, for writing without cloning: the same variants in
/// the same order with the same fields, so that it serializes to exactly the bytes of the
/// owned record (a store decodes what it wrote as a [`Record`]).
#[derive(Clone, Copy, Debug, Serialize)]
pub enum RecordRef<'a> {
    Meta {
        seq: u64,
        cutoff: &'a Option<String>,
        clock: UnixMs,
    },
    Counter(&'a CounterKey, &'a Counter),
    Rate(&'a String, u64),
    Run(&'a Run),
    Reservation(&'a Reservation),
    Idempotency(&'a IdempotencyRecord),
}

impl Entity {
    /// A stable text key for the entity, unique across kinds.
    pub fn storage_key(&self) -> String {
        let mut key = String::new();
        self.write_storage_key(&mut key);
        key
    }

    /// Appends [`Entity::storage_key`] to `out` (no allocation of its own).
    pub fn write_storage_key(&self, out: &mut String) {
        use std::fmt::Write;
        match self {
            Entity::Meta => out.push('m'),
            Entity::Counter(k) => {
                // Writing into a String cannot fail.
                let _ = write!(
                    out,
                    "c|{}|{}|{}",
                    k.scope,
                    k.window.window.name(),
                    k.window.index
                );
            }
            Entity::Rate(k) => {
                out.push_str("g|");
                out.push_str(k);
            }
            Entity::Run(id) => {
                out.push_str("r|");
                out.push_str(&id.0);
            }
            Entity::Reservation(id) => {
                out.push_str("s|");
                out.push_str(&id.0);
            }
            Entity::Idempotency(k) => {
                out.push_str("i|");
                out.push_str(k);
            }
        }
    }
}

impl Record {
    pub fn entity(&self) -> Entity {
        match self {
            Record::Meta { .. } => Entity::Meta,
            Record::Counter(k, _) => Entity::Counter(k.clone()),
            Record::Rate(k, _) => Entity::Rate(k.clone()),
            Record::Run(r) => Entity::Run(r.id.clone()),
            Record::Reservation(r) => Entity::Reservation(r.id.clone()),
            Record::Idempotency(r) => Entity::Idempotency(r.key.clone()),
        }
    }
}

impl Ledger {
    /// The entities changed since the last call (read each with [`Ledger::record_ref`]).
    pub fn take_dirty(&mut self) -> Vec<Entity> {
        self.dirty.drain().collect()
    }

    /// The current record of an entity, borrowed (`None`: it does not exist).
    pub fn record_ref(&self, e: &Entity) -> Option<RecordRef<'_>> {
        Some(match e {
            Entity::Meta => RecordRef::Meta {
                seq: self.seq,
                cutoff: &self.cutoff,
                clock: self.clock,
            },
            Entity::Counter(k) => {
                let (k, c) = self.counters.get_key_value(k)?;
                RecordRef::Counter(k, c)
            }
            Entity::Rate(k) => {
                let (k, t) = self.rates.get_key_value(k)?;
                RecordRef::Rate(k, *t)
            }
            Entity::Run(id) => RecordRef::Run(self.runs.get(id)?),
            Entity::Reservation(id) => RecordRef::Reservation(self.reservations.get(id)?),
            Entity::Idempotency(k) => RecordRef::Idempotency(self.idempotency.get(k)?),
        })
    }

    /// Forgets pending changes (after the store reloaded from disk).
    pub fn clear_changes(&mut self) {
        self.dirty.clear();
    }

    pub fn record(&self, e: &Entity) -> Option<Record> {
        Some(match e {
            Entity::Meta => Record::Meta {
                seq: self.seq,
                cutoff: self.cutoff.clone(),
                clock: self.clock,
            },
            Entity::Counter(k) => Record::Counter(k.clone(), *self.counters.get(k)?),
            Entity::Rate(k) => Record::Rate(k.clone(), *self.rates.get(k)?),
            Entity::Run(id) => Record::Run(self.runs.get(id)?.clone()),
            Entity::Reservation(id) => Record::Reservation(self.reservations.get(id)?.clone()),
            Entity::Idempotency(k) => Record::Idempotency(self.idempotency.get(k)?.clone()),
        })
    }

    /// Rebuilds a ledger from its records (derived indexes are recomputed).
    pub fn restore(records: impl IntoIterator<Item = Record>, track_changes: bool) -> Ledger {
        let mut l = Ledger {
            track_changes,
            ..Ledger::default()
        };
        for r in records {
            match r {
                Record::Meta { seq, cutoff, clock } => {
                    l.seq = seq;
                    l.cutoff = cutoff;
                    l.clock = clock;
                }
                Record::Counter(k, c) => {
                    if let Some(end) = stale_from(&k) {
                        l.ending.insert((end, k.clone()));
                    }
                    l.counters.insert(k, c);
                }
                Record::Rate(k, t) => {
                    l.rates.insert(k, t);
                }
                Record::Run(run) => {
                    l.runs.insert(run.id.clone(), run);
                }
                Record::Reservation(res) => {
                    l.reservations.insert(res.id.clone(), res);
                }
                Record::Idempotency(rec) => {
                    l.timers
                        .insert((rec.expires, Timer::Idempotency(rec.key.clone())));
                    l.idempotency.insert(rec.key.clone(), rec);
                }
            }
        }
        let mut stats = Stats::default();
        let mut steps: Vec<(&RunId, UnixMs, &ReservationId)> = Vec::new();
        for r in l.reservations.values() {
            stats.count(r, true);
            if r.kind != ReservationKind::RunHold && l.runs.contains_key(&r.run_id) {
                steps.push((&r.run_id, r.created, &r.id));
            }
        }
        // In the order they were taken (as far as the clock tells; the order is not used).
        steps.sort_unstable();
        for (run, _, id) in steps {
            l.run_steps.entry(run.clone()).or_default().push(id.clone());
        }
        stats.runs_active = l
            .runs
            .values()
            .filter(|r| r.state == RunState::Active)
            .count() as u64;
        l.stats = stats;
        for run in l.runs.values() {
            match run.state {
                RunState::Active => {
                    l.timers
                        .insert((run.lease_until, Timer::Lease(run.id.clone())));
                    for s in &run.slots {
                        *l.slots.entry(s.clone()).or_insert(0) += 1;
                    }
                }
                RunState::Finished | RunState::Expired => {
                    let at = run
                        .ended_at
                        .unwrap_or(run.created)
                        .plus_ms(RECORD_RETENTION_MS);
                    l.timers.insert((at, Timer::Purge(run.id.clone())));
                }
            }
        }
        l
    }

    /// Every record, for a full snapshot.
    pub fn records(&self) -> Vec<Record> {
        let mut v = vec![self.record(&Entity::Meta).unwrap_or(Record::Meta {
            seq: self.seq,
            cutoff: None,
            clock: self.clock,
        })];
        v.extend(
            self.counters
                .iter()
                .map(|(k, c)| Record::Counter(k.clone(), *c)),
        );
        v.extend(self.rates.iter().map(|(k, t)| Record::Rate(k.clone(), *t)));
        v.extend(self.runs.values().cloned().map(Record::Run));
        v.extend(self.reservations.values().cloned().map(Record::Reservation));
        v.extend(self.idempotency.values().cloned().map(Record::Idempotency));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::{ScopeKey, ScopeKind};
    use crate::window::{UnixMs, Window};

    /// Storage keys are stable (a store finds its rows by them): one of each kind, spelled out.
    #[test]
    fn storage_keys_are_spelled_as_stored() {
        let day = Window::Day.at(UnixMs(86_400_000 * 3));
        let counter = |kind, id: &str| {
            Entity::Counter(CounterKey {
                scope: ScopeKey::new(kind, id),
                window: day,
            })
        };
        let cases = [
            (Entity::Meta, "m"),
            (counter(ScopeKind::Global, ""), "c|global|day|3"),
            (counter(ScopeKind::Session, "s1"), "c|session:s1|day|3"),
            (
                counter(ScopeKind::Ip, "10.0.0.0/24"),
                "c|ip:10.0.0.0/24|day|3",
            ),
            (Entity::Rate("rate|x".into()), "g|rate|x"),
            (Entity::Run(RunId("run-1".into())), "r|run-1"),
            (
                Entity::Reservation(ReservationId("stp-1".into())),
                "s|stp-1",
            ),
            (Entity::Idempotency("k".into()), "i|k"),
        ];
        for (entity, key) in cases {
            assert_eq!(entity.storage_key(), key);
            let mut out = String::from("prefix/");
            entity.write_storage_key(&mut out);
            assert_eq!(out, format!("prefix/{key}"));
        }
    }
}
