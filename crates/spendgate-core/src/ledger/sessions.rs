//! Guest session creation, rate-limited per address prefix and globally.

use super::error::{check_id, LedgerError};
use super::messages::{Applied, SessionGrant};
use super::records::Entity;
use super::refusal::{Refusal, RefusalCode};
use super::Ledger;
use crate::scope::{IpScope, Policy, ScopeKind};
use crate::window::UnixMs;

impl Ledger {
    /// Rate-limits guest session creation per address prefix and globally. `dry`: answers
    /// what a creation would, applying nothing.
    pub fn create_session(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        ips: &[IpScope],
        dry: bool,
    ) -> Result<Applied<Result<SessionGrant, Refusal>>, LedgerError> {
        let (now, swept) = self.advance(now);
        let now_us = now.0.saturating_mul(1000);
        let mut tats = Vec::new();
        let mut pressure = false;
        let mut checks: Vec<(String, crate::Rate, ScopeKind)> = Vec::new();
        if let Some(r) = policy.session_create_per_ip {
            for ip in ips {
                check_id("address prefix", &ip.prefix)?;
                checks.push((
                    format!("create|ip:{}", ip.prefix),
                    r.scaled(ip.factor.max(1)),
                    ScopeKind::Ip,
                ));
            }
        }
        if let Some(r) = policy.session_create_global {
            checks.push(("create|global".to_string(), r, ScopeKind::Global));
        }
        for (key, rate, kind) in checks {
            let tat = self.rates.get(&key).copied().unwrap_or(0);
            match rate.check(tat, now_us) {
                Ok(t) => {
                    // Pressure: more than half the burst is in use.
                    let half = rate.interval_us().saturating_mul(rate.burst.max(1)) / 2;
                    if t.saturating_sub(now_us) > half {
                        pressure = true;
                    }
                    tats.push((key, t));
                }
                Err(wait) => {
                    let r = Refusal::new(
                        RefusalCode::RateLimited,
                        Some(kind),
                        format!("session creation rate exceeded ({})", kind.name()),
                    )
                    .retry_after(wait.div_ceil(1_000_000));
                    // (a dry check is not a refusal answered: it is not counted)
                    if !dry {
                        self.record_refusal(now, &r, None);
                    }
                    if swept {
                        self.bump();
                    }
                    return Ok(self.answer(Err(r), swept));
                }
            }
        }
        if dry {
            if swept {
                self.bump();
            }
            return Ok(self.answer(Ok(SessionGrant { pressure }), swept));
        }
        for (k, t) in tats {
            self.rates.insert(k.clone(), t);
            self.touch(Entity::Rate(k));
        }
        self.bump();
        Ok(self.answer(Ok(SessionGrant { pressure }), true))
    }
}
