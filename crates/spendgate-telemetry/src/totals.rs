//! Running totals of the usage history ([`spendgate_core::history`]): the store tells
//! [`HistoryTotals`] (a [`HistoryTap`]) of every history event it made durable in this
//! process, and it counts them, so that `/metrics`' charge, reservation and refusal counters
//! are sums of the same records `report` reads, whoever resolved the reservation (the
//! decision API, the proxy, the sweeper's expiries).
//!
//! Each replica counts what its own store calls made durable; the sum over the replicas (a
//! Prometheus `sum()`) is the ledger's. A counter starts at zero with the process.

use crate::metrics::{escape, LABEL_SETS_MAX};
use spendgate_core::history::{HistoryEvent, ReservationRecord};
use spendgate_core::ReservationState;
use spendgate_store::HistoryTap;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write;
use std::sync::Mutex;

/// Reservations whose counted charge is remembered, the newest: a record written again (a
/// late overrun tops its charge up, within the minute its run's records are kept) adds only
/// the difference. Past it the oldest is forgotten; a top-up of a forgotten one counts its
/// whole charge again, so the counters err high (never below what was charged).
pub const RECENT_RESERVATIONS_MAX: usize = 65_536;

/// The label a model or tool name past [`LABEL_SETS_MAX`] distinct ones is counted under.
pub const OTHER_NAME: &str = "_other";

#[derive(Default)]
struct Totals {
    charged_by_state: BTreeMap<&'static str, u64>,
    reservations_by_state: BTreeMap<&'static str, u64>,
    charged_by_scope_kind: BTreeMap<&'static str, u64>,
    /// (class, model or tool name).
    charged_by_name: BTreeMap<(&'static str, String), u64>,
    /// (code, scope kind or "").
    refusals: BTreeMap<(&'static str, &'static str), u64>,
    /// Charges already counted, by reservation id, and their order of arrival.
    recent: HashMap<String, u64>,
    recent_order: VecDeque<String>,
}

/// The history's running totals (see the module's doc).
#[derive(Default)]
pub struct HistoryTotals {
    inner: Mutex<Totals>,
}

impl HistoryTap for HistoryTotals {
    fn seen(&self, events: &[HistoryEvent]) {
        let mut t = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        for event in events {
            match event {
                HistoryEvent::Reservation(r) => t.reservation(r),
                HistoryEvent::Refusals { at, count } => {
                    let key = (at.code.name(), at.scope.map_or("", |s| s.name()));
                    add(&mut t.refusals, key, *count);
                }
                HistoryEvent::Run(_) | HistoryEvent::Adjustment(_) => {}
            }
        }
    }
}

/// Adds `n` under `key`; a new key past [`LABEL_SETS_MAX`] is not kept (the keys of these
/// families are closed sets far below it).
fn add<K: Ord>(m: &mut BTreeMap<K, u64>, key: K, n: u64) {
    if m.len() < LABEL_SETS_MAX || m.contains_key(&key) {
        let v = m.entry(key).or_insert(0);
        *v = v.saturating_add(n);
    }
}

impl Totals {
    fn reservation(&mut self, r: &ReservationRecord) {
        let charged = r.charged.0;
        let (added, first) = match self.recent.get_mut(&r.id.0) {
            Some(seen) => {
                // A record written again: only a larger charge adds (its difference).
                let more = charged.saturating_sub(*seen);
                *seen = (*seen).max(charged);
                (more, false)
            }
            None => {
                if self.recent_order.len() >= RECENT_RESERVATIONS_MAX {
                    if let Some(old) = self.recent_order.pop_front() {
                        self.recent.remove(&old);
                    }
                }
                self.recent.insert(r.id.0.clone(), charged);
                self.recent_order.push_back(r.id.0.clone());
                (charged, true)
            }
        };
        let state = r.state.name();
        if first {
            add(&mut self.reservations_by_state, state, 1);
        }
        add(&mut self.charged_by_state, state, added);
        let mut kinds: Vec<&'static str> = r.counters.iter().map(|c| c.scope.kind.name()).collect();
        kinds.sort_unstable();
        kinds.dedup();
        for kind in kinds {
            add(&mut self.charged_by_scope_kind, kind, added);
        }
        // Run holds (`whole_run`) have no model or tool.
        if !r.name.is_empty() {
            let class = r.class.name();
            let key = (class, r.name.clone());
            let key = if self.charged_by_name.contains_key(&key)
                || self.charged_by_name.len() < LABEL_SETS_MAX - 2
            {
                key
            } else {
                (class, OTHER_NAME.to_string())
            };
            let v = self.charged_by_name.entry(key).or_insert(0);
            *v = v.saturating_add(added);
        }
    }
}

/// A counter family's head: HELP, TYPE, and the unit when it has one.
pub(crate) fn head(out: &mut String, name: &str, kind: &str, unit: Option<&str>, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    if let Some(unit) = unit {
        let _ = writeln!(out, "# UNIT {name} {unit}");
    }
}

impl HistoryTotals {
    /// Reservations that ended `unknown`, whoever resolved them.
    pub fn unknown_outcomes(&self) -> u64 {
        let t = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        t.reservations_by_state
            .get(ReservationState::Unknown.name())
            .copied()
            .unwrap_or(0)
    }

    /// The totals in the Prometheus text format. Every terminal state is shown, at zero
    /// before its first record, so that a rate over it has a start.
    pub fn render(&self, out: &mut String) {
        let t = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let states = ["committed", "released", "unknown", "expired"];
        head(
            out,
            "spendgate_charged_micros_total",
            "counter",
            Some("micros"),
            "Micros charged by reservations that reached a terminal state, by state (from the \
             usage history this replica's store made durable).",
        );
        for s in states {
            let v = t.charged_by_state.get(s).copied().unwrap_or(0);
            let _ = writeln!(out, "spendgate_charged_micros_total{{state=\"{s}\"}} {v}");
        }
        head(
            out,
            "spendgate_reservations_total",
            "counter",
            None,
            "Reservations that reached a terminal state, by state.",
        );
        for s in states {
            let v = t.reservations_by_state.get(s).copied().unwrap_or(0);
            let _ = writeln!(out, "spendgate_reservations_total{{state=\"{s}\"}} {v}");
        }
        head(
            out,
            "spendgate_scope_charged_micros_total",
            "counter",
            Some("micros"),
            "Micros charged, counted once under every scope kind whose budgets the \
             reservation charged (each kind's series is the spend on its budgets).",
        );
        for (k, v) in &t.charged_by_scope_kind {
            let _ = writeln!(
                out,
                "spendgate_scope_charged_micros_total{{scope=\"{k}\"}} {v}"
            );
        }
        head(
            out,
            "spendgate_name_charged_micros_total",
            "counter",
            Some("micros"),
            "Micros charged by model or tool calls, by class (model, tool) and name \
             (whole-run holds are in no series; names past the bound count as \"_other\").",
        );
        for ((class, name), v) in &t.charged_by_name {
            let name = escape(name);
            let _ = writeln!(
                out,
                "spendgate_name_charged_micros_total{{class=\"{class}\",name=\"{name}\"}} {v}"
            );
        }
        head(
            out,
            "spendgate_ledger_refusals_total",
            "counter",
            None,
            "Refusals the ledger recorded in its history, by code and the kind of scope that \
             refused (empty: no scope).",
        );
        for ((code, scope), v) in &t.refusals {
            let _ = writeln!(
                out,
                "spendgate_ledger_refusals_total{{code=\"{code}\",scope=\"{scope}\"}} {v}"
            );
        }
        let unknown = t
            .reservations_by_state
            .get(ReservationState::Unknown.name())
            .copied()
            .unwrap_or(0);
        head(
            out,
            "spendgate_unknown_outcomes_total",
            "counter",
            None,
            "Reservations that ended unknown (charged in full), whoever resolved them: the \
             decision API's unknown, the proxy's lost upstream answers.",
        );
        let _ = writeln!(out, "spendgate_unknown_outcomes_total {unknown}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_core::history::{RefusalMinute, StepClass};
    use spendgate_core::{
        CounterKey, Micros, RefusalCode, ReservationId, RunId, ScopeKey, ScopeKind, UnixMs, Window,
    };

    fn record(id: &str, name: &str, state: ReservationState, charged: u64) -> ReservationRecord {
        let at = UnixMs(1_800_000_000_000);
        ReservationRecord {
            id: ReservationId(id.into()),
            run_id: RunId("run".into()),
            session: "s".into(),
            conversation: "c".into(),
            address: "192.0.2.1/32".into(),
            class: StepClass::Model,
            name: name.into(),
            retry: false,
            usage: None,
            units: None,
            result_bytes: None,
            reserved: Micros(charged),
            charged: Micros(charged),
            state,
            created: at,
            resolved_at: at,
            overrun: false,
            result_too_large: false,
            counters: vec![
                CounterKey {
                    scope: ScopeKey::global(),
                    window: Window::Day.at(at),
                },
                CounterKey {
                    scope: ScopeKey::global(),
                    window: Window::Month.at(at),
                },
                CounterKey {
                    scope: ScopeKey::new(ScopeKind::Session, "s"),
                    window: Window::Day.at(at),
                },
            ],
        }
    }

    fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
        out.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{prefix} missing in:\n{out}"))
    }

    #[test]
    fn totals_count_each_record_once_and_a_top_up_by_its_difference() {
        let t = HistoryTotals::default();
        t.seen(&[
            HistoryEvent::Reservation(record("a", "m\"1", ReservationState::Committed, 100)),
            HistoryEvent::Reservation(record("b", "m2", ReservationState::Unknown, 50)),
            HistoryEvent::Refusals {
                at: RefusalMinute::of(UnixMs(0), RefusalCode::BudgetExhausted, None),
                count: 2,
            },
        ]);
        // A late overrun writes b again with a larger charge; a repeat with the same charge
        // adds nothing.
        t.seen(&[
            HistoryEvent::Reservation(record("b", "m2", ReservationState::Unknown, 80)),
            HistoryEvent::Reservation(record("b", "m2", ReservationState::Unknown, 80)),
        ]);
        let mut out = String::new();
        t.render(&mut out);
        for (prefix, want) in [
            ("spendgate_charged_micros_total{state=\"committed\"}", "100"),
            ("spendgate_charged_micros_total{state=\"unknown\"}", "80"),
            ("spendgate_reservations_total{state=\"unknown\"}", "1"),
            ("spendgate_reservations_total{state=\"expired\"}", "0"),
            (
                "spendgate_scope_charged_micros_total{scope=\"global\"}",
                "180",
            ),
            (
                "spendgate_scope_charged_micros_total{scope=\"session\"}",
                "180",
            ),
            (
                "spendgate_name_charged_micros_total{class=\"model\",name=\"m\\\"1\"}",
                "100",
            ),
            (
                "spendgate_ledger_refusals_total{code=\"budget_exhausted\",scope=\"\"}",
                "2",
            ),
            ("spendgate_unknown_outcomes_total", "1"),
        ] {
            let l = line(&out, prefix);
            assert_eq!(l.rsplit(' ').next(), Some(want), "{l}");
        }
        assert_eq!(t.unknown_outcomes(), 1);
    }

    #[test]
    fn names_past_the_bound_count_as_other() {
        let t = HistoryTotals::default();
        for i in 0..LABEL_SETS_MAX + 10 {
            t.seen(&[HistoryEvent::Reservation(record(
                &format!("r{i}"),
                &format!("m{i}"),
                ReservationState::Committed,
                1,
            ))]);
        }
        let mut out = String::new();
        t.render(&mut out);
        let names = out
            .lines()
            .filter(|l| l.starts_with("spendgate_name_charged_micros_total{"))
            .count();
        assert!(names < LABEL_SETS_MAX, "{names}");
        let sum: u64 = out
            .lines()
            .filter(|l| l.starts_with("spendgate_name_charged_micros_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        assert_eq!(sum, (LABEL_SETS_MAX + 10) as u64, "nothing lost");
    }
}
