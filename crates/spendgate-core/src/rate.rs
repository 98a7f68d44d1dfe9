//! Request rates and the generic cell rate algorithm (GCRA).
//!
//! GCRA keeps one number per limited key: the theoretical arrival time (TAT) of the next
//! request. A request at `now` is allowed when the new TAT, `max(tat, now) + interval`, is no
//! further ahead of `now` than `burst` intervals. Refused requests change nothing.

use serde::{Deserialize, Serialize};

/// `count` requests per `period_ms`, with up to `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rate {
    pub count: u64,
    pub period_ms: u64,
    pub burst: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    #[error("rate {0:?} is not of the form \"N/second\", \"N/minute\", \"N/hour\" or \"N/day\"")]
    Syntax(String),
    #[error("rate {0:?} must allow at least one request")]
    Zero(String),
}

impl Rate {
    /// Parses "N/second", "N/minute", "N/hour", "N/day". Burst defaults to `N` capped at 1000;
    /// callers set it explicitly where config gives one.
    pub fn parse(text: &str) -> Result<Rate, RateError> {
        let syntax = || RateError::Syntax(text.to_string());
        let (n, unit) = text.trim().split_once('/').ok_or_else(syntax)?;
        let count: u64 = n.trim().parse().map_err(|_| syntax())?;
        // The SPEC's words only: a one-letter "m" could be read as a month.
        let period_ms = match unit.trim() {
            "second" => 1000,
            "minute" => 60_000,
            "hour" => 3_600_000,
            "day" => 86_400_000,
            _ => return Err(syntax()),
        };
        if count == 0 {
            return Err(RateError::Zero(text.to_string()));
        }
        Ok(Rate {
            count,
            period_ms,
            burst: count.clamp(1, 1000),
        })
    }

    /// Scales the rate and its burst by `factor` (wider address prefixes get more room).
    pub fn scaled(self, factor: u64) -> Rate {
        Rate {
            count: self.count.saturating_mul(factor),
            period_ms: self.period_ms,
            burst: self.burst.saturating_mul(factor),
        }
    }

    /// Emission interval in microseconds, rounded up (a slower rate is the conservative one).
    pub fn interval_us(&self) -> u64 {
        (self.period_ms.saturating_mul(1000))
            .div_ceil(self.count.max(1))
            .max(1)
    }

    /// GCRA decision at `now_us` for a key whose stored TAT is `tat_us` (0 when unseen).
    /// Returns the new TAT on admission, or the microseconds to wait.
    pub fn check(&self, tat_us: u64, now_us: u64) -> Result<u64, u64> {
        let interval = self.interval_us();
        let tolerance = interval.saturating_mul(self.burst.max(1));
        let new_tat = tat_us.max(now_us).saturating_add(interval);
        let ahead = new_tat - now_us;
        if ahead <= tolerance {
            Ok(new_tat)
        } else {
            Err(ahead - tolerance)
        }
    }

    /// What a key whose TAT is `tat_us` has left at `now_us`, as `(remaining, reset_s)`; meant
    /// for the TAT an admission has just written (so `tat_us > now_us`).
    ///
    /// - `remaining`: how many more requests [`Rate::check`] would admit right now, one after
    ///   the other (the burst left): the largest `k` with `tat + k * interval - now` within the
    ///   tolerance of `burst` intervals.
    /// - `reset_s`: seconds until one more unit of quota is regained (until `remaining` would
    ///   grow by one), rounded up; always in `1..=ceil(interval)` for a TAT ahead of `now`.
    ///   When `remaining` is 0 this is also the wait [`Rate::check`] would report for the next
    ///   request (in seconds, rounded up).
    pub fn left(&self, tat_us: u64, now_us: u64) -> (u64, u64) {
        let interval = self.interval_us();
        let tolerance = interval.saturating_mul(self.burst.max(1));
        let slack = tolerance.saturating_sub(tat_us.saturating_sub(now_us));
        let remaining = slack / interval;
        let reset_us = interval - slack % interval;
        (remaining, reset_us.div_ceil(1_000_000))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates() {
        let r = Rate::parse("10/hour").expect("valid");
        assert_eq!((r.count, r.period_ms, r.burst), (10, 3_600_000, 10));
        assert_eq!(Rate::parse("600/minute").expect("valid").period_ms, 60_000);
        for bad in [
            "",
            "10",
            "10/week",
            "x/second",
            "0/second",
            "-1/second",
            "10/m",
            "10/s",
        ] {
            assert!(Rate::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn gcra_allows_burst_then_paces() {
        let r = Rate {
            count: 10,
            period_ms: 1000,
            burst: 3,
        };
        let mut tat = 0;
        let now = 1_000_000_000;
        for _ in 0..3 {
            tat = r.check(tat, now).expect("within burst");
        }
        let wait = r.check(tat, now).expect_err("burst spent");
        assert_eq!(wait, 100_000, "one interval of 100 ms");
        assert!(r.check(tat, now + wait).is_ok());
        // After a long pause the full burst is available again.
        let later = now + 10_000_000;
        let mut t2 = tat;
        for _ in 0..3 {
            t2 = r.check(t2, later).expect("burst again");
        }
        assert!(r.check(t2, later).is_err());
    }

    #[test]
    fn left_counts_burst_down_and_rounds_reset_up() {
        // 10/second: an interval of 100 ms; a burst of 3.
        let r = Rate {
            count: 10,
            period_ms: 1000,
            burst: 3,
        };
        let now = 1_000_000_000;
        let mut tat = 0;
        let mut seen = Vec::new();
        for _ in 0..3 {
            tat = r.check(tat, now).expect("within burst");
            seen.push(r.left(tat, now));
        }
        // 100 ms to regain one unit: rounded up to 1 s.
        assert_eq!(seen, [(2, 1), (1, 1), (0, 1)]);
        // `remaining` is exactly how many more are admitted now.
        assert!(r.check(tat, now).is_err());
        // 2/minute, burst 2: 30 s to regain one unit.
        let slow = Rate {
            count: 2,
            period_ms: 60_000,
            burst: 2,
        };
        let t1 = slow.check(0, now).expect("first");
        assert_eq!(slow.left(t1, now), (1, 30));
        let t2 = slow.check(t1, now).expect("second");
        assert_eq!(slow.left(t2, now), (0, 30));
        // 10.5 s later: still none left, 19.5 s to go, rounded up to 20.
        assert_eq!(slow.left(t2, now + 10_500_000), (0, 20));
        assert_eq!(
            slow.check(t2, now + 10_500_000),
            Err(19_500_000),
            "the wait of the next request is the reset"
        );
        // 30 s later one unit is back; the next one comes 30 s after that.
        assert_eq!(slow.left(t2, now + 30_000_000), (1, 30));
        // 1/day, burst 1: a day to the next.
        let daily = Rate {
            count: 1,
            period_ms: 86_400_000,
            burst: 1,
        };
        let t = daily.check(0, now).expect("first");
        assert_eq!(daily.left(t, now), (0, 86_400));
    }
}
