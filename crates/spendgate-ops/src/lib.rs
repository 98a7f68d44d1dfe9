//! spendgate-ops: the operator's commands beside `serve`. `spendgate report` and
//! `spendgate tune` read a running gateway through its admin API (so they work the same on
//! every store, and never open the sqlite file a server holds); [`store`] says what
//! `spendgate store init` did.

#![warn(clippy::too_many_lines)]

pub mod history;
pub mod store;
pub mod tune;

use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Reservations read by one `tune` poll at most (the admin API's row bound; the newest).
pub const TUNE_ROWS_MAX: usize = 1000;
/// Reservations a watching `tune` keeps at most (past it, new ones are not sampled).
pub const TUNE_ROWS_KEPT_MAX: usize = 200_000;
/// How often a watching `tune` polls: well within the minute the ledger keeps an ended run's
/// reservations, so a run that ends between polls is still seen.
pub const TUNE_POLL_EVERY: std::time::Duration = std::time::Duration::from_secs(20);
/// Longest `tune --watch-seconds`.
pub const TUNE_WATCH_MAX_S: u64 = 86_400;

/// Reservations seen over several polls of the admin API, by id (the latest state wins).
#[derive(Default)]
pub struct TuneSample {
    rows: BTreeMap<String, Value>,
}

impl TuneSample {
    /// Adds a `/admin/v1/reservations` answer.
    pub fn add(&mut self, listing: &Value) {
        for r in listing["reservations"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let Some(id) = r["id"].as_str() else { continue };
            if self.rows.len() >= TUNE_ROWS_KEPT_MAX && !self.rows.contains_key(id) {
                continue;
            }
            self.rows.insert(id.to_string(), r.clone());
        }
    }

    /// The sample as one listing, for [`render_tune`].
    pub fn listing(&self) -> Value {
        serde_json::json!({ "reservations": self.rows.values().collect::<Vec<_>>() })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("{0}")]
    Usage(String),
    #[error("admin API: {0}")]
    Http(String),
    #[error("admin API answered {status}: {body}")]
    Status { status: u16, body: String },
}

pub async fn admin_get(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    path: &str,
) -> Result<Value, OpsError> {
    let r = http
        .get(format!("{}{path}", base.trim_end_matches('/')))
        .bearer_auth(token)
        .send()
        .await
        .map_err(|e| OpsError::Http(e.to_string()))?;
    let status = r.status().as_u16();
    let body = r.text().await.map_err(|e| OpsError::Http(e.to_string()))?;
    if status != 200 {
        return Err(OpsError::Status { status, body });
    }
    serde_json::from_str(&body).map_err(|e| OpsError::Http(e.to_string()))
}

/// `spendgate report`: spend by scope and window, from a running gateway's admin API.
/// An HTTP client for the admin API (TLS from the process's installed crypto provider).
pub(crate) fn client() -> Result<reqwest::Client, OpsError> {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()
        .map_err(|e| OpsError::Http(e.to_string()))
}

/// `spendgate report`: spend by scope and window, from a running gateway's admin API.
pub async fn report(
    url: &str,
    token: &str,
    kind: Option<String>,
    top: usize,
) -> Result<String, OpsError> {
    let http = client()?;
    let path = format!(
        "/admin/v1/scopes?top={top}{}",
        kind.map(|k| format!("&kind={k}")).unwrap_or_default()
    );
    let v = admin_get(&http, url, token, &path).await?;
    Ok(render_report(&v))
}

/// `spendgate tune`: usage percentiles per run and suggested bounds, sampled for
/// `watch_seconds` (0: one look).
pub async fn tune(url: &str, token: &str, watch_seconds: u64) -> Result<String, OpsError> {
    if watch_seconds > TUNE_WATCH_MAX_S {
        return Err(OpsError::Usage(format!(
            "--watch-seconds is at most {TUNE_WATCH_MAX_S}"
        )));
    }
    let http = client()?;
    let path = format!("/admin/v1/reservations?limit={TUNE_ROWS_MAX}");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(watch_seconds);
    let mut sample = TuneSample::default();
    loop {
        sample.add(&admin_get(&http, url, token, &path).await?);
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        tokio::time::sleep(left.min(TUNE_POLL_EVERY)).await;
    }
    Ok(render_tune(&sample.listing()))
}

fn units(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

/// Spend by scope and window, as a table.
pub fn render_report(scopes: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<48} {:<22} {:>16} {:>16} {:>16}  resets at",
        "scope", "window", "limit", "used", "reserved"
    );
    for s in scopes["scopes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let n = |k: &str| s[k].as_u64().unwrap_or(0);
        let _ = writeln!(
            out,
            "{:<48} {:<22} {:>16} {:>16} {:>16}  {}{}",
            s["scope"].as_str().unwrap_or(""),
            s["window"].as_str().unwrap_or(""),
            units(n("limit_micros")),
            units(n("used_micros")),
            units(n("reserved_micros")),
            s["resets_at"].as_str().unwrap_or("never"),
            if s["overrun"].as_bool() == Some(true) {
                "  OVERRUN"
            } else {
                ""
            },
        );
    }
    out
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).ceil() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// What one run used, summed over its reservations.
#[derive(Default)]
struct RunUse {
    cost: u64,
    rounds: u64,
    retries: u64,
    tools: u64,
    /// A step is still held: the run is not over.
    open: bool,
}

/// The use of every run of a reservations listing whose every reservation has ended.
fn ended_runs(reservations: &Value) -> BTreeMap<String, RunUse> {
    let mut runs: BTreeMap<String, RunUse> = BTreeMap::new();
    for r in reservations["reservations"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let state = r["state"].as_str().unwrap_or("");
        let kind = r["kind"].as_str().unwrap_or("");
        if kind == "run_hold" {
            continue;
        }
        let e = runs
            .entry(r["run_id"].as_str().unwrap_or("").to_string())
            .or_default();
        if state == "held" {
            e.open = true;
            continue;
        }
        e.cost = e
            .cost
            .saturating_add(r["charged_micros"].as_u64().unwrap_or(0));
        if kind.starts_with("model:") {
            if r["retry"].as_bool() == Some(true) {
                e.retries = e.retries.saturating_add(1);
            } else {
                e.rounds = e.rounds.saturating_add(1);
            }
        } else if kind.starts_with("tool:") {
            e.tools = e.tools.saturating_add(1);
        }
    }
    runs.retain(|_, r| !r.open);
    runs
}

/// Percentiles of observed usage per run (cost, model rounds, retries, tool calls) over the
/// runs whose every reservation has ended (a run with a step still held is not over, and
/// would pull the figures down), and bounds suggested from them: the p99 with half again as
/// headroom, rounded up. Suggestions are a starting point, not capacity evidence.
pub fn render_tune(reservations: &Value) -> String {
    let runs = ended_runs(reservations);
    let mut out = String::new();
    if runs.is_empty() {
        let _ = writeln!(
            out,
            "no ended reservations to learn from yet (the ledger keeps a run's reservations \
             for a minute after it ends: run this while traffic flows)"
        );
        return out;
    }
    let col = |f: &dyn Fn(&RunUse) -> u64| {
        let mut v: Vec<u64> = runs.values().map(f).collect();
        v.sort_unstable();
        v
    };
    let cost = col(&|r| r.cost);
    let rounds = col(&|r| r.rounds);
    let retries = col(&|r| r.retries);
    let tools = col(&|r| r.tools);
    let _ = writeln!(out, "{} runs observed", runs.len());
    let _ = writeln!(
        out,
        "{:<16} {:>14} {:>14} {:>14} {:>14}  suggested bound",
        "per run", "p50", "p90", "p99", "max"
    );
    let headroom = |v: u64| v.saturating_add(v.div_ceil(2)).max(1);
    let row = |out: &mut String, name: &str, v: &[u64], fmt: &dyn Fn(u64) -> String, key: &str| {
        let _ = writeln!(
            out,
            "{:<16} {:>14} {:>14} {:>14} {:>14}  {key} = {}",
            name,
            fmt(percentile(v, 0.5)),
            fmt(percentile(v, 0.9)),
            fmt(percentile(v, 0.99)),
            fmt(*v.last().unwrap_or(&0)),
            fmt(headroom(percentile(v, 0.99))),
        );
    };
    row(
        &mut out,
        "cost",
        &cost,
        &|m| format!("\"{}\"", units(m)),
        "run.max_cost",
    );
    row(
        &mut out,
        "model rounds",
        &rounds,
        &|n| n.to_string(),
        "run.max_model_rounds",
    );
    row(
        &mut out,
        "retries",
        &retries,
        &|n| n.to_string(),
        "run.max_retries",
    );
    row(
        &mut out,
        "tool calls",
        &tools,
        &|n| n.to_string(),
        "run.max_tool_calls",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tune_groups_by_run_and_suggests_headroom() {
        let mut rows = Vec::new();
        for run in 0..10u64 {
            for step in 0..=run % 3 {
                rows.push(json!({"run_id": format!("r{run}"), "kind": "model:m", "state": "committed", "charged_micros": 1000 * (step + 1)}));
            }
            rows.push(json!({"run_id": format!("r{run}"), "kind": "tool:t", "state": "unknown", "charged_micros": 500}));
        }
        rows.push(
            json!({"run_id": "held", "kind": "model:m", "state": "held", "charged_micros": 0}),
        );
        // A run with a step still held is not over: none of its steps count.
        rows.push(json!({"run_id": "r0", "kind": "model:m", "state": "held", "charged_micros": 0}));
        rows.push(
            json!({"run_id": "r11", "kind": "model:m", "state": "held", "charged_micros": 0}),
        );
        rows.push(json!({"run_id": "r11", "kind": "tool:t", "state": "committed", "charged_micros": 9_000_000}));
        // Retries are counted apart from rounds.
        for run in 1..10u64 {
            rows.push(json!({"run_id": format!("r{run}"), "kind": "model:m", "retry": true, "state": "released", "charged_micros": 0}));
        }
        let mut sample = TuneSample::default();
        let listing = |rows: &[Value]| {
            let rows: Vec<Value> = rows
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let mut r = r.clone();
                    r["id"] = json!(format!("s{i}"));
                    r
                })
                .collect();
            json!({ "reservations": rows })
        };
        // Two polls that overlap: each reservation counts once.
        sample.add(&listing(&rows[..rows.len() / 2]));
        sample.add(&listing(&rows));
        let out = render_tune(&sample.listing());
        assert!(out.starts_with("9 runs observed"), "{out}");
        assert!(
            out.contains("run.max_retries = 2"),
            "one retry + half: {out}"
        );
        assert!(
            out.contains("run.max_model_rounds = 5"),
            "p99 of 3 rounds + half: {out}"
        );
        assert!(out.contains("run.max_tool_calls = 2"), "{out}");
        assert!(
            out.contains("run.max_cost = \"0.009750\""),
            "p99 cost 6500 + half: {out}"
        );
    }

    #[test]
    fn report_renders_rows() {
        let out = render_report(
            &json!({"scopes": [{"scope": "global", "window": "day:2026-11-30", "limit_micros": 50_000_000,
            "used_micros": 1_500_000, "reserved_micros": 10_000, "resets_at": "2026-12-01T00:00:00Z", "overrun": false}]}),
        );
        assert!(
            out.contains("50.000000")
                && out.contains("1.500000")
                && out.contains("2026-12-01T00:00:00Z"),
            "{out}"
        );
    }
}
