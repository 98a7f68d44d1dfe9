//! Metrics in the Prometheus text format. Names follow `spendgate_<name>_<unit>`.

use spendgate_core::{ScopeKind, Summary, UsageLine};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::burn::Forecast;
use crate::totals::{head, HistoryTotals};

/// Distinct label sets kept per counter family (codes × scopes × kinds is far below this).
pub const LABEL_SETS_MAX: usize = 256;

/// A label value in the text format: backslash, double quote and line feed escaped.
pub fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[derive(Default)]
pub struct Metrics {
    admissions: Mutex<BTreeMap<&'static str, u64>>,
    refusals: Mutex<BTreeMap<(&'static str, &'static str, &'static str), u64>>,
    /// Refusals a limit in dry-run would have given (the request was admitted).
    dry_run_refusals: Mutex<BTreeMap<(&'static str, &'static str, &'static str), u64>>,
    overruns: AtomicU64,
    /// Every error answer by status and code (store outages, bad input and the framework's
    /// own refusals included; an upstream's error passed through as code "upstream").
    error_answers: Mutex<BTreeMap<(u16, &'static str), u64>>,
    /// Every store call, timed by the store's decorator (`metered::Metered`).
    store_calls: Arc<Timing>,
    upstream_calls: Timing,
    proxy_overheads: Timing,
    /// The usage history's running totals (charges, reservations, refusals, unknown
    /// outcomes), told by the store ([`Metrics::history_tap`]).
    history: Arc<HistoryTotals>,
    /// Proxied answers cut at the output bound their upstream went past.
    output_cuts: AtomicU64,
    /// The Redis history drain's gauges, once a drain reports ([`Metrics::history_drain`]).
    history_drain: Mutex<Option<HistoryDrain>>,
}

/// What the Redis history drain reports (`spendgate_redis::history::DrainStatus`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HistoryDrain {
    /// Age of the oldest record not yet drained, in milliseconds.
    pub lag_ms: u64,
    /// Records delivered to a drain and not yet acknowledged.
    pub pending: u64,
    /// Records this replica drained.
    pub drained: u64,
    /// Records the stream's cap evicted before any drain took them.
    pub evicted: u64,
}

/// Upper bounds of the latency histograms' buckets, in microseconds (Prometheus `le`, in
/// seconds when rendered): from 100 µs, where a store call on loopback lands, to 10 s, past
/// any configured timeout.
const BUCKETS_MICROS: [u64; 16] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// A Prometheus histogram of durations: how many fell in each bucket (not cumulative here),
/// how many in all, and their total time. Lock-free.
#[derive(Default)]
struct Timing {
    buckets: [AtomicU64; BUCKETS_MICROS.len()],
    count: AtomicU64,
    micros: AtomicU64,
}

impl Timing {
    fn record(&self, d: Duration) {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if let Some(i) = BUCKETS_MICROS.iter().position(|&b| micros <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.micros.fetch_add(micros, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        head(out, name, "histogram", Some("seconds"), help);
        let count = self.count.load(Ordering::Relaxed);
        let mut cumulative = 0u64;
        for (bound, n) in BUCKETS_MICROS.iter().zip(&self.buckets) {
            // Read after `count`: a record in between can make a bucket exceed the count,
            // never fall below it; capped so the series stays monotonic.
            cumulative = cumulative
                .saturating_add(n.load(Ordering::Relaxed))
                .min(count);
            let le = *bound as f64 / 1e6;
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_count {count}");
        let micros = self.micros.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_sum {}", micros as f64 / 1e6);
    }
}

/// Where the store's decorator records each call's time (`spendgate_store_call_seconds`).
#[derive(Clone)]
pub struct StoreTiming(Arc<Timing>);

impl StoreTiming {
    pub fn record(&self, d: Duration) {
        self.0.record(d);
    }
}

fn bump<K: Ord>(m: &Mutex<BTreeMap<K, u64>>, k: K) {
    let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
    if g.len() < LABEL_SETS_MAX || g.contains_key(&k) {
        *g.entry(k).or_insert(0) += 1;
    }
}

impl Metrics {
    pub fn admitted(&self, what: &'static str) {
        bump(&self.admissions, what);
    }
    pub fn refused(&self, what: &'static str, code: &'static str, scope: Option<ScopeKind>) {
        bump(
            &self.refusals,
            (what, code, scope.map(|s| s.name()).unwrap_or("")),
        );
    }
    pub fn dry_run_refused(
        &self,
        what: &'static str,
        code: &'static str,
        scope: Option<ScopeKind>,
    ) {
        bump(
            &self.dry_run_refusals,
            (what, code, scope.map(|s| s.name()).unwrap_or("")),
        );
    }
    pub fn error_answer(&self, status: u16, code: &'static str) {
        bump(&self.error_answers, (status, code));
    }
    pub fn overrun(&self) {
        self.overruns.fetch_add(1, Ordering::Relaxed);
    }
    /// What the store tells of every history event it makes durable
    /// (`Store::tap_history`): the running totals of charges, reservations and refusals.
    pub fn history_tap(&self) -> Arc<HistoryTotals> {
        self.history.clone()
    }
    pub fn output_cut(&self) {
        self.output_cuts.fetch_add(1, Ordering::Relaxed);
    }
    /// The histogram of store calls, for the store's decorator (`metered::Metered`)
    /// to record into.
    pub fn store_timing(&self) -> StoreTiming {
        StoreTiming(self.store_calls.clone())
    }
    /// Time a proxied call spent in spendgate rather than upstream: before forwarding
    /// (identity, bounds, admission) and, when not streaming, after the answer (commit).
    pub fn proxy_overhead(&self, d: Duration) {
        self.proxy_overheads.record(d);
    }
    pub fn upstream_call(&self, d: Duration) {
        self.upstream_calls.record(d);
    }

    /// The history drain's latest figures.
    pub fn history_drain(&self, d: HistoryDrain) {
        *self.history_drain.lock().unwrap_or_else(|p| p.into_inner()) = Some(d);
    }

    /// `global`: the global budgets' lines (their spend per window, from the counters);
    /// `burn`: their burn rates and forecasts ([`crate::burn`]).
    pub fn render(
        &self,
        summary: Option<&Summary>,
        global: &[UsageLine],
        burn: &[Forecast],
    ) -> String {
        let mut out = String::new();
        self.render_counters(&mut out);
        self.history.render(&mut out);
        render_global(&mut out, global);
        crate::burn::render(&mut out, burn);
        self.render_totals(&mut out);
        if let Some(s) = summary {
            render_summary(&mut out, s);
        }
        out
    }

    /// Admissions, refusals (enforced and dry-run) and error answers, by label.
    fn render_counters(&self, out: &mut String) {
        head(
            out,
            "spendgate_admissions_total",
            "counter",
            None,
            "Requests this replica admitted, by what was admitted (run, step, proxy_step...).",
        );
        for (k, v) in self
            .admissions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(out, "spendgate_admissions_total{{what=\"{k}\"}} {v}");
        }
        for (name, family, help) in [
            (
                "spendgate_refusals_total",
                &self.refusals,
                "Requests this replica refused, by what was asked, refusal code and the kind \
                 of scope that refused (empty: none).",
            ),
            (
                "spendgate_dry_run_refusals_total",
                &self.dry_run_refusals,
                "Refusals a limit in dry-run would have given (the request was admitted), by \
                 what was asked, code and scope kind.",
            ),
        ] {
            head(out, name, "counter", None, help);
            for ((w, c, s), v) in family.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                let _ = writeln!(out, "{name}{{what=\"{w}\",code=\"{c}\",scope=\"{s}\"}} {v}");
            }
        }
        head(
            out,
            "spendgate_error_answers_total",
            "counter",
            None,
            "Error answers of this replica by status and code (refusals, bad input, store \
             outages, overload; an upstream's error passed through as code \"upstream\").",
        );
        for ((status, code), v) in self
            .error_answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "spendgate_error_answers_total{{status=\"{status}\",code=\"{code}\"}} {v}"
            );
        }
    }

    /// Overruns, output cuts, and the call-time histograms.
    fn render_totals(&self, out: &mut String) {
        let l = |n: &AtomicU64| n.load(Ordering::Relaxed);
        head(
            out,
            "spendgate_overruns_total",
            "counter",
            None,
            "Settlements this replica made with usage above the reservation (charged in full).",
        );
        let _ = writeln!(out, "spendgate_overruns_total {}", l(&self.overruns));
        head(
            out,
            "spendgate_output_cuts_total",
            "counter",
            None,
            "Proxied answers cut at the output bound their upstream went past.",
        );
        let _ = writeln!(out, "spendgate_output_cuts_total {}", l(&self.output_cuts));
        self.store_calls.render(
            out,
            "spendgate_store_call_seconds",
            "Time of every store call this replica made.",
        );
        self.upstream_calls.render(
            out,
            "spendgate_upstream_call_seconds",
            "Time of the proxy's upstream calls, to the end of the answer.",
        );
        self.proxy_overheads.render(
            out,
            "spendgate_proxy_overhead_seconds",
            "Time a proxied call spent in spendgate rather than upstream.",
        );
        let drain = *self.history_drain.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = drain {
            let _ = writeln!(
                out,
                "# HELP spendgate_history_drain_lag_seconds Age of the oldest history record not \
                 yet drained into PostgreSQL.\n# TYPE spendgate_history_drain_lag_seconds gauge\n\
                 spendgate_history_drain_lag_seconds {}\n\
                 # HELP spendgate_history_drain_pending History records read from the stream and not yet acknowledged.\n\
                 # TYPE spendgate_history_drain_pending gauge\nspendgate_history_drain_pending {}\n\
                 # HELP spendgate_history_drained_total History records this replica drained.\n\
                 # TYPE spendgate_history_drained_total counter\nspendgate_history_drained_total {}\n\
                 # HELP spendgate_history_evicted_total History records the stream's cap dropped before they were drained.\n\
                 # TYPE spendgate_history_evicted_total counter\nspendgate_history_evicted_total {}",
                d.lag_ms as f64 / 1000.0,
                d.pending,
                d.drained,
                d.evicted
            );
        }
    }
}

/// The global budgets' gauges, per window: used, held, limit and what is left.
fn render_global(out: &mut String, global: &[UsageLine]) {
    for (name, help, value) in [
        (
            "spendgate_global_used_micros",
            "spent in the current window",
            (|l: &UsageLine| l.used.0) as fn(&UsageLine) -> u64,
        ),
        (
            "spendgate_global_reserved_micros",
            "held by reservations in flight in the current window",
            |l| l.reserved.0,
        ),
        (
            "spendgate_global_limit_micros",
            "the window's budget",
            |l| l.limit.0,
        ),
        (
            "spendgate_global_remaining_micros",
            "what is left to admit in the current window (limit - used - held)",
            |l| {
                l.limit
                    .0
                    .saturating_sub(l.used.0)
                    .saturating_sub(l.reserved.0)
            },
        ),
    ] {
        if global.is_empty() {
            break;
        }
        head(
            out,
            name,
            "gauge",
            Some("micros"),
            &format!("Global budget: {help}."),
        );
        for line in global {
            let w = line.window.window.name();
            let _ = writeln!(out, "{name}{{window=\"{w}\"}} {}", value(line));
        }
    }
}

/// What the ledger holds now: reservations in flight and what they hold, runs, cutoff,
/// sequence. (Terminal reservations and charges are the running totals of the history.)
fn render_summary(out: &mut String, s: &Summary) {
    let held = s.reservations.get("held").copied().unwrap_or(0);
    head(
        out,
        "spendgate_reservations_held",
        "gauge",
        None,
        "Reservations in flight (held) in the ledger.",
    );
    let _ = writeln!(out, "spendgate_reservations_held {held}");
    head(
        out,
        "spendgate_held_micros",
        "gauge",
        Some("micros"),
        "Micros held by the reservations in flight.",
    );
    let _ = writeln!(out, "spendgate_held_micros {}", s.held_micros.0);
    head(
        out,
        "spendgate_runs_active",
        "gauge",
        None,
        "Runs open in the ledger.",
    );
    let _ = writeln!(out, "spendgate_runs_active {}", s.runs_active);
    head(
        out,
        "spendgate_cutoff_engaged",
        "gauge",
        None,
        "1 while the kill switch refuses all new work.",
    );
    let _ = writeln!(
        out,
        "spendgate_cutoff_engaged {}",
        u8::from(s.cutoff.is_some())
    );
    head(
        out,
        "spendgate_ledger_seq",
        "gauge",
        None,
        "The ledger's sequence number (operations applied).",
    );
    let _ = writeln!(out, "spendgate_ledger_seq {}", s.seq);
}

/// The policies of the live replicas on this ledger (issue 18): how many distinct
/// fingerprints, how many replicas publish each, whether they drift (more than one), and this
/// replica's own (`replica`: its id and fingerprint). Fingerprints and replica ids are of the
/// store's checked characters (letters, digits, `.`, `-`, `_`, `:`), at most `REPLICAS_MAX`.
pub fn render_policy(out: &mut String, fingerprints: &[(String, usize)], replica: (&str, &str)) {
    let _ = writeln!(
        out,
        "# HELP spendgate_policy_fingerprints Distinct policy fingerprints among the live \
         replicas on this ledger (above 1: they enforce different limits).\n\
         # TYPE spendgate_policy_fingerprints gauge\nspendgate_policy_fingerprints {}",
        fingerprints.len()
    );
    let _ = writeln!(
        out,
        "# HELP spendgate_policy_replicas Live replicas on this ledger by the fingerprint of \
         their policy.\n# TYPE spendgate_policy_replicas gauge"
    );
    for (fp, n) in fingerprints {
        let _ = writeln!(out, "spendgate_policy_replicas{{fingerprint=\"{fp}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP spendgate_policy_drift 1 when live replicas on this ledger enforce different \
         policies.\n# TYPE spendgate_policy_drift gauge\nspendgate_policy_drift {}",
        u8::from(fingerprints.len() > 1)
    );
    let _ = writeln!(
        out,
        "# HELP spendgate_policy_info This replica and the fingerprint of its policy.\n\
         # TYPE spendgate_policy_info gauge\n\
         spendgate_policy_info{{replica=\"{}\",fingerprint=\"{}\"}} 1",
        replica.0, replica.1
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_render_as_histograms_in_seconds() {
        let m = Metrics::default();
        m.store_timing().record(Duration::from_micros(1_500));
        m.store_timing().record(Duration::from_micros(500));
        m.store_timing().record(Duration::from_secs(60));
        m.proxy_overhead(Duration::from_millis(3));
        let out = m.render(None, &[], &[]);
        for line in [
            "# TYPE spendgate_store_call_seconds histogram",
            "spendgate_store_call_seconds_bucket{le=\"0.0001\"} 0",
            "spendgate_store_call_seconds_bucket{le=\"0.0005\"} 1",
            "spendgate_store_call_seconds_bucket{le=\"0.001\"} 1",
            "spendgate_store_call_seconds_bucket{le=\"0.0025\"} 2",
            "spendgate_store_call_seconds_bucket{le=\"10\"} 2",
            "spendgate_store_call_seconds_bucket{le=\"+Inf\"} 3",
            "spendgate_store_call_seconds_count 3",
            "spendgate_store_call_seconds_sum 60.002",
            "spendgate_upstream_call_seconds_count 0",
            "spendgate_upstream_call_seconds_bucket{le=\"+Inf\"} 0",
            "spendgate_proxy_overhead_seconds_bucket{le=\"0.0025\"} 0",
            "spendgate_proxy_overhead_seconds_bucket{le=\"0.005\"} 1",
            "spendgate_proxy_overhead_seconds_count 1",
            "spendgate_proxy_overhead_seconds_sum 0.003",
        ] {
            assert!(
                out.lines().any(|l| l == line),
                "{line:?} missing in:\n{out}"
            );
        }
    }
}
