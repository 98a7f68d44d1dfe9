//! Budget windows: UTC calendar hours, days and months, or the whole lifetime of a scope.
//!
//! A window is identified by an index derived from the store's clock at admission time, so
//! there is no reset job: a new window simply starts with a fresh counter.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Milliseconds since the Unix epoch, from the store's clock.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct UnixMs(pub u64);

impl UnixMs {
    pub fn plus_ms(self, ms: u64) -> UnixMs {
        UnixMs(self.0.saturating_add(ms))
    }
    /// Whole seconds from `self` until `later`, rounded up; zero if `later` is not later.
    pub fn secs_until(self, later: UnixMs) -> u64 {
        later.0.saturating_sub(self.0).div_ceil(1000)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Window {
    Hour,
    Day,
    Month,
    Lifetime,
}

impl Window {
    pub fn name(self) -> &'static str {
        match self {
            Window::Hour => "hour",
            Window::Day => "day",
            Window::Month => "month",
            Window::Lifetime => "lifetime",
        }
    }

    pub fn parse(s: &str) -> Option<Window> {
        Some(match s {
            "hour" => Window::Hour,
            "day" => Window::Day,
            "month" => Window::Month,
            "lifetime" => Window::Lifetime,
            _ => return None,
        })
    }

    /// The window that contains `now`.
    pub fn at(self, now: UnixMs) -> WindowId {
        let secs = now.0 / 1000;
        let index = match self {
            Window::Hour => secs / 3600,
            Window::Day => secs / 86_400,
            Window::Month => {
                let (y, m, _) = civil_from_days((secs / 86_400) as i64);
                (y * 12 + i64::from(m) - 1) as u64
            }
            Window::Lifetime => 0,
        };
        WindowId {
            window: self,
            index,
        }
    }
}

/// One concrete window: its kind and its index (hours, days or months since the epoch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WindowId {
    pub window: Window,
    pub index: u64,
}

impl WindowId {
    /// When this window ends and a fresh one starts; `None` for lifetime.
    pub fn resets_at(self) -> Option<UnixMs> {
        let secs = match self.window {
            Window::Hour => (self.index + 1) * 3600,
            Window::Day => (self.index + 1) * 86_400,
            Window::Month => {
                let next = self.index + 1;
                let (y, m) = ((next / 12) as i64, (next % 12) as u32 + 1);
                days_from_civil(y, m, 1) as u64 * 86_400
            }
            Window::Lifetime => return None,
        };
        Some(UnixMs(secs * 1000))
    }
}

impl fmt::Display for WindowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.window {
            Window::Hour => {
                let (y, m, d) = civil_from_days((self.index / 24) as i64);
                write!(f, "hour:{y:04}-{m:02}-{d:02}T{:02}", self.index % 24)
            }
            Window::Day => {
                let (y, m, d) = civil_from_days(self.index as i64);
                write!(f, "day:{y:04}-{m:02}-{d:02}")
            }
            Window::Month => write!(f, "month:{:04}-{:02}", self.index / 12, self.index % 12 + 1),
            Window::Lifetime => write!(f, "lifetime"),
        }
    }
}

/// Formats a timestamp as RFC 3339 UTC with second precision ("2026-12-01T00:00:00Z").
pub fn rfc3339(t: UnixMs) -> String {
    let secs = t.0 / 1000;
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        (s / 60) % 60,
        s % 60
    )
}

/// Howard Hinnant's days_from_civil: days since 1970-01-01 of a proleptic Gregorian date.
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2026-11-30T12:34:56Z
    const T: UnixMs = UnixMs(1_796_042_096_000);

    #[test]
    fn windows_have_the_expected_ids_and_resets() {
        assert_eq!(rfc3339(T), "2026-11-30T12:34:56Z");
        let day = Window::Day.at(T);
        assert_eq!(day.to_string(), "day:2026-11-30");
        assert_eq!(
            rfc3339(day.resets_at().expect("day resets")),
            "2026-12-01T00:00:00Z"
        );
        let month = Window::Month.at(T);
        assert_eq!(month.to_string(), "month:2026-11");
        assert_eq!(
            rfc3339(month.resets_at().expect("month resets")),
            "2026-12-01T00:00:00Z"
        );
        let hour = Window::Hour.at(T);
        assert_eq!(hour.to_string(), "hour:2026-11-30T12");
        assert_eq!(
            rfc3339(hour.resets_at().expect("hour resets")),
            "2026-11-30T13:00:00Z"
        );
        assert_eq!(Window::Lifetime.at(T).resets_at(), None);
        let dec = Window::Month.at(UnixMs(1_798_675_200_000 + 5)); // 2026-12-31T...
        assert_eq!(
            rfc3339(dec.resets_at().expect("month resets")),
            "2027-01-01T00:00:00Z"
        );
    }

    #[test]
    fn civil_roundtrip() {
        for z in -800_000..800_000i64 {
            if z % 997 != 0 {
                continue;
            }
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    #[test]
    fn secs_until_rounds_up() {
        assert_eq!(UnixMs(1000).secs_until(UnixMs(1001)), 1);
        assert_eq!(UnixMs(1000).secs_until(UnixMs(3000)), 2);
        assert_eq!(UnixMs(5000).secs_until(UnixMs(3000)), 0);
    }
}
