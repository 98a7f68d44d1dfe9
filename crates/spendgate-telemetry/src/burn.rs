//! Burn rate and forecast of the global budgets (issue 20): how fast each is being spent over a
//! short and a long window (`alerts.burn_short_s`, 5 minutes, and `alerts.burn_long_s`, an
//! hour), what it will have spent when its window resets at that rate, and when it runs out.
//!
//! The source is the budgets' own counters: the alert checker reads every global budget's
//! `used` each second (`Command::Usage`) and [`Burn::observe`] keeps a bounded ring of samples
//! per budget. Every replica reads the same shared counters, so they compute the same rates
//! (to a sample's timing). The ring is in the process: after a restart a rate is over what was
//! watched since (`watched_s` says how long), and a window's reset starts it afresh.
//!
//! The burn-rate alert is the multi-window rule of SRE practice: the budget would be spent
//! before its window resets at the rate of the short window AND at the rate of the long one
//! (the short one alone pages on a spike, the long one alone too late). It is sent once per
//! budget window across replicas (`alert:burn:global:WINDOW`, `Command::ConsumeOnce`), and only
//! once the short window has been watched whole.

use crate::alerts::{first_to_send, key_ttl_ms, Alerts};
use crate::totals::head;
use serde_json::json;
use spendgate_core::{rfc3339, UnixMs, UsageLine, WindowId};
use spendgate_store::Store;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Samples kept per budget: the long window is sampled at most this finely (an hour at one a
/// second fits; a longer window keeps one sample every `long / BURN_SAMPLES_MAX`).
pub const BURN_SAMPLES_MAX: usize = 4096;
/// Budgets watched at most (the global budgets: one per window kind).
pub const BURN_BUDGETS_MAX: usize = 16;

/// One budget's samples: its window and (time, used) pairs, oldest first.
#[derive(Default)]
struct Ring {
    window: Option<WindowId>,
    samples: VecDeque<(u64, u64)>,
    last: Option<UsageLine>,
}

/// The rate of one budget over one window.
#[derive(Clone, Debug, PartialEq)]
pub struct RateOver {
    /// The window the rate is meant over (`burn_short_s` or `burn_long_s`).
    pub over_s: u64,
    /// What the rate is really over: shorter than `over_s` until that long was watched
    /// (after a start, a restart or the budget's window reset).
    pub watched_s: f64,
    pub micros_per_s: f64,
    /// Spend at the window's reset at this rate (`None` for a lifetime budget).
    pub projected_micros: Option<u64>,
    /// Seconds until `used` reaches the limit at this rate (`None`: the rate is zero; 0: spent).
    pub exhausted_in_s: Option<f64>,
}

/// One budget's burn: its state and its rates over the short and the long window.
#[derive(Clone, Debug, PartialEq)]
pub struct Forecast {
    pub line: UsageLine,
    /// When the forecast was made (ms since the epoch).
    pub at_ms: u64,
    /// Short window first, then long.
    pub rates: Vec<RateOver>,
}

impl Forecast {
    /// The multi-window rule: at both rates the budget is spent before its window resets,
    /// and the short window was watched whole. Never for a lifetime budget, nor one already
    /// spent (the 100% threshold alert tells that).
    pub fn would_exhaust(&self) -> bool {
        let Some(reset) = self.line.resets_at else {
            return false;
        };
        if self.line.used >= self.line.limit || self.rates.is_empty() {
            return false;
        }
        let left_s = reset.0.saturating_sub(self.at_ms) as f64 / 1000.0;
        let short_whole = self.rates[0].watched_s + 0.5 >= self.rates[0].over_s as f64;
        short_whole
            && self
                .rates
                .iter()
                .all(|r| r.exhausted_in_s.is_some_and(|t| t < left_s))
    }
}

/// The rings of every global budget, and the two windows.
pub struct Burn {
    short_ms: u64,
    long_ms: u64,
    rings: Mutex<BTreeMap<&'static str, Ring>>,
}

impl Burn {
    pub fn new(short: Duration, long: Duration) -> Burn {
        let short_ms = (short.as_millis() as u64).max(1);
        Burn {
            short_ms,
            long_ms: (long.as_millis() as u64).max(short_ms),
            rings: Mutex::new(BTreeMap::new()),
        }
    }

    /// Records the global budgets' lines read at `now_ms`.
    pub fn observe(&self, now_ms: u64, lines: &[UsageLine]) {
        let mut rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        let gap = self.long_ms / BURN_SAMPLES_MAX as u64;
        for line in lines {
            let key = line.window.window.name();
            if !rings.contains_key(key) && rings.len() >= BURN_BUDGETS_MAX {
                continue;
            }
            let ring = rings.entry(key).or_default();
            if ring.window != Some(line.window) {
                // A new window (or the first look): its spend starts afresh.
                ring.window = Some(line.window);
                ring.samples.clear();
            }
            ring.last = Some(line.clone());
            if ring
                .samples
                .back()
                .is_some_and(|(t, _)| now_ms < t.saturating_add(gap.max(1)))
            {
                continue;
            }
            ring.samples.push_back((now_ms, line.used.0));
            // Keep one sample at or before the long window's start, none older.
            let start = now_ms.saturating_sub(self.long_ms);
            while ring.samples.len() > BURN_SAMPLES_MAX
                || ring.samples.get(1).is_some_and(|(t, _)| *t <= start)
            {
                ring.samples.pop_front();
            }
        }
    }

    /// Every watched budget's forecast, as of its last sample.
    pub fn forecasts(&self) -> Vec<Forecast> {
        let rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        rings
            .values()
            .filter_map(|ring| {
                let line = ring.last.clone()?;
                let &(now, used) = ring.samples.back()?;
                let rates = [self.short_ms, self.long_ms]
                    .iter()
                    .map(|w| rate_over(&ring.samples, now, used, *w, &line))
                    .collect();
                Some(Forecast {
                    line,
                    at_ms: now,
                    rates,
                })
            })
            .collect()
    }
}

/// The rate over `w_ms` before the newest sample `(now, used)`: from the newest sample at or
/// before `now - w_ms`, or the oldest one when the ring is younger than that.
fn rate_over(
    samples: &VecDeque<(u64, u64)>,
    now: u64,
    used: u64,
    w_ms: u64,
    line: &UsageLine,
) -> RateOver {
    let start = now.saturating_sub(w_ms);
    let base = samples
        .iter()
        .rev()
        .find(|(t, _)| *t <= start)
        .or_else(|| samples.front())
        .copied()
        .unwrap_or((now, used));
    let span_ms = now.saturating_sub(base.0);
    let micros_per_s = if span_ms == 0 {
        0.0
    } else {
        used.saturating_sub(base.1) as f64 * 1000.0 / span_ms as f64
    };
    let left = line.limit.0.saturating_sub(line.used.0);
    let exhausted_in_s = if left == 0 {
        Some(0.0)
    } else if micros_per_s > 0.0 {
        Some(left as f64 / micros_per_s)
    } else {
        None
    };
    let projected_micros = line.resets_at.map(|r| {
        let to_reset_s = r.0.saturating_sub(now) as f64 / 1000.0;
        line.used
            .0
            .saturating_add((micros_per_s * to_reset_s).ceil() as u64)
    });
    RateOver {
        over_s: w_ms.div_ceil(1000),
        watched_s: span_ms as f64 / 1000.0,
        micros_per_s,
        projected_micros,
        exhausted_in_s,
    }
}

/// Sends the burn-rate alert of every budget whose forecast meets the rule, once per budget
/// window across replicas; how many this replica sent.
pub async fn check(
    store: &Arc<dyn Store>,
    alerts: &Alerts,
    sent_here: &mut HashSet<String>,
    forecasts: &[Forecast],
) -> usize {
    let mut sent = 0;
    for f in forecasts.iter().filter(|f| f.would_exhaust()) {
        let key = format!("alert:burn:global:{}", f.line.window);
        if sent_here.contains(&key) {
            continue;
        }
        // Room in the queue first (the key is used up in the shared store).
        let Ok(slot) = alerts.tx.try_reserve() else {
            continue;
        };
        let ttl = key_ttl_ms(f.line.resets_at);
        if !first_to_send(store, sent_here, key, ttl).await {
            continue;
        }
        let (short, long) = (&f.rates[0], &f.rates[f.rates.len() - 1]);
        let exhausted_in = short.exhausted_in_s.unwrap_or(f64::INFINITY);
        let exhausted_at = UnixMs(f.at_ms.saturating_add((exhausted_in * 1000.0) as u64));
        slot.send(Alerts::event(
            "burn_rate",
            format!(
                "global spend for {} is on course to exhaust its budget before the window \
                 resets: {:.0} micros/s over the last {}s and {:.0} micros/s over the last {}s; \
                 {} of {} micros used, spent in about {:.0}s",
                f.line.window,
                short.micros_per_s,
                short.over_s,
                long.micros_per_s,
                long.over_s,
                f.line.used.0,
                f.line.limit.0,
                exhausted_in
            ),
            json!({
                "scope": "global",
                "window": f.line.window.to_string(),
                "used_micros": f.line.used.0,
                "limit_micros": f.line.limit.0,
                "resets_at": f.line.resets_at.map(rfc3339),
                "exhausted_in_s": short.exhausted_in_s,
                "exhausted_at": rfc3339(exhausted_at),
                "rates": f.rates.iter().map(rate_json).collect::<Vec<_>>(),
            }),
        ));
        sent += 1;
    }
    sent
}

fn rate_json(r: &RateOver) -> serde_json::Value {
    json!({
        "over_s": r.over_s,
        "watched_s": r.watched_s,
        "micros_per_s": r.micros_per_s,
        "projected_micros": r.projected_micros,
        "exhausted_in_s": r.exhausted_in_s,
    })
}

/// The burn gauges, per budget window and rate window.
pub fn render(out: &mut String, forecasts: &[Forecast]) {
    if forecasts.is_empty() {
        return;
    }
    type Value = fn(&RateOver) -> Option<f64>;
    let families: [(&str, &str, &str, Value); 3] = [
        (
            "spendgate_burn_rate_micros_per_second",
            "micros_per_second",
            "Global budget: spend rate over the last `over` seconds (over less when fewer \
             were watched since the start or the window's reset).",
            |r| Some(r.micros_per_s),
        ),
        (
            "spendgate_burn_projected_micros",
            "micros",
            "Global budget: spend projected at the window's reset at the rate of the last \
             `over` seconds.",
            |r| r.projected_micros.map(|p| p as f64),
        ),
        (
            "spendgate_burn_exhausted_in_seconds",
            "seconds",
            "Global budget: seconds until it is spent at the rate of the last `over` seconds \
             (+Inf: not at this rate).",
            |r| Some(r.exhausted_in_s.unwrap_or(f64::INFINITY)),
        ),
    ];
    for (name, unit, help, value) in families {
        head(out, name, "gauge", Some(unit), help);
        for f in forecasts {
            let w = f.line.window.window.name();
            for r in &f.rates {
                let Some(v) = value(r) else { continue };
                let v = if v.is_infinite() {
                    "+Inf".to_string()
                } else {
                    format!("{v}")
                };
                let _ = writeln!(out, "{name}{{window=\"{w}\",over=\"{}\"}} {v}", r.over_s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_core::{Micros, ScopeKey, Window};

    fn line(at_ms: u64, used: u64, limit: u64) -> UsageLine {
        let window = Window::Day.at(UnixMs(at_ms));
        UsageLine {
            scope: ScopeKey::global(),
            window,
            limit: Micros(limit),
            used: Micros(used),
            reserved: Micros(0),
            overrun: false,
            resets_at: window.resets_at(),
        }
    }

    /// 2026-12-04T00:00:00Z, the start of a day window.
    const DAY: u64 = 1_796_342_400_000;

    #[test]
    fn rates_forecast_and_the_multi_window_rule() {
        let burn = Burn::new(Duration::from_secs(5), Duration::from_secs(30));
        let limit = 86_400_000_000; // spend 1,000,000 micros a second: a day's budget
                                    // 1000 micros/s for 40 s: short and long rates are 1000/s.
        for s in 0..=40u64 {
            burn.observe(DAY + s * 1000, &[line(DAY + s * 1000, s * 1000, limit)]);
        }
        let f = &burn.forecasts()[0];
        assert_eq!(f.rates.len(), 2);
        assert_eq!((f.rates[0].over_s, f.rates[1].over_s), (5, 30));
        assert_eq!((f.rates[0].watched_s, f.rates[1].watched_s), (5.0, 30.0));
        assert!((f.rates[0].micros_per_s - 1000.0).abs() < 1e-9);
        let left_s = (limit - 40_000) as f64 / 1000.0;
        assert!((f.rates[1].exhausted_in_s.expect("a rate") - left_s).abs() < 1e-6);
        // At 1000/s the day's budget lasts far past the reset: no alert.
        assert!(!f.would_exhaust());
        // Now 10,000,000 micros/s for 30 s: both windows see it, it exhausts in hours.
        let mut used = 40_000;
        for s in 41..=70u64 {
            used += 10_000_000;
            burn.observe(DAY + s * 1000, &[line(DAY + s * 1000, used, limit)]);
        }
        let f = &burn.forecasts()[0];
        assert!((f.rates[0].micros_per_s - 10_000_000.0).abs() < 1e-6);
        assert!(f.would_exhaust(), "{f:?}");
        let projected = f.rates[0].projected_micros.expect("a day resets");
        assert!(projected > limit, "{projected}");
    }

    #[test]
    fn a_spike_alone_does_not_meet_the_rule_and_a_reset_starts_afresh() {
        let burn = Burn::new(Duration::from_secs(5), Duration::from_secs(3600));
        let limit = 86_400_000_000;
        let mut used = 0;
        for s in 0..=600u64 {
            // A tenth of the rate that would spend the day, then a 5 s spike at 100x.
            used += if s > 595 { 100_000_000 } else { 100_000 };
            burn.observe(DAY + s * 1000, &[line(DAY + s * 1000, used, limit)]);
        }
        let f = &burn.forecasts()[0];
        assert!(f.rates[0].exhausted_in_s.expect("rate") < 86_400.0);
        assert!(!f.would_exhaust(), "the long window is calm: {f:?}");
        // The next day: the ring starts again.
        let next = DAY + 86_400_000;
        burn.observe(next, &[line(next, 0, limit)]);
        let f = &burn.forecasts()[0];
        assert_eq!(f.rates[0].watched_s, 0.0);
        assert_eq!(f.rates[0].exhausted_in_s, None);
    }

    #[test]
    fn the_ring_is_bounded() {
        let burn = Burn::new(Duration::from_secs(1), Duration::from_secs(100_000));
        for s in 0..20_000u64 {
            burn.observe(DAY + s * 1000, &[line(DAY + s * 1000, s, 1 << 40)]);
        }
        let rings = burn.rings.lock().expect("lock");
        let n = rings.values().next().expect("a ring").samples.len();
        assert!(n <= BURN_SAMPLES_MAX, "{n}");
    }
}
