//! The admission decision: one pure function over every budget a request touches. It either
//! admits against all of them or names the refusing one that frees last and when to retry;
//! applying the decision is the caller's single, all-or-nothing step.

use crate::ledger::{Counter, LIFETIME_RETRY_AFTER_S};
use crate::money::Micros;
use crate::scope::ScopeKind;
use crate::window::UnixMs;

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
}

/// Why a budget refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// Index of the refusing budget in the slice given to [`decide`].
    pub index: usize,
    pub scope: ScopeKind,
    /// Seconds until its window resets (at least 1).
    pub retry_after_s: u64,
}

/// Admits `amount` only if it fits every budget. A refusal names the refusing budget that
/// frees last (the latest window reset; a lifetime budget counts as
/// [`LIFETIME_RETRY_AFTER_S`] away; the first of equals), so that a client that waits its
/// `Retry-After` is not refused again by another budget that was spent as well.
#[inline]
pub fn decide(budgets: &[BudgetView], amount: Micros, now: UnixMs) -> Result<(), BudgetRefusal> {
    let mut worst: Option<(UnixMs, BudgetRefusal)> = None;
    for (index, b) in budgets.iter().enumerate() {
        if !b.fits(amount) {
            let free_at = b.resets_at.unwrap_or(UnixMs(
                now.0
                    .saturating_add(LIFETIME_RETRY_AFTER_S.saturating_mul(1000)),
            ));
            if worst.is_none_or(|(at, _)| free_at > at) {
                let refusal = BudgetRefusal {
                    index,
                    scope: b.scope,
                    retry_after_s: now.secs_until(free_at).max(1),
                };
                worst = Some((free_at, refusal));
            }
        }
    }
    match worst {
        Some((_, refusal)) => Err(refusal),
        None => Ok(()),
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
        }
    }
}
