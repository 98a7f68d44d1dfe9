//! `spendgate tune`'s arithmetic, pure: what the runs of a period used (every run bound), what
//! each session, address prefix and conversation spent per day and how many runs it started per
//! minute, and for each `[run]` key and each `[limits.*]` rate and budget a suggested value
//! (the p99 with half again as headroom, rounded up to two significant figures) with the share
//! of the observed runs, or scopes, it would have refused. Suggestions are a starting point
//! read from real traffic, not capacity evidence.

use spendgate_core::history::{ReservationRecord, RunRecord, StepClass, GROUPS_MAX};
use spendgate_core::{Policy, ScopeKind, Window};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

/// Runs one tune keeps at most (past it, later runs are not sampled, and it says so).
pub const TUNE_RUNS_MAX: usize = 1_000_000;

/// What the period showed, accumulated record by record ([`Tally::run`],
/// [`Tally::reservation`]) so that no period is held in memory whole.
#[derive(Default)]
pub struct Tally {
    /// One column per run bound, in [`RUN_KEYS`] order, one value per run.
    runs: [Vec<u64>; 9],
    /// Output tokens of each model call (its bound is per call).
    call_output: Vec<u64>,
    /// Spend per (scope kind, scope, day).
    day_spend: HashMap<(ScopeKind, String, u64), u64>,
    /// Runs started per (scope kind, scope, minute).
    minute_runs: HashMap<(ScopeKind, String, u64), u64>,
    /// Records not counted because a bound was reached.
    pub dropped: u64,
}

/// The `[run]` keys, in the order of [`Tally::runs`].
pub const RUN_KEYS: [&str; 9] = [
    "max_input_bytes",
    "max_context_tokens",
    "max_output_tokens",
    "max_tool_result_bytes",
    "max_model_rounds",
    "max_tool_calls",
    "max_retries",
    "max_seconds",
    "max_cost",
];
const OUTPUT: usize = 2;
const COST: usize = 8;

/// The scope kinds `tune` suggests limits for.
const KINDS: [ScopeKind; 4] = [
    ScopeKind::Global,
    ScopeKind::Ip,
    ScopeKind::Session,
    ScopeKind::Conversation,
];

fn scope_of(kind: ScopeKind, session: &str, address: &str, conversation: &str) -> String {
    match kind {
        ScopeKind::Ip => address.to_owned(),
        ScopeKind::Session => session.to_owned(),
        ScopeKind::Conversation => conversation.to_owned(),
        _ => String::new(),
    }
}

impl Tally {
    /// Counts one ended run.
    pub fn run(&mut self, r: &RunRecord) {
        if self.runs[0].len() >= TUNE_RUNS_MAX {
            self.dropped += 1;
            return;
        }
        let values = [
            r.input_bytes,
            r.context_tokens,
            r.output_tokens,
            r.tool_result_bytes,
            u64::from(r.rounds),
            u64::from(r.tool_calls),
            u64::from(r.retries),
            r.duration_ms.div_ceil(1000),
            r.cost.0,
        ];
        for (col, v) in self.runs.iter_mut().zip(values) {
            col.push(v);
        }
        let minute = r.created.0 / 60_000;
        for kind in KINDS {
            let key = (
                kind,
                scope_of(kind, &r.session, &r.address, &r.conversation),
                minute,
            );
            bump(&mut self.minute_runs, key, 1, &mut self.dropped);
        }
    }

    /// Counts one reservation's charge (and a model call's output).
    pub fn reservation(&mut self, r: &ReservationRecord) {
        if let (StepClass::Model, Some(u)) = (r.class, r.usage) {
            if self.call_output.len() < TUNE_RUNS_MAX {
                self.call_output.push(u.completion_tokens);
            }
        }
        if r.charged.0 == 0 {
            return;
        }
        let day = r.resolved_at.0 / 86_400_000;
        for kind in KINDS {
            let key = (
                kind,
                scope_of(kind, &r.session, &r.address, &r.conversation),
                day,
            );
            bump(&mut self.day_spend, key, r.charged.0, &mut self.dropped);
        }
    }

    pub fn runs_seen(&self) -> usize {
        self.runs[0].len()
    }
}

fn bump(
    map: &mut HashMap<(ScopeKind, String, u64), u64>,
    key: (ScopeKind, String, u64),
    by: u64,
    dropped: &mut u64,
) {
    if let Some(v) = map.get_mut(&key) {
        *v = v.saturating_add(by);
    } else if map.len() >= GROUPS_MAX {
        *dropped += 1;
    } else {
        map.insert(key, by);
    }
}

/// The distribution of one quantity and the value suggested for its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Suggestion {
    /// The config key: `run.max_cost`, `limits.session.rate`, `limits.ip.budgets`...
    pub key: String,
    /// What was measured, for the table.
    pub what: &'static str,
    pub samples: usize,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
    pub suggested: u64,
    /// What the config in use sets, when known.
    pub current: Option<u64>,
    /// Samples above the suggested value, per million of them.
    pub refused_ppm: u64,
    /// Samples above the current value, per million.
    pub current_refused_ppm: Option<u64>,
    pub unit: Unit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Count,
    Micros,
    PerMinute,
}

/// The value at quantile `p` of a sorted sample (nearest rank, rounded up).
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).ceil() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `v` with half again as headroom, rounded up to two significant figures, at least 1.
pub fn headroom(v: u64) -> u64 {
    let v = v.saturating_add(v.div_ceil(2)).max(1);
    let mut scale = 1u64;
    while v / scale >= 100 {
        scale = scale.saturating_mul(10);
    }
    v.div_ceil(scale).saturating_mul(scale)
}

fn above_ppm(sorted: &[u64], bound: u64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let above = sorted.len() - sorted.partition_point(|&v| v <= bound);
    (above as u64 * 1_000_000).div_ceil(sorted.len() as u64)
}

fn suggest(
    key: String,
    what: &'static str,
    mut v: Vec<u64>,
    cap: u64,
    current: Option<u64>,
    unit: Unit,
) -> Suggestion {
    v.sort_unstable();
    let p99 = percentile(&v, 0.99);
    let suggested = headroom(p99).min(cap);
    Suggestion {
        key,
        what,
        samples: v.len(),
        p50: percentile(&v, 0.5),
        p90: percentile(&v, 0.9),
        p99,
        max: v.last().copied().unwrap_or(0),
        refused_ppm: above_ppm(&v, suggested),
        current_refused_ppm: current.map(|c| above_ppm(&v, c)),
        suggested,
        current,
        unit,
    }
}

/// Every suggestion of a tally: the nine `[run]` bounds, then, per scope kind, its daily
/// budget and its rate per minute. `policy` is the config in use, when known.
pub fn suggestions(t: &Tally, policy: Option<&Policy>) -> Vec<Suggestion> {
    use spendgate_config as c;
    let caps = [
        c::RUN_BYTES_MAX,
        c::RUN_TOKENS_MAX,
        c::RUN_TOKENS_MAX,
        c::RUN_BYTES_MAX,
        c::RUN_COUNT_MAX,
        c::RUN_COUNT_MAX,
        c::RUN_COUNT_MAX,
        c::RUN_SECONDS_MAX,
        spendgate_core::MICROS_MAX.0,
    ];
    let current = policy.map(|p| {
        let r = &p.run;
        [
            r.max_input_bytes,
            r.max_context_tokens,
            r.max_output_tokens,
            r.max_tool_result_bytes,
            u64::from(r.max_model_rounds),
            u64::from(r.max_tool_calls),
            u64::from(r.max_retries),
            r.max_seconds,
            r.max_cost.0,
        ]
    });
    let defaults = {
        let r = spendgate_core::RunBounds::default();
        [
            r.max_input_bytes,
            r.max_context_tokens,
            r.max_output_tokens,
            r.max_tool_result_bytes,
            u64::from(r.max_model_rounds),
            u64::from(r.max_tool_calls),
            u64::from(r.max_retries),
            r.max_seconds,
            r.max_cost.0,
        ]
    };
    let whats = [
        "input bytes per run",
        "largest prompt (tokens) per run",
        "output tokens per model call",
        "largest tool result (bytes)",
        "model rounds per run",
        "tool calls per run",
        "retries per run",
        "seconds per run",
        "cost per run",
    ];
    let mut out = Vec::new();
    for (i, key) in RUN_KEYS.iter().enumerate() {
        let sample = if i == OUTPUT && !t.call_output.is_empty() {
            t.call_output.clone()
        } else {
            t.runs[i].clone()
        };
        let unit = if i == COST { Unit::Micros } else { Unit::Count };
        let mut s = suggest(
            format!("run.{key}"),
            whats[i],
            sample,
            caps[i],
            current.map(|c| c[i]),
            unit,
        );
        if s.max == 0 {
            // None used it (no tool calls, no retries): the value in use stays, since 1 would
            // refuse the first real one.
            s.suggested = current.unwrap_or(defaults)[i];
            s.refused_ppm = 0;
        }
        out.push(s);
    }
    for kind in KINDS {
        out.extend(scope_suggestions(t, kind, policy));
    }
    out
}

/// A scope kind's daily budget (from each scope's spend per day) and rate (from each scope's
/// busiest minute).
fn scope_suggestions(t: &Tally, kind: ScopeKind, policy: Option<&Policy>) -> [Suggestion; 2] {
    let per_scope = |m: &HashMap<(ScopeKind, String, u64), u64>, peak: bool| -> Vec<u64> {
        let mut by_scope: BTreeMap<&str, u64> = BTreeMap::new();
        let mut all = Vec::new();
        for ((k, scope, _), v) in m {
            if *k != kind {
                continue;
            }
            if peak {
                let e = by_scope.entry(scope.as_str()).or_default();
                *e = (*e).max(*v);
            } else {
                all.push(*v);
            }
        }
        if peak {
            by_scope.into_values().collect()
        } else {
            all
        }
    };
    let scope_policy = policy.and_then(|p| p.for_kind(kind));
    let day_budget = scope_policy
        .and_then(|p| p.budgets.iter().find(|b| b.window == Window::Day))
        .map(|b| b.amount.0);
    let rate = scope_policy
        .and_then(|p| p.rate)
        .map(|r| (r.count.saturating_mul(60_000)).div_ceil(r.period_ms.max(1)));
    let name = kind.name();
    [
        suggest(
            format!("limits.{name}.budgets"),
            "spend per scope per day",
            per_scope(&t.day_spend, false),
            spendgate_core::MICROS_MAX.0,
            day_budget,
            Unit::Micros,
        ),
        suggest(
            format!("limits.{name}.rate"),
            "runs per scope, busiest minute",
            per_scope(&t.minute_runs, true),
            spendgate_config::RATE_COUNT_MAX,
            rate,
            Unit::PerMinute,
        ),
    ]
}

/// Micros in currency units, with no trailing zeros ("0.0125", "3").
pub fn units(micros: u64) -> String {
    let frac = format!("{:06}", micros % 1_000_000);
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() {
        format!("{}", micros / 1_000_000)
    } else {
        format!("{}.{frac}", micros / 1_000_000)
    }
}

fn show(v: u64, unit: Unit) -> String {
    match unit {
        Unit::Count => v.to_string(),
        Unit::Micros => units(v),
        Unit::PerMinute => format!("{v}/minute"),
    }
}

fn share(ppm: u64) -> String {
    format!("{}.{:02}%", ppm / 10_000, (ppm % 10_000) / 100)
}

/// The suggestions as a table: percentiles, the suggestion, the share of runs (or scopes) it
/// would have refused, and the current value with its share.
pub fn render_table(s: &[Suggestion]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<30} {:>8} {:>12} {:>12} {:>12} {:>12} {:>14} {:>8} {:>14} {:>8}",
        "key", "samples", "p50", "p90", "p99", "max", "suggested", "refused", "current", "refused"
    );
    for x in s {
        let (cur, cur_share) = match (x.current, x.current_refused_ppm) {
            (Some(c), Some(p)) => (show(c, x.unit), share(p)),
            _ => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            out,
            "{:<30} {:>8} {:>12} {:>12} {:>12} {:>12} {:>14} {:>8} {:>14} {:>8}",
            x.key,
            x.samples,
            show(x.p50, x.unit),
            show(x.p90, x.unit),
            show(x.p99, x.unit),
            show(x.max, x.unit),
            show(x.suggested, x.unit),
            share(x.refused_ppm),
            cur,
            cur_share,
        );
    }
    out
}

/// The suggestions as a config snippet that `check-config` accepts: the `[run]` bounds
/// observed in at least one run, and each scope kind's daily budget and rate seen in at least
/// one scope. Keys with no sample are left out (they keep the config's value).
pub fn render_toml(s: &[Suggestion]) -> String {
    let mut tables: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for x in s.iter().filter(|x| x.samples > 0) {
        let Some((table, key)) = x.key.rsplit_once('.') else {
            continue;
        };
        let line = match (key, x.unit) {
            ("budgets", _) => format!(
                "budgets = [{{ amount = \"{}\", window = \"day\" }}]",
                units(x.suggested.max(1))
            ),
            ("rate", _) => format!("rate = \"{}/minute\"", x.suggested.max(1)),
            (k, Unit::Micros) => format!("{k} = \"{}\"", units(x.suggested.max(1))),
            (k, _) => format!("{k} = {}", x.suggested.max(1)),
        };
        tables.entry(table.to_owned()).or_default().push(line);
    }
    let mut out = String::new();
    // `[run]` first, then the scopes in the order of the config reference.
    let order = [
        "run",
        "limits.global",
        "limits.ip",
        "limits.session",
        "limits.conversation",
    ];
    for t in order {
        if let Some(lines) = tables.get(t) {
            let _ = writeln!(out, "[{t}]");
            for l in lines {
                let _ = writeln!(out, "{l}");
            }
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_core::history::StepClass;
    use spendgate_core::{
        Micros, ReservationId, ReservationState, RunId, RunState, TokenUsage, UnixMs,
    };

    fn run(i: u64, session: &str, cost: u64, rounds: u32) -> RunRecord {
        RunRecord {
            id: RunId(format!("run{i}")),
            session: session.into(),
            conversation: format!("c{i}"),
            address: "192.0.2.0/24".into(),
            created: UnixMs(1_000_000 + i * 1000),
            ended_at: UnixMs(1_000_000 + i * 1000 + 2500),
            ended: RunState::Finished,
            input_bytes: 100 + i,
            context_tokens: 1000,
            output_tokens: 50,
            tool_result_bytes: 0,
            rounds,
            tool_calls: 1,
            retries: 0,
            duration_ms: 2500,
            cost: Micros(cost),
            refused: vec![],
        }
    }

    fn reservation(i: u64, session: &str, charged: u64, out: u64) -> ReservationRecord {
        ReservationRecord {
            id: ReservationId(format!("r{i}")),
            run_id: RunId(format!("run{i}")),
            session: session.into(),
            conversation: format!("c{i}"),
            address: "192.0.2.0/24".into(),
            class: StepClass::Model,
            name: "m".into(),
            retry: false,
            usage: Some(TokenUsage {
                prompt_tokens: 10,
                completion_tokens: out,
                cached_tokens: 0,
            }),
            units: None,
            result_bytes: None,
            reserved: Micros(charged),
            charged: Micros(charged),
            state: ReservationState::Committed,
            created: UnixMs(1_000_000),
            resolved_at: UnixMs(1_000_000 + i),
            overrun: false,
            result_too_large: false,
            counters: vec![],
        }
    }

    #[test]
    fn headroom_rounds_up_to_two_figures() {
        assert_eq!(headroom(0), 1);
        assert_eq!(headroom(2), 3);
        assert_eq!(headroom(99), 150);
        assert_eq!(headroom(6500), 9800);
        assert_eq!(headroom(1_000_001), 1_600_000);
    }

    #[test]
    fn every_bound_and_limit_gets_a_value_and_its_refused_share() {
        let mut t = Tally::default();
        // 200 runs: 199 cost 1000 and take 2 rounds, one outlier costs 1,000,000 and 9 rounds.
        for i in 0..200 {
            let s = if i < 100 { "s-big" } else { "s-small" };
            let (cost, rounds) = if i == 199 { (1_000_000, 9) } else { (1000, 2) };
            t.run(&run(i, s, cost, rounds));
            t.reservation(&reservation(i, s, cost, 40 + i));
        }
        let policy = Policy::default();
        let s = suggestions(&t, Some(&policy));
        assert_eq!(s.len(), 9 + 8);
        let get = |k: &str| s.iter().find(|x| x.key == k).expect(k).clone();
        let cost = get("run.max_cost");
        assert_eq!((cost.p50, cost.p99, cost.max), (1000, 1000, 1_000_000));
        assert_eq!(cost.suggested, 1500);
        assert_eq!(cost.refused_ppm, 5_000, "the one outlier of 200");
        let rounds = get("run.max_model_rounds");
        assert_eq!((rounds.suggested, rounds.refused_ppm), (3, 5_000));
        assert_eq!(rounds.current, Some(8));
        assert_eq!(rounds.current_refused_ppm, Some(5_000));
        // Output tokens are per model call, from the reservations.
        // Nobody retried: the value in use stays.
        assert_eq!(get("run.max_retries").suggested, 2);
        let output = get("run.max_output_tokens");
        assert_eq!((output.max, output.samples), (239, 200));
        assert_eq!(get("run.max_seconds").p50, 3);
        // Two sessions: one spent 100 × 1000 that day, the other 99 × 1000 + the outlier.
        let budget = get("limits.session.budgets");
        assert_eq!(budget.samples, 2);
        assert_eq!(budget.max, 1_099_000);
        let global = get("limits.global.budgets");
        assert_eq!((global.samples, global.max), (1, 1_199_000));
        // One run a second: at most 60 in a minute, per session fewer.
        let rate = get("limits.global.rate");
        assert_eq!(rate.max, 60, "{rate:?}");
        assert_eq!(rate.refused_ppm, 0);
        let table = render_table(&s);
        assert!(
            table.contains("run.max_cost") && table.contains("0.50%"),
            "{table}"
        );
        let snippet = render_toml(&s);
        assert!(
            snippet.starts_with("[run]\nmax_input_bytes = "),
            "{snippet}"
        );
        assert!(snippet.contains("max_cost = \"0.0015\""), "{snippet}");
        assert!(
            snippet.contains(
                "[limits.session]\nbudgets = [{ amount = \"1.7\", window = \"day\" }]\nrate = \""
            ),
            "{snippet}"
        );
        let cfg =
            spendgate_config::load(&snippet, &|_| None).expect("the snippet is a valid config");
        assert_eq!(cfg.policy.run.max_cost, Micros(1500));
        assert_eq!(cfg.policy.run.max_model_rounds, 3);
    }

    #[test]
    fn an_empty_period_suggests_nothing_and_the_snippet_is_still_valid() {
        let s = suggestions(&Tally::default(), None);
        assert!(s.iter().all(|x| x.samples == 0));
        let snippet = render_toml(&s);
        assert_eq!(snippet, "");
        spendgate_config::load(&snippet, &|_| None).expect("valid");
    }
}
