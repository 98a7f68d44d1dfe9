//! `spendgate report --since …` and `spendgate tune --since …`: the usage history of a period,
//! read from the store's own history (the sqlite file; PostgreSQL) through a
//! [`HistoryReader`], or from a running gateway's `GET /admin/v1/history`. Both sources give
//! the same figures: a grouped read is [`spendgate_store::history_read::group`] either way.

use crate::tune::{self, Tally};
use crate::{admin_get, client, OpsError};
use serde_json::{json, Value};
pub use spendgate_core::history::GroupBy;
use spendgate_core::history::{ReservationRecord, RunRecord, StepClass};
pub use spendgate_core::UnixMs;
use spendgate_core::{
    rfc3339, Micros, ReservationId, ReservationState, RunId, RunState, TokenUsage,
};
use spendgate_store::history_read::{group, parse_time, HISTORY_SCAN_MAX};
use spendgate_store::{HistoryFilter, HistoryReader, HISTORY_PAGE_MAX};
use std::fmt::Write;
use std::sync::Arc;

/// Where the history is read from.
pub enum Source {
    /// The store's history, opened from the config.
    Reader(Arc<dyn HistoryReader>),
    /// A running gateway's admin API.
    Admin { url: String, token: String },
}

/// The store's history, opened from the config: the sqlite file, read-only (a running server
/// holds it exclusively: read that one through its admin API); PostgreSQL where `[history]
/// url` is set.
pub fn open_reader(cfg: &spendgate_config::Config) -> Result<Arc<dyn HistoryReader>, OpsError> {
    match cfg.store.kind {
        spendgate_config::StoreKind::Sqlite => {
            spendgate_store::sqlite::SqliteFileHistory::open(&cfg.store.path)
                .map(|h| Arc::new(h) as Arc<dyn HistoryReader>)
                .map_err(|e| OpsError::Usage(e.to_string()))
        }
        spendgate_config::StoreKind::Redis => match &cfg.history.url {
            Some(url) => Ok(Arc::new(spendgate_history_pg::PgHistory::new(url.expose()))),
            None => Err(OpsError::Usage(
                "this Redis deployment keeps its history in Redis only ([history] url is \
                 empty): read it from a running gateway with --url and --admin-token"
                    .into(),
            )),
        },
        spendgate_config::StoreKind::Memory => Err(OpsError::Usage(
            "a memory store keeps its history in the process that serves it: read it \
             with --url and --admin-token"
                .into(),
        )),
    }
}

/// How `report` prints its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Table,
    Csv,
    Json,
}

impl Format {
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "table" => Some(Format::Table),
            "csv" => Some(Format::Csv),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

/// A time as `--since`/`--until` take it: `now`, `today` and `yesterday` (midnight UTC),
/// `7d`, `12h` or `30m` ago, or what [`parse_time`] takes (RFC 3339, a date, unix ms).
pub fn parse_when(s: &str, now: UnixMs) -> Result<UnixMs, OpsError> {
    let day = 86_400_000;
    let ago = |n: &str, unit: u64| {
        n.parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(unit))
            .map(|ms| UnixMs(now.0.saturating_sub(ms)))
    };
    let t = match s.trim() {
        "now" => Some(now),
        "today" => Some(UnixMs(now.0 - now.0 % day)),
        "yesterday" => Some(UnixMs((now.0 - now.0 % day).saturating_sub(day))),
        s if s.ends_with('d') && s.len() > 1 => ago(&s[..s.len() - 1], day),
        s if s.ends_with('h') && s.len() > 1 => ago(&s[..s.len() - 1], 3_600_000),
        s if s.ends_with('m') && s.len() > 1 => ago(&s[..s.len() - 1], 60_000),
        s => parse_time(s),
    };
    t.ok_or_else(|| {
        OpsError::Usage(format!(
            "{s:?} is not a time: now, today, yesterday, 7d, 12h, 30m, 2026-12-03, \
             2026-12-03T10:00:00Z or unix milliseconds"
        ))
    })
}

/// The wall clock, for `--since yesterday` and the default `--until`.
pub fn now() -> UnixMs {
    UnixMs(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    )
}

/// One report: the period's reservations grouped by `by`, `top` of them when ranked.
pub struct ReportAsk {
    pub since: UnixMs,
    pub until: UnixMs,
    pub by: GroupBy,
    pub top: Option<usize>,
    pub format: Format,
}

/// `spendgate report --since …`: the grouped history, rendered.
pub async fn report(src: &Source, ask: &ReportAsk) -> Result<String, OpsError> {
    if ask.since >= ask.until {
        return Err(OpsError::Usage("--since must be before --until".into()));
    }
    let answer = match src {
        Source::Reader(reader) => {
            let filter = HistoryFilter::period(ask.since, ask.until);
            let g = group(&**reader, &filter, ask.by, ask.top, HISTORY_SCAN_MAX)
                .await
                .map_err(|e| OpsError::Http(format!("reading the history: {e}")))?;
            json!({
                "since": rfc3339(ask.since), "until": rfc3339(ask.until), "by": ask.by.name(),
                "source": reader.kind(), "rows": g.rows, "scanned": g.scanned,
                "truncated": g.truncated,
            })
        }
        Source::Admin { url, token } => {
            let mut path = format!(
                "/admin/v1/history?since={}&until={}&by={}",
                ask.since.0,
                ask.until.0,
                ask.by.name()
            );
            if let Some(top) = ask.top {
                let _ = write!(path, "&top={top}");
            }
            admin_get(&client()?, url, token, &path).await?
        }
    };
    Ok(render_report(&answer, ask.format))
}

/// A grouped history answer (the admin API's shape) as a table, CSV or JSON. JSON rows carry
/// `key`, `reservations`, `reserved_micros`, `charged_micros`, and a `totals` row sums them.
pub fn render_report(answer: &Value, format: Format) -> String {
    let rows = answer["rows"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let n = |r: &Value, k: &str| r[k].as_u64().unwrap_or(0);
    let sum = |k: &str| rows.iter().map(|r| n(r, k)).fold(0u64, u64::saturating_add);
    let totals = json!({
        "reservations": sum("reservations"),
        "reserved_micros": sum("reserved_micros"),
        "charged_micros": sum("charged_micros"),
    });
    let truncated = answer["truncated"].as_bool() == Some(true);
    let mut out = String::new();
    match format {
        Format::Json => {
            let mut v = answer.clone();
            v["totals"] = totals;
            out = format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or_default());
        }
        Format::Csv => {
            out.push_str(
                "key,reservations,reserved_micros,charged_micros,overruns,unknown_or_expired\n",
            );
            for r in rows {
                let _ = writeln!(
                    out,
                    "{},{},{},{},{},{}",
                    csv_field(r["key"].as_str().unwrap_or("")),
                    n(r, "reservations"),
                    n(r, "reserved_micros"),
                    n(r, "charged_micros"),
                    n(r, "overruns"),
                    n(r, "unknown_or_expired"),
                );
            }
        }
        Format::Table => {
            let _ = writeln!(
                out,
                "spend by {} from {} to {} ({} records read from {})",
                answer["by"].as_str().unwrap_or(""),
                answer["since"].as_str().unwrap_or(""),
                answer["until"].as_str().unwrap_or(""),
                n(answer, "scanned"),
                answer["source"].as_str().unwrap_or(""),
            );
            let line = |out: &mut String, key: &str, r: &Value| {
                let _ = writeln!(
                    out,
                    "{:<44} {:>12} {:>16} {:>16} {:>9} {:>16}",
                    key,
                    n(r, "reservations"),
                    tune::units(n(r, "reserved_micros")),
                    tune::units(n(r, "charged_micros")),
                    n(r, "overruns"),
                    n(r, "unknown_or_expired"),
                );
            };
            let _ = writeln!(
                out,
                "{:<44} {:>12} {:>16} {:>16} {:>9} {:>16}",
                "key", "reservations", "reserved", "charged", "overruns", "unknown/expired"
            );
            for r in rows {
                line(&mut out, r["key"].as_str().unwrap_or(""), r);
            }
            line(&mut out, "total (of these rows)", &totals);
        }
    }
    if truncated && format != Format::Json {
        out.push_str(
            "warning: the read stopped at its bound on records: the figures are a lower \
             bound; ask for a shorter period\n",
        );
    }
    out
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// `spendgate tune --since …`: every run bound's and every limit's distribution over the
/// period, and the suggestions as a table and a TOML snippet.
pub async fn tune(
    src: &Source,
    since: UnixMs,
    until: UnixMs,
    policy: Option<&spendgate_core::Policy>,
) -> Result<String, OpsError> {
    if since >= until {
        return Err(OpsError::Usage("--since must be before --until".into()));
    }
    let mut tally = Tally::default();
    let filter = HistoryFilter::period(since, until);
    match src {
        Source::Reader(reader) => tally_reader(&**reader, &filter, &mut tally).await?,
        Source::Admin { url, token } => tally_admin(url, token, &filter, &mut tally).await?,
    }
    let s = tune::suggestions(&tally, policy);
    let mut out = format!(
        "{} runs ended from {} to {}{}\n\n",
        tally.runs_seen(),
        rfc3339(since),
        rfc3339(until),
        if tally.dropped > 0 {
            format!(
                " ({} records past the tune's bounds were left out)",
                tally.dropped
            )
        } else {
            String::new()
        }
    );
    out.push_str(&tune::render_table(&s));
    let snippet = tune::render_toml(&s);
    if snippet.is_empty() {
        out.push_str("\nno runs in this period: nothing to suggest\n");
    } else {
        let _ = write!(
            out,
            "\n# Suggested by `spendgate tune` from {} to {}: the p99 with half again as\n\
             # headroom, rounded up. A starting point read from real traffic, not capacity\n\
             # evidence: merge it into your config and run `spendgate check-config`.\n{snippet}",
            rfc3339(since),
            rfc3339(until)
        );
    }
    Ok(out)
}

async fn tally_reader(
    reader: &dyn HistoryReader,
    filter: &HistoryFilter,
    tally: &mut Tally,
) -> Result<(), OpsError> {
    let err = |e: spendgate_store::StoreError| OpsError::Http(format!("reading the history: {e}"));
    let mut cursor: Option<String> = None;
    for _ in 0..pages_max() {
        let page = reader
            .runs(filter, cursor.as_deref(), HISTORY_PAGE_MAX)
            .await
            .map_err(err)?;
        page.items.iter().for_each(|r| tally.run(r));
        match page.next {
            Some(n) if !page.items.is_empty() => cursor = Some(n),
            _ => break,
        }
    }
    cursor = None;
    for _ in 0..pages_max() {
        let page = reader
            .reservations(filter, cursor.as_deref(), HISTORY_PAGE_MAX)
            .await
            .map_err(err)?;
        page.items.iter().for_each(|r| tally.reservation(r));
        match page.next {
            Some(n) if !page.items.is_empty() => cursor = Some(n),
            _ => break,
        }
    }
    Ok(())
}

/// Pages one tune reads of each kind at most.
fn pages_max() -> usize {
    tune::TUNE_RUNS_MAX.div_ceil(HISTORY_PAGE_MAX)
}

async fn tally_admin(
    url: &str,
    token: &str,
    filter: &HistoryFilter,
    tally: &mut Tally,
) -> Result<(), OpsError> {
    let http = client()?;
    for kind in ["runs", "reservations"] {
        let mut cursor: Option<String> = None;
        for _ in 0..pages_max() {
            let mut path = format!(
                "/admin/v1/history?kind={kind}&since={}&until={}&limit={HISTORY_PAGE_MAX}",
                filter.since.0, filter.until.0
            );
            if let Some(c) = &cursor {
                let _ = write!(path, "&cursor={}", query_escape(c));
            }
            let v = admin_get(&http, url, token, &path).await?;
            let items = v[kind].as_array().map(Vec::as_slice).unwrap_or_default();
            for item in items {
                if kind == "runs" {
                    tally.run(&run_from(item));
                } else {
                    tally.reservation(&reservation_from(item));
                }
            }
            match v["next_cursor"].as_str() {
                Some(n) if !items.is_empty() => cursor = Some(n.to_owned()),
                _ => break,
            }
        }
    }
    Ok(())
}

fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn text(v: &Value, k: &str) -> String {
    v[k].as_str().unwrap_or("").to_owned()
}

fn num(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

/// A run record from the admin API's row (what tune reads of it).
fn run_from(v: &Value) -> RunRecord {
    let small = |k: &str| u32::try_from(num(v, k)).unwrap_or(u32::MAX);
    RunRecord {
        id: RunId(text(v, "id")),
        session: text(v, "session"),
        conversation: text(v, "conversation"),
        address: text(v, "address"),
        created: UnixMs(num(v, "created_ms")),
        ended_at: UnixMs(num(v, "ended_at_ms")),
        ended: if v["ended"] == "expired" {
            RunState::Expired
        } else {
            RunState::Finished
        },
        input_bytes: num(v, "input_bytes"),
        context_tokens: num(v, "context_tokens"),
        output_tokens: num(v, "output_tokens"),
        tool_result_bytes: num(v, "tool_result_bytes"),
        rounds: small("rounds"),
        tool_calls: small("tool_calls"),
        retries: small("retries"),
        duration_ms: num(v, "duration_ms"),
        cost: Micros(num(v, "cost_micros")),
        refused: vec![],
    }
}

/// A reservation record from the admin API's row (what tune reads of it).
fn reservation_from(v: &Value) -> ReservationRecord {
    let class = match v["class"].as_str() {
        Some("model") => StepClass::Model,
        Some("tool") => StepClass::Tool,
        _ => StepClass::RunHold,
    };
    ReservationRecord {
        id: ReservationId(text(v, "id")),
        run_id: RunId(text(v, "run_id")),
        session: text(v, "session"),
        conversation: text(v, "conversation"),
        address: text(v, "address"),
        class,
        name: text(v, "name"),
        retry: v["retry"].as_bool() == Some(true),
        usage: v["completion_tokens"].as_u64().map(|c| TokenUsage {
            prompt_tokens: num(v, "prompt_tokens"),
            completion_tokens: c,
            cached_tokens: num(v, "cached_tokens"),
        }),
        units: v["units"].as_u64(),
        result_bytes: v["result_bytes"].as_u64(),
        reserved: Micros(num(v, "reserved_micros")),
        charged: Micros(num(v, "charged_micros")),
        state: ReservationState::parse(v["state"].as_str().unwrap_or(""))
            .unwrap_or(ReservationState::Unknown),
        created: UnixMs(num(v, "created_ms")),
        resolved_at: UnixMs(num(v, "resolved_at_ms")),
        overrun: v["overrun"].as_bool() == Some(true),
        result_too_large: v["result_too_large"].as_bool() == Some(true),
        counters: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operators_write_times_their_way() {
        // 2026-11-30T12:34:56Z
        let now = UnixMs(1_796_042_096_000);
        let midnight = 1_796_042_096_000 - 45_296_000;
        assert_eq!(parse_when("today", now).expect("t").0, midnight);
        assert_eq!(
            parse_when("yesterday", now).expect("t").0,
            midnight - 86_400_000
        );
        assert_eq!(parse_when("7d", now).expect("t").0, now.0 - 7 * 86_400_000);
        assert_eq!(parse_when("2h", now).expect("t").0, now.0 - 7_200_000);
        assert_eq!(parse_when("2026-11-30", now).expect("t").0, midnight);
        assert_eq!(parse_when("now", now).expect("t"), now);
        for bad in ["d", "soon", "7x", "2026-13-01"] {
            assert!(parse_when(bad, now).is_err(), "{bad}");
        }
    }

    #[test]
    fn reports_render_as_table_csv_and_json() {
        let answer = json!({"since": "2026-12-02T00:00:00Z", "until": "2026-12-03T00:00:00Z",
        "by": "model", "source": "sqlite", "scanned": 3, "truncated": false,
        "rows": [
            {"key": "gpt-4o", "reservations": 2, "reserved_micros": 3000, "charged_micros": 2500, "overruns": 0, "unknown_or_expired": 1},
            {"key": "a,\"b\"", "reservations": 1, "reserved_micros": 100, "charged_micros": 100, "overruns": 0, "unknown_or_expired": 0},
        ]});
        let table = render_report(&answer, Format::Table);
        assert!(
            table.contains("gpt-4o") && table.contains("0.0025"),
            "{table}"
        );
        assert!(
            table.contains("total (of these rows)") && table.contains("0.0026"),
            "{table}"
        );
        let csv = render_report(&answer, Format::Csv);
        assert!(csv.contains("gpt-4o,2,3000,2500,0,1\n"), "{csv}");
        assert!(csv.contains("\"a,\"\"b\"\"\",1,100,100,0,0\n"), "{csv}");
        let v: Value = serde_json::from_str(&render_report(&answer, Format::Json)).expect("json");
        assert_eq!(v["rows"][0]["key"], "gpt-4o");
        assert_eq!(v["totals"]["charged_micros"], 2600);
        assert_eq!(v["totals"]["reservations"], 3);
        let mut cut = answer.clone();
        cut["truncated"] = json!(true);
        assert!(render_report(&cut, Format::Csv).contains("lower bound"));
    }

    #[test]
    fn records_read_back_from_the_admin_rows() {
        let r = run_from(
            &json!({"id": "u1", "session": "s", "created_ms": 5, "ended_at_ms": 9,
            "ended": "expired", "rounds": 3, "cost_micros": 77, "duration_ms": 4}),
        );
        assert_eq!(
            (r.rounds, r.cost, r.ended),
            (3, Micros(77), RunState::Expired)
        );
        let x = reservation_from(&json!({"id": "r1", "class": "model", "name": "m",
            "completion_tokens": 12, "charged_micros": 5, "state": "committed", "resolved_at_ms": 8}));
        assert_eq!(x.usage.map(|u| u.completion_tokens), Some(12));
        assert_eq!(
            (x.class, x.state, x.charged),
            (StepClass::Model, ReservationState::Committed, Micros(5))
        );
        assert_eq!(query_escape("12:r/1"), "12%3Ar%2F1");
    }
}
