//! Budget counters: which ones a request touches, whether an amount fits them, holding it
//! and charging it.

use super::messages::Settlement;
use super::model::{
    stale_from, Counter, CounterKey, Reservation, ReservationId, ReservationState, RunId,
};
use super::records::Entity;
use super::refusal::{Refusal, RefusalCode};
use super::Ledger;
use crate::admission::{BudgetRefusal, BudgetView, Shortfall};
use crate::money::Micros;
use crate::scope::{Policy, ScopeKey, ScopeKind};
use crate::window::{UnixMs, WindowId};

impl Ledger {
    pub(super) fn counter_mut(&mut self, key: &CounterKey, limit: Micros) -> &mut Counter {
        if self.track_changes {
            self.dirty.insert(Entity::Counter(key.clone()));
        }
        let ending = &mut self.ending;
        let c = self.counters.entry(key.clone()).or_insert_with(|| {
            if let Some(end) = stale_from(key) {
                ending.insert((end, key.clone()));
            }
            Counter::default()
        });
        c.limit = limit;
        c
    }

    /// The budget counters (and their limits) a request from these scopes touches at `now`.
    pub(super) fn budget_counters(
        policy: &Policy,
        scopes: &[(ScopeKey, u64)],
        now: UnixMs,
    ) -> Vec<(CounterKey, Micros)> {
        let mut v = Vec::new();
        for (scope, factor) in scopes {
            let Some(p) = policy.for_kind(scope.kind) else {
                continue;
            };
            for b in &p.scaled(*factor).budgets {
                v.push((
                    CounterKey {
                        scope: scope.clone(),
                        window: b.window.at(now),
                    },
                    b.amount,
                ));
            }
        }
        v
    }

    pub(super) fn counter_view(&self, key: &CounterKey, limit: Micros) -> Counter {
        let mut c = self.counters.get(key).copied().unwrap_or_default();
        c.limit = limit;
        c
    }

    /// Checks that `amount` fits every counter. `Err`: the enforced counter that it does not
    /// fit that frees last (see [`crate::admission::decide`]), and why. `Ok(Some(_))`: every enforced counter fits, and this is the
    /// first counter in dry-run that it does not (see [`ScopePolicy::dry_run`](crate::scope::ScopePolicy::dry_run)).
    pub(super) fn check_budgets(
        &self,
        policy: &Policy,
        counters: &[(CounterKey, Micros)],
        amount: Micros,
        now: UnixMs,
    ) -> Result<Option<Refusal>, Refusal> {
        let check = |dry: bool| -> Result<(), Refusal> {
            let picked: Vec<&(CounterKey, Micros)> = counters
                .iter()
                .filter(|(key, _)| policy.dry_run(key.scope.kind) == dry)
                .collect();
            let views: Vec<BudgetView> = picked
                .iter()
                .map(|(key, limit)| {
                    let c = self.counters.get(key).copied().unwrap_or_default();
                    BudgetView::of(key.scope.kind, &c, *limit, key.window.resets_at())
                })
                .collect();
            crate::admission::decide(&views, amount, now).map_err(|r| {
                let (key, limit) = picked[r.index];
                budget_refusal(key, &self.counter_view(key, *limit), r)
            })
        };
        check(false)?;
        Ok(check(true).err())
    }

    pub(super) fn hold(
        &mut self,
        policy: &Policy,
        counters: &[(CounterKey, Micros)],
        amount: Micros,
    ) {
        for (key, limit) in counters {
            let dry = policy.dry_run(key.scope.kind);
            let c = self.counter_mut(key, *limit);
            c.reserved = c.reserved.add_capped(amount);
            if c.used.0 + c.reserved.0 > c.limit.0 {
                // Only a limit in dry-run admits past itself; it is then overrun (and I1's
                // exception), so that it reports every later request as refused.
                debug_assert!(dry, "I1: admission must keep used + reserved <= limit");
                if dry {
                    c.overrun = true;
                }
            }
        }
    }

    pub(super) fn insert_reservation(&mut self, r: Reservation) {
        self.stats.count(&r, true);
        if let Some(old) = self.reservations.insert(r.id.clone(), r) {
            debug_assert!(false, "reservation ids are unique");
            self.stats.count(&old, false);
        }
    }

    /// Moves a reservation to a terminal state, charging `charged` to each of its counters.
    /// `detail`: what a commit reported (for the run's tally and the history record).
    pub(super) fn settle(
        &mut self,
        id: &ReservationId,
        state: ReservationState,
        charged: Micros,
        now: UnixMs,
        detail: Option<Settlement>,
    ) {
        let Some(res) = self.reservations.get_mut(id) else {
            return;
        };
        debug_assert_eq!(
            res.state,
            ReservationState::Held,
            "I2: settle only a held reservation"
        );
        debug_assert!(state != ReservationState::Held);
        self.stats.count(res, false);
        res.state = state;
        res.charged = charged;
        res.resolved_at = Some(now);
        res.overrun = charged > res.amount;
        self.stats.count(res, true);
        let (amount, keys) = (res.amount, res.counters.clone());
        self.touch(Entity::Reservation(id.clone()));
        for key in keys {
            let limit = self.counters.get(&key).map(|c| c.limit).unwrap_or_default();
            let c = self.counter_mut(&key, limit);
            c.reserved = c.reserved.saturating_sub(amount);
            c.used = c.used.add_capped(charged);
            if c.used > c.limit {
                c.overrun = true;
            }
        }
        self.tally_settled(id, detail);
        self.record_reservation(id, detail);
    }

    /// A late overrun ([`Ledger::resolve`]): a terminal reservation's charge grows to
    /// `charged`, and its scopes' used spend by the difference (an overrun there when that
    /// takes it above the limit). Its state and resolution time stay.
    /// `detail`: what the late commit reported (the history record is made again with it).
    pub(super) fn top_up(
        &mut self,
        id: &ReservationId,
        charged: Micros,
        detail: Option<Settlement>,
    ) {
        let Some(res) = self.reservations.get_mut(id) else {
            return;
        };
        debug_assert!(
            res.state != ReservationState::Held && charged > res.charged,
            "a top-up raises a settled charge"
        );
        let delta = Micros(charged.0.saturating_sub(res.charged.0));
        self.stats.count(res, false);
        res.charged = charged;
        res.overrun = charged > res.amount;
        self.stats.count(res, true);
        let keys = res.counters.clone();
        self.touch(Entity::Reservation(id.clone()));
        for key in keys {
            let limit = self.counters.get(&key).map(|c| c.limit).unwrap_or_default();
            let c = self.counter_mut(&key, limit);
            c.used = c.used.add_capped(delta);
            if c.used > c.limit {
                c.overrun = true;
            }
        }
        self.record_reservation(id, detail);
    }

    /// `whole_run`: after a step's overrun, the run's hold follows what the run was charged
    /// when that is more, so that its scopes count the overrun at once (as `per_step` charges
    /// it to them at commit), not only when the run ends: a held hold grows (held beyond a
    /// scope's limit, it is an overrun there: the scope admits nothing more until its window
    /// resets); after a late overrun, a settled one is topped up ([`Ledger::top_up`]).
    pub(super) fn run_hold_follows(&mut self, run_id: &RunId) {
        let Some(run) = self.runs.get(run_id) else {
            return;
        };
        let Some(hold_id) = run.hold.clone() else {
            return;
        };
        let run_used = self
            .counters
            .get(&run.counter_key())
            .map(|c| c.used)
            .unwrap_or_default();
        let settled = match self.reservations.get(&hold_id) {
            Some(h) if h.state != ReservationState::Held => Some(h.charged),
            _ => None,
        };
        if let Some(charged) = settled {
            if run_used > charged {
                self.top_up(&hold_id, run_used, None);
            }
            return;
        }
        let Some(hold) = self.reservations.get_mut(&hold_id) else {
            return;
        };
        if hold.state != ReservationState::Held || run_used <= hold.amount {
            return;
        }
        let delta = Micros(run_used.0 - hold.amount.0);
        // (a hold is not counted in the stats' held sum: nothing to recount)
        hold.amount = run_used;
        let keys = hold.counters.clone();
        self.touch(Entity::Reservation(hold_id));
        for key in keys {
            let limit = self.counters.get(&key).map(|c| c.limit).unwrap_or_default();
            let c = self.counter_mut(&key, limit);
            c.reserved = c.reserved.add_capped(delta);
            if c.used.add_capped(c.reserved) > c.limit {
                c.overrun = true;
            }
        }
    }
}

/// A counter as the admission decision sees it. (Here, not beside [`BudgetView`]: the
/// decision knows no counters, so that `admission` does not depend on the ledger.)
impl BudgetView {
    pub fn of(
        scope: ScopeKind,
        c: &Counter,
        limit: Micros,
        resets_at: Option<UnixMs>,
    ) -> BudgetView {
        BudgetView {
            scope,
            limit,
            used: c.used,
            reserved: c.reserved,
            overrun: c.overrun,
            resets_at,
        }
    }
}

/// The refusal of the budget `r` names (counter `c` under `key`).
fn budget_refusal(key: &CounterKey, c: &Counter, r: BudgetRefusal) -> Refusal {
    let (code, state) = match r.shortfall {
        Shortfall::Spent => (RefusalCode::BudgetExhausted, "is spent"),
        Shortfall::Held => (RefusalCode::BudgetHeld, "is held by calls in flight"),
    };
    Refusal::new(
        code,
        Some(key.scope.kind),
        budget_message(key.scope.kind, &key.window, state, c),
    )
    .retry_after(r.retry_after_s)
}

/// The text of a budget refusal (`state`: "is spent", "is held by calls in flight"); the
/// Redis store writes the same from the script's fields.
pub fn budget_message(kind: ScopeKind, window: &WindowId, state: &str, c: &Counter) -> String {
    format!(
        "{} budget for {window} {state} ({} used, {} reserved of {})",
        kind.name(),
        c.used,
        c.reserved,
        c.limit
    )
}
