//! Idempotency keys and single-use keys.

use super::error::{check_id, LedgerError};
use super::messages::{Applied, IdempotencyKey, IdempotencyRecord, IdempotentOutcome};
use super::records::Entity;
use super::refusal::Refusal;
use super::{Ledger, Timer, IDEMPOTENCY_RETENTION_MS, LEDGER_RECORDS_MAX};
use crate::window::UnixMs;

impl Ledger {
    pub(super) fn remember(
        &mut self,
        idem: Option<&IdempotencyKey>,
        outcome: IdempotentOutcome,
        now: UnixMs,
        ttl_ms: u64,
    ) {
        let Some(k) = idem else { return };
        let expires = now.plus_ms(IDEMPOTENCY_RETENTION_MS.max(ttl_ms));
        self.idempotency.insert(
            k.key.clone(),
            IdempotencyRecord {
                key: k.key.clone(),
                fingerprint: k.fingerprint.clone(),
                outcome,
                expires,
            },
        );
        self.timers
            .insert((expires, Timer::Idempotency(k.key.clone())));
        self.touch(Entity::Idempotency(k.key.clone()));
    }

    pub(super) fn recall(
        &self,
        idem: Option<&IdempotencyKey>,
    ) -> Result<Option<IdempotentOutcome>, LedgerError> {
        let Some(k) = idem else { return Ok(None) };
        check_id("idempotency key", &k.key)?;
        match self.idempotency.get(&k.key) {
            None => Ok(None),
            Some(r) if r.fingerprint == k.fingerprint => Ok(Some(r.outcome.clone())),
            Some(_) => Err(LedgerError::IdempotencyConflict),
        }
    }

    /// Ends an admission: remembers the outcome under its idempotency key, and moves the
    /// sequence number when anything changed (a grant, a remembered refusal, or expiries).
    pub(super) fn conclude<T>(
        &mut self,
        outcome: Result<T, Refusal>,
        remembered: Option<IdempotentOutcome>,
        idem: Option<&IdempotencyKey>,
        now: UnixMs,
        ttl_ms: u64,
        swept: bool,
    ) -> Applied<Result<T, Refusal>> {
        if let Some(o) = remembered {
            self.remember(idem, o, now, ttl_ms);
        }
        let changed = swept || outcome.is_ok() || idem.is_some();
        if changed {
            self.bump();
        }
        self.answer(outcome, changed)
    }

    /// Marks `key` as used for `ttl_ms`; true only for the first call.
    pub fn consume_once(
        &mut self,
        now: UnixMs,
        key: &str,
        ttl_ms: u64,
    ) -> Result<Applied<bool>, LedgerError> {
        let (now, swept) = self.advance(now);
        check_id("single-use key", key)?;
        let key = format!("once:{key}");
        if self.idempotency.contains_key(&key) {
            return Ok(self.answer(false, swept));
        }
        self.mark_used(key, String::new(), now.plus_ms(ttl_ms))?;
        self.bump();
        Ok(self.answer(true, true))
    }

    /// Records single-use `key` (with what it was used for) until `expires`.
    pub(super) fn mark_used(
        &mut self,
        key: String,
        fingerprint: String,
        expires: UnixMs,
    ) -> Result<(), LedgerError> {
        if self.records_held() >= LEDGER_RECORDS_MAX {
            return Err(LedgerError::Full(LEDGER_RECORDS_MAX));
        }
        self.idempotency.insert(
            key.clone(),
            IdempotencyRecord {
                key: key.clone(),
                fingerprint,
                outcome: IdempotentOutcome::Used,
                expires,
            },
        );
        self.timers
            .insert((expires, Timer::Idempotency(key.clone())));
        self.touch(Entity::Idempotency(key));
        Ok(())
    }
}
