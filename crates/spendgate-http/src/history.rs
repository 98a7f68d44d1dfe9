//! `GET /admin/v1/history`: a period of the usage history, read through the store's
//! [`HistoryReader`](spendgate_store::HistoryReader): grouped (`by`), or its records page by
//! page (`kind`, `cursor`, `limit`).

use crate::auth::AdminAuth;
use crate::query::Query;
use crate::state::Shared;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use spendgate_core::history::{GroupBy, RefusalMinute, ReservationRecord, RunRecord};
use spendgate_core::{rfc3339, ReservationState, UnixMs};
use spendgate_store::history::parse_cursor;
use spendgate_store::history_read::{group, parse_time};
use spendgate_store::{HistoryFilter, HistoryReader, HISTORY_PAGE_MAX};
use spendgate_wire::answers::{
    AdminHistoryAnswer, ErrorBody, HistoryGroupRow, HistoryRefusalRow, HistoryReservationRow,
    HistoryRunRow,
};
use spendgate_wire::error::{run_state_name, ApiError, ApiResult, ErrorCode};

/// Records one grouped answer reads at most (it must answer within the API's request
/// timeout); past it the answer says `truncated`.
pub const HISTORY_SCAN_MAX: usize = 200_000;
/// Records one page holds when `limit` is absent.
pub const HISTORY_PAGE_DEFAULT: usize = 1000;
/// Refusal rows one answer holds at most (minutes × codes × scope kinds of the period).
pub const REFUSAL_ROWS_MAX: usize = 100_000;
/// The period read when `since` is absent: the last day.
pub const HISTORY_PERIOD_DEFAULT_MS: u64 = 86_400_000;

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    /// Inclusive: RFC 3339 or unix milliseconds (default: `until` less a day).
    pub since: Option<String>,
    /// Exclusive: RFC 3339 or unix milliseconds (default: now).
    pub until: Option<String>,
    /// day, hour, minute, scope-kind, model, tool, session, address, conversation, state
    /// (absent: the records themselves).
    pub by: Option<String>,
    /// Groups ranked by charge kept at most.
    pub top: Option<usize>,
    pub session: Option<String>,
    pub address: Option<String>,
    pub conversation: Option<String>,
    /// A model or tool name.
    pub name: Option<String>,
    /// A reservation's terminal state.
    pub state: Option<String>,
    /// `reservations` (default), `runs` or `refusals`.
    pub kind: Option<String>,
    /// The `next_cursor` of the page before.
    pub cursor: Option<String>,
    /// Records per page, at most 10000.
    pub limit: Option<usize>,
}

/// What a history query asks, checked.
struct Asked {
    kind: &'static str,
    filter: HistoryFilter,
    by: Option<GroupBy>,
    top: Option<usize>,
    limit: usize,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn time(name: &str, v: Option<&str>) -> Result<Option<UnixMs>, ApiError> {
    v.filter(|s| !s.is_empty())
        .map(|s| {
            parse_time(s).ok_or_else(|| {
                ApiError::invalid(format!(
                    "{name} {s:?} is neither RFC 3339 (2026-12-03T10:00:00Z) nor unix milliseconds"
                ))
            })
        })
        .transpose()
}

fn check(q: HistoryQuery) -> Result<Asked, ApiError> {
    let until = time("until", q.until.as_deref())?.unwrap_or(UnixMs(now_ms().saturating_add(1)));
    let since = time("since", q.since.as_deref())?
        .unwrap_or(UnixMs(until.0.saturating_sub(HISTORY_PERIOD_DEFAULT_MS)));
    if since >= until {
        return Err(ApiError::invalid("since must be before until"));
    }
    let kind = match q.kind.as_deref().unwrap_or("reservations") {
        "reservations" => "reservations",
        "runs" => "runs",
        "refusals" => "refusals",
        k => {
            return Err(ApiError::invalid(format!(
                "unknown kind {k:?}: reservations, runs or refusals"
            )))
        }
    };
    let by = q
        .by
        .as_deref()
        .filter(|b| !b.is_empty())
        .map(|b| GroupBy::parse(b).ok_or_else(|| ApiError::invalid(format!("unknown by {b:?}"))))
        .transpose()?;
    match (kind, by) {
        ("runs", Some(_)) => return Err(ApiError::invalid("runs are not grouped: leave out by")),
        ("refusals", Some(b)) if !b.is_time() => {
            return Err(ApiError::invalid(
                "refusals group by minute, hour or day only",
            ))
        }
        _ => {}
    }
    let state = q
        .state
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(|s| {
            ReservationState::parse(s)
                .ok_or_else(|| ApiError::invalid(format!("unknown state {s:?}")))
        })
        .transpose()?;
    let limit = q.limit.unwrap_or(HISTORY_PAGE_DEFAULT);
    if limit == 0 || limit > HISTORY_PAGE_MAX {
        return Err(ApiError::invalid(format!(
            "limit must be between 1 and {HISTORY_PAGE_MAX}"
        )));
    }
    if q.cursor
        .as_deref()
        .is_some_and(|c| parse_cursor(c).is_none())
    {
        return Err(ApiError::invalid("cursor is not one this API answered"));
    }
    let filter = HistoryFilter {
        since,
        until,
        session: q.session,
        address: q.address,
        conversation: q.conversation,
        name: q.name,
        state,
    };
    Ok(Asked {
        kind,
        filter,
        by,
        top: q.top,
        limit,
    })
}

/// A period of the usage history: grouped by `by` (periods in time order, other groups
/// ranked by charge), or its records (`kind`), paginated.
#[utoipa::path(get, path = "/admin/v1/history", tag = "admin",
    params(HistoryQuery),
    responses(
        (status = 200, description = "the period's history", body = AdminHistoryAnswer),
        (status = 400, description = "invalid_request: a parameter that does not parse", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 503, description = "store_unavailable: the store cannot be read, or keeps no usage history", body = ErrorBody),
    ),
    security(("admin" = [])))]
pub async fn history(
    _auth: AdminAuth,
    State(state): State<Shared>,
    Query(q): Query<HistoryQuery>,
) -> ApiResult<Response> {
    let cursor = q.cursor.clone();
    let asked = check(q)?;
    let reader = state.store.history().ok_or_else(|| {
        ApiError::new(
            ErrorCode::StoreUnavailable,
            "this store keeps no usage history",
        )
    })?;
    let mut answer = AdminHistoryAnswer {
        kind: asked.kind,
        since: rfc3339(asked.filter.since),
        until: rfc3339(asked.filter.until),
        by: asked.by.map(GroupBy::name),
        source: reader.kind(),
        rows: None,
        reservations: None,
        runs: None,
        refusals: None,
        next_cursor: None,
        scanned: 0,
        truncated: false,
    };
    match (asked.kind, asked.by) {
        ("refusals", by) => refusals(&*reader, &asked.filter, by, &mut answer).await?,
        ("runs", _) => {
            let page = reader
                .runs(&asked.filter, cursor.as_deref(), asked.limit)
                .await?;
            answer.scanned = page.items.len() as u64;
            answer.runs = Some(page.items.iter().map(run_row).collect());
            answer.next_cursor = page.next;
        }
        (_, Some(by)) => {
            let g = group(&*reader, &asked.filter, by, asked.top, HISTORY_SCAN_MAX).await?;
            answer.scanned = g.scanned;
            answer.truncated = g.truncated;
            answer.rows = Some(
                g.rows
                    .into_iter()
                    .map(|r| HistoryGroupRow {
                        key: r.key,
                        reservations: r.reservations,
                        reserved_micros: r.reserved_micros,
                        charged_micros: r.charged_micros,
                        overruns: r.overruns,
                        unknown_or_expired: r.unknown_or_expired,
                    })
                    .collect(),
            );
        }
        (_, None) => {
            let page = reader
                .reservations(&asked.filter, cursor.as_deref(), asked.limit)
                .await?;
            answer.scanned = page.items.len() as u64;
            answer.reservations = Some(page.items.iter().map(reservation_row).collect());
            answer.next_cursor = page.next;
        }
    }
    Ok(Json(answer).into_response())
}

/// Refusal counts of the period, per minute (or hour, or day), code and scope kind.
async fn refusals(
    reader: &dyn HistoryReader,
    filter: &HistoryFilter,
    by: Option<GroupBy>,
    answer: &mut AdminHistoryAnswer,
) -> Result<(), ApiError> {
    let period = match by {
        Some(GroupBy::Hour) => 3_600_000,
        Some(GroupBy::Day) => 86_400_000,
        _ => 60_000,
    };
    let minutes = reader.refusals(filter.since, filter.until).await?;
    answer.scanned = minutes.len() as u64;
    let mut rows: std::collections::BTreeMap<RefusalMinute, u64> = Default::default();
    for (m, count) in minutes {
        let at = RefusalMinute {
            minute: UnixMs(m.minute.0 - m.minute.0 % period),
            ..m
        };
        if rows.len() >= REFUSAL_ROWS_MAX && !rows.contains_key(&at) {
            answer.truncated = true;
            continue;
        }
        *rows.entry(at).or_default() += count;
    }
    answer.refusals = Some(
        rows.into_iter()
            .map(|(m, count)| HistoryRefusalRow {
                at: rfc3339(m.minute),
                code: m.code.name(),
                scope: m.scope.map(|s| s.name()),
                count,
            })
            .collect(),
    );
    Ok(())
}

fn reservation_row(r: &ReservationRecord) -> HistoryReservationRow {
    HistoryReservationRow {
        id: r.id.0.clone(),
        run_id: r.run_id.0.clone(),
        session: r.session.clone(),
        conversation: r.conversation.clone(),
        address: r.address.clone(),
        class: r.class.name(),
        name: r.name.clone(),
        retry: r.retry,
        prompt_tokens: r.usage.map(|u| u.prompt_tokens),
        completion_tokens: r.usage.map(|u| u.completion_tokens),
        cached_tokens: r.usage.map(|u| u.cached_tokens),
        units: r.units,
        result_bytes: r.result_bytes,
        reserved_micros: r.reserved.0,
        charged_micros: r.charged.0,
        state: r.state.name(),
        created_ms: r.created.0,
        resolved_at_ms: r.resolved_at.0,
        overrun: r.overrun,
        result_too_large: r.result_too_large,
        counters: r
            .counters
            .iter()
            .map(|c| format!("{}@{}", c.scope, c.window))
            .collect(),
    }
}

fn run_row(r: &RunRecord) -> HistoryRunRow {
    HistoryRunRow {
        id: r.id.0.clone(),
        session: r.session.clone(),
        conversation: r.conversation.clone(),
        address: r.address.clone(),
        created_ms: r.created.0,
        ended_at_ms: r.ended_at.0,
        ended: run_state_name(r.ended),
        input_bytes: r.input_bytes,
        context_tokens: r.context_tokens,
        output_tokens: r.output_tokens,
        tool_result_bytes: r.tool_result_bytes,
        rounds: r.rounds,
        tool_calls: r.tool_calls,
        retries: r.retries,
        duration_ms: r.duration_ms,
        cost_micros: r.cost.0,
        refused: r.refused.iter().map(|c| c.name()).collect(),
    }
}
