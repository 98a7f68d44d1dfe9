//! Scopes (what a limit applies to) and their policies.

use crate::money::Micros;
use crate::rate::Rate;
use crate::window::Window;
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeKind {
    Global,
    Ip,
    Session,
    Conversation,
    Run,
}

impl ScopeKind {
    pub fn name(self) -> &'static str {
        match self {
            ScopeKind::Global => "global",
            ScopeKind::Ip => "ip",
            ScopeKind::Session => "session",
            ScopeKind::Conversation => "conversation",
            ScopeKind::Run => "run",
        }
    }

    pub fn parse(s: &str) -> Option<ScopeKind> {
        Some(match s {
            "global" => ScopeKind::Global,
            "ip" => ScopeKind::Ip,
            "session" => ScopeKind::Session,
            "conversation" => ScopeKind::Conversation,
            "run" => ScopeKind::Run,
            _ => return None,
        })
    }
}

/// One thing a limit applies to: a kind and an id within it (`""` for global).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ScopeKey {
    pub kind: ScopeKind,
    pub id: String,
}

impl ScopeKey {
    pub fn global() -> ScopeKey {
        ScopeKey {
            kind: ScopeKind::Global,
            id: String::new(),
        }
    }
    pub fn new(kind: ScopeKind, id: impl Into<String>) -> ScopeKey {
        ScopeKey {
            kind,
            id: id.into(),
        }
    }
    /// Parses "global", "ip:203.0.113.7/32", "session:ID", "conversation:ID", "run:ID".
    pub fn parse(s: &str) -> Option<ScopeKey> {
        if s == "global" {
            return Some(ScopeKey::global());
        }
        let (kind, id) = s.split_once(':')?;
        let kind = ScopeKind::parse(kind)?;
        if kind == ScopeKind::Global || id.is_empty() {
            return None;
        }
        Some(ScopeKey::new(kind, id))
    }
}

impl fmt::Display for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ScopeKind::Global => f.write_str("global"),
            k => write!(f, "{}:{}", k.name(), self.id),
        }
    }
}

/// An address prefix the request came from, and how much wider than the base prefix it is:
/// limits of wider IPv6 prefixes (/56, /48) are the `ip` policy multiplied by `factor`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IpScope {
    pub prefix: String,
    pub factor: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    pub amount: Micros,
    pub window: Window,
    /// This budget alone in dry-run (see [`ScopePolicy::dry_run`]); the scope's other limits
    /// stay enforced. (Left out of the serialized form when false, so that a policy without
    /// per-limit dry-run keeps its fingerprint.)
    #[serde(default, skip_serializing_if = "is_false")]
    pub dry_run: bool,
}

impl Budget {
    /// An enforced budget.
    pub fn new(amount: Micros, window: Window) -> Budget {
        Budget {
            amount,
            window,
            dry_run: false,
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Limits of one scope kind: budgets per window, a request rate, a concurrency cap.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopePolicy {
    pub budgets: Vec<Budget>,
    pub rate: Option<Rate>,
    pub concurrency: Option<u32>,
    /// Dry-run: this scope's limits are checked against the real state and a failing check
    /// is reported (`dry_run` in the answer) instead of refusing. What is admitted is
    /// accounted as usual (reserved, charged, slots taken); a budget held past its limit is
    /// marked overrun, and a request past the rate does not move the rate's state (a refused
    /// request would not have).
    pub dry_run: bool,
    /// The rate alone in dry-run (the scope's budgets and concurrency cap stay enforced).
    #[serde(default, skip_serializing_if = "is_false")]
    pub rate_dry_run: bool,
    /// The concurrency cap alone in dry-run.
    #[serde(default, skip_serializing_if = "is_false")]
    pub concurrency_dry_run: bool,
}

impl ScopePolicy {
    /// The policy multiplied by `factor` (wider prefixes, higher thresholds).
    pub fn scaled(&self, factor: u64) -> ScopePolicy {
        if factor == 1 {
            return self.clone();
        }
        let f32 = u32::try_from(factor).unwrap_or(u32::MAX);
        ScopePolicy {
            budgets: self
                .budgets
                .iter()
                .map(|b| Budget {
                    amount: Micros(b.amount.0.saturating_mul(factor).min(crate::MICROS_MAX.0)),
                    window: b.window,
                    dry_run: b.dry_run,
                })
                .collect(),
            rate: self.rate.map(|r| r.scaled(factor)),
            concurrency: self.concurrency.map(|c| c.saturating_mul(f32)),
            dry_run: self.dry_run,
            rate_dry_run: self.rate_dry_run,
            concurrency_dry_run: self.concurrency_dry_run,
        }
    }

    /// Whether the rate is in dry-run (the whole scope, or the rate alone).
    pub fn rate_dry(&self) -> bool {
        self.dry_run || self.rate_dry_run
    }

    /// Whether the concurrency cap is in dry-run (the whole scope, or the cap alone).
    pub fn concurrency_dry(&self) -> bool {
        self.dry_run || self.concurrency_dry_run
    }

    /// Whether the budget of `window` is in dry-run (the whole scope, or that budget alone;
    /// a scope has at most one budget per window).
    pub fn budget_dry(&self, window: Window) -> bool {
        self.dry_run || self.budgets.iter().any(|b| b.window == window && b.dry_run)
    }

    /// Whether any of this scope's limits is in dry-run.
    pub fn any_dry(&self) -> bool {
        self.dry_run
            || self.rate_dry_run
            || self.concurrency_dry_run
            || self.budgets.iter().any(|b| b.dry_run)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationMode {
    /// Each step reserves its own bound against every scope.
    PerStep,
    /// Admission reserves the run's cost bound once; steps draw from it; finish reconciles.
    WholeRun,
}

/// Bounds on one run (one accepted user message and everything it causes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunBounds {
    pub max_input_bytes: u64,
    pub max_context_tokens: u64,
    pub max_output_tokens: u64,
    pub max_tool_result_bytes: u64,
    pub max_model_rounds: u32,
    pub max_tool_calls: u32,
    pub max_retries: u32,
    pub max_seconds: u64,
    pub max_cost: Micros,
    pub shrink_to_fit: bool,
    pub min_output_tokens: u64,
}

impl Default for RunBounds {
    fn default() -> Self {
        RunBounds {
            max_input_bytes: 16_384,
            max_context_tokens: 16_000,
            max_output_tokens: 1024,
            max_tool_result_bytes: 65_536,
            max_model_rounds: 8,
            max_tool_calls: 16,
            max_retries: 2,
            max_seconds: 120,
            max_cost: Micros(200_000),
            shrink_to_fit: false,
            min_output_tokens: 64,
        }
    }
}

/// Everything the ledger needs to decide: the validated, parsed limits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub global: ScopePolicy,
    pub ip: ScopePolicy,
    pub session: ScopePolicy,
    pub conversation: ScopePolicy,
    pub run: RunBounds,
    pub mode: ReservationMode,
    pub lease_ttl_ms: u64,
    pub session_create_per_ip: Option<Rate>,
    pub session_create_global: Option<Rate>,
}

impl Policy {
    /// Whether a scope kind's limits are in dry-run (never for `run`: run bounds are always
    /// enforced).
    pub fn dry_run(&self, kind: ScopeKind) -> bool {
        self.for_kind(kind).is_some_and(|p| p.dry_run)
    }

    /// Whether the budget of a scope kind in `window` is in dry-run (never for `run`).
    pub fn budget_dry_run(&self, kind: ScopeKind, window: Window) -> bool {
        self.for_kind(kind).is_some_and(|p| p.budget_dry(window))
    }

    pub fn for_kind(&self, kind: ScopeKind) -> Option<&ScopePolicy> {
        match kind {
            ScopeKind::Global => Some(&self.global),
            ScopeKind::Ip => Some(&self.ip),
            ScopeKind::Session => Some(&self.session),
            ScopeKind::Conversation => Some(&self.conversation),
            ScopeKind::Run => None,
        }
    }
}

impl Default for Policy {
    /// The defaults of SPEC §9 for global and run; per-guest limits an operator of a public
    /// chat page would start from.
    fn default() -> Self {
        let budget = |units: u64, window| Budget::new(Micros(units), window);
        Policy {
            global: ScopePolicy {
                budgets: vec![
                    budget(50_000_000, Window::Day),
                    budget(1_000_000_000, Window::Month),
                ],
                rate: Some(Rate {
                    count: 100,
                    period_ms: 1000,
                    burst: 20,
                }),
                concurrency: Some(64),
                dry_run: false,
                rate_dry_run: false,
                concurrency_dry_run: false,
            },
            ip: ScopePolicy {
                budgets: vec![budget(1_000_000, Window::Day)],
                rate: Some(Rate {
                    count: 30,
                    period_ms: 60_000,
                    burst: 10,
                }),
                concurrency: Some(4),
                dry_run: false,
                rate_dry_run: false,
                concurrency_dry_run: false,
            },
            session: ScopePolicy {
                budgets: vec![budget(500_000, Window::Day)],
                rate: Some(Rate {
                    count: 20,
                    period_ms: 60_000,
                    burst: 5,
                }),
                concurrency: Some(2),
                dry_run: false,
                rate_dry_run: false,
                concurrency_dry_run: false,
            },
            conversation: ScopePolicy {
                budgets: vec![budget(500_000, Window::Day)],
                rate: None,
                concurrency: Some(1),
                dry_run: false,
                rate_dry_run: false,
                concurrency_dry_run: false,
            },
            run: RunBounds::default(),
            mode: ReservationMode::PerStep,
            lease_ttl_ms: 30_000,
            session_create_per_ip: Some(Rate {
                count: 10,
                period_ms: 3_600_000,
                burst: 10,
            }),
            session_create_global: Some(Rate {
                count: 600,
                period_ms: 60_000,
                burst: 600,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A single limit in dry-run is its own, the scope's flag covers them all, and scaling
    /// (wider address prefixes) keeps both.
    #[test]
    fn dry_run_of_a_scope_or_of_a_single_limit() {
        let mut p = Policy::default();
        let s = &mut p.session;
        s.budgets = vec![
            Budget::new(Micros(500_000), Window::Day),
            Budget {
                dry_run: true,
                ..Budget::new(Micros(100_000), Window::Hour)
            },
        ];
        s.rate_dry_run = true;
        assert!(s.budget_dry(Window::Hour) && !s.budget_dry(Window::Day));
        assert!(!s.budget_dry(Window::Month), "no budget there");
        assert!(s.rate_dry() && !s.concurrency_dry() && s.any_dry());
        let wide = s.scaled(4);
        assert!(wide.budget_dry(Window::Hour) && !wide.budget_dry(Window::Day));
        assert!(wide.rate_dry() && !wide.concurrency_dry());
        assert_eq!(wide.budgets[1].amount, Micros(400_000));
        assert!(p.budget_dry_run(ScopeKind::Session, Window::Hour));
        assert!(!p.budget_dry_run(ScopeKind::Session, Window::Day));
        assert!(!p.budget_dry_run(ScopeKind::Run, Window::Hour));
        assert!(
            !p.dry_run(ScopeKind::Session),
            "the scope itself is enforced"
        );
        p.ip.dry_run = true;
        assert!(p.ip.budget_dry(Window::Day) && p.ip.rate_dry() && p.ip.concurrency_dry());
        assert!(!Policy::default().global.any_dry());
    }
}
