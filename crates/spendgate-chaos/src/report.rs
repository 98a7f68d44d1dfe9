//! The run's one table, and its last line `overspend=N lost=N violations=N`.

use crate::checks::{Check, Spend};
use crate::record::Record;
use crate::schedule::FaultKind;
use hdrhistogram::Histogram;
use std::fmt::Write;

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn lat(h: &Histogram<u64>) -> String {
    if h.is_empty() {
        return "-".to_string();
    }
    format!(
        "p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} calls)",
        ms(h, 0.5),
        ms(h, 0.99),
        h.max() as f64 / 1000.0,
        h.len()
    )
}

fn micros(m: u64) -> String {
    format!("{}.{:06}", m / 1_000_000, m % 1_000_000)
}

fn pct(a: u64, b: u64) -> String {
    if b == 0 {
        "-".to_string()
    } else {
        format!("{:.1}%", a as f64 * 100.0 / b as f64)
    }
}

/// The totals of the last line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub overspend: u64,
    pub lost: u64,
    pub violations: u64,
}

pub fn totals(checks: &[Check]) -> Totals {
    let of = |n: &str| {
        checks
            .iter()
            .find(|c| c.name == n)
            .map_or(0, |c| c.violations)
    };
    Totals {
        overspend: of("overspend"),
        lost: of("lost"),
        violations: checks.iter().map(|c| c.violations).sum(),
    }
}

/// The faults injected, by kind (upstream windows with the calls they hit).
fn faults_injected(rec: &Record) -> Vec<String> {
    FaultKind::ALL
        .iter()
        .filter_map(|k| {
            let n = rec.injected.get(k).copied().unwrap_or(0);
            let calls = rec.upstream_faulted.get(k).copied().unwrap_or(0);
            match (n, k.upstream()) {
                (0, _) => None,
                (n, true) => Some(format!("{k} {n} ({calls} calls)")),
                (n, false) if *k == FaultKind::Flood => Some(format!(
                    "{k} {n} ({} connections opened, {} not)",
                    rec.flood_opened, rec.flood_failed
                )),
                (n, false) => Some(format!("{k} {n}")),
            }
        })
        .collect()
}

/// Served against the global budget and the address and session closest to theirs.
fn served_vs_budget(spend: &Spend) -> String {
    format!(
        "global {} of {} ({}); top address {} of {} ({}); top session {} of {} ({})",
        micros(spend.global_served),
        micros(spend.global_budget),
        pct(spend.global_served, spend.global_budget),
        micros(spend.ip_max.0),
        micros(spend.ip_max.1),
        pct(spend.ip_max.0, spend.ip_max.1),
        micros(spend.session_max.0),
        micros(spend.session_max.1),
        pct(spend.session_max.0, spend.session_max.1),
    )
}

/// The table (header lines, then one row per line of the table).
pub fn table(
    title: &str,
    rec: &Record,
    spend: &Spend,
    checks: &[Check],
    notes: &[String],
) -> String {
    let mut s = String::new();
    let row = |s: &mut String, k: &str, v: String| {
        let _ = writeln!(s, "  {k:<20} {v}");
    };
    let _ = writeln!(s, "{title}");
    let admitted: Vec<String> = rec
        .admitted
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    row(&mut s, "admitted", admitted.join(", "));
    let refused: u64 = rec.refused.values().sum();
    let by_code: Vec<String> = rec
        .refused
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    row(
        &mut s,
        "refused",
        format!("{refused}: {}", by_code.join(", ")),
    );
    row(
        &mut s,
        "other answers",
        format!(
            "{} upstream errors relayed, {} calls without an answer, {} answers off the contract",
            rec.relayed, rec.no_answer, rec.bad_answers
        ),
    );
    let faults = faults_injected(rec);
    row(&mut s, "faults injected", faults.join(", "));
    row(&mut s, "served vs budget", served_vs_budget(spend));
    row(
        &mut s,
        "served beyond bound",
        format!(
            "{} (upstream output past the bound it was given; {} tagged calls served)",
            micros(spend.beyond_bound),
            spend.tags_served
        ),
    );
    row(&mut s, "latency decision API", lat(&rec.lat_api));
    row(&mut s, "latency proxy head", lat(&rec.lat_proxy));
    row(
        &mut s,
        "operator in floods",
        format!(
            "{} calls, {} refused for capacity; another address: {} calls, {} refused; {}",
            rec.probes.sent,
            rec.probes.refused,
            rec.probes.other_sent,
            rec.probes.other_refused,
            lat(&rec.probes.latency)
        ),
    );
    for c in checks {
        let verdict = if c.ok() {
            "ok".to_string()
        } else {
            format!("FAILED: {} violations", c.violations)
        };
        row(
            &mut s,
            &format!("check {}", c.name),
            format!("{verdict} ({})", c.what),
        );
        for e in &c.examples {
            let _ = writeln!(s, "  {:<20}   - {e}", "");
        }
    }
    for n in notes {
        row(&mut s, "note", n.clone());
    }
    let t = totals(checks);
    let _ = writeln!(
        s,
        "overspend={} lost={} violations={}",
        t.overspend, t.lost, t.violations
    );
    s
}
