//! Metrics in the Prometheus text format. Names follow `spendgate_<name>_<unit>`.

use spendgate_core::{ScopeKind, Summary};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Distinct label sets kept per counter family (codes × scopes × kinds is far below this).
const LABEL_SETS_MAX: usize = 256;

#[derive(Default)]
pub struct Metrics {
    admissions: Mutex<BTreeMap<&'static str, u64>>,
    refusals: Mutex<BTreeMap<(&'static str, &'static str, &'static str), u64>>,
    overruns: AtomicU64,
    store_calls: AtomicU64,
    store_micros: AtomicU64,
    upstream_calls: AtomicU64,
    upstream_micros: AtomicU64,
    proxy_overheads: AtomicU64,
    proxy_overhead_micros: AtomicU64,
    unknown_outcomes: AtomicU64,
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
    pub fn overrun(&self) {
        self.overruns.fetch_add(1, Ordering::Relaxed);
    }
    pub fn unknown_outcome(&self) {
        self.unknown_outcomes.fetch_add(1, Ordering::Relaxed);
    }
    pub fn store_call(&self, d: Duration) {
        self.store_calls.fetch_add(1, Ordering::Relaxed);
        self.store_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }
    /// Time a proxied call spent in spendgate rather than upstream: before forwarding
    /// (identity, bounds, admission) and, when not streaming, after the answer (commit).
    pub fn proxy_overhead(&self, d: Duration) {
        self.proxy_overheads.fetch_add(1, Ordering::Relaxed);
        self.proxy_overhead_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }
    pub fn upstream_call(&self, d: Duration) {
        self.upstream_calls.fetch_add(1, Ordering::Relaxed);
        self.upstream_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn render(&self, summary: Option<&Summary>) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# TYPE spendgate_admissions_total counter");
        for (k, v) in self
            .admissions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(out, "spendgate_admissions_total{{what=\"{k}\"}} {v}");
        }
        let _ = writeln!(out, "# TYPE spendgate_refusals_total counter");
        for ((w, c, s), v) in self
            .refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "spendgate_refusals_total{{what=\"{w}\",code=\"{c}\",scope=\"{s}\"}} {v}"
            );
        }
        let l = |n: &AtomicU64| n.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# TYPE spendgate_overruns_total counter\nspendgate_overruns_total {}",
            l(&self.overruns)
        );
        let _ = writeln!(
            out,
            "# TYPE spendgate_unknown_outcomes_total counter\nspendgate_unknown_outcomes_total {}",
            l(&self.unknown_outcomes)
        );
        let _ = writeln!(out, "# TYPE spendgate_store_call_seconds summary");
        let _ = writeln!(
            out,
            "spendgate_store_call_seconds_count {}",
            l(&self.store_calls)
        );
        let _ = writeln!(
            out,
            "spendgate_store_call_seconds_sum {}",
            l(&self.store_micros) as f64 / 1e6
        );
        let _ = writeln!(out, "# TYPE spendgate_upstream_call_seconds summary");
        let _ = writeln!(
            out,
            "spendgate_upstream_call_seconds_count {}",
            l(&self.upstream_calls)
        );
        let _ = writeln!(
            out,
            "spendgate_upstream_call_seconds_sum {}",
            l(&self.upstream_micros) as f64 / 1e6
        );
        let _ = writeln!(out, "# TYPE spendgate_proxy_overhead_seconds summary");
        let _ = writeln!(
            out,
            "spendgate_proxy_overhead_seconds_count {}",
            l(&self.proxy_overheads)
        );
        let _ = writeln!(
            out,
            "spendgate_proxy_overhead_seconds_sum {}",
            l(&self.proxy_overhead_micros) as f64 / 1e6
        );
        if let Some(s) = summary {
            let _ = writeln!(out, "# TYPE spendgate_reservations gauge");
            for (state, n) in &s.reservations {
                let _ = writeln!(out, "spendgate_reservations{{state=\"{state}\"}} {n}");
            }
            let _ = writeln!(
                out,
                "# TYPE spendgate_held_micros gauge\nspendgate_held_micros {}",
                s.held_micros.0
            );
            let _ = writeln!(
                out,
                "# TYPE spendgate_charged_micros gauge\nspendgate_charged_micros {}",
                s.charged_micros.0
            );
            let _ = writeln!(
                out,
                "# TYPE spendgate_runs_active gauge\nspendgate_runs_active {}",
                s.runs_active
            );
            let _ = writeln!(
                out,
                "# TYPE spendgate_cutoff_engaged gauge\nspendgate_cutoff_engaged {}",
                u8::from(s.cutoff.is_some())
            );
            let _ = writeln!(
                out,
                "# TYPE spendgate_ledger_seq gauge\nspendgate_ledger_seq {}",
                s.seq
            );
        }
        out
    }
}
