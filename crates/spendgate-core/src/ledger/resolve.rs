//! Resolving a held step: commit, release or unknown.

use super::error::LedgerError;
use super::messages::{Applied, Resolution, Resolved, Settlement};
use super::model::{Reservation, ReservationId, ReservationKind, ReservationState, RunState};
use super::Ledger;
use crate::money::Micros;
use crate::scope::Policy;
use crate::window::UnixMs;

impl Ledger {
    /// Resolves a held step. `Commit` charges observed usage (above the hold: an overrun,
    /// charged in full); `Release` charges nothing; `Unknown` charges the hold in full.
    /// A repeat of the same transition returns the first outcome; a different transition on a
    /// resolved reservation is refused with its state and charge.
    pub fn resolve(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        step_id: &ReservationId,
        how: Resolution,
    ) -> Result<Applied<Resolved>, LedgerError> {
        let (now, mut swept) = self.advance(now);
        // (the run's id is cloned only when its lease is over, not on every commit)
        let lapsed = self.reservations.get(step_id).and_then(|r| {
            self.runs
                .get(&r.run_id)
                .filter(|run| run.state == RunState::Active && run.lease_until <= now)
                .map(|_| r.run_id.clone())
        });
        if let Some(run_id) = lapsed {
            swept |= self.lapse(&run_id, now);
        }
        let res = self
            .reservations
            .get(step_id)
            .filter(|r| r.kind != ReservationKind::RunHold)
            .ok_or_else(|| LedgerError::NotFound(format!("step {}", step_id.0)))?;
        if res.state != ReservationState::Held {
            return self.resolve_settled(step_id, how, swept);
        }
        let (state, charged) = match how {
            Resolution::Commit(s) => (ReservationState::Committed, charge_of(res, s)?),
            Resolution::Release => (ReservationState::Released, Micros::ZERO),
            Resolution::Unknown => (ReservationState::Unknown, res.amount),
        };
        let (run_id, amount) = (res.run_id.clone(), res.amount);
        let too_large = match how {
            Resolution::Commit(Settlement::ResultBytes(b)) => self
                .runs
                .get(&run_id)
                .is_some_and(|r| b > r.bounds.max_tool_result_bytes),
            _ => false,
        };
        let detail = match how {
            Resolution::Commit(s) => Some(s),
            _ => None,
        };
        self.settle(step_id, state, charged, now, detail);
        if charged > amount {
            self.run_hold_follows(&run_id);
        }
        if too_large {
            if let Some(res) = self.reservations.get_mut(step_id) {
                res.result_too_large = true;
            }
        }
        self.renew(&run_id, now, policy.lease_ttl_ms);
        self.bump();
        let value = Resolved {
            state,
            charged,
            reserved: amount,
            overrun: charged > amount,
            repeated: false,
            result_too_large: too_large,
        };
        Ok(self.answer(value, true))
    }
    /// A resolution of a step that is no longer held: a late overrun (below), a repeat of
    /// the same transition (its first outcome), or a refusal with its state and charge.
    fn resolve_settled(
        &mut self,
        step_id: &ReservationId,
        how: Resolution,
        swept: bool,
    ) -> Result<Applied<Resolved>, LedgerError> {
        let Some(res) = self.reservations.get(step_id) else {
            return Err(LedgerError::NotFound(format!("step {}", step_id.0)));
        };
        // A late overrun: a commit that reaches a reservation after it expired (its
        // holder could not reach the store before its lease ran out) or was marked
        // unknown, with a usage that costs more than it was charged. The difference is
        // charged (I1b: never below what the upstream served; I3: failures err towards
        // charging more); the state stays, and the first outcome is answered otherwise.
        if let (ReservationState::Expired | ReservationState::Unknown, Resolution::Commit(s)) =
            (res.state, how)
        {
            // (a settlement of the wrong kind is answered as closed, like any other)
            let late = charge_of(res, s).unwrap_or(Micros::ZERO);
            if late > res.charged {
                let (state, amount, run_id) = (res.state, res.amount, res.run_id.clone());
                self.top_up(step_id, late, Some(s));
                self.run_hold_follows(&run_id);
                self.bump();
                let value = Resolved {
                    state,
                    charged: late,
                    reserved: amount,
                    overrun: late > amount,
                    repeated: false,
                    result_too_large: false,
                };
                return Ok(self.answer(value, true));
            }
        }
        let same = matches!(
            (res.state, how),
            (ReservationState::Committed, Resolution::Commit(_))
                | (ReservationState::Released, Resolution::Release)
                | (ReservationState::Unknown, Resolution::Unknown)
        );
        if !same {
            return Err(LedgerError::Closed {
                state: res.state,
                charged: res.charged,
            });
        }
        let value = Resolved {
            state: res.state,
            charged: res.charged,
            reserved: res.amount,
            overrun: res.overrun,
            repeated: true,
            result_too_large: res.result_too_large,
        };
        Ok(self.answer(value, swept))
    }
}

fn charge_of(res: &Reservation, s: Settlement) -> Result<Micros, LedgerError> {
    match (&res.kind, s) {
        (ReservationKind::Model { price, .. }, Settlement::Tokens(u)) => Ok(price.charge(&u)),
        (ReservationKind::Tool { price, .. }, Settlement::Units(n)) => Ok(price.cost(n)),
        (ReservationKind::Tool { .. }, Settlement::ResultBytes(_)) => Ok(res.amount),
        (ReservationKind::Model { .. }, _) => Err(LedgerError::Invalid(
            "a model step commits with \"usage\"".into(),
        )),
        (ReservationKind::Tool { .. }, Settlement::Tokens(_)) => Err(LedgerError::Invalid(
            "a tool step commits with \"units\" or \"result_bytes\"".into(),
        )),
        (ReservationKind::RunHold, _) => Err(LedgerError::Invalid("not a step".into())),
    }
}
