//! The operator's levers: the spending cutoff and adjustments.

use super::error::{check_id, LedgerError};
use super::messages::{Adjustment, Applied};
use super::refusal::{Refusal, RefusalCode};
use super::{Ledger, ADJUSTMENT_KEY_TTL_MS, CUTOFF_MESSAGE};
use crate::money::Micros;
use crate::scope::{Policy, ScopeKey, ScopeKind};
use crate::window::UnixMs;

impl Ledger {
    /// The refusal every admission gets while the spending cutoff is engaged. The operator's
    /// reason stays with the operator (summary, dashboard): refused guests see a fixed text.
    pub(super) fn cutoff_refusal(&self) -> Option<Refusal> {
        self.cutoff.as_ref().map(|_| {
            Refusal::new(
                RefusalCode::CutoffEngaged,
                Some(ScopeKind::Global),
                CUTOFF_MESSAGE.to_string(),
            )
            .retry_after(60)
        })
    }

    pub fn set_cutoff(&mut self, now: UnixMs, engaged: bool, reason: &str) -> Applied<bool> {
        let (_, swept) = self.advance(now);
        let new = engaged.then(|| reason.to_string());
        let changed = new != self.cutoff;
        self.cutoff = new;
        if changed || swept {
            self.bump();
        }
        self.answer(engaged, changed || swept)
    }

    /// Charges (positive) or credits (negative) a scope's current windows. A credit never
    /// takes `used` below zero.
    pub fn adjust(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        scope: &ScopeKey,
        factor: u64,
        amount: i64,
        once: Option<&str>,
    ) -> Result<Applied<Adjustment>, LedgerError> {
        let (now, swept) = self.advance(now);
        if scope.kind == ScopeKind::Run {
            return Err(LedgerError::Invalid(
                "adjust a run through its steps".into(),
            ));
        }
        // The scope's limits as its admissions see them: a wider address prefix is limited at
        // `factor` times the configured amounts.
        let scopes = [(scope.clone(), factor.max(1))];
        let counters = Self::budget_counters(policy, &scopes, now);
        if counters.is_empty() {
            return Err(LedgerError::Invalid(format!(
                "no budget applies to {scope}"
            )));
        }
        if let Some(once) = once {
            check_id("adjustment key", once)?;
            let key = format!("once:adjust:{once}");
            let fingerprint = format!("{scope}|{factor}|{amount}");
            if let Some(r) = self.idempotency.get(&key) {
                if r.fingerprint != fingerprint {
                    return Err(LedgerError::IdempotencyConflict);
                }
                let value = Adjustment {
                    lines: self.usage(policy, now, &scopes),
                    repeated: true,
                };
                if swept {
                    self.bump();
                }
                return Ok(self.answer(value, swept));
            }
            self.mark_used(key, fingerprint, now.plus_ms(ADJUSTMENT_KEY_TTL_MS))?;
        }
        let mut applied = Vec::with_capacity(counters.len());
        for (key, limit) in &counters {
            let c = self.counter_mut(key, *limit);
            let before = c.used;
            if amount >= 0 {
                c.used = c.used.add_capped(Micros(amount.unsigned_abs()));
            } else {
                let credit = Micros(amount.unsigned_abs()).min(c.used);
                c.used = c.used.saturating_sub(credit);
            }
            // What was applied (a credit stops at zero, a charge at MICROS_MAX), so that
            // used = charges + adjustments holds (I2).
            let delta = i128::from(c.used.0) - i128::from(before.0);
            let delta = i64::try_from(delta).unwrap_or(i64::MAX);
            c.adjusted = c.adjusted.saturating_add(delta);
            // A charge on top of what is held may take the scope past its limit (I1's
            // exception, as an overrun): it is closed for the rest of its window.
            if c.used.add_capped(c.reserved) > c.limit {
                c.overrun = true;
            }
            applied.push((key.clone(), delta));
        }
        self.bump();
        self.record_adjustment(amount, applied);
        let value = Adjustment {
            lines: self.usage(policy, now, &scopes),
            repeated: false,
        };
        Ok(self.answer(value, true))
    }
}
