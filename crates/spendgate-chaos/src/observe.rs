//! The operator's view, through the admin API: every reservation, polled by state while the
//! run goes on (an ended run's reservations are kept only a minute, and a listing returns the
//! newest 1,000 of a state), the summary, and each scope's usage at the end.

use crate::cluster::{ADMIN_TOKEN, SERVICE_TOKEN};
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;

/// Rows a listing asks for (the admin API's most).
pub const LISTING_ROWS: usize = 1000;
/// The states listed.
const STATES: [&str; 5] = ["held", "committed", "released", "unknown", "expired"];
/// An admin call's bound.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A reservation as last seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub run: String,
    pub kind: String,
    pub state: String,
    pub reserved: u64,
    pub charged: u64,
}

impl Seen {
    pub fn terminal(&self) -> bool {
        self.state != "held"
    }
}

/// Every reservation seen, and what the polls found amiss.
#[derive(Debug, Default)]
pub struct Observed {
    pub res: HashMap<String, Seen>,
    /// Reservations seen in one terminal state and later in another (or charged another
    /// amount): I2 says a reservation ends once; only a late overrun raises an unknown or
    /// expired charge.
    pub flips: Vec<String>,
    pub flip_count: u64,
    pub polls: u64,
    pub failed_polls: u64,
    /// Listings that came back full and whose oldest row is newer than the previous
    /// listing of that state: rows between the two may have been missed.
    pub gaps: u64,
}

impl Observed {
    /// Takes in one listing's rows.
    pub fn absorb(&mut self, rows: &[Value]) {
        for row in rows {
            let (Some(id), Some(state)) = (
                row.get("id").and_then(Value::as_str),
                row.get("state").and_then(Value::as_str),
            ) else {
                continue;
            };
            let seen = Seen {
                run: row
                    .get("run_id")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                kind: row
                    .get("kind")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                state: state.to_string(),
                reserved: row
                    .get("reserved_micros")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
                charged: row
                    .get("charged_micros")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
            };
            match self.res.get(id) {
                // A late overrun (SPEC I1b, docs/decisions/0041): an unknown or expired
                // reservation's charge grows, its state kept. The newer, larger charge stands.
                Some(old)
                    if old.terminal()
                        && old.state == seen.state
                        && matches!(old.state.as_str(), "unknown" | "expired")
                        && seen.charged > old.charged =>
                {
                    self.res.insert(id.to_string(), seen);
                }
                // A terminal state is final, and so is its charge.
                Some(old) if old.terminal() => {
                    if old.state != seen.state || old.charged != seen.charged {
                        self.flip_count += 1;
                        if self.flips.len() < crate::record::EXAMPLES_MAX {
                            self.flips.push(format!(
                                "{id}: {} charged {} then {} charged {}",
                                old.state, old.charged, seen.state, seen.charged
                            ));
                        }
                    }
                }
                _ => {
                    self.res.insert(id.to_string(), seen);
                }
            }
        }
    }
}

/// A GET of the admin API.
pub async fn admin_get(http: &reqwest::Client, base: &str, path: &str) -> Option<Value> {
    let r = http
        .get(format!("{base}{path}"))
        .bearer_auth(ADMIN_TOKEN)
        .timeout(ADMIN_TIMEOUT)
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.json().await.ok()
}

/// Rows a listing starts with: a listing that fails (a store call past its timeout: a
/// thousand rows take a debug build over 100 ms) asks for half as many next time, one that
/// comes back full twice as many.
const LISTING_ROWS_START: usize = 250;
const LISTING_ROWS_MIN: usize = 100;

/// How many rows each state's listing asks for, and when each state was last listed
/// (seconds since the epoch, the store's clock being this machine's).
#[derive(Debug, Clone)]
pub struct Limits {
    rows: [usize; 5],
    listed_at: [Option<u64>; 5],
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            rows: [LISTING_ROWS_START; 5],
            listed_at: [None; 5],
        }
    }
}

impl Limits {
    /// Every listing at its most rows (the last look, once nothing moves).
    pub fn most(mut self) -> Self {
        self.rows = [LISTING_ROWS; 5];
        self
    }
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SSZ` (how the admin API writes times).
fn epoch_s(t: &str) -> Option<u64> {
    let num = |r: std::ops::Range<usize>| t.get(r)?.parse::<u32>().ok();
    if t.len() != 20 || !t.ends_with('Z') {
        return None;
    }
    let days =
        spendgate_core::window::days_from_civil(i64::from(num(0..4)?), num(5..7)?, num(8..10)?);
    let secs = u64::from(num(11..13)? * 3600 + num(14..16)? * 60 + num(17..19)?);
    u64::try_from(days).ok().map(|d| d * 86_400 + secs)
}

/// One poll of every state's listing from `base`; false when a listing failed.
pub async fn poll(
    http: &reqwest::Client,
    base: &str,
    observed: &mut Observed,
    limits: &mut Limits,
) -> bool {
    let mut ok = true;
    for (i, state) in STATES.iter().enumerate() {
        let limit = limits.rows[i];
        let path = format!("/admin/v1/reservations?state={state}&limit={limit}");
        let asked_at = now_s();
        match admin_get(http, base, &path).await {
            Some(v) => {
                let rows = v
                    .get("reservations")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                if rows.len() >= limit {
                    // Full: the rows before the oldest listed were not. Missed only if that
                    // oldest row is newer than the previous listing (one second of margin:
                    // the times are whole seconds).
                    let oldest = rows
                        .iter()
                        .filter_map(|r| r.get("created").and_then(Value::as_str))
                        .filter_map(epoch_s)
                        .min();
                    let covered = matches!((oldest, limits.listed_at[i]),
                        (Some(o), Some(prev)) if o + 1 < prev);
                    if !covered && limits.listed_at[i].is_some() {
                        observed.gaps += 1;
                    }
                    limits.rows[i] = (limit * 2).min(LISTING_ROWS);
                }
                limits.listed_at[i] = Some(asked_at);
                observed.absorb(&rows);
            }
            None => {
                limits.rows[i] = (limit / 2).max(LISTING_ROWS_MIN);
                ok = false;
            }
        }
    }
    observed.polls += 1;
    if !ok {
        observed.failed_polls += 1;
    }
    ok
}

/// A scope's usage line, as `GET /v1/usage` answers it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Line {
    pub kind: String,
    pub limit: u64,
    pub used: u64,
    pub reserved: u64,
}

/// `GET /v1/usage?session=&client_ip=` (service token): the session's, the address's and
/// the global budget lines.
pub async fn usage(http: &reqwest::Client, base: &str, token: &str, ip: &str) -> Option<Vec<Line>> {
    let r = http
        .get(format!(
            "{base}/v1/usage?session={}&client_ip={}",
            encode(token),
            encode(ip)
        ))
        .bearer_auth(SERVICE_TOKEN)
        .timeout(ADMIN_TIMEOUT)
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    let v: Value = r.json().await.ok()?;
    let lines = v.get("scopes")?.as_array()?;
    Some(
        lines
            .iter()
            .map(|l| Line {
                kind: l
                    .get("kind")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                limit: l.get("limit_micros").and_then(Value::as_u64).unwrap_or(0),
                used: l.get("used_micros").and_then(Value::as_u64).unwrap_or(0),
                reserved: l
                    .get("reserved_micros")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
            })
            .collect(),
    )
}

/// Percent-encodes a query value (every byte but the unreserved ones).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn admin_times_read_as_epoch_seconds() {
        let t =
            spendgate_core::window::rfc3339(spendgate_core::UnixMs(1_764_777_600_000 + 3_723_000));
        assert_eq!(epoch_s(&t), Some(1_764_777_600 + 3_723));
        assert_eq!(epoch_s("2026-12-03T17:00:00"), None);
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(encode("a.b-c_d~e"), "a.b-c_d~e");
        assert_eq!(encode("a+b/c=:"), "a%2Bb%2Fc%3D%3A");
    }

    #[test]
    fn a_terminal_state_that_changes_is_a_flip() {
        let mut o = Observed::default();
        let row = |state: &str, charged: u64| {
            json!({"id": "s1", "run_id": "r1", "kind": "model:m", "state": state,
                "reserved_micros": 10, "charged_micros": charged})
        };
        o.absorb(&[row("held", 0)]);
        o.absorb(&[row("committed", 7)]);
        o.absorb(&[row("committed", 7)]);
        assert_eq!(o.flip_count, 0);
        assert_eq!(o.res["s1"].charged, 7);
        o.absorb(&[row("expired", 10)]);
        assert_eq!(o.flip_count, 1);
        assert_eq!(
            o.res["s1"].state, "committed",
            "the first terminal state stays"
        );
    }

    #[test]
    fn a_late_overrun_raises_an_unknown_charge_and_nothing_else_does() {
        let mut o = Observed::default();
        let row = |id: &str, state: &str, charged: u64| {
            json!({"id": id, "run_id": "r1", "kind": "model:m", "state": state,
                "reserved_micros": 10, "charged_micros": charged})
        };
        o.absorb(&[row("u", "unknown", 10), row("c", "committed", 7)]);
        o.absorb(&[row("u", "unknown", 25)]);
        assert_eq!(
            (o.flip_count, o.res["u"].charged),
            (0, 25),
            "a late overrun"
        );
        o.absorb(&[row("u", "unknown", 12)]);
        o.absorb(&[row("c", "committed", 9)]);
        assert_eq!(
            o.flip_count, 2,
            "a charge that goes down, or a committed one that moves"
        );
        assert_eq!((o.res["u"].charged, o.res["c"].charged), (25, 7));
    }
}
