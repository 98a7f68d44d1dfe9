//! `POST /v1/chat/completions` (SPEC §6): the OpenAI Chat Completions shape.

use crate::answer::{read_answer, WholeAnswer};
use crate::bounds::NO_WORK_STATUSES;
use crate::caller::caller;
use crate::guard::{Hold, StepGuard};
use crate::prompt::prompt_texts;
use crate::sse::{relay, SseTap};
use crate::upstream::{
    abandon, extra_only, fail, note_resolution, pass_headers, read_capped, redact,
    FORWARDED_HEADERS,
};
use axum::body::Body as AxumBody;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{json, Value};
use spendgate_config::MOCK_UPSTREAM;
use spendgate_core::{
    Command, Refusal, RefusalCode, Reply, ReservationId, Resolution, RunId, RunRequest, ScopeKind,
    StepKind, StepRequest,
};
use spendgate_http::body::Body;
use spendgate_http::error::{ApiError, ApiResult};
use spendgate_http::ids::{check_id_path, new_id};
use spendgate_http::plant;
use spendgate_http::ratelimit::{note_dry_run, rate_limit_headers};
use spendgate_http::Shared;
use spendgate_store::StoreError;
use spendgate_tokens::{self as tokens, OutputTally};
use std::net::SocketAddr;
use std::time::Instant;

#[allow(clippy::too_many_lines)] // (split into its steps next)
pub async fn chat_completions(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: axum::extract::Request,
) -> ApiResult<Response> {
    let entered = Instant::now();
    // Who is calling, from the headers alone: a caller without credentials is refused before
    // its body is read.
    let (mut parts, body) = request.into_parts();
    let headers = std::mem::take(&mut parts.headers);
    let who = caller(&state, peer, &headers)?;
    let request = axum::extract::Request::from_parts(parts, body);
    let body =
        <Body<Value> as axum::extract::FromRequest<Shared>>::from_request(request, &state).await?;
    let mut req = body.value;
    if !req.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    }
    let model_name = req
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
    let bounds = state.config.policy.run;
    let texts = prompt_texts(&req)?;
    let largest_tool_result = texts.largest_tool_result;
    // The operator's backend composes the history; a guest (browser-direct) writes all of it,
    // every field the upstream bills as prompt (tools, response_format, unknown fields).
    let input_bytes = if who.guest {
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
        .saturating_add(tokens::count_all(model.tokenizer, texts.texts).await);
    // Refused before any store call: the prompt bound alone is over the context limit.
    if prompt > bounds.max_context_tokens {
        return Err(context_too_large(format!("prompt of {prompt} tokens")));
    }
    // The effective output bound: the smallest of every alias the request carries and ours.
    let mut requested: Option<u64> = None;
    for k in ["max_tokens", "max_completion_tokens"] {
        match req.get(k) {
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
    match req.get("n") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "only n = 1 is supported (each choice is paid)",
            ))
        }
    }
    // A `stream` that is not a boolean would be forwarded as sent, and read here as `false`.
    let stream = match req.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("\"stream\" must be true or false")),
    };

    // Open a one-step run unless the call is a step of an existing run.
    let step_id = ReservationId(new_id("stp"));
    let step_of = |run_id: &RunId| StepRequest {
        run_id: run_id.clone(),
        step_id: step_id.clone(),
        kind: StepKind::Model {
            model: model_name.clone(),
            price: model.price,
            prompt_tokens: prompt,
            max_output_tokens: requested,
            retry: who.retry,
        },
    };
    // What a limit in dry-run would have refused at the one-step run's admission.
    let mut run_dry_run: Option<Refusal> = None;
    // What the one-step run's admission left of the tightest request rate.
    let mut run_rate_left = None;
    // The one-step run's deadline (a step of the caller's run learns its run's at once).
    let mut run_deadline = None;
    let (run_id, own_run, reserved) = match &who.run {
        Some(r) => {
            check_id_path("run", r)?;
            let run_id = RunId(r.clone());
            let reserved = state.store.reserve_step(step_of(&run_id), None).await;
            (run_id, false, reserved)
        }
        None => {
            let run_id = RunId(new_id("run"));
            let run = RunRequest {
                run_id: run_id.clone(),
                session: who.session.clone(),
                ips: who.ips.clone(),
                conversation: who.conversation.clone(),
                input_bytes,
            };
            // Admission and reservation in one call: a group-committing store (sqlite) makes
            // both durable in one write.
            let store_started = Instant::now();
            let mut answers = state
                .store
                .execute_many(vec![
                    Command::AdmitRun {
                        req: run,
                        idem: None,
                    },
                    Command::ReserveStep {
                        req: step_of(&run_id),
                        idem: None,
                    },
                ])
                .await
                .into_iter();
            state.metrics.store_call(store_started.elapsed());
            let admitted = match answers.next() {
                Some(Ok(Reply::Run(a))) => Ok(a),
                Some(Ok(other)) => Err(StoreError::Unavailable(format!(
                    "unexpected answer {other:?}"
                ))),
                Some(Err(e)) => Err(e),
                None => Err(StoreError::Unavailable("no answer".into())),
            };
            let reserved = match answers.next() {
                Some(Ok(Reply::Step(a))) => Ok(a),
                Some(Ok(other)) => Err(StoreError::Unavailable(format!(
                    "unexpected answer {other:?}"
                ))),
                Some(Err(e)) => Err(e),
                None => Err(StoreError::Unavailable("no answer".into())),
            };
            match admitted.map(|a| a.value) {
                Ok(Ok(a)) => {
                    run_dry_run = a.dry_run;
                    run_rate_left = Some(a.rate_left);
                    run_deadline = Some(a.deadline);
                }
                Ok(Err(r)) => {
                    state.metrics.refused("proxy_run", r.code.name(), r.scope);
                    return Err(ApiError::from(&r));
                }
                Err(e) => {
                    // The run's fate is unknown; anything held for it held nothing paid.
                    abandon(&state, &step_id, Some(&run_id)).await;
                    return Err(e.into());
                }
            }
            (run_id, true, reserved)
        }
    };
    let reserved = match reserved.map(|a| a.value) {
        Ok(Ok(r)) => r,
        Ok(Err(r)) => {
            if own_run {
                let _ = state.store.finish(run_id.clone()).await;
            }
            state.metrics.refused("proxy_step", r.code.name(), r.scope);
            return Err(ApiError::from(&r));
        }
        Err(e) => {
            if own_run {
                abandon(&state, &step_id, Some(&run_id)).await;
            } else {
                abandon(&state, &step_id, None).await;
            }
            return Err(e.into());
        }
    };
    state.metrics.admitted("proxy_step");
    // The forwarded request: exactly one output bound, usage asked for in streams.
    let out = reserved
        .max_output_tokens
        .unwrap_or(bounds.max_output_tokens);
    let guard = StepGuard::new(
        state.clone(),
        Hold {
            step: step_id.clone(),
            price: model.price,
            reserved: reserved.reserved,
            prompt_bound: prompt,
            bound: out,
        },
        run_id.clone(),
        own_run,
        run_deadline,
    );
    let mut client_wants_usage = false;
    if let Some(o) = req.as_object_mut() {
        // The field the model's upstream honours, never the client's choice: an upstream
        // that ignores the other alias would generate past the bound reserved.
        o.remove("max_tokens");
        o.remove("max_completion_tokens");
        let out = plant::forwarded_bound(out, requested);
        o.insert(model.output_bound_field.name().to_string(), json!(out));
        if let Some(name) = &model.upstream_model {
            o.insert("model".into(), json!(name));
        }
        if stream {
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
    }
    let mut extra = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(&run_id.0) {
        extra.insert("spendgate-run", v);
    }
    if let Ok(v) = HeaderValue::from_str(&step_id.0) {
        extra.insert("spendgate-step", v);
    }
    if let Ok(v) = HeaderValue::from_str(&reserved.reserved.0.to_string()) {
        extra.insert("spendgate-reserved-micros", v);
    }
    if let Ok(v) = HeaderValue::from_str(&out.to_string()) {
        extra.insert("spendgate-max-output-tokens", v);
    }
    if reserved.shrunk {
        extra.insert("spendgate-output-shrunk", HeaderValue::from_static("true"));
    }
    // A proxied call that opened its own run is an admission (SPEC §6).
    if let Some(left) = run_rate_left {
        rate_limit_headers(&state, left, &mut extra);
    }
    // A run's refusal first (it is checked first), else the step's.
    let dry_run = run_dry_run.as_ref().or(reserved.dry_run.as_ref());
    note_dry_run(&state, "proxy_step", dry_run, true, &mut extra);

    let url = format!(
        "{}/chat/completions",
        upstream.base_url.trim_end_matches('/')
    );
    let mut builder = state.http.post(&url).json(&req);
    drop(req);
    if !upstream.api_key.is_empty() {
        builder = builder.bearer_auth(&upstream.api_key);
    }
    // The mock's controls: from the operator's backend, or to the built-in mock (the demo);
    // a guest does not choose how an upstream behaves (a hang, a slow pace, cached tokens).
    if !who.guest || model.upstream == MOCK_UPSTREAM {
        for h in FORWARDED_HEADERS {
            if let Some(v) = headers.get(*h) {
                builder = builder.header(*h, v.clone());
            }
        }
    }
    let started = Instant::now();
    let before_forwarding = started.duration_since(entered);
    // One deadline for the answer's head (and, when not streaming, its whole body). Every way
    // the call ends is timed in `upstream_call`, failures too: their time is what an operator
    // watches in a brownout.
    let deadline = tokio::time::Instant::now() + upstream.timeout;
    let head = tokio::select! {
        head = tokio::time::timeout_at(deadline, builder.send()) => head,
        _ = guard.stopped() => {
            tracing::warn!(run = %run_id.0, "the run's deadline passed before the upstream answered; charging the step in full");
            state.metrics.upstream_call(started.elapsed());
            return Ok(fail(
                guard,
                Resolution::Unknown,
                extra,
                StatusCode::GATEWAY_TIMEOUT,
                "run_deadline_exceeded",
                "the run's deadline passed before the upstream answered; the call was charged in full",
            )
            .await);
        }
    };
    let resp = match head {
        Ok(Ok(r)) => r,
        Ok(Err(e)) if e.is_connect() || e.is_builder() => {
            // The request never left (no connection, or no request could be built from the
            // upstream's URL): no paid work started.
            tracing::warn!(error = %e, upstream = %model.upstream, "upstream unreachable; releasing the step");
            state.metrics.upstream_call(started.elapsed());
            return Ok(fail(
                guard,
                Resolution::Release,
                extra,
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                "the upstream could not be reached; nothing was charged",
            )
            .await);
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, upstream = %model.upstream, "upstream request failed; charging the step in full");
            state.metrics.upstream_call(started.elapsed());
            return Ok(fail(
                guard,
                Resolution::Unknown,
                extra,
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "the upstream connection failed before an answer; the call was charged in full",
            )
            .await);
        }
        Err(_) => {
            tracing::warn!(upstream = %model.upstream, timeout_s = upstream.timeout.as_secs(), "upstream timed out; charging the step in full");
            state.metrics.upstream_call(started.elapsed());
            return Ok(fail(
                guard,
                Resolution::Unknown,
                extra,
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_timeout",
                "the upstream did not answer in time; the call was charged in full",
            )
            .await);
        }
    };
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut out_headers = HeaderMap::new();
    pass_headers(resp.headers(), &mut out_headers);
    out_headers.extend(extra);

    if !status.is_success() {
        // An error answer: by default no paid work started.
        let bytes = read_capped(resp, deadline, guard.stopped()).await;
        state.metrics.upstream_call(started.elapsed());
        // A redirect is not followed (the client has none of our credentials for where it
        // points, and a 307 would send the paid request again): it did no work either.
        let how = if upstream.release_on_error
            && bytes.is_some()
            && (NO_WORK_STATUSES.contains(&status.as_u16()) || status.is_redirection())
        {
            Resolution::Release
        } else {
            Resolution::Unknown
        };
        // A redirect, or the upstream refusing our key: an operator problem, not the client's.
        let operator_problem = if status.is_redirection() {
            tracing::error!(upstream = %model.upstream, %status, "the upstream answered a redirect, which is not followed; check upstreams.{}.base_url", model.upstream);
            Some("the upstream answered a redirect, which spendgate does not follow; tell the operator")
        } else if matches!(status.as_u16(), 401 | 403) {
            tracing::error!(upstream = %model.upstream, %status, "the upstream refused spendgate's credentials; check upstreams.{}.api_key", model.upstream);
            Some("the upstream refused spendgate's credentials for it; tell the operator")
        } else {
            None
        };
        if let Some(message) = operator_problem {
            return Ok(fail(
                guard,
                how,
                extra_only(out_headers),
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                message,
            )
            .await);
        }
        if let Some(a) = guard.resolve(how).await {
            note_resolution(&a, &mut out_headers);
        }
        let body = redact(bytes.unwrap_or_default(), &upstream.api_key);
        let mut r = (status, body).into_response();
        r.headers_mut().extend(out_headers);
        return Ok(r);
    }

    if !stream {
        let Some(bytes) = read_capped(resp, deadline, guard.stopped()).await else {
            state.metrics.upstream_call(started.elapsed());
            return Ok(fail(
                guard,
                Resolution::Unknown,
                out_headers,
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "the upstream answer was cut off or too slow; the call was charged in full",
            )
            .await);
        };
        let upstream_done = Instant::now();
        state
            .metrics
            .upstream_call(upstream_done.duration_since(started));
        let tokenizer = model.tokenizer;
        let len = bytes.len();
        let answer = tokens::counting(len, move || read_answer(tokenizer, out, bytes))
            .await
            // A count that could not run: as if the answer could not be read (a token a byte).
            .unwrap_or(WholeAnswer {
                body: Bytes::new(),
                usage: None,
                output: OutputTally {
                    floor: len as u64,
                    upper: len as u64,
                },
                cut: false,
                unreadable: true,
            });
        if answer.usage.is_none() {
            tracing::warn!(upstream = %model.upstream, "upstream answer without usage; charging the step in full (or for the output counted, when more)");
        }
        let how = guard.settlement(answer.usage, answer.usage, answer.output);
        if answer.unreadable {
            tracing::warn!(upstream = %model.upstream, bound = out, "an upstream answer that is not JSON, over the output bound; not passed on");
            state.metrics.output_cut();
            return Ok(fail(
                guard,
                how,
                out_headers,
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "the upstream's answer could not be read and is longer than the output bound it was given; it was charged for what was sent",
            )
            .await);
        }
        if answer.cut {
            tracing::warn!(upstream = %model.upstream, bound = out, counted = answer.output.floor, "an upstream answered past the output bound it was given; the answer was cut to the bound");
            state.metrics.output_cut();
            out_headers.insert("spendgate-output-cut", HeaderValue::from_static("true"));
        }
        if let Some(a) = guard.resolve(how).await {
            note_resolution(&a, &mut out_headers);
        }
        state
            .metrics
            .proxy_overhead(before_forwarding + upstream_done.elapsed());
        let mut r = (status, answer.body).into_response();
        r.headers_mut().extend(out_headers);
        return Ok(r);
    }

    state.metrics.proxy_overhead(before_forwarding);
    // Streaming: pass every chunk through as it arrives; watch for the usage chunk, and
    // count the output.
    let body_stream = relay(
        resp.bytes_stream(),
        guard,
        upstream.timeout,
        SseTap::new(!client_wants_usage, model.tokenizer, out),
        started,
    );
    let mut r = Response::new(AxumBody::from_stream(body_stream));
    *r.status_mut() = status;
    r.headers_mut().extend(out_headers);
    Ok(r)
}
