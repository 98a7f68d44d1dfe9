//! The admission decision: one pure function over every budget a request touches. It either
//! admits against all of them or names the first that refuses and when to retry; applying the
//! decision is the caller's single, all-or-nothing step.

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

/// Admits `amount` only if it fits every budget.
#[inline]
pub fn decide(budgets: &[BudgetView], amount: Micros, now: UnixMs) -> Result<(), BudgetRefusal> {
    for (index, b) in budgets.iter().enumerate() {
        if !b.fits(amount) {
            let retry_after_s = b
                .resets_at
                .map(|r| now.secs_until(r))
                .unwrap_or(LIFETIME_RETRY_AFTER_S)
                .max(1);
            return Err(BudgetRefusal {
                index,
                scope: b.scope,
                retry_after_s,
            });
        }
    }
    Ok(())
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
