//! Runs: `POST /v1/runs`, heartbeat and finish (SPEC §6).

use crate::answer::{grant, ledger_answer};
use crate::auth::ServiceAuth;
use crate::body::{Body, Empty};
use crate::client::{check_conversation, ip_scopes, parse_ip};
use crate::idempotency::idempotency;
use crate::ids::new_id;
use crate::path::RunIdPath;
use crate::ratelimit::{note_dry_run, rate_limit_headers};
use crate::state::Shared;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use spendgate_core::{rfc3339, RunBounds, RunId, RunRequest};
use spendgate_store::clock::now_unix;
use spendgate_wire::answers::{
    ErrorBody, FinishAnswer, HeartbeatAnswer, RunAnswer, RunBoundsAnswer,
};
use spendgate_wire::error::{ApiError, ApiResult};

// ---------------------------------------------------------------------------------------
// Runs and steps

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRunBody {
    pub session: String,
    pub client_ip: String,
    pub conversation: String,
    pub input_text: Option<String>,
    pub input_bytes: Option<u64>,
}

/// A run: its bounds, and the hold on its budgets.
#[utoipa::path(post, path = "/v1/runs", tag = "runs",
    request_body = CreateRunBody,
    params(("Idempotency-Key" = Option<String>, Header, description = "a repeat returns the first answer")),
    responses(
        (status = 201, description = "the run, admitted", body = RunAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 409, description = "idempotency_conflict, reservation_closed, run_closed", body = ErrorBody),
        (status = 413, description = "payload_too_large", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 429, description = "a rate, concurrency or budget limit (Retry-After)", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("service" = [])))]
pub async fn create_run(
    _auth: ServiceAuth,
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Body<CreateRunBody>,
) -> ApiResult<Response> {
    let b = &body.value;
    let session = state.keys.verify(&b.session, now_unix())?;
    let ip = parse_ip(&b.client_ip)?;
    check_conversation(&b.conversation)?;
    let input_bytes = match (&b.input_text, b.input_bytes) {
        (Some(t), None) => t.len() as u64,
        (None, Some(n)) => n,
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of input_text and input_bytes",
            ))
        }
    };
    let req = RunRequest {
        run_id: RunId(new_id("run")),
        session: session.id,
        ips: ip_scopes(&state, ip),
        conversation: b.conversation.clone(),
        input_bytes,
    };
    // Keys are the guest session's own: two sessions (or two backends) that happen to pick
    // the same key do not meet.
    let idem = idempotency(&headers, &format!("run:{}", req.session), &body.raw)?;
    // (a first answer under a key always changes the ledger: it is remembered)
    let keyed = idem.is_some();
    let applied = state.store.admit_run(req, idem).await?;
    let rate_left = applied.value.as_ref().ok().and_then(|a| a.rate_left);
    let changed = applied.changed;
    let dry_run = applied.value.as_ref().ok().and_then(|a| a.dry_run.clone());
    let seq = applied.seq;
    let out = applied.value.map(|a| RunAnswer {
        run_id: a.run_id.0,
        deadline: rfc3339(a.deadline),
        bounds: bounds_answer(&a.bounds),
        reserved_micros: a.reserved.0,
        ledger_seq: seq,
    });
    let mut resp = grant(
        &state.metrics,
        "run",
        out,
        StatusCode::CREATED,
        (applied.seq, keyed && !changed),
    );
    if resp.status() == StatusCode::CREATED {
        rate_limit_headers(&state, rate_left, resp.headers_mut());
        note_dry_run(&state, "run", dry_run.as_ref(), changed, resp.headers_mut());
    }
    Ok(resp)
}

fn bounds_answer(b: &RunBounds) -> RunBoundsAnswer {
    RunBoundsAnswer {
        max_input_bytes: b.max_input_bytes,
        max_context_tokens: b.max_context_tokens,
        max_output_tokens: b.max_output_tokens,
        max_tool_result_bytes: b.max_tool_result_bytes,
        max_model_rounds: b.max_model_rounds,
        max_tool_calls: b.max_tool_calls,
        max_retries: b.max_retries,
        max_seconds: b.max_seconds,
        max_cost_micros: b.max_cost.0,
    }
}

/// Extends the run's lease.
#[utoipa::path(post, path = "/v1/runs/{run_id}/heartbeat", tag = "runs",
    params(("run_id" = String, Path)),
    responses(
        (status = 200, description = "the lease, extended", body = HeartbeatAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "not_found", body = ErrorBody),
        (status = 409, description = "idempotency_conflict, reservation_closed, run_closed", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("service" = [])))]
pub async fn heartbeat(
    _auth: ServiceAuth,
    State(state): State<Shared>,
    RunIdPath(run_id): RunIdPath,
    _b: Body<Empty>,
) -> ApiResult<Response> {
    let applied = state.store.heartbeat(run_id).await?;
    let h = applied.value;
    let body = HeartbeatAnswer {
        lease_until: rfc3339(h.lease_until),
        deadline: rfc3339(h.deadline),
        ledger_seq: applied.seq,
    };
    Ok(ledger_answer(body, applied.seq))
}

/// Closes the run: its hold is released, what its steps used stays charged.
#[utoipa::path(post, path = "/v1/runs/{run_id}/finish", tag = "runs",
    params(("run_id" = String, Path)),
    responses(
        (status = 200, description = "the run, closed", body = FinishAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "not_found", body = ErrorBody),
        (status = 409, description = "idempotency_conflict, reservation_closed, run_closed", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("service" = [])))]
pub async fn finish(
    _auth: ServiceAuth,
    State(state): State<Shared>,
    RunIdPath(run_id): RunIdPath,
    _b: Body<Empty>,
) -> ApiResult<Response> {
    let applied = state.store.finish(run_id).await?;
    let f = applied.value;
    let body = FinishAnswer {
        state: spendgate_wire::error::run_state_name(f.state),
        charged_micros: f.charged.0,
        budgets_charged_micros: f.budgets_charged.0,
        steps: f.steps,
        repeated: f.repeated,
        ledger_seq: applied.seq,
    };
    Ok(ledger_answer(body, applied.seq))
}
