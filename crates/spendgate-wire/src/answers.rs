//! The answers of the decision, admin and health API as types: what each route sends, and the
//! schema `docs/openapi.json` publishes (`spendgate_http::openapi`). A handler builds one of
//! these and serializes it; none builds its answer ad hoc.

use crate::error::ErrorCode;
use serde::Serialize;
use utoipa::ToSchema;

/// `POST /v1/sessions`: a guest session (also set as a cookie).
#[derive(Debug, Serialize, ToSchema)]
pub struct SessionAnswer {
    /// The session token.
    pub session: String,
    /// RFC 3339.
    pub expires_at: String,
    pub ledger_seq: u64,
}

/// A run's bounds, as admitted.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunBoundsAnswer {
    pub max_input_bytes: u64,
    pub max_context_tokens: u64,
    pub max_output_tokens: u64,
    pub max_tool_result_bytes: u64,
    pub max_model_rounds: u32,
    pub max_tool_calls: u32,
    pub max_retries: u32,
    pub max_seconds: u64,
    pub max_cost_micros: u64,
}

/// `POST /v1/runs`: an admitted run.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunAnswer {
    pub run_id: String,
    /// RFC 3339.
    pub deadline: String,
    pub bounds: RunBoundsAnswer,
    pub reserved_micros: u64,
    pub ledger_seq: u64,
}

/// `POST /v1/runs/{run_id}/heartbeat`: the run's lease, extended.
#[derive(Debug, Serialize, ToSchema)]
pub struct HeartbeatAnswer {
    /// RFC 3339.
    pub lease_until: String,
    /// RFC 3339.
    pub deadline: String,
    pub ledger_seq: u64,
}

/// `POST /v1/runs/{run_id}/finish`: the run, closed.
#[derive(Debug, Serialize, ToSchema)]
pub struct FinishAnswer {
    /// `active`, `finished` or `expired`.
    pub state: &'static str,
    /// The sum of the run's steps' charges. In `whole_run` mode the budgets may have been
    /// charged more (an expired run is charged its whole hold): see `budgets_charged_micros`.
    pub charged_micros: u64,
    /// What the run's budgets were charged: `charged_micros` in `per_step` mode, the run's
    /// hold as committed or expired in `whole_run` mode.
    pub budgets_charged_micros: u64,
    pub steps: u32,
    pub repeated: bool,
    pub ledger_seq: u64,
}

/// `POST /v1/runs/{run_id}/steps`: an admitted step.
#[derive(Debug, Serialize, ToSchema)]
pub struct StepAnswer {
    pub step_id: String,
    pub reserved_micros: u64,
    /// The output bound the call must be forwarded with (model steps).
    pub max_output_tokens: Option<u64>,
    /// The bound shrank to what the budget covers (`run.shrink_to_fit`).
    pub output_shrunk: bool,
    pub ledger_seq: u64,
}

/// `POST /v1/steps/{step_id}/commit`, `release` and `unknown`: the step, resolved.
#[derive(Debug, Serialize, ToSchema)]
pub struct ResolvedAnswer {
    /// The reservation's state.
    pub state: &'static str,
    pub charged_micros: u64,
    pub reserved_micros: u64,
    pub overrun: bool,
    pub repeated: bool,
    /// A tool result over `max_tool_result_bytes`: charged, not to be fed back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_too_large: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<&'static str>,
    pub ledger_seq: u64,
}

/// One budget that applies to a caller, in its current window.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageScope {
    /// `global`, `ip`, `session`, `conversation` or `run`.
    pub kind: &'static str,
    /// The scope's id (none for the global scope).
    pub id: Option<String>,
    pub window: &'static str,
    pub window_id: String,
    pub limit_micros: u64,
    pub used_micros: u64,
    pub reserved_micros: u64,
    pub remaining_micros: u64,
    pub overrun: bool,
    /// RFC 3339; none for a window that never resets.
    pub resets_at: Option<String>,
}

/// `GET /v1/usage`: every budget that applies, global included.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageAnswer {
    pub scopes: Vec<UsageScope>,
}

/// `POST /admin/v1/adjustments`: the scope's budgets after the adjustment.
#[derive(Debug, Serialize, ToSchema)]
pub struct AdjustAnswer {
    pub scopes: Vec<UsageScope>,
    /// An earlier answer under the same `Idempotency-Key`: applied once.
    pub repeated: bool,
    pub ledger_seq: u64,
}

/// `PUT /admin/v1/cutoff`: the cutoff as set.
#[derive(Debug, Serialize, ToSchema)]
pub struct CutoffAnswer {
    pub engaged: bool,
    pub reason: Option<String>,
    pub ledger_seq: u64,
}

/// One counter of `GET /admin/v1/scopes`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AdminScopeRow {
    pub scope: String,
    pub kind: &'static str,
    pub window: String,
    pub limit_micros: u64,
    pub used_micros: u64,
    pub reserved_micros: u64,
    pub overrun: bool,
    pub resets_at: Option<String>,
}

/// `GET /admin/v1/scopes`: the busiest counters.
#[derive(Debug, Serialize, ToSchema)]
pub struct AdminScopesAnswer {
    pub scopes: Vec<AdminScopeRow>,
}

/// One reservation of `GET /admin/v1/reservations`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AdminReservationRow {
    pub id: String,
    pub run_id: String,
    /// `model:NAME`, `tool:NAME` or `run_hold`.
    pub kind: String,
    pub retry: bool,
    pub state: &'static str,
    pub reserved_micros: u64,
    pub charged_micros: u64,
    pub overrun: bool,
    /// RFC 3339.
    pub created: String,
    pub resolved_at: Option<String>,
}

/// `GET /admin/v1/reservations`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AdminReservationsAnswer {
    pub reservations: Vec<AdminReservationRow>,
}

/// `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct HealthAnswer {
    /// `ok`.
    pub status: &'static str,
}

/// `GET /readyz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReadyAnswer {
    /// `ready`.
    pub status: &'static str,
    /// The store's kind (`memory`, `sqlite`, `redis`).
    pub store: &'static str,
}

/// The error shape of every refusal (OpenAI's): `{"error": {...}}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
    /// The challenge to solve (`challenge_required`), as in `error.challenge`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub challenge: Option<serde_json::Value>,
    /// The refusal changed the ledger: its sequence number.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ledger_seq: Option<u64>,
}

/// The inside of [`ErrorBody`].
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// OpenAI's error type (`invalid_request_error`, `rate_limit_error`, ...).
    #[serde(rename = "type")]
    pub kind: String,
    pub code: ErrorCode,
    pub message: String,
    /// Always null (OpenAI's field).
    #[schema(value_type = Option<String>)]
    pub param: Option<String>,
    /// The budget or limit that refused (`global`, `ip`, `session`, `conversation`, `run`).
    pub scope: Option<String>,
    pub retry_after_s: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub challenge: Option<serde_json::Value>,
}

/// `GET /admin/v1/summary`: the ledger at a glance.
#[derive(Debug, Serialize, ToSchema)]
pub struct AdminSummaryAnswer {
    pub ledger_seq: u64,
    /// The store kind: `memory`, `sqlite`, `redis`.
    pub store: &'static str,
    pub cutoff: CutoffState,
    pub runs_active: u64,
    /// Reservations by state.
    pub reservations: std::collections::BTreeMap<String, u64>,
    pub held_micros: u64,
    pub charged_micros: u64,
    pub overruns: u64,
    /// `server.dry_run`: every limit reported, none enforced.
    pub dry_run: bool,
    /// The limits reported, not enforced: a scope kind (all its limits) or one limit of it
    /// (`session.rate`, `ip.concurrency`, `global.budgets.month`).
    pub dry_run_limits: Vec<String>,
    /// The global budgets in their current windows.
    pub global: Vec<UsageScope>,
    /// Live replicas on this ledger enforce different policies (issue 18).
    pub policy_drift: bool,
    pub policy: PolicyAnswer,
    /// The global budgets' burn rates and forecasts, from the spend this replica watched
    /// (after a start or a window's reset, over what was watched since: `watched_s`).
    pub burn: Vec<BurnAnswer>,
}

/// One global budget's burn: its spend rate over the short and the long window
/// (`alerts.burn_short_s`, `alerts.burn_long_s`), and the forecasts at each rate.
#[derive(Debug, Serialize, ToSchema)]
pub struct BurnAnswer {
    pub window: &'static str,
    pub window_id: String,
    pub limit_micros: u64,
    pub used_micros: u64,
    /// RFC 3339; none for a window that never resets.
    pub resets_at: Option<String>,
    /// When the rates were last sampled (RFC 3339).
    pub sampled_at: String,
    /// At both rates the budget is spent before its window resets (the burn-rate alert's
    /// rule; it needs the short window watched whole).
    pub would_exhaust: bool,
    /// The short window's rate first, then the long one's.
    pub rates: Vec<BurnRateAnswer>,
}

/// A budget's spend rate over one window, and what it forecasts.
#[derive(Debug, Serialize, ToSchema)]
pub struct BurnRateAnswer {
    /// The window the rate is meant over, in seconds.
    pub over_s: u64,
    /// What it is over: less than `over_s` until that long was watched.
    pub watched_s: f64,
    pub micros_per_s: f64,
    /// Spend at the window's reset at this rate; none for a window that never resets.
    pub projected_micros: Option<u64>,
    /// Seconds until the budget is spent at this rate; none when the rate is zero.
    pub exhausted_in_s: Option<f64>,
    /// When that is (RFC 3339).
    pub exhausted_at: Option<String>,
}

/// The kill switch's state.
#[derive(Debug, Serialize, ToSchema)]
pub struct CutoffState {
    pub engaged: bool,
    pub reason: Option<String>,
}

/// This replica's policy fingerprint and the live replicas'.
#[derive(Debug, Serialize, ToSchema)]
pub struct PolicyAnswer {
    /// This replica's id.
    pub replica: String,
    pub fingerprint: String,
    /// The distinct fingerprints, with how many live replicas publish each.
    pub fingerprints: Vec<FingerprintCount>,
    pub replicas: Vec<ReplicaRow>,
}

/// One fingerprint of [`PolicyAnswer`].
#[derive(Debug, Serialize, ToSchema)]
pub struct FingerprintCount {
    pub fingerprint: String,
    pub replicas: usize,
}

/// One live replica of [`PolicyAnswer`].
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplicaRow {
    pub replica: String,
    pub fingerprint: String,
    /// When it last published (RFC 3339); absent while it has not.
    pub seen: Option<String>,
}

/// One group of `GET /admin/v1/history?by=…` (and of `spendgate report --format json`).
#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryGroupRow {
    /// The grouping key: an RFC 3339 period start, a scope kind, a model, a session...
    pub key: String,
    pub reservations: u64,
    pub reserved_micros: u64,
    pub charged_micros: u64,
    pub overruns: u64,
    /// Reservations that ended `unknown` or `expired` (charged in full).
    pub unknown_or_expired: u64,
}

/// One reservation's terminal record.
#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryReservationRow {
    pub id: String,
    pub run_id: String,
    pub session: String,
    pub conversation: String,
    /// The client's address prefix.
    pub address: String,
    /// `model`, `tool` or `run_hold`.
    pub class: &'static str,
    /// The model or tool; empty for a run hold.
    pub name: String,
    pub retry: bool,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub units: Option<u64>,
    pub result_bytes: Option<u64>,
    pub reserved_micros: u64,
    pub charged_micros: u64,
    pub state: &'static str,
    /// Unix milliseconds.
    pub created_ms: u64,
    /// Unix milliseconds.
    pub resolved_at_ms: u64,
    pub overrun: bool,
    pub result_too_large: bool,
    /// Every budget counter the charge went to (`scope@window`).
    pub counters: Vec<String>,
}

/// One run's summary, written when it ended.
#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryRunRow {
    pub id: String,
    pub session: String,
    pub conversation: String,
    pub address: String,
    /// Unix milliseconds.
    pub created_ms: u64,
    /// Unix milliseconds.
    pub ended_at_ms: u64,
    /// `finished` or `expired`.
    pub ended: &'static str,
    pub input_bytes: u64,
    pub context_tokens: u64,
    pub output_tokens: u64,
    pub tool_result_bytes: u64,
    pub rounds: u32,
    pub tool_calls: u32,
    pub retries: u32,
    pub duration_ms: u64,
    pub cost_micros: u64,
    /// Refusal codes its steps got.
    pub refused: Vec<&'static str>,
}

/// Refusals of one code by one scope kind in one period.
#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryRefusalRow {
    /// The period's start, RFC 3339 (a minute, or the hour or day of `by`).
    pub at: String,
    pub code: &'static str,
    /// The refusing scope kind, when one refused.
    pub scope: Option<&'static str>,
    pub count: u64,
}

/// `GET /admin/v1/history`: a period of the usage history, grouped (`rows`) or as records
/// (`reservations`, `runs` or `refusals`, by `kind`), paginated by `next_cursor`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AdminHistoryAnswer {
    /// `reservations`, `runs` or `refusals`.
    pub kind: &'static str,
    /// RFC 3339, inclusive.
    pub since: String,
    /// RFC 3339, exclusive.
    pub until: String,
    /// The grouping, when grouped.
    pub by: Option<&'static str>,
    /// What keeps the history (`sqlite`, `postgres`, `redis-stream`, `memory`).
    pub source: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rows: Option<Vec<HistoryGroupRow>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reservations: Option<Vec<HistoryReservationRow>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runs: Option<Vec<HistoryRunRow>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusals: Option<Vec<HistoryRefusalRow>>,
    /// The cursor of the next page of records; absent on the last page (and when grouped).
    pub next_cursor: Option<String>,
    /// Records read to answer.
    pub scanned: u64,
    /// A grouped answer stopped at its bound on records read (or on groups): its figures
    /// are a lower bound; ask for a shorter period.
    pub truncated: bool,
}
