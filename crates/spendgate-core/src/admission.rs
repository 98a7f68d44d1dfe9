//! The admission decision: one pure function over every budget a request touches. It either
//! admits against all of them or names the refusing one that frees last and when to retry;
//! applying the decision is the caller's single, all-or-nothing step.
//!
//! A budget refuses for one of two reasons ([`Shortfall`]): its used spend leaves no room (it
//! is spent until its window resets), or its used spend alone would admit the amount and the
//! holds of calls still in flight take the room (a wait: the room comes back as they resolve,
//! within their lease).

use crate::money::Micros;
use crate::scope::ScopeKind;
use crate::window::UnixMs;

/// `Retry-After` for a lifetime budget, which never resets.
pub const LIFETIME_RETRY_AFTER_S: u64 = 86_400;
/// `Retry-After` of a budget refused only by the holds of calls in flight (`budget_held`):
/// used spend alone would admit the call. A counter does not know when its holds end (each
/// ends with its own call, at the latest when its run's lease runs out, `store.lease_ttl_s`,
/// at least 1 s), and most end within one upstream call; so the shortest wait the header can
/// say, never longer than a lease. A retry refused again costs one store call and no rate
/// quota (a refused admission does not move the rate's state).
pub const HELD_RETRY_AFTER_S: u64 = 1;

/// What the decision needs to know of one budget counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetView {
    pub scope: ScopeKind,
    pub limit: Micros,
    pub used: Micros,
    pub reserved: Micros,
    pub overrun: bool,
    /// When the window resets; `None` for lifetime budgets.
    pub resets_at: Option<UnixMs>,
}

impl BudgetView {
    /// Whether `amount` more fits: `used + reserved + amount <= limit` and no overrun.
    #[inline]
    pub fn fits(&self, amount: Micros) -> bool {
        !self.overrun
            && self
                .used
                .0
                .checked_add(self.reserved.0)
                .and_then(|s| s.checked_add(amount.0))
                .is_some_and(|total| total <= self.limit.0)
    }

    /// Why `amount` does not fit (`None`: it fits). [`Shortfall::Held`] when used spend alone
    /// would admit it (`used + amount <= limit`, no overrun) and holds refuse it.
    #[inline]
    pub fn shortfall(&self, amount: Micros) -> Option<Shortfall> {
        if self.fits(amount) {
            return None;
        }
        let used_alone_fits = !self.overrun
            && self
                .used
                .0
                .checked_add(amount.0)
                .is_some_and(|total| total <= self.limit.0);
        Some(if used_alone_fits {
            Shortfall::Held
        } else {
            Shortfall::Spent
        })
    }
}

/// Why a budget has no room for an amount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shortfall {
    /// Used spend (or an overrun) leaves no room: it frees when the window resets.
    Spent,
    /// Used spend alone would admit the amount; holds of calls in flight take the room. It
    /// frees as they resolve: each is committed, released or expired within its lease.
    Held,
}

/// Why a budget refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// Index of the refusing budget in the slice given to [`decide`].
    pub index: usize,
    pub scope: ScopeKind,
    pub shortfall: Shortfall,
    /// Spent: seconds until its window resets. Held: [`HELD_RETRY_AFTER_S`] (or the window's
    /// reset, when sooner). At least 1.
    pub retry_after_s: u64,
}

/// Admits `amount` only if it fits every budget. A refusal names a spent budget when any is
/// (its wait is the longer one): the spent budget that frees last (the latest window reset; a
/// lifetime budget counts as [`LIFETIME_RETRY_AFTER_S`] away; the first of equals), so that a
/// client that waits its `Retry-After` is not refused again by another budget that was spent
/// as well. Only when every refusing budget is merely held does it name a held one (the first),
/// with the short wait of [`HELD_RETRY_AFTER_S`].
#[inline]
pub fn decide(budgets: &[BudgetView], amount: Micros, now: UnixMs) -> Result<(), BudgetRefusal> {
    let mut spent: Option<(UnixMs, BudgetRefusal)> = None;
    let mut held: Option<BudgetRefusal> = None;
    for (index, b) in budgets.iter().enumerate() {
        let Some(shortfall) = b.shortfall(amount) else {
            continue;
        };
        let free_at = b.resets_at.unwrap_or(UnixMs(
            now.0
                .saturating_add(LIFETIME_RETRY_AFTER_S.saturating_mul(1000)),
        ));
        let to_reset = now.secs_until(free_at).max(1);
        match shortfall {
            Shortfall::Spent => {
                if spent.is_none_or(|(at, _)| free_at > at) {
                    let refusal = BudgetRefusal {
                        index,
                        scope: b.scope,
                        shortfall,
                        retry_after_s: to_reset,
                    };
                    spent = Some((free_at, refusal));
                }
            }
            Shortfall::Held => {
                held.get_or_insert(BudgetRefusal {
                    index,
                    scope: b.scope,
                    shortfall,
                    retry_after_s: to_reset.min(HELD_RETRY_AFTER_S),
                });
            }
        }
    }
    match (spent, held) {
        (Some((_, refusal)), _) | (None, Some(refusal)) => Err(refusal),
        (None, None) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn view(limit: u64, used: u64, reserved: u64) -> BudgetView {
        BudgetView {
            scope: ScopeKind::Global,
            limit: Micros(limit),
            used: Micros(used),
            reserved: Micros(reserved),
            overrun: false,
            resets_at: Some(UnixMs(10_000)),
        }
    }

    #[test]
    fn names_the_first_refusing_budget() {
        let mut b = [view(100, 10, 10), view(100, 50, 0), view(100, 0, 0)];
        b[1].scope = ScopeKind::Session;
        assert_eq!(decide(&b, Micros(50), UnixMs(0)), Ok(()));
        let r = decide(&b, Micros(51), UnixMs(1)).expect_err("session is full");
        assert_eq!(
            (r.index, r.scope, r.retry_after_s),
            (1, ScopeKind::Session, 10)
        );
        b[2].overrun = true;
        assert_eq!(
            decide(&b, Micros(0), UnixMs(0)).map_err(|r| r.index),
            Err(2)
        );
    }

    #[test]
    fn names_the_refusing_budget_that_frees_last() {
        // A spent hour (resets at 10 s) and a spent day (at 20 s) and a lifetime budget
        // that still fits: the day is named, with its wait.
        let mut b = [view(100, 100, 0), view(100, 100, 0), view(1000, 0, 0)];
        b[1].scope = ScopeKind::Session;
        b[1].resets_at = Some(UnixMs(20_000));
        b[2].resets_at = None;
        let r = decide(&b, Micros(1), UnixMs(1_000)).expect_err("both spent");
        assert_eq!(
            (r.index, r.scope, r.retry_after_s),
            (1, ScopeKind::Session, 19)
        );
        // A spent lifetime budget is a day away: later than both.
        b[2].used = Micros(1000);
        let r = decide(&b, Micros(1), UnixMs(1_000)).expect_err("all spent");
        assert_eq!((r.index, r.retry_after_s), (2, LIFETIME_RETRY_AFTER_S));
        // Equals: the first.
        b[1].resets_at = Some(UnixMs(10_000));
        b[2].used = Micros(0);
        assert_eq!(
            decide(&b, Micros(1), UnixMs(0)).map_err(|r| r.index),
            Err(0)
        );
    }

    /// Used spend alone would admit: the holds refuse, a short wait (`Held`). Used spend alone
    /// would not, or the budget overran: spent until the reset.
    #[test]
    fn a_refusal_by_holds_is_a_wait_and_a_spent_budget_waits_for_its_reset() {
        // 60 used + 40 held of 100: 10 more is refused by the holds.
        let held = view(100, 60, 40);
        assert_eq!(held.shortfall(Micros(10)), Some(Shortfall::Held));
        assert_eq!(held.shortfall(Micros(40)), Some(Shortfall::Held));
        assert_eq!(held.shortfall(Micros(41)), Some(Shortfall::Spent));
        assert_eq!(view(100, 60, 30).shortfall(Micros(10)), None);
        let r = decide(&[held], Micros(10), UnixMs(0)).expect_err("held");
        assert_eq!(
            (r.shortfall, r.retry_after_s),
            (Shortfall::Held, HELD_RETRY_AFTER_S)
        );
        // An overrun is spent whatever its holds.
        let mut over = view(100, 60, 0);
        over.overrun = true;
        assert_eq!(over.shortfall(Micros(1)), Some(Shortfall::Spent));
        let r = decide(&[over], Micros(1), UnixMs(1_000)).expect_err("overrun");
        assert_eq!((r.shortfall, r.retry_after_s), (Shortfall::Spent, 9));
        // A held lifetime budget is still a short wait, not a day.
        let mut life = view(100, 0, 100);
        life.resets_at = None;
        let r = decide(&[life], Micros(1), UnixMs(0)).expect_err("held");
        assert_eq!(r.retry_after_s, HELD_RETRY_AFTER_S);
    }

    /// Several budgets refuse: a spent one is named before any held one (its wait is the
    /// longer), wherever it stands; among held ones, the first.
    #[test]
    fn a_spent_budget_is_named_before_a_held_one() {
        let mut b = [view(100, 0, 100), view(100, 100, 0), view(100, 50, 50)];
        b[1].scope = ScopeKind::Session;
        let r = decide(&b, Micros(1), UnixMs(0)).expect_err("refused");
        assert_eq!(
            (r.index, r.scope, r.shortfall, r.retry_after_s),
            (1, ScopeKind::Session, Shortfall::Spent, 10)
        );
        b[1].used = Micros(0);
        let r = decide(&b, Micros(1), UnixMs(0)).expect_err("refused");
        assert_eq!(
            (r.index, r.shortfall, r.retry_after_s),
            (0, Shortfall::Held, HELD_RETRY_AFTER_S)
        );
    }

    #[test]
    fn overflow_never_fits() {
        let b = [view(u64::MAX, u64::MAX - 1, 1)];
        assert!(decide(&b, Micros(1), UnixMs(0)).is_err());
    }

    proptest! {
        #[test]
        fn admits_exactly_when_every_budget_has_room(
            rows in proptest::collection::vec((0u64..1000, 0u64..1000, 0u64..1000), 1..6),
            amount in 0u64..1000,
        ) {
            let b: Vec<BudgetView> = rows.iter().map(|(l, u, r)| view(*l, *u, *r)).collect();
            let all_fit = rows.iter().all(|(l, u, r)| u + r + amount <= *l);
            prop_assert_eq!(decide(&b, Micros(amount), UnixMs(0)).is_ok(), all_fit);
            // A refusal is `Held` exactly when used spend alone would admit on every refusing
            // budget.
            if let Err(r) = decide(&b, Micros(amount), UnixMs(0)) {
                let all_held = rows
                    .iter()
                    .filter(|(l, u, r)| u + r + amount > *l)
                    .all(|(l, u, _)| u + amount <= *l);
                prop_assert_eq!(r.shortfall == Shortfall::Held, all_held);
            }
        }
    }
}
