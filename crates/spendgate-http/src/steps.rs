//! Steps: `POST /v1/runs/{run_id}/steps`, commit, release and unknown (SPEC §6).

use crate::answer::{grant, ledger_answer};
use crate::auth::ServiceAuth;
use crate::body::{Body, Empty};
use crate::idempotency::idempotency;
use crate::ids::new_id;
use crate::path::{RunIdPath, StepIdPath};
use crate::ratelimit::note_dry_run;
use crate::state::{AppState, Shared};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use spendgate_config::Config;
use spendgate_core::{
    Applied, Micros, ReservationId, Resolution, Resolved, Settlement, StepKind, StepRequest,
    TokenUsage,
};
use spendgate_wire::answers::{ErrorBody, ResolvedAnswer, StepAnswer};
use spendgate_wire::error::{ApiError, ApiResult};

// Its variants deny unknown fields as the enum does: the document says so through
// `openapi::CLOSED_TAGGED_BODIES` (utoipa cannot derive it for an enum's variants).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum StepBody {
    Model {
        model: String,
        prompt_tokens: Option<u64>,
        prompt_text: Option<String>,
        // 0 is refused (`step_kind`).
        #[schema(minimum = 1)]
        max_output_tokens: Option<u64>,
        #[serde(default)]
        retry: bool,
    },
    Tool {
        tool: String,
        units: Option<u64>,
    },
}

/// Builds the core step from a request, with the configured price: no price, no call. A
/// long `prompt_text` is counted on the blocking pool (`tokens::count_all`), never on the
/// worker that serves other requests.
pub async fn step_kind(config: &Config, body: &StepBody) -> ApiResult<StepKind> {
    match body {
        StepBody::Model {
            model,
            prompt_tokens,
            prompt_text,
            max_output_tokens,
            retry,
        } => {
            let m = config.models.get(model).ok_or_else(|| {
                ApiError::model_not_allowed(format!("model {model:?} is not configured"))
            })?;
            // 0 is refused: some upstreams (Ollama's) read an output bound of 0 as no limit.
            if *max_output_tokens == Some(0) {
                return Err(ApiError::invalid("max_output_tokens must be at least 1"));
            }
            let prompt_tokens = match (prompt_tokens, prompt_text) {
                (Some(n), None) => *n,
                (None, Some(t)) => {
                    let overhead =
                        spendgate_tokens::TOKENS_PER_MESSAGE + spendgate_tokens::TOKENS_PER_REQUEST;
                    // More text than the context bound can hold is not counted: the ledger
                    // refuses it as over the bound (`context_too_large`) all the same.
                    let max = config.policy.run.max_context_tokens;
                    if spendgate_tokens::over_countable(t.len() as u64, max) {
                        (t.len() as u64).saturating_add(overhead)
                    } else {
                        spendgate_tokens::count_all(m.tokenizer, vec![t.clone()])
                            .await
                            .saturating_add(overhead)
                    }
                }
                _ => {
                    return Err(ApiError::invalid(
                        "give exactly one of prompt_tokens and prompt_text",
                    ))
                }
            };
            Ok(StepKind::Model {
                model: model.clone(),
                price: m.price,
                prompt_tokens,
                max_output_tokens: *max_output_tokens,
                retry: *retry,
            })
        }
        StepBody::Tool { tool, units } => {
            let price = config.tools.get(tool).ok_or_else(|| {
                ApiError::model_not_allowed(format!("tool {tool:?} has no configured price"))
            })?;
            if *units == Some(0) && price.per_unit > Micros::ZERO {
                // It would hold nothing (admitted even on a spent budget), and its commit
                // would then be an overrun.
                return Err(ApiError::invalid(format!(
                    "units must be at least 1 for tool {tool:?}, which is priced per unit"
                )));
            }
            Ok(StepKind::Tool {
                tool: tool.clone(),
                price: *price,
                units: units.unwrap_or(1),
            })
        }
    }
}

/// A step of a run: a model call or a paid tool, reserved before it is made.
#[utoipa::path(post, path = "/v1/runs/{run_id}/steps", tag = "steps",
    request_body = StepBody,
    params(("run_id" = String, Path),
        ("Idempotency-Key" = Option<String>, Header, description = "a repeat returns the first answer")),
    responses(
        (status = 201, description = "the step, reserved", body = StepAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "not_found", body = ErrorBody),
        (status = 409, description = "idempotency_conflict, reservation_closed, run_closed", body = ErrorBody),
        (status = 413, description = "payload_too_large", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 429, description = "a rate, concurrency or budget limit (Retry-After)", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("service" = [])))]
pub async fn create_step(
    _auth: ServiceAuth,
    State(state): State<Shared>,
    RunIdPath(run_id): RunIdPath,
    headers: HeaderMap,
    body: Body<StepBody>,
) -> ApiResult<Response> {
    let kind = step_kind(&state.config, &body.value).await?;
    let idem = idempotency(&headers, &format!("step:{}", run_id.0), &body.raw)?;
    let req = StepRequest {
        run_id,
        step_id: ReservationId(new_id("stp")),
        kind,
    };
    let keyed = idem.is_some();
    let applied = state.store.reserve_step(req, idem).await?;
    let shrunk = matches!(&applied.value, Ok(s) if s.shrunk);
    let changed = applied.changed;
    let dry_run = applied.value.as_ref().ok().and_then(|s| s.dry_run.clone());
    let seq = applied.seq;
    let out = applied.value.map(|s| StepAnswer {
        step_id: s.step_id.0,
        reserved_micros: s.reserved.0,
        max_output_tokens: s.max_output_tokens,
        output_shrunk: s.shrunk,
        ledger_seq: seq,
    });
    let mut resp = grant(
        &state.metrics,
        "step",
        out,
        StatusCode::CREATED,
        (applied.seq, keyed && !changed),
    );
    if shrunk {
        resp.headers_mut()
            .insert("spendgate-output-shrunk", HeaderValue::from_static("true"));
    }
    if resp.status() == StatusCode::CREATED {
        note_dry_run(
            &state,
            "step",
            dry_run.as_ref(),
            changed,
            resp.headers_mut(),
        );
    }
    Ok(resp)
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UsageBody {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommitBody {
    pub usage: Option<UsageBody>,
    pub units: Option<u64>,
    pub result_bytes: Option<u64>,
}

fn resolved_response(state: &AppState, step: &str, applied: Applied<Resolved>) -> Response {
    let r = applied.value;
    if r.overrun && !r.repeated {
        state.metrics.overrun();
        state.alerts.overrun(step, r.reserved.0, r.charged.0);
        tracing::warn!(
            charged = r.charged.0,
            reserved = r.reserved.0,
            "overrun: observed usage above the reservation, charged in full"
        );
    }
    let body = ResolvedAnswer {
        state: r.state.name(),
        charged_micros: r.charged.0,
        reserved_micros: r.reserved.0,
        overrun: r.overrun,
        repeated: r.repeated,
        result_too_large: r.result_too_large.then_some(true),
        message: r.result_too_large.then_some(
            "tool result is over max_tool_result_bytes: charged, but it must not be fed back to the model",
        ),
        ledger_seq: applied.seq,
    };
    ledger_answer(body, applied.seq)
}

/// Settles a step from what it used: token usage, units, or a tool result's size.
///
/// A commit that reaches a step already `unknown` or `expired` (its holder could not reach the store in
/// time) with usage that costs more than it was charged is a late overrun: the difference is
/// charged, the state stays, and the answer says so (`overrun: true`). Any other commit of a
/// settled step is refused `reservation_closed`.
#[utoipa::path(post, path = "/v1/steps/{step_id}/commit", tag = "steps",
    request_body = CommitBody,
    params(("step_id" = String, Path)),
    responses(
        (status = 200, description = "the step, charged (committed; or a late overrun of an unknown or expired step, its state kept)", body = ResolvedAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "not_found", body = ErrorBody),
        (status = 409, description = "idempotency_conflict, reservation_closed, run_closed", body = ErrorBody),
        (status = 413, description = "payload_too_large", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("service" = [])))]
pub async fn commit_step(
    _auth: ServiceAuth,
    State(state): State<Shared>,
    StepIdPath(step_id): StepIdPath,
    body: Body<CommitBody>,
) -> ApiResult<Response> {
    let b = &body.value;
    let settlement = match (&b.usage, b.units, b.result_bytes) {
        (Some(u), None, None) => Settlement::Tokens(TokenUsage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens,
        }),
        (None, Some(n), None) => Settlement::Units(n),
        (None, None, Some(n)) => Settlement::ResultBytes(n),
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of usage, units and result_bytes",
            ))
        }
    };
    resolve(&state, step_id, Resolution::Commit(settlement)).await
}

async fn resolve(state: &AppState, step_id: ReservationId, how: Resolution) -> ApiResult<Response> {
    let applied = state.store.resolve(step_id.clone(), how).await?;
    Ok(resolved_response(state, &step_id.0, applied))
}

/// Releases a step that was not made: nothing is charged.
#[utoipa::path(post, path = "/v1/steps/{step_id}/release", tag = "steps",
    params(("step_id" = String, Path)),
    responses(
        (status = 200, description = "the step, released", body = ResolvedAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "not_found", body = ErrorBody),
        (status = 409, description = "idempotency_conflict, reservation_closed, run_closed", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("service" = [])))]
pub async fn release_step(
    _auth: ServiceAuth,
    State(state): State<Shared>,
    StepIdPath(step_id): StepIdPath,
    _b: Body<Empty>,
) -> ApiResult<Response> {
    resolve(&state, step_id, Resolution::Release).await
}

/// A step whose outcome is unknown: charged in full.
#[utoipa::path(post, path = "/v1/steps/{step_id}/unknown", tag = "steps",
    params(("step_id" = String, Path)),
    responses(
        (status = 200, description = "the step, charged in full", body = ResolvedAnswer),
        (status = 400, description = "invalid_request and the other refusals of the request as sent", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "not_found", body = ErrorBody),
        (status = 409, description = "idempotency_conflict, reservation_closed, run_closed", body = ErrorBody),
        (status = 415, description = "the route takes JSON", body = ErrorBody),
        (status = 503, description = "store_unavailable or cutoff_engaged", body = ErrorBody),
    ),
    security(("service" = [])))]
pub async fn unknown_step(
    _auth: ServiceAuth,
    State(state): State<Shared>,
    StepIdPath(step_id): StepIdPath,
    _b: Body<Empty>,
) -> ApiResult<Response> {
    resolve(&state, step_id, Resolution::Unknown).await
}
