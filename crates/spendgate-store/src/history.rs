//! Reading the usage history ([`spendgate_core::history`]) back, whatever keeps it: the
//! sqlite file, PostgreSQL (drained from Redis), Redis's own capped stream, or a memory
//! store's bounded list. `report`, `tune`, the admin API and the dashboard read through this
//! trait only, and group with [`spendgate_core::history::aggregate`].
//!
//! And [`HistoryTap`]: what a process's store tells its metrics about each history event it
//! made durable, so that counters are running totals of the same records.

use crate::StoreError;
use async_trait::async_trait;
use spendgate_core::history::{
    AdjustmentRecord, HistoryEvent, RefusalMinute, ReservationRecord, RunRecord,
};
use spendgate_core::{ReservationState, UnixMs};

/// Records one page of a history read holds at most.
pub const HISTORY_PAGE_MAX: usize = 10_000;

/// Which records a history read selects: resolved (reservations) or ended (runs) in
/// `[since, until)`, and, when set, only those of one session, address, conversation, model or
/// tool name, or terminal state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HistoryFilter {
    pub since: UnixMs,
    pub until: UnixMs,
    pub session: Option<String>,
    pub address: Option<String>,
    pub conversation: Option<String>,
    /// A model or tool name.
    pub name: Option<String>,
    pub state: Option<ReservationState>,
}

impl HistoryFilter {
    pub fn period(since: UnixMs, until: UnixMs) -> HistoryFilter {
        HistoryFilter {
            since,
            until,
            ..HistoryFilter::default()
        }
    }

    /// Whether a reservation record is selected (for backends that filter in the process).
    pub fn selects(&self, r: &ReservationRecord) -> bool {
        r.resolved_at >= self.since
            && r.resolved_at < self.until
            && self.session.as_ref().is_none_or(|s| *s == r.session)
            && self.address.as_ref().is_none_or(|a| *a == r.address)
            && self
                .conversation
                .as_ref()
                .is_none_or(|c| *c == r.conversation)
            && self.name.as_ref().is_none_or(|n| *n == r.name)
            && self.state.is_none_or(|s| s == r.state)
    }

    /// Whether a run record is selected (name and state do not apply to runs).
    pub fn selects_run(&self, r: &RunRecord) -> bool {
        r.ended_at >= self.since
            && r.ended_at < self.until
            && self.session.as_ref().is_none_or(|s| *s == r.session)
            && self.address.as_ref().is_none_or(|a| *a == r.address)
            && self
                .conversation
                .as_ref()
                .is_none_or(|c| *c == r.conversation)
    }
}

/// One page of records, in (time, id) order; `next` is the opaque cursor of the page after
/// it, `None` on the last page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Option<String>,
}

/// A cursor: the (time, id) of the last record of a page.
pub fn cursor(at: UnixMs, id: &str) -> String {
    format!("{}:{id}", at.0)
}

/// The (time, id) a cursor names; `None` when it is not one [`cursor`] made.
pub fn parse_cursor(c: &str) -> Option<(UnixMs, &str)> {
    let (at, id) = c.split_once(':')?;
    Some((UnixMs(at.parse().ok()?), id))
}

/// One page of `items` (each with its time and id, in any order): those after the cursor
/// `after`, in (time, id) order, at most `limit` (and [`HISTORY_PAGE_MAX`]). For backends that
/// select in the process. A cursor that is not one [`cursor`] made is refused.
pub fn page_of<T>(
    mut items: Vec<(UnixMs, String, T)>,
    after: Option<&str>,
    limit: usize,
) -> Result<Page<T>, StoreError> {
    let after = match after {
        None => None,
        Some(c) => Some(
            parse_cursor(c)
                .map(|(t, id)| (t, id.to_owned()))
                .ok_or_else(|| bad_cursor(c))?,
        ),
    };
    let limit = limit.clamp(1, HISTORY_PAGE_MAX);
    if let Some((t, id)) = &after {
        items.retain(|(at, i, _)| (*at, i.as_str()) > (*t, id.as_str()));
    }
    items.sort_unstable_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let more = items.len() > limit;
    items.truncate(limit);
    let next = if more {
        items.last().map(|(t, id, _)| cursor(*t, id))
    } else {
        None
    };
    Ok(Page {
        items: items.into_iter().map(|(_, _, x)| x).collect(),
        next,
    })
}

/// The error of a cursor that no page made.
pub fn bad_cursor(c: &str) -> StoreError {
    StoreError::Ledger(
        spendgate_core::LedgerError::Invalid(format!("not a history cursor: {c:?}")),
        None,
    )
}

/// Where the usage history is read from.
#[async_trait]
pub trait HistoryReader: Send + Sync + 'static {
    /// Reservation records the filter selects, after `after` (a cursor), at most `limit`
    /// (itself at most [`HISTORY_PAGE_MAX`]).
    async fn reservations(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<ReservationRecord>, StoreError>;

    /// Run records the filter selects, after `after`, at most `limit`.
    async fn runs(
        &self,
        filter: &HistoryFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<RunRecord>, StoreError>;

    /// Refusal counts of the minutes in `[since, until)`.
    async fn refusals(
        &self,
        since: UnixMs,
        until: UnixMs,
    ) -> Result<Vec<(RefusalMinute, u64)>, StoreError>;

    /// Operator adjustments made in `[since, until)`, in time order, at most `limit`
    /// (itself at most [`HISTORY_PAGE_MAX`]): with the reservation records, what every budget
    /// counter's used spend is made of. A history that does not keep them says so (an error,
    /// never an empty answer that would pass for "none").
    async fn adjustments(
        &self,
        since: UnixMs,
        until: UnixMs,
        limit: usize,
    ) -> Result<Vec<AdjustmentRecord>, StoreError> {
        let _ = (since, until, limit);
        Err(StoreError::Unavailable(format!(
            "the {} history keeps no adjustments",
            self.kind()
        )))
    }

    /// What keeps it ("sqlite", "postgres", "redis-stream", "memory").
    fn kind(&self) -> &'static str;
}

/// Told of every history event a store made durable in this process, once, in the order the
/// ledger made them. Must not block (it runs on the store's applier path): count and return.
pub trait HistoryTap: Send + Sync + 'static {
    fn seen(&self, events: &[HistoryEvent]);
}
