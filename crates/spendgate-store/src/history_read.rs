//! Reading a period of the usage history through any [`HistoryReader`], for `report`, `tune`
//! and `/admin/v1/history`: times as an operator writes them ([`parse_time`]), and a grouped
//! read ([`group`]) that pages through the reader, groups each page with
//! [`spendgate_core::history::aggregate`] and stops at a bound on the records it scans
//! (saying so), so that a report over a flood costs bounded memory and time.

use crate::history::{HistoryFilter, HistoryReader, HISTORY_PAGE_MAX};
use crate::StoreError;
use spendgate_core::history::{aggregate, GroupBy, HistoryRow, GROUPS_MAX};
use spendgate_core::window::days_from_civil;
use spendgate_core::UnixMs;
use std::collections::BTreeMap;

/// Records one grouped read scans at most; past it the answer says it is truncated.
pub const HISTORY_SCAN_MAX: usize = 1_000_000;

/// A grouped read of the history.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Grouped {
    /// Periods in time order; other groups by charge, largest first.
    pub rows: Vec<HistoryRow>,
    /// Records read.
    pub scanned: u64,
    /// The read stopped at its scan bound, or groups past [`GROUPS_MAX`] were dropped: the
    /// rows are a lower bound.
    pub truncated: bool,
}

/// Groups the reservation records `filter` selects by `by` (`top` of them when ranked),
/// reading at most `scan_max` records.
pub async fn group(
    reader: &dyn HistoryReader,
    filter: &HistoryFilter,
    by: GroupBy,
    top: Option<usize>,
    scan_max: usize,
) -> Result<Grouped, StoreError> {
    let mut groups: BTreeMap<String, HistoryRow> = BTreeMap::new();
    let mut out = Grouped::default();
    let mut cursor: Option<String> = None;
    loop {
        let left = scan_max.saturating_sub(out.scanned as usize);
        if left == 0 {
            out.truncated = true;
            break;
        }
        let page = reader
            .reservations(filter, cursor.as_deref(), left.min(HISTORY_PAGE_MAX))
            .await?;
        out.scanned += page.items.len() as u64;
        let (rows, dropped) = aggregate(&page.items, by, None);
        out.truncated |= dropped;
        for row in rows {
            merge_row(&mut groups, row, &mut out.truncated);
        }
        match page.next {
            Some(next) if !page.items.is_empty() => cursor = Some(next),
            _ => break,
        }
    }
    out.rows = groups.into_values().collect();
    if !by.is_time() {
        out.rows.sort_by(|a, b| {
            b.charged_micros
                .cmp(&a.charged_micros)
                .then_with(|| a.key.cmp(&b.key))
        });
    }
    if let Some(top) = top {
        out.rows.truncate(top);
    }
    Ok(out)
}

fn merge_row(groups: &mut BTreeMap<String, HistoryRow>, row: HistoryRow, truncated: &mut bool) {
    if let Some(g) = groups.get_mut(&row.key) {
        g.reservations += row.reservations;
        g.reserved_micros = g.reserved_micros.saturating_add(row.reserved_micros);
        g.charged_micros = g.charged_micros.saturating_add(row.charged_micros);
        g.overruns += row.overruns;
        g.unknown_or_expired += row.unknown_or_expired;
    } else if groups.len() >= GROUPS_MAX {
        *truncated = true;
    } else {
        groups.insert(row.key.clone(), row);
    }
}

/// A time as the admin API and the command line take it: unix milliseconds, an RFC 3339
/// date-time (`2026-12-03T10:00:00Z`, `2026-12-03T10:00:00.250+01:00`) or a date
/// (`2026-12-03`, its midnight UTC). `None` when it is none of them.
pub fn parse_time(s: &str) -> Option<UnixMs> {
    let s = s.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse().ok().map(UnixMs);
    }
    let (date, rest) = match s.find(['T', 't', ' ']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let day = parse_date(date)?;
    let ms = match rest {
        None => 0,
        Some(rest) => parse_clock(rest)?,
    };
    let at = day.checked_mul(86_400_000)?.checked_add(ms)?;
    u64::try_from(at).ok().map(UnixMs)
}

/// Days since the epoch of `YYYY-MM-DD`.
fn parse_date(s: &str) -> Option<i64> {
    let mut it = s.split('-');
    let (y, m, d) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() || y.len() != 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    let (y, m, d): (i64, u32, u32) = (y.parse().ok()?, m.parse().ok()?, d.parse().ok()?);
    let days_in_month = match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        _ => return None,
    };
    (1..=days_in_month)
        .contains(&d)
        .then(|| days_from_civil(y, m, d))
}

/// Milliseconds since midnight UTC of `HH:MM:SS[.fff](Z|±HH:MM)`, the offset applied.
fn parse_clock(s: &str) -> Option<i64> {
    let (clock, offset_ms) = if let Some(c) = s.strip_suffix(['Z', 'z']) {
        (c, 0)
    } else {
        let i = s.rfind(['+', '-'])?;
        let (c, off) = (&s[..i], &s[i..]);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let (h, m) = off[1..].split_once(':')?;
        if h.len() != 2 || m.len() != 2 {
            return None;
        }
        let (h, m): (i64, i64) = (h.parse().ok()?, m.parse().ok()?);
        if h > 23 || m > 59 {
            return None;
        }
        (c, sign * (h * 3_600_000 + m * 60_000))
    };
    let (hms, frac) = match clock.split_once('.') {
        Some((hms, frac)) => (hms, frac),
        None => (clock, ""),
    };
    let mut it = hms.split(':');
    let (h, m, sec) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() || [h, m, sec].iter().any(|p| p.len() != 2) {
        return None;
    }
    let (h, m, sec): (i64, i64, i64) = (h.parse().ok()?, m.parse().ok()?, sec.parse().ok()?);
    if h > 23 || m > 59 || sec > 60 || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let ms: i64 = format!("{frac:0<3}")[..3].parse().ok()?;
    Some(h * 3_600_000 + m * 60_000 + sec * 1000 + ms - offset_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{cursor, parse_cursor, Page};
    use async_trait::async_trait;
    use spendgate_core::history::{RefusalMinute, ReservationRecord, RunRecord, StepClass};
    use spendgate_core::{Micros, ReservationId, ReservationState, RunId};

    /// A reader over a Vec (test support only), paging like a real one.
    struct VecReader(Vec<ReservationRecord>);

    #[async_trait]
    impl HistoryReader for VecReader {
        async fn reservations(
            &self,
            filter: &HistoryFilter,
            after: Option<&str>,
            limit: usize,
        ) -> Result<Page<ReservationRecord>, StoreError> {
            let after = after
                .and_then(parse_cursor)
                .map(|(t, id)| (t, id.to_owned()));
            let items: Vec<ReservationRecord> = self
                .0
                .iter()
                .filter(|r| filter.selects(r))
                .filter(|r| {
                    after
                        .as_ref()
                        .is_none_or(|(t, id)| (r.resolved_at, &r.id.0) > (*t, id))
                })
                .take(limit)
                .cloned()
                .collect();
            let next = (items.len() == limit)
                .then(|| items.last().map(|r| cursor(r.resolved_at, &r.id.0)))
                .flatten();
            Ok(Page { items, next })
        }
        async fn runs(
            &self,
            _: &HistoryFilter,
            _: Option<&str>,
            _: usize,
        ) -> Result<Page<RunRecord>, StoreError> {
            Ok(Page {
                items: vec![],
                next: None,
            })
        }
        async fn refusals(
            &self,
            _: UnixMs,
            _: UnixMs,
        ) -> Result<Vec<(RefusalMinute, u64)>, StoreError> {
            Ok(vec![])
        }
        fn kind(&self) -> &'static str {
            "vec"
        }
    }

    fn record(i: u64, name: &str, charged: u64) -> ReservationRecord {
        ReservationRecord {
            id: ReservationId(format!("r{i:06}")),
            run_id: RunId("run".into()),
            session: format!("s{}", i % 3),
            conversation: "c".into(),
            address: "10.0.0.1/32".into(),
            class: StepClass::Model,
            name: name.into(),
            retry: false,
            usage: None,
            units: None,
            result_bytes: None,
            reserved: Micros(charged),
            charged: Micros(charged),
            state: ReservationState::Committed,
            created: UnixMs(1000),
            resolved_at: UnixMs(1000 + i),
            overrun: false,
            result_too_large: false,
            counters: vec![],
        }
    }

    #[tokio::test]
    async fn a_grouped_read_pages_through_and_stops_at_its_bound() {
        let n = HISTORY_PAGE_MAX as u64 * 2 + 7;
        let reader = VecReader(
            (0..n)
                .map(|i| record(i, ["a", "b"][(i % 2) as usize], i % 2 + 1))
                .collect(),
        );
        let filter = HistoryFilter::period(UnixMs(0), UnixMs(u64::MAX));
        let all = group(&reader, &filter, GroupBy::Model, None, HISTORY_SCAN_MAX)
            .await
            .expect("group");
        assert_eq!(all.scanned, n);
        assert!(!all.truncated);
        let b = n / 2;
        assert_eq!(
            all.rows
                .iter()
                .map(|r| (r.key.as_str(), r.reservations, r.charged_micros))
                .collect::<Vec<_>>(),
            [("b", b, b * 2), ("a", n - b, n - b)]
        );
        let one = group(
            &reader,
            &filter,
            GroupBy::Session,
            Some(1),
            HISTORY_SCAN_MAX,
        )
        .await
        .expect("group");
        assert_eq!(one.rows.len(), 1);
        let cut = group(&reader, &filter, GroupBy::Day, None, 15_000)
            .await
            .expect("group");
        assert!(cut.truncated);
        assert_eq!((cut.scanned, cut.rows[0].reservations), (15_000, 15_000));
    }

    #[test]
    fn times_parse_as_operators_write_them() {
        assert_eq!(parse_time("1796042096000"), Some(UnixMs(1_796_042_096_000)));
        assert_eq!(
            parse_time("2026-11-30T12:34:56Z"),
            Some(UnixMs(1_796_042_096_000))
        );
        assert_eq!(
            parse_time("2026-11-30T13:34:56.5+01:00"),
            Some(UnixMs(1_796_042_096_500))
        );
        assert_eq!(
            parse_time("2026-11-30"),
            Some(UnixMs(1_796_042_096_000 - 45_296_000))
        );
        for bad in [
            "",
            "yesterday",
            "2026-02-30",
            "2026-11-30T25:00:00Z",
            "2026-11-30T12:00:00",
            "-5",
        ] {
            assert_eq!(parse_time(bad), None, "{bad}");
        }
    }
}
