//! `POST /v1/chat/completions` (SPEC §6): the OpenAI Chat Completions shape, and the flow
//! every shape goes through ([`proxy`]; Anthropic's Messages brings its pieces from
//! [`crate::messages`]).
//!
//! A call goes [`parse`] → [`plan`] → [`admit`] → [`forward`] → [`relay`] → [`settle`]: who
//! calls and what it asks for; what it may cost (the prompt counted, the output bound); the
//! one-step run and the step reserved; the upstream's answer awaited; the answer passed on
//! (an error, a whole answer counted and cut, or a stream relayed as it arrives); the step
//! resolved from what was observed. A stream is settled at its end by its relay
//! ([`crate::sse`]), or by its guard if the client goes away.

use crate::answer::{read_answer_in, Dialect, WholeAnswer};
use crate::bounds::NO_WORK_STATUSES;
use crate::caller::{caller, Caller};
use crate::guard::{Hold, HostedHold, StepGuard};
use crate::prompt::prompt_texts;
use crate::responses::{self, HostedTool};
use crate::sse::{relay as relay_sse, SseTap};
use crate::upstream::{
    abandon, extra_only, fail, note_resolution, pass_headers, read_capped, redact,
    FORWARDED_HEADERS,
};
use crate::{embeddings, messages};
use axum::body::Body as AxumBody;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{json, Map, Value};
use spendgate_config::{ModelConfig, UpstreamApi, MOCK_UPSTREAM};
use spendgate_core::{
    Applied, Command, ModelPrice, RateLeft, Refusal, RefusalCode, Reply, ReservationId, Resolution,
    RunAdmitted, RunId, RunRequest, ScopeKind, StepKind, StepRequest, StepReserved,
};
use spendgate_http::body::Body;
use spendgate_http::ids::{check_id, new_id};
use spendgate_http::ratelimit::{note_dry_run, rate_limit_headers};
use spendgate_http::{AppState, Shared, Upstream};
use spendgate_store::StoreError;
use spendgate_tokens::{self as tokens, OutputTally};
use spendgate_wire::error::{ApiError, ApiResult, ErrorCode};
use spendgate_wire::plant;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: axum::extract::Request,
) -> ApiResult<Response> {
    proxy(state, peer, request, Shape::Chat).await
}

/// `POST /v1/embeddings`.
pub async fn embeddings(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: axum::extract::Request,
) -> ApiResult<Response> {
    proxy(state, peer, request, Shape::Embeddings).await
}

/// `POST /v1/responses`.
pub async fn responses_route(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: axum::extract::Request,
) -> ApiResult<Response> {
    proxy(state, peer, request, Shape::Responses).await
}

/// The API shape a call came in (its route).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/messages`
    Messages,
    /// `POST /v1/embeddings`
    Embeddings,
    /// `POST /v1/responses`
    Responses,
}

impl Shape {
    /// The upstream's path, after its base URL.
    fn path(self) -> &'static str {
        match self {
            Shape::Chat => "/chat/completions",
            Shape::Messages => "/messages",
            Shape::Embeddings => "/embeddings",
            Shape::Responses => "/responses",
        }
    }

    /// Whether an upstream of API `api` (`None`: the built-in mock, which speaks both) serves
    /// this shape.
    fn served_by(self, api: Option<UpstreamApi>) -> bool {
        matches!(
            (self, api),
            (_, None)
                | (
                    Shape::Chat | Shape::Embeddings | Shape::Responses,
                    Some(UpstreamApi::OpenAi)
                )
                | (Shape::Messages, Some(UpstreamApi::Anthropic))
        )
    }
}

/// One call of any shape: parse, plan, admit, forward, relay (and settle).
pub(crate) async fn proxy(
    state: Shared,
    peer: SocketAddr,
    request: axum::extract::Request,
    shape: Shape,
) -> ApiResult<Response> {
    let entered = Instant::now();
    let call = parse(&state, peer, request, shape).await?;
    let plan = plan(&state, &call).await?;
    let admitted = admit(&state, &call, &plan).await?;
    let prepared = prepare(&state, call, &plan, admitted);
    let answer = match forward(&state, prepared, entered).await {
        Ok(answer) => answer,
        Err(failed) => return Ok(failed),
    };
    Ok(relay(&state, answer).await)
}

/// A parsed call: who calls, its body, and the model and upstream it goes to.
struct Call {
    shape: Shape,
    who: Caller,
    headers: HeaderMap,
    body: Value,
    model_name: String,
    model: ModelConfig,
    upstream: Upstream,
}

/// Who is calling, from the headers alone (a caller without credentials is refused before
/// its body is read), then the body, its model and that model's upstream.
async fn parse(
    state: &Shared,
    peer: SocketAddr,
    request: axum::extract::Request,
    shape: Shape,
) -> ApiResult<Call> {
    let (mut parts, body) = request.into_parts();
    let mut headers = std::mem::take(&mut parts.headers);
    if shape == Shape::Messages {
        messages::check_headers(&mut headers)?;
    }
    let who = caller(state, peer, &headers)?;
    let request = axum::extract::Request::from_parts(parts, body);
    let body =
        <Body<Value> as axum::extract::FromRequest<Shared>>::from_request(request, state).await?;
    let body = body.value;
    if !body.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    }
    let model_name = body
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid("\"model\" is required"))?
        .to_string();
    let model = state
        .config
        .models
        .get(&model_name)
        .ok_or_else(|| {
            ApiError::model_not_allowed(format!("model {model_name:?} is not allowed here"))
        })?
        .clone();
    let upstream = state
        .upstreams
        .get(&model.upstream)
        .ok_or_else(|| {
            ApiError::model_not_allowed(format!("model {model_name:?} has no reachable upstream"))
        })?
        .clone();
    let api = state.config.upstreams.get(&model.upstream).map(|u| u.api);
    if !shape.served_by(api) {
        let route = match api {
            Some(UpstreamApi::Anthropic) => "/v1/messages",
            _ => "/v1/chat/completions",
        };
        return Err(ApiError::model_not_allowed(format!(
            "model {model_name:?} is served on {route}, not on this route"
        )));
    }
    Ok(Call {
        shape,
        who,
        headers,
        body,
        model_name,
        model,
        upstream,
    })
}

/// What a call is admitted for.
struct Plan {
    /// The prompt's tokens, counted (an upper bound of what the upstream bills).
    prompt: u64,
    /// The input the run's `max_input_bytes` bounds.
    input_bytes: u64,
    /// The smallest output bound the request carries, if any.
    requested: Option<u64>,
    stream: bool,
    /// The price the step is reserved and settled at.
    price: ModelPrice,
    /// How the answer is read.
    dialect: Dialect,
    /// The hosted tools offered (`/v1/responses`), each reserved with the call, and the
    /// calls one answer may make of them.
    hosted: Vec<HostedTool>,
    hosted_calls: Option<u64>,
}

/// The prompt checked against the run bounds and counted (refused before any store call when
/// it is over them), then the output options.
async fn plan(state: &AppState, call: &Call) -> ApiResult<Plan> {
    let bounds = state.config.policy.run;
    // `unseen`: the upstream adds input out of sight (`previous_response_id`, …), reserved
    // at the whole context bound.
    let mut unseen = false;
    let (texts, price, dialect) = match call.shape {
        Shape::Chat => (prompt_texts(&call.body)?, call.model.price, Dialect::Chat),
        Shape::Messages => {
            let (texts, caching) = messages::prompt_texts(&call.body)?;
            let m = &call.model;
            let price = messages::step_price(m.price, m.cache_write_per_million, caching);
            let pricing = messages::Pricing {
                step: price,
                input: m.price.input_per_million,
                cache_write: m.cache_write_per_million,
            };
            (texts, price, Dialect::Messages(pricing))
        }
        Shape::Embeddings => (
            embeddings::prompt_texts(&call.body)?,
            call.model.price,
            Dialect::Embeddings,
        ),
        Shape::Responses => {
            let (texts, refers) = responses::prompt_texts(&call.body)?;
            unseen = refers;
            (texts, call.model.price, Dialect::Responses)
        }
    };
    let (hosted, hosted_calls) = hosted_of(state, call)?;

    let largest_tool_result = texts.largest_tool_result;
    // The operator's backend composes the history; a guest (browser-direct) writes all of it,
    // every field the upstream bills as prompt (tools, response_format, unknown fields).
    let input_bytes = if call.who.guest {
        texts.bytes
    } else {
        texts.last_user_bytes
    };
    if largest_tool_result > bounds.max_tool_result_bytes {
        return Err(ApiError::from(&Refusal {
            code: RefusalCode::RunBoundExceeded,
            scope: Some(ScopeKind::Run),
            retry_after_s: None,
            message: format!(
                "a tool result of {largest_tool_result} bytes is over max_tool_result_bytes ({})",
                bounds.max_tool_result_bytes
            ),
        }));
    }
    let context_too_large = |what: String| {
        ApiError::from(&Refusal {
            code: RefusalCode::ContextTooLarge,
            scope: Some(ScopeKind::Run),
            retry_after_s: None,
            message: format!(
                "{what} is over the context limit of {} tokens",
                bounds.max_context_tokens
            ),
        })
    };
    // Refused before it is counted: more text than the context limit can hold.
    if tokens::over_countable(texts.bytes, bounds.max_context_tokens) {
        return Err(context_too_large(format!(
            "a prompt of {} bytes (more than {} bytes per token)",
            texts.bytes,
            tokens::BYTES_PER_TOKEN_MAX
        )));
    }
    let prompt = texts
        .overhead
        .saturating_add(tokens::count_all(call.model.tokenizer, texts.texts).await);
    // Refused before any store call: the prompt bound alone is over the context limit.
    if prompt > bounds.max_context_tokens {
        return Err(context_too_large(format!("prompt of {prompt} tokens")));
    }
    let prompt = if unseen {
        bounds.max_context_tokens
    } else {
        prompt
    };
    let (requested, stream) = match call.shape {
        Shape::Chat => output_options(&call.body)?,
        Shape::Messages => messages::output_options(&call.body)?,
        Shape::Embeddings => embeddings::output_options(&call.body)?,
        Shape::Responses => responses::output_options(&call.body)?,
    };
    Ok(Plan {
        prompt,
        input_bytes,
        requested,
        stream,
        price,
        dialect,
        hosted,
        hosted_calls,
    })
}

/// The hosted tools a call offers (`/v1/responses`), priced, and the calls one answer may
/// make of them.
fn hosted_of(state: &AppState, call: &Call) -> ApiResult<(Vec<HostedTool>, Option<u64>)> {
    if call.shape != Shape::Responses {
        return Ok((Vec::new(), None));
    }
    let hosted = responses::hosted_tools(&call.body, &state.config.tools)?;
    let run_max = u64::from(state.config.policy.run.max_tool_calls);
    let calls = responses::hosted_calls_bound(&call.body, &hosted, run_max)?;
    Ok((hosted, calls))
}

/// The request's output bound (the smallest of every alias it carries) and whether it
/// streams; `n` other than 1 is refused.
fn output_options(body: &Value) -> ApiResult<(Option<u64>, bool)> {
    let mut requested: Option<u64> = None;
    for k in ["max_tokens", "max_completion_tokens"] {
        match body.get(k) {
            None | Some(Value::Null) => {}
            Some(v) => {
                // 0 is refused: some upstreams (Ollama's) read it as "no limit".
                let n = v.as_u64().filter(|n| *n > 0).ok_or_else(|| {
                    ApiError::invalid(format!("\"{k}\" must be a positive integer"))
                })?;
                requested = Some(requested.map_or(n, |r| r.min(n)));
            }
        }
    }
    // Each choice is paid and one is reserved: any `n` but the integer 1 is refused, also
    // `2.0` or `"2"`, which an upstream may read as 2.
    match body.get("n") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "only n = 1 is supported (each choice is paid)",
            ))
        }
    }
    // A `stream` that is not a boolean would be forwarded as sent, and read here as `false`.
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("\"stream\" must be true or false")),
    };
    Ok((requested, stream))
}

/// What admission granted: the step reserved, in the caller's run or a one-step run opened
/// for the call.
struct Admitted {
    run_id: RunId,
    step_id: ReservationId,
    /// The run was opened for this call (and is finished with it).
    own_run: bool,
    reserved: StepReserved,
    /// The one-step run's admission: what a limit in dry-run would have refused, what it left
    /// of the tightest request rate, and the run's deadline (a step of the caller's run learns
    /// its run's at once).
    run: Option<RunAdmitted>,
    /// The hosted tools' steps, reserved with the call, in the order of [`Plan::hosted`].
    hosted: Vec<(ReservationId, StepReserved)>,
}

/// Reserves the step (and a step for each hosted tool offered, [`Plan::hosted`]): in the
/// caller's run (`Spendgate-Run`), else in a one-step run admitted with them, in one store
/// call. All or none: when any is refused (or the store fails), whatever was held is given
/// back (no paid work started) and the refusal answered.
async fn admit(state: &AppState, call: &Call, plan: &Plan) -> ApiResult<Admitted> {
    let step_id = ReservationId(new_id("stp"));
    let (run_id, own_run) = match &call.who.run {
        Some(r) => {
            check_id("run", r)?;
            (RunId(r.clone()), false)
        }
        None => (RunId(new_id("run")), true),
    };
    let step = StepRequest {
        run_id: run_id.clone(),
        step_id: step_id.clone(),
        kind: StepKind::Model {
            model: call.model_name.clone(),
            price: plan.price,
            prompt_tokens: plan.prompt,
            max_output_tokens: plan.requested,
            retry: call.who.retry,
        },
    };
    let hosted: Vec<StepRequest> = plan
        .hosted
        .iter()
        .map(|h| StepRequest {
            run_id: run_id.clone(),
            step_id: ReservationId(new_id("stp")),
            kind: StepKind::Tool {
                tool: h.tool.clone(),
                price: h.price(),
                units: plan.hosted_calls.unwrap_or(1),
            },
        })
        .collect();
    let mut held: Vec<ReservationId> = vec![step_id.clone()];
    held.extend(hosted.iter().map(|h| h.step_id.clone()));
    let run_request = own_run.then(|| RunRequest {
        run_id: run_id.clone(),
        session: call.who.session.clone(),
        ips: call.who.ips.clone(),
        conversation: call.who.conversation.clone(),
        input_bytes: plan.input_bytes,
    });
    let (run, mut answers) = reserve(state, run_request, step, hosted).await;
    let own = own_run.then_some(&run_id);
    let run = match run {
        None => None,
        Some(Ok(Ok(a))) => Some(a),
        Some(Ok(Err(r))) => {
            state.metrics.refused("proxy_run", r.code.name(), r.scope);
            return Err(ApiError::from(&r));
        }
        Some(Err(e)) => {
            // The run's fate is unknown; anything held for it held nothing paid.
            abandon(state, &held, own).await;
            return Err(e.into());
        }
    };
    let mut granted = Vec::with_capacity(answers.len());
    for answer in answers.drain(..) {
        match answer.map(|a| a.value) {
            Ok(Ok(r)) => granted.push(r),
            Ok(Err(r)) => {
                abandon(state, &held, own).await;
                state.metrics.refused("proxy_step", r.code.name(), r.scope);
                return Err(ApiError::from(&r));
            }
            Err(e) => {
                abandon(state, &held, own).await;
                return Err(e.into());
            }
        }
    }
    let mut granted = granted.into_iter();
    let Some(reserved) = granted.next() else {
        abandon(state, &held, own).await;
        return Err(StoreError::Unavailable("no answer".into()).into());
    };
    state.metrics.admitted("proxy_step");
    Ok(Admitted {
        run_id,
        step_id,
        own_run,
        reserved,
        run,
        hosted: held.into_iter().skip(1).zip(granted).collect(),
    })
}

/// The store's answer to reserving a step.
type Reserved = Result<Applied<Result<StepReserved, Refusal>>, StoreError>;
/// The store's answer to admitting a run.
type RunAnswer = Result<Result<RunAdmitted, Refusal>, StoreError>;

/// Admits a one-step run for the call (`run`, when the call is not a step of the caller's
/// run) and reserves its step and the hosted tools' steps, in one store call (a
/// group-committing store, sqlite, makes them durable in one write). The run's admission,
/// and each step's answer, the call's first.
async fn reserve(
    state: &AppState,
    run: Option<RunRequest>,
    step: StepRequest,
    hosted: Vec<StepRequest>,
) -> (Option<RunAnswer>, Vec<Reserved>) {
    if run.is_none() && hosted.is_empty() {
        return (None, vec![state.store.reserve_step(step, None).await]);
    }
    let with_run = run.is_some();
    let mut cmds = Vec::with_capacity(hosted.len() + 2);
    if let Some(req) = run {
        cmds.push(Command::AdmitRun { req, idem: None });
    }
    cmds.push(Command::ReserveStep {
        req: step,
        idem: None,
    });
    for req in hosted {
        cmds.push(Command::ReserveStep { req, idem: None });
    }
    let mut answers = state.store.execute_many(cmds).await.into_iter();
    let run = with_run.then(|| match answers.next() {
        Some(Ok(Reply::Run(a))) => Ok(a.value),
        other => Err(unexpected(other)),
    });
    let steps = answers
        .map(|a| match a {
            Ok(Reply::Step(a)) => Ok(a),
            other => Err(unexpected(Some(other))),
        })
        .collect();
    (run, steps)
}

/// A batched store call's answer that is not the one its command gets.
fn unexpected(answer: Option<Result<Reply, StoreError>>) -> StoreError {
    match answer {
        Some(Ok(other)) => StoreError::Unavailable(format!("unexpected answer {other:?}")),
        Some(Err(e)) => e,
        None => StoreError::Unavailable("no answer".into()),
    }
}

/// A call ready to forward: the step's guard, the body the upstream gets and the headers
/// every answer to the client carries.
struct Prepared {
    call: Call,
    guard: StepGuard,
    run_id: RunId,
    /// The output bound forwarded (the one reserved).
    out: u64,
    stream: bool,
    /// The client asked for the usage chunk of a stream itself.
    client_wants_usage: bool,
    /// `spendgate-*` headers of the step, the rate limit and the dry run.
    extra: HeaderMap,
    dialect: Dialect,
}

/// The step's guard, the forwarded body (exactly one output bound, usage asked for in
/// streams) and the step's headers.
fn prepare(state: &Shared, mut call: Call, plan: &Plan, admitted: Admitted) -> Prepared {
    let out = admitted
        .reserved
        .max_output_tokens
        .unwrap_or(state.config.policy.run.max_output_tokens);
    let guard = StepGuard::new(
        state.clone(),
        Hold {
            step: admitted.step_id.clone(),
            price: plan.price,
            reserved: admitted.reserved.reserved,
            prompt_bound: plan.prompt,
            bound: out,
            hosted: admitted
                .hosted
                .iter()
                .zip(&plan.hosted)
                .map(|((step, _), h)| HostedHold {
                    step: step.clone(),
                    call_type: h.call_type.clone(),
                    calls: plan.hosted_calls.unwrap_or(1),
                })
                .collect(),
        },
        admitted.run_id.clone(),
        admitted.own_run,
        admitted.run.as_ref().map(|a| a.deadline),
    );
    let client_wants_usage = match (call.body.as_object_mut(), call.shape) {
        (Some(o), Shape::Chat) => upstream_body(o, &call.model, out, plan),
        (Some(o), Shape::Messages) => {
            messages::upstream_body(o, &call.model, plant::forwarded_bound(out, plan.requested));
            false
        }
        (Some(o), Shape::Embeddings) => {
            embeddings::upstream_body(o, call.model.upstream_model.as_ref());
            false
        }
        (Some(o), Shape::Responses) => {
            let bound = plant::forwarded_bound(out, plan.requested);
            let model = call.model.upstream_model.as_ref();
            responses::upstream_body(o, model, bound, plan.hosted_calls);
            false
        }
        (None, _) => false,
    };
    let extra = step_headers(state, &admitted, out);
    Prepared {
        call,
        guard,
        run_id: admitted.run_id,
        out,
        stream: plan.stream,
        client_wants_usage,
        extra,
        dialect: plan.dialect,
    }
}

/// Rewrites the body for the upstream: the output bound in the field the model's upstream
/// honours, never the client's choice (an upstream that ignores the other alias would
/// generate past the bound reserved), the upstream's model name, and usage asked for in a
/// stream. Whether the client asked for a stream's usage itself.
fn upstream_body(o: &mut Map<String, Value>, model: &ModelConfig, out: u64, plan: &Plan) -> bool {
    o.remove("max_tokens");
    o.remove("max_completion_tokens");
    let out = plant::forwarded_bound(out, plan.requested);
    o.insert(model.output_bound_field.name().to_string(), json!(out));
    if let Some(name) = &model.upstream_model {
        o.insert("model".into(), json!(name));
    }
    let mut client_wants_usage = false;
    if plan.stream {
        let so = o.entry("stream_options").or_insert_with(|| json!({}));
        if let Some(so) = so.as_object_mut() {
            client_wants_usage = so
                .get("include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            so.insert("include_usage".into(), json!(true));
        } else {
            *so = json!({"include_usage": true});
        }
    }
    client_wants_usage
}

/// The step's headers: its run, id, reservation and output bound, a shrunk bound, the rate
/// limit of a one-step run (an admission, SPEC §6) and a dry-run refusal.
fn step_headers(state: &AppState, admitted: &Admitted, out: u64) -> HeaderMap {
    let mut extra = HeaderMap::new();
    let reserved = &admitted.reserved;
    // The hosted tools' holds are the call's too.
    let held = admitted
        .hosted
        .iter()
        .fold(reserved.reserved, |sum, (_, r)| sum.add_capped(r.reserved));
    for (name, value) in [
        ("spendgate-run", admitted.run_id.0.clone()),
        ("spendgate-step", admitted.step_id.0.clone()),
        ("spendgate-reserved-micros", held.0.to_string()),
        ("spendgate-max-output-tokens", out.to_string()),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            extra.insert(name, v);
        }
    }
    if reserved.shrunk {
        extra.insert("spendgate-output-shrunk", HeaderValue::from_static("true"));
    }
    let rate_left: Option<Option<RateLeft>> = admitted.run.as_ref().map(|a| a.rate_left);
    if let Some(left) = rate_left {
        rate_limit_headers(state, left, &mut extra);
    }
    // A run's refusal first (it is checked first), else the step's.
    let run_dry_run = admitted.run.as_ref().and_then(|a| a.dry_run.as_ref());
    let dry_run = run_dry_run.or(reserved.dry_run.as_ref());
    note_dry_run(state, "proxy_step", dry_run, true, &mut extra);
    extra
}

/// The upstream's answer, its head read.
struct Sent {
    call: Call,
    guard: StepGuard,
    resp: reqwest::Response,
    out: u64,
    stream: bool,
    client_wants_usage: bool,
    extra: HeaderMap,
    dialect: Dialect,
    /// When the call was forwarded; the time spent before it.
    started: Instant,
    before_forwarding: Duration,
    /// The one deadline of the answer's head (and, when not streaming, its whole body).
    deadline: tokio::time::Instant,
}

/// Sends the call upstream and waits for the answer's head until the upstream's timeout or
/// the run's deadline. A call that failed on the way is resolved and answered here
/// (`Err`): released when the request never left, charged in full otherwise. Every way the
/// call ends is timed in `upstream_call`, failures too: their time is what an operator
/// watches in a brownout.
async fn forward(state: &AppState, p: Prepared, entered: Instant) -> Result<Sent, Response> {
    let (mut call, guard, extra) = (p.call, p.guard, p.extra);
    let url = format!(
        "{}{}",
        call.upstream.base_url.trim_end_matches('/'),
        call.shape.path()
    );
    let mut builder = state.http.post(&url).json(&call.body);
    // (serialized: not held while the answer is relayed)
    call.body = Value::Null;
    let upstream = &call.upstream;
    builder = match call.shape {
        Shape::Chat | Shape::Embeddings | Shape::Responses if !upstream.api_key.is_empty() => {
            builder.bearer_auth(&upstream.api_key)
        }
        Shape::Chat | Shape::Embeddings | Shape::Responses => builder,
        Shape::Messages => messages::upstream_headers(builder, &upstream.api_key, &call.headers),
    };
    // The mock's controls: from the operator's backend, or to the built-in mock (the demo);
    // a guest does not choose how an upstream behaves (a hang, a slow pace, cached tokens).
    if !call.who.guest || call.model.upstream == MOCK_UPSTREAM {
        for h in FORWARDED_HEADERS {
            if let Some(v) = call.headers.get(*h) {
                builder = builder.header(*h, v.clone());
            }
        }
    }
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + upstream.timeout;
    let head = tokio::select! {
        head = tokio::time::timeout_at(deadline, builder.send()) => head,
        _ = guard.stopped() => {
            tracing::warn!(run = %p.run_id.0, "the run's deadline passed before the upstream answered; charging the step in full");
            state.metrics.upstream_call(started.elapsed());
            return Err(fail(
                guard,
                Resolution::Unknown,
                extra,
                ErrorCode::RunDeadlineExceeded,
                "the run's deadline passed before the upstream answered; the call was charged in full",
            )
            .await);
        }
    };
    let resp = match head {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            state.metrics.upstream_call(started.elapsed());
            return Err(send_failed(&call, guard, extra, &e).await);
        }
        Err(_) => {
            tracing::warn!(upstream = %call.model.upstream, timeout_s = upstream.timeout.as_secs(), "upstream timed out; charging the step in full");
            state.metrics.upstream_call(started.elapsed());
            return Err(fail(
                guard,
                Resolution::Unknown,
                extra,
                ErrorCode::UpstreamTimeout,
                "the upstream did not answer in time; the call was charged in full",
            )
            .await);
        }
    };
    Ok(Sent {
        call,
        guard,
        resp,
        out: p.out,
        stream: p.stream,
        client_wants_usage: p.client_wants_usage,
        extra,
        dialect: p.dialect,
        started,
        before_forwarding: started.duration_since(entered),
        deadline,
    })
}

/// The answer to a call whose request failed before an answer: released when it never left
/// (no connection, or no request could be built from the upstream's URL: no paid work
/// started), else charged in full.
async fn send_failed(
    call: &Call,
    guard: StepGuard,
    extra: HeaderMap,
    e: &reqwest::Error,
) -> Response {
    if e.is_connect() || e.is_builder() {
        tracing::warn!(error = %e, upstream = %call.model.upstream, "upstream unreachable; releasing the step");
        fail(
            guard,
            Resolution::Release,
            extra,
            ErrorCode::UpstreamUnreachable,
            "the upstream could not be reached; nothing was charged",
        )
        .await
    } else {
        tracing::warn!(error = %e, upstream = %call.model.upstream, "upstream request failed; charging the step in full");
        fail(
            guard,
            Resolution::Unknown,
            extra,
            ErrorCode::UpstreamError,
            "the upstream connection failed before an answer; the call was charged in full",
        )
        .await
    }
}

/// Passes the upstream's answer on: an error answer, a whole answer (counted, cut to the
/// output bound, then settled), or a stream (relayed as it arrives, settled at its end).
async fn relay(state: &AppState, mut sent: Sent) -> Response {
    let status =
        StatusCode::from_u16(sent.resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut headers = HeaderMap::new();
    pass_headers(sent.resp.headers(), &mut headers);
    headers.extend(std::mem::take(&mut sent.extra));
    if !status.is_success() {
        return relay_error(state, sent, status, headers).await;
    }
    if !sent.stream {
        return relay_whole(state, sent, status, headers).await;
    }
    state.metrics.proxy_overhead(sent.before_forwarding);
    // Streaming: pass every chunk through as it arrives; watch for the usage chunk, and
    // count the output.
    let hosted_types = sent.guard.hosted.iter().map(|h| h.call_type.clone());
    let tap = SseTap::new(
        !sent.client_wants_usage,
        sent.call.model.tokenizer,
        sent.out,
    )
    .in_dialect(sent.dialect)
    .with_hosted(hosted_types.collect());
    let body_stream = relay_sse(
        sent.resp.bytes_stream(),
        sent.guard,
        sent.call.upstream.timeout,
        tap,
        sent.started,
    );
    let mut r = Response::new(AxumBody::from_stream(body_stream));
    *r.status_mut() = status;
    r.headers_mut().extend(headers);
    r
}

/// An error answer of the upstream: by default no paid work started. Released when its
/// status says so and the upstream is configured `release_on_error`, else charged in full;
/// passed on, except where it is the operator's problem.
async fn relay_error(
    state: &AppState,
    sent: Sent,
    status: StatusCode,
    headers: HeaderMap,
) -> Response {
    let Sent {
        call, guard, resp, ..
    } = sent;
    let bytes = read_capped(resp, sent.deadline, guard.stopped()).await;
    state.metrics.upstream_call(sent.started.elapsed());
    // A redirect is not followed (the client has none of our credentials for where it
    // points, and a 307 would send the paid request again): it did no work either.
    let how = if call.upstream.release_on_error
        && bytes.is_some()
        && (NO_WORK_STATUSES.contains(&status.as_u16()) || status.is_redirection())
    {
        Resolution::Release
    } else {
        Resolution::Unknown
    };
    let upstream = &call.model.upstream;
    // A redirect, or the upstream refusing our key: an operator problem, not the client's.
    let operator_problem = if status.is_redirection() {
        tracing::error!(%upstream, %status, "the upstream answered a redirect, which is not followed; check upstreams.{upstream}.base_url");
        Some("the upstream answered a redirect, which spendgate does not follow; tell the operator")
    } else if matches!(status.as_u16(), 401 | 403) {
        tracing::error!(%upstream, %status, "the upstream refused spendgate's credentials; check upstreams.{upstream}.api_key");
        Some("the upstream refused spendgate's credentials for it; tell the operator")
    } else {
        None
    };
    if let Some(message) = operator_problem {
        let headers = extra_only(headers);
        return fail(guard, how, headers, ErrorCode::UpstreamError, message).await;
    }
    let body = redact(bytes.unwrap_or_default(), &call.upstream.api_key);
    settle(guard, how, status, body, headers).await
}

/// A whole answer: read by the deadline, its output counted and cut to the bound forwarded,
/// then settled from its usage (never below the output counted).
async fn relay_whole(
    state: &AppState,
    sent: Sent,
    status: StatusCode,
    mut headers: HeaderMap,
) -> Response {
    let Sent {
        call,
        mut guard,
        resp,
        ..
    } = sent;
    let upstream = &call.model.upstream;
    let Some(bytes) = read_capped(resp, sent.deadline, guard.stopped()).await else {
        state.metrics.upstream_call(sent.started.elapsed());
        return fail(
            guard,
            Resolution::Unknown,
            headers,
            ErrorCode::UpstreamError,
            "the upstream answer was cut off or too slow; the call was charged in full",
        )
        .await;
    };
    let upstream_done = Instant::now();
    state
        .metrics
        .upstream_call(upstream_done.duration_since(sent.started));
    let types: Vec<String> = guard.hosted.iter().map(|h| h.call_type.clone()).collect();
    let answer = read_whole(sent.dialect, call.model.tokenizer, sent.out, bytes, types).await;
    guard.hosted_seen = answer.hosted.clone();
    if answer.usage.is_none() {
        tracing::warn!(%upstream, "upstream answer without usage; charging the step in full (or for the output counted, when more)");
    }
    let how = guard.settlement(answer.usage, answer.usage, answer.output);
    if answer.unreadable {
        tracing::warn!(%upstream, bound = sent.out, "an upstream answer that is not JSON, over the output bound; not passed on");
        state.metrics.output_cut();
        return fail(
            guard,
            how,
            headers,
            ErrorCode::UpstreamError,
            "the upstream's answer could not be read and is longer than the output bound it was given; it was charged for what was sent",
        )
        .await;
    }
    if answer.cut {
        tracing::warn!(%upstream, bound = sent.out, counted = answer.output.floor, "an upstream answered past the output bound it was given; the answer was cut to the bound");
        state.metrics.output_cut();
        headers.insert("spendgate-output-cut", HeaderValue::from_static("true"));
    }
    let resp = settle(guard, how, status, answer.body, headers).await;
    state
        .metrics
        .proxy_overhead(sent.before_forwarding + upstream_done.elapsed());
    resp
}

/// A whole answer read and counted on the blocking pool when it is large
/// ([`tokens::counting`]); a count that could not run reads as an answer that could not be
/// read (a token a byte).
async fn read_whole(
    dialect: Dialect,
    tokenizer: tokens::Tokenizer,
    out: u64,
    bytes: Bytes,
    hosted_types: Vec<String>,
) -> WholeAnswer {
    let len = bytes.len();
    tokens::counting(len, move || {
        read_answer_in(dialect, tokenizer, out, bytes, &hosted_types)
    })
    .await
    .unwrap_or(WholeAnswer {
        body: Bytes::new(),
        usage: None,
        output: OutputTally {
            floor: len as u64,
            upper: len as u64,
        },
        cut: false,
        unreadable: true,
        hosted: responses::HostedSeen::default(),
    })
}

/// Resolves the step `how` and answers `body` with `status` and the step's headers (what it
/// was charged, and how it ended).
async fn settle(
    guard: StepGuard,
    how: Resolution,
    status: StatusCode,
    body: Bytes,
    mut headers: HeaderMap,
) -> Response {
    if let Some(a) = guard.resolve(how).await {
        note_resolution(&a, &mut headers);
    }
    let mut r = (status, body).into_response();
    r.headers_mut().extend(headers);
    r
}
