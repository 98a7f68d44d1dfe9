//! OpenAI-compatible proxy (`POST /v1/chat/completions`, SPEC §6): bounds the prompt, clamps
//! the output, reserves, forwards (streams pass through as they arrive), and reconciles from
//! the upstream's `usage`. Whatever cannot be known is charged in full.
//!
//! It counts the output it relays ([`OutputCounter`], with the model's tokenizer) and
//! enforces the bound it forwarded: a stream past it is cut there (nothing more is relayed,
//! what the upstream had sent is read and counted for at most [`CUT_DRAIN_MAX`], the
//! connection is closed and the client's stream ends with an error event); a whole answer
//! past it is cut to it (`finish_reason: "length"`, header `spendgate-output-cut: true`).
//! A client that goes away mid-stream leaves the same drain behind it, in the background:
//! what the upstream had sent is counted before the step is resolved. No charge is below the
//! output counted ([`settlement`]).
//!
//! Terminal states:
//! - upstream answered with usage (streamed or not) → `committed` at the observed usage (its
//!   completion tokens never below the output counted);
//! - upstream answered an error status that says no work was done ([`NO_WORK_STATUSES`]: a
//!   refusal, 500, 503; or a redirect, which is not followed) and the upstream is configured
//!   `release_on_error` → `released`; any other error status (a gateway's 502 or 504, which
//!   may follow the work) → `unknown`;
//! - connection lost, timeout, client gone mid-stream, an answer without usage → `unknown`,
//!   charged in full; unless a usage chunk had already been read whole, which is trusted.
//!   A stream's usage is trusted at its end only after `[DONE]` or a final (choices-less)
//!   usage chunk, with no content and no error event after it; a usage read but not trusted,
//!   or the output counted past the bound, that costs more than the reservation is committed
//!   (an overrun) rather than `unknown`.

use crate::api::{self, Shared};
use crate::config::Tokenizer;
use crate::error::{ApiError, ApiResult};
use crate::tokens::{self, OutputCounter, OutputTally, TOKENS_PER_MESSAGE, TOKENS_PER_REQUEST};
use axum::body::Body as AxumBody;
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};
use spendgate_core::*;
use spendgate_store::StoreError;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Largest proxied request body.
pub const PROXY_BODY_BYTES_MAX: usize = 4 * 1024 * 1024;
/// Idle upstream connections kept per host.
pub const UPSTREAM_IDLE_CONNECTIONS_MAX: usize = 256;
/// Largest non-streamed upstream answer read.
pub const UPSTREAM_BODY_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Longest SSE line buffered while looking for the usage chunk.
pub const SSE_LINE_BYTES_MAX: usize = 1024 * 1024;
/// Messages in one request.
pub const MESSAGES_MAX: usize = 4096;
/// Pauses before each retry of a proxied step's resolution that could not reach the store
/// (about 4 s in all; the hold expires, charged in full, if none lands first).
pub const SETTLE_RETRY_PAUSES: [Duration; 4] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];
/// Resolutions being retried in the background at most (per process); past it a failed
/// resolution is not retried: its hold expires and is charged in full.
pub const SETTLE_RETRIES_MAX: usize = 4096;
/// Resolutions being retried now (bounded by [`SETTLE_RETRIES_MAX`]).
static SETTLE_RETRIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One slot of [`SETTLE_RETRIES`], given back on drop.
struct RetrySlot;

impl RetrySlot {
    fn take() -> Option<RetrySlot> {
        use std::sync::atomic::Ordering;
        SETTLE_RETRIES
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < SETTLE_RETRIES_MAX).then_some(n + 1)
            })
            .ok()
            .map(|_| RetrySlot)
    }
}

impl Drop for RetrySlot {
    fn drop(&mut self) {
        SETTLE_RETRIES.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// The shortest period between two renewals of a proxied run's lease.
pub const LEASE_RENEWAL_MIN: Duration = Duration::from_millis(100);
/// Error statuses by which the upstream itself says it did no paid work: the request was
/// refused (bad, unauthorized, not found, too large, rate limited) or failed in the server
/// (500, 503). Any other error status (a 502 or 504 of a gateway in front of the provider, a
/// 408 or a CDN's 52x) may come after the work was done: charged in full.
pub const NO_WORK_STATUSES: [u16; 11] = [400, 401, 403, 404, 409, 413, 415, 422, 429, 500, 503];

/// One configured upstream, resolved at start.
#[derive(Clone, Debug)]
pub struct Upstream {
    pub base_url: String,
    pub api_key: String,
    pub timeout: Duration,
    pub release_on_error: bool,
}

/// Who is calling and which run the call belongs to.
struct Caller {
    session: String,
    ips: Vec<IpScope>,
    conversation: String,
    run: Option<String>,
    retry: bool,
    /// A guest calling with its cookie (browser-direct): it wrote the whole history, so the
    /// input bound covers every message, not only the last user message.
    guest: bool,
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

fn caller(state: &api::AppState, peer: SocketAddr, headers: &HeaderMap) -> ApiResult<Caller> {
    let run = header_str(headers, "spendgate-run").map(str::to_string);
    let retry = matches!(header_str(headers, "spendgate-retry"), Some("1" | "true"));
    if headers.contains_key(header::AUTHORIZATION) {
        api::require_service(state, headers)?;
        let token = header_str(headers, "spendgate-session")
            .ok_or_else(|| ApiError::invalid("Spendgate-Session header is required"))?;
        let session = state.keys.verify(token, api::now_unix())?;
        let ip = api::parse_ip(
            header_str(headers, "spendgate-client-ip")
                .ok_or_else(|| ApiError::invalid("Spendgate-Client-Ip header is required"))?,
        )?;
        let conversation = header_str(headers, "spendgate-conversation")
            .ok_or_else(|| ApiError::invalid("Spendgate-Conversation header is required"))?
            .to_string();
        api::check_conversation(&conversation)?;
        return Ok(Caller {
            session: session.id,
            ips: api::ip_scopes(state, ip),
            conversation,
            run,
            retry,
            guest: false,
        });
    }
    if !state.config.server.browser_direct {
        return Err(ApiError::unauthorized(
            "missing service token (Authorization: Bearer ...)",
        ));
    }
    let token = api::session_from_cookie(state, headers).ok_or_else(|| {
        ApiError::unauthorized("no session cookie; create one with POST /v1/sessions")
    })?;
    if run.is_some() {
        // Runs are opened by the operator's backend: a guest attaches to none.
        return Err(ApiError::unauthorized(
            "Spendgate-Run needs a service token (Authorization: Bearer ...)",
        ));
    }
    let session = state.keys.verify(&token, api::now_unix())?;
    let ip = api::client_ip_of(state, peer, headers);
    // A guest's conversation is its own (see `api::guest_conversation`); without one named,
    // the session is the conversation.
    let conversation = match header_str(headers, "spendgate-conversation") {
        Some(c) => {
            api::check_conversation(c)?;
            api::guest_conversation(&session.id, c)
        }
        None => session.id.clone(),
    };
    Ok(Caller {
        session: session.id,
        ips: api::ip_scopes(state, ip),
        conversation,
        run,
        retry,
        guest: true,
    })
}

/// The text of a message's content: a string, or an array of `text` (and, in an assistant's
/// earlier answer, `refusal`) parts. Any other part (an image, audio, a file) is refused: the
/// upstream charges it by what it holds (an image URL of 50 bytes can cost a thousand
/// tokens), which spendgate can neither count nor price (SPEC §6: no price, no call).
fn content_text(content: &Value, out: &mut String) -> ApiResult<()> {
    match content {
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
            for (i, p) in parts.iter().enumerate() {
                // Parts are counted apart: a newline between them is a boundary the
                // tokenizer's pre-split never merges across, so the count is at least the
                // sum of the parts' (an upstream that tokenizes each part is not under-
                // counted by two parts that would merge into one token when joined).
                if i > 0 {
                    out.push('\n');
                }
                // A part's other keys may be billed (`cache_control`: cache writes cost more
                // than input) or read by an upstream as more text.
                if let Some(extra) = p.as_object().and_then(|o| {
                    o.keys()
                        .find(|k| !matches!(k.as_str(), "type" | "text" | "refusal"))
                }) {
                    return Err(ApiError::invalid(format!(
                        "content parts carry \"type\" and their text only, not {extra:?}"
                    )));
                }
                let kind = p.get("type").and_then(Value::as_str);
                let text = match kind {
                    Some("text") => p.get("text").and_then(Value::as_str),
                    Some("refusal") => p.get("refusal").and_then(Value::as_str),
                    _ => None,
                };
                match (text, kind) {
                    (Some(t), _) => out.push_str(t),
                    (None, Some(k @ ("text" | "refusal"))) => {
                        return Err(ApiError::invalid(format!(
                            "a {k:?} content part must carry its text in \"{k}\""
                        )))
                    }
                    (None, k) => {
                        return Err(ApiError::invalid(format!(
                            "content parts of type {} cannot be bounded or priced here; only \
                             text is accepted",
                            k.map_or_else(|| "(none)".to_string(), |k| format!("{k:?}"))
                        )))
                    }
                }
            }
        }
        Value::Null => {}
        other => out.push_str(&other.to_string()),
    }
    Ok(())
}

/// Request options that make the upstream charge more than text tokens at the configured
/// prices (audio output, web search, a priority tier) are refused rather than reserved and
/// charged as text (SPEC §6: no price, no call).
fn check_priced_as_text(body: &Value) -> ApiResult<()> {
    let set = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
    if let Some(m) = body.get("modalities").filter(|v| !v.is_null()) {
        let text_only = m
            .as_array()
            .is_some_and(|a| a.iter().all(|v| v.as_str() == Some("text")));
        if !text_only {
            return Err(ApiError::invalid(
                "\"modalities\" other than [\"text\"] have no price here",
            ));
        }
    }
    // `prediction`: its rejected tokens are billed as output beyond what the output bound
    // reserves.
    // `plugins` (OpenRouter's web search and others) are billed per use; `models` and
    // `fallbacks` (LiteLLM) fall back to other models, at their prices; `provider` (OpenRouter)
    // picks providers of the model at their own prices.
    for k in [
        "audio",
        "web_search_options",
        "prediction",
        "plugins",
        "models",
        "fallbacks",
        "provider",
    ] {
        if set(k) {
            return Err(ApiError::invalid(format!(
                "\"{k}\" is charged beyond the text tokens reserved here"
            )));
        }
    }
    // Work the answer's usage does not show: `best_of` samples that many sequences and
    // returns one (vLLM), beam search as many beams.
    if let Some(b) = body.get("best_of").filter(|v| !v.is_null()) {
        if b.as_u64() != Some(1) {
            return Err(ApiError::invalid(
                "\"best_of\" other than 1 samples work its usage does not report",
            ));
        }
    }
    if body
        .get("use_beam_search")
        .is_some_and(|v| v.as_bool() != Some(false) && !v.is_null())
    {
        return Err(ApiError::invalid(
            "\"use_beam_search\" samples work its usage does not report",
        ));
    }
    // Tools the upstream runs itself (web search, code interpreters) are billed per call;
    // only tools the caller runs (functions) are bounded here.
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        for t in tools {
            let kind = t.get("type").and_then(Value::as_str);
            if !matches!(kind, Some("function" | "custom")) {
                return Err(ApiError::invalid(format!(
                    "tools of type {} are run and billed by the upstream; only \"function\" \
                     tools are accepted",
                    kind.map_or_else(|| "(none)".to_string(), |k| format!("{k:?}"))
                )));
            }
        }
    }
    if let Some(tier) = body.get("service_tier").filter(|v| !v.is_null()) {
        if !matches!(tier.as_str(), Some("auto" | "default" | "flex")) {
            return Err(ApiError::invalid(format!(
                "service_tier {tier} may be charged above the configured prices; use \
                 \"auto\", \"default\" or \"flex\""
            )));
        }
    }
    Ok(())
}

/// Top-level request fields that carry no text an upstream bills as prompt tokens. Every
/// other field is counted as its JSON text: `tools`, `functions`, `response_format`,
/// `tool_choice`, and any field this list does not know, which an OpenAI-compatible upstream
/// may put before the model (a field counted needlessly costs a few tokens of headroom; one
/// not counted would be input nobody reserved).
const UNBILLED_FIELDS: [&str; 24] = [
    "model",
    "messages",
    "stream",
    "stream_options",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "stop",
    "user",
    "metadata",
    "store",
    "parallel_tool_calls",
    "service_tier",
    "reasoning_effort",
    "modalities",
    "prompt_cache_key",
];

/// Prompt bound of a request: the text of every field of every message (its content, tool
/// calls, the legacy `function_call`, names, and any field not known here), and every
/// top-level field but [`UNBILLED_FIELDS`], through the model's tokenizer, plus per-message
/// and per-request overhead. Returns the bound, the largest tool result's bytes and the last
/// user message's bytes.
pub fn prompt_tokens(tokenizer: Tokenizer, body: &Value) -> ApiResult<(u64, u64, u64)> {
    let p = prompt_texts(body)?;
    let tokens = p.texts.iter().fold(p.overhead, |n, t| {
        n.saturating_add(tokens::count(tokenizer, t))
    });
    Ok((tokens, p.largest_tool_result, p.last_user_bytes))
}

/// The billed text of a request, to be counted: the pieces [`prompt_tokens`] counts.
pub struct PromptTexts {
    /// Each message's text, then each billed request field's.
    pub texts: Vec<String>,
    /// Tokens added for the request and its messages.
    pub overhead: u64,
    /// Bytes of every text together.
    pub bytes: u64,
    pub largest_tool_result: u64,
    pub last_user_bytes: u64,
}

/// The texts of [`prompt_tokens`], not yet counted (counting a large prompt is expensive:
/// [`tokens::count_all`]).
pub fn prompt_texts(body: &Value) -> ApiResult<PromptTexts> {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid("\"messages\" must be an array"))?;
    if messages.is_empty() || messages.len() > MESSAGES_MAX {
        return Err(ApiError::invalid(format!(
            "\"messages\" must hold 1 to {MESSAGES_MAX} messages"
        )));
    }
    check_priced_as_text(body)?;
    let mut texts = Vec::with_capacity(messages.len() + 1);
    let mut overhead = TOKENS_PER_REQUEST;
    let mut largest_tool_result = 0u64;
    let mut last_user_bytes = 0u64;
    for m in messages {
        let fields = m
            .as_object()
            .ok_or_else(|| ApiError::invalid("each message must be a JSON object"))?;
        let mut content = String::new();
        let mut text = String::new();
        for (k, v) in fields {
            match (k.as_str(), v) {
                (_, Value::Null) => {}
                ("content", c) => content_text(c, &mut content)?,
                // An earlier audio answer referred to by id is billed as audio input.
                ("audio", _) => {
                    return Err(ApiError::invalid(
                        "messages carrying \"audio\" are charged beyond text tokens and have no price here",
                    ))
                }
                (_, Value::String(s)) => text.push_str(s),
                (_, other) => text.push_str(&other.to_string()),
            }
        }
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if role == "tool" || role == "function" {
            largest_tool_result = largest_tool_result.max(content.len() as u64);
        }
        if role == "user" {
            last_user_bytes = content.len() as u64;
        }
        content.push_str(&text);
        texts.push(content);
        overhead = overhead.saturating_add(TOKENS_PER_MESSAGE);
    }
    for (k, v) in body.as_object().into_iter().flatten() {
        if !v.is_null() && !UNBILLED_FIELDS.contains(&k.as_str()) {
            texts.push(v.to_string());
        }
    }
    let bytes = texts.iter().map(|t| t.len() as u64).sum();
    Ok(PromptTexts {
        texts,
        overhead,
        bytes,
        largest_tool_result,
        last_user_bytes,
    })
}

/// Resolves a step exactly once; if dropped unresolved (client gone, task cancelled), the
/// step is resolved from the usage already read whole, else marked `unknown` (charged in
/// full; or at a usage read that costs more, see [`StepGuard::unsure`]), and a one-step run
/// is finished. Resolution runs on its own task, so a client going
/// away while the store answers cannot cut it short. While the step is unresolved, its run's
/// lease is renewed, so that a call longer than `store.lease_ttl_s` keeps its slots (one
/// generation per conversation) and is not expired under a live holder; the lease never
/// outlives the run's deadline, which bounds the call.
struct StepGuard {
    state: Shared,
    step: Option<ReservationId>,
    run: Option<RunId>,
    /// A usage the proxy finished reading (trusted even if the stream is cut later).
    usage: Option<TokenUsage>,
    /// The largest usage read, trusted or not (see [`StepGuard::unsure`]).
    seen: Option<TokenUsage>,
    /// The step's price and reservation: what a usage read would cost, against the hold.
    price: ModelPrice,
    reserved: Micros,
    /// The prompt bound and the output bound the step reserved for.
    prompt_bound: u64,
    bound: u64,
    /// The output counted so far (see [`StepGuard::settlement`]).
    output: OutputTally,
    /// The task renewing the run's lease; stopped when the step is resolved.
    renewal: Option<tokio::task::AbortHandle>,
    /// When the call must stop ([`StepGuard::stopped`]): the run's deadline once known, or
    /// the moment the run was found ended under the call.
    stop: tokio::sync::watch::Receiver<Option<tokio::time::Instant>>,
}

/// The local instant of a store time (the store's clock is this machine's, or Redis's).
fn instant_of(at: UnixMs) -> tokio::time::Instant {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    tokio::time::Instant::now() + Duration::from_millis(at.0.saturating_sub(now_ms))
}

impl StepGuard {
    /// `deadline`: the run's, when the caller knows it (a run the proxy opened); else the
    /// first renewal, at once, learns it.
    fn new(
        state: Shared,
        hold: Hold,
        run_id: RunId,
        own_run: bool,
        deadline: Option<UnixMs>,
    ) -> StepGuard {
        // A third of the lease: two renewals may fail or be late before it runs out.
        let every = (state.config.store.lease_ttl / 3).max(LEASE_RENEWAL_MIN);
        let (stop_tx, stop) = tokio::sync::watch::channel(deadline.map(instant_of));
        let renewal = {
            let state = state.clone();
            let run_id = run_id.clone();
            tokio::spawn(async move {
                let mut known = deadline.is_some();
                loop {
                    if known {
                        tokio::time::sleep(every).await;
                    }
                    match state.store.heartbeat(run_id.clone()).await {
                        Ok(a) => {
                            known = true;
                            let _ = stop_tx.send(Some(instant_of(a.value.deadline)));
                            // At its deadline: the lease can grow no more.
                            if a.value.lease_until >= a.value.deadline {
                                return;
                            }
                        }
                        // The run has ended (finished, expired): its holds were settled
                        // without this call, which must stop now.
                        Err(StoreError::Ledger(e, _)) => {
                            tracing::warn!(error = %e, run = %run_id.0, "a proxied call's run ended under it; stopping the call");
                            let _ = stop_tx.send(Some(tokio::time::Instant::now()));
                            return;
                        }
                        Err(e) => {
                            known = true;
                            tracing::warn!(error = %e, run = %run_id.0, "could not renew a proxied run's lease")
                        }
                    }
                }
            })
            .abort_handle()
        };
        StepGuard {
            state,
            step: Some(hold.step),
            run: own_run.then_some(run_id),
            usage: None,
            seen: None,
            price: hold.price,
            reserved: hold.reserved,
            prompt_bound: hold.prompt_bound,
            bound: hold.bound,
            output: OutputTally::default(),
            renewal: Some(renewal),
            stop,
        }
    }

    /// Completes when the call must stop: at the run's deadline (a run never exceeds its
    /// seconds, I5; past it, its lease is over and its holds are charged, so paid work must
    /// not go on), or when the run ended under the call.
    fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.clone();
        async move {
            loop {
                let at = *rx.borrow_and_update();
                let changed = async {
                    if rx.changed().await.is_err() {
                        // No more news: the last word stands.
                        std::future::pending::<()>().await;
                    }
                };
                match at {
                    Some(at) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(at) => return,
                            _ = changed => {}
                        }
                    }
                    None => changed.await,
                }
            }
        }
    }

    /// How to resolve the step from what was observed (see [`settlement`]).
    fn settlement(
        &self,
        trusted: Option<TokenUsage>,
        seen: Option<TokenUsage>,
        output: OutputTally,
    ) -> Resolution {
        settlement(
            (self.price, self.reserved),
            (self.prompt_bound, self.bound),
            Observed {
                trusted,
                seen,
                output,
            },
        )
    }

    fn take(&mut self) -> Option<(ReservationId, Option<RunId>)> {
        if let Some(r) = self.renewal.take() {
            r.abort();
        }
        let step = self.step.take()?;
        Some((step, self.run.take()))
    }

    /// Resolves a step (and finishes a one-step run). When the store cannot be reached, the
    /// resolution is tried again in the background, [`SETTLE_RETRY_PAUSES`] apart: the hold
    /// stays until then, and expires charged in full if no retry lands first (I3).
    async fn settle(
        state: Shared,
        step: ReservationId,
        run: Option<RunId>,
        how: Resolution,
    ) -> Option<Applied<Resolved>> {
        let unknown = how == Resolution::Unknown;
        let step_name = step.0.clone();
        let mut cmds = vec![Command::Resolve { step, how }];
        if let Some(run) = run {
            cmds.push(Command::Finish { run });
        }
        match Self::settle_once(&state, cmds.clone(), unknown, &step_name, false).await {
            Ok(a) => Some(a),
            Err(e @ (StoreError::Unavailable(_) | StoreError::Timeout(_))) => {
                let Some(slot) = RetrySlot::take() else {
                    tracing::warn!(error = %e, step = %step_name, "could not resolve a proxied step, and {SETTLE_RETRIES_MAX} retries are pending already; it will expire and be charged in full");
                    return None;
                };
                tracing::warn!(error = %e, step = %step_name, "could not resolve a proxied step; retrying (else it expires and is charged in full)");
                tokio::spawn(async move {
                    let _slot = slot;
                    for pause in SETTLE_RETRY_PAUSES {
                        tokio::time::sleep(pause).await;
                        match Self::settle_once(&state, cmds.clone(), unknown, &step_name, true)
                            .await
                        {
                            Ok(_) => return,
                            Err(StoreError::Unavailable(_) | StoreError::Timeout(_)) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, step = %step_name, "could not resolve a proxied step on a retry; it will expire and be charged in full");
                                return;
                            }
                        }
                    }
                    tracing::warn!(step = %step_name, "could not resolve a proxied step after retries; it will expire and be charged in full");
                });
                None
            }
            Err(e) => {
                // The hold stays; it expires and is charged in full.
                tracing::warn!(error = %e, "could not resolve a proxied step; it will expire and be charged in full");
                None
            }
        }
    }

    /// One attempt of [`StepGuard::settle`]; counts and alerts what it applied. `retried`: an
    /// earlier attempt failed, so an answer that repeats an outcome repeats that attempt's
    /// (it applied after all), which nobody counted yet.
    async fn settle_once(
        state: &api::AppState,
        cmds: Vec<Command>,
        unknown: bool,
        step_name: &str,
        retried: bool,
    ) -> Result<Applied<Resolved>, StoreError> {
        let mut answers = state.store.execute_many(cmds).await.into_iter();
        let r = match answers.next() {
            Some(Ok(Reply::Resolved(a))) => Ok(a),
            Some(Ok(other)) => Err(StoreError::Unavailable(format!(
                "unexpected answer {other:?}"
            ))),
            Some(Err(e)) => Err(e),
            None => Err(StoreError::Unavailable("no answer".into())),
        };
        if r.is_ok() {
            if let Some(Err(e)) = answers.next() {
                tracing::warn!(error = %e, "could not finish a one-step proxy run; its lease will expire");
            }
        }
        let a = r?;
        if !a.value.repeated || retried {
            if unknown {
                state.metrics.unknown_outcome();
            }
            if a.value.overrun {
                state.metrics.overrun();
                state
                    .alerts
                    .overrun(step_name, a.value.reserved.0, a.value.charged.0);
                tracing::warn!(
                    charged = a.value.charged.0,
                    reserved = a.value.reserved.0,
                    "overrun: upstream usage above the reservation, charged in full"
                );
            }
        }
        Ok(a)
    }

    async fn resolve(mut self, how: Resolution) -> Option<Applied<Resolved>> {
        let (step, run) = self.take()?;
        let state = self.state.clone();
        tokio::spawn(Self::settle(state, step, run, how))
            .await
            .ok()
            .flatten()
    }
}

impl Drop for StepGuard {
    fn drop(&mut self) {
        let Some((step, run)) = self.take() else {
            return;
        };
        let how = if self.usage.is_none() && crate::plant::on(crate::plant::Plant::DropReleases) {
            Resolution::Release
        } else {
            self.settlement(self.usage, self.seen, self.output)
        };
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(Self::settle(self.state.clone(), step, run, how));
        }
    }
}

/// What a proxied step's hold covers.
struct Hold {
    step: ReservationId,
    price: ModelPrice,
    reserved: Micros,
    /// The prompt bound reserved for.
    prompt_bound: u64,
    /// The output bound forwarded.
    bound: u64,
}

/// What the proxy observed of a step's answer.
#[derive(Clone, Copy, Debug)]
struct Observed {
    /// A usage that covers the whole answer (read whole, nothing after it).
    trusted: Option<TokenUsage>,
    /// The largest usage read, trusted or not.
    seen: Option<TokenUsage>,
    /// The output counted ([`OutputCounter`]).
    output: OutputTally,
}

/// How a proxied step ends, never charged below what the upstream is shown to have served
/// (SPEC I1b):
/// - a trusted usage is committed, its completion tokens never below the output counted
///   ([`OutputTally::floor`]: an upstream that reports less than it sent is charged what
///   it sent);
/// - without one (no usage, a usage followed by more content, a stream cut, an error
///   event), the step is `unknown`, charged its reservation, unless the usage read (or the
///   prompt bound, without one) with the output counted costs more: that is committed, an
///   overrun (charged, counted and alerted). The output counted is the floor while it is
///   within the bound (an upstream that kept to its bound is covered by the reservation),
///   and the most the text can have cost ([`OutputTally::upper`]) once the floor shows the
///   upstream went past it.
fn settlement(
    (price, reserved): (ModelPrice, Micros),
    (prompt_bound, bound): (u64, u64),
    o: Observed,
) -> Resolution {
    if let Some(u) = o.trusted {
        return Resolution::Commit(Settlement::Tokens(TokenUsage {
            completion_tokens: u.completion_tokens.max(o.output.floor),
            ..u
        }));
    }
    let counted = if o.output.floor > bound {
        o.output.upper
    } else {
        o.output.floor
    };
    let base = o.seen.unwrap_or(TokenUsage {
        prompt_tokens: prompt_bound,
        completion_tokens: 0,
        cached_tokens: 0,
    });
    let u = TokenUsage {
        completion_tokens: base.completion_tokens.max(counted),
        ..base
    };
    if price.charge(&u) > reserved {
        Resolution::Commit(Settlement::Tokens(u))
    } else {
        Resolution::Unknown
    }
}

fn usage_of(v: &Value) -> Option<TokenUsage> {
    let u = v.get("usage")?;
    if u.is_null() {
        return None;
    }
    let prompt_tokens = u.get("prompt_tokens")?.as_u64()?;
    let mut completion_tokens = u.get("completion_tokens")?.as_u64()?;
    // OpenAI counts reasoning tokens inside `completion_tokens`. A usage that reports more
    // reasoning than completion tokens cannot be read that way: both are charged.
    let reasoning = u
        .get("completion_tokens_details")
        .and_then(|d| d.get("reasoning_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    if reasoning > completion_tokens {
        completion_tokens = completion_tokens.saturating_add(reasoning);
    }
    // Some providers (xAI's) count reasoning outside `completion_tokens` but inside
    // `total_tokens`: whatever the total holds beyond the prompt was generated.
    if let Some(total) = u.get("total_tokens").and_then(Value::as_u64) {
        completion_tokens = completion_tokens.max(total.saturating_sub(prompt_tokens));
    }
    let details = u.get("prompt_tokens_details");
    let detail = |k: &str| {
        details
            .and_then(|d| d.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    // Cache writes (OpenRouter's `cache_write_tokens`) are billed above the input price (up
    // to twice it): each is charged once more at the input price.
    let prompt_tokens = prompt_tokens.saturating_add(detail("cache_write_tokens"));
    Some(TokenUsage {
        prompt_tokens,
        completion_tokens,
        cached_tokens: detail("cached_tokens"),
    })
}

/// Which text of an answer a piece of output belongs to: the choice's index, the field (see
/// [`each_output_text`]) and the tool call's index. A stream's pieces of one field are
/// counted as one text; fields apart.
type FieldKey = (u64, u8, u64);

/// Most levels of an array `content` searched for text.
const CONTENT_DEPTH_MAX: usize = 8;

/// Calls `f` with every text an upstream generated in an answer or in a stream's event,
/// field by field in the order a model generates them. For each choice's `message` (a whole
/// answer) or `delta` (a stream): its reasoning (`reasoning_content`, `reasoning`), its
/// `content` (a string, or every string of an array of parts but their `type`), its
/// `refusal`, each tool call's name and arguments (`function.name` and `.arguments`, or a
/// custom tool's `custom.name` and `.input`), and the legacy `function_call`. Other fields
/// (roles, ids, annotations, logprobs) are not counted: a reported usage covers them, and
/// else the reservation does.
fn each_output_text(event: &mut Value, f: &mut dyn FnMut(FieldKey, &mut String)) {
    let Some(choices) = event.get_mut("choices").and_then(Value::as_array_mut) else {
        return;
    };
    for (pos, choice) in choices.iter_mut().enumerate() {
        let c = choice
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(pos as u64);
        for part in ["message", "delta"] {
            let Some(m) = choice.get_mut(part).and_then(Value::as_object_mut) else {
                continue;
            };
            for (kind, k) in [(0u8, "reasoning_content"), (1, "reasoning")] {
                if let Some(Value::String(t)) = m.get_mut(k) {
                    f((c, kind, 0), t);
                }
            }
            if let Some(content) = m.get_mut("content") {
                each_string(content, CONTENT_DEPTH_MAX, &mut |t| f((c, 2, 0), t));
            }
            if let Some(Value::String(t)) = m.get_mut("refusal") {
                f((c, 3, 0), t);
            }
            if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                for (tpos, call) in calls.iter_mut().enumerate() {
                    let t = call
                        .get("index")
                        .and_then(Value::as_u64)
                        .unwrap_or(tpos as u64);
                    for (holder, text) in [("function", "arguments"), ("custom", "input")] {
                        let Some(h) = call.get_mut(holder).and_then(Value::as_object_mut) else {
                            continue;
                        };
                        for (kind, k) in [(4u8, "name"), (5, text)] {
                            if let Some(Value::String(x)) = h.get_mut(k) {
                                f((c, kind, t), x);
                            }
                        }
                    }
                }
            }
            if let Some(h) = m.get_mut("function_call").and_then(Value::as_object_mut) {
                for (kind, k) in [(6u8, "name"), (7, "arguments")] {
                    if let Some(Value::String(x)) = h.get_mut(k) {
                        f((c, kind, 0), x);
                    }
                }
            }
        }
    }
}

/// Every string of `v` (a string, or in arrays and objects but under the key `type`), to
/// `depth` levels.
fn each_string(v: &mut Value, depth: usize, f: &mut dyn FnMut(&mut String)) {
    match v {
        Value::String(t) => f(t),
        Value::Array(items) if depth > 0 => {
            for item in items {
                each_string(item, depth - 1, f);
            }
        }
        Value::Object(fields) if depth > 0 => {
            for (k, item) in fields.iter_mut() {
                if k != "type" {
                    each_string(item, depth - 1, f);
                }
            }
        }
        _ => {}
    }
}

/// A whole (non-streamed) answer, read: what the client receives, and what it shows.
struct WholeAnswer {
    /// The answer as the upstream sent it, or cut to the output bound.
    body: Bytes,
    /// Its usage (a whole answer's usage is trusted).
    usage: Option<TokenUsage>,
    /// Its output, counted whole (before any cut).
    output: OutputTally,
    /// The answer's texts were cut to the output bound ([`clip_answer`]).
    cut: bool,
    /// The answer is not a JSON object with `choices`, and its bytes are over the output
    /// bound: it cannot be cut, and is not passed on.
    unreadable: bool,
}

/// Reads a whole answer: its usage, its output counted ([`each_output_text`], each text a
/// field of its own; an answer that is not a JSON object with `choices` counts a token a
/// byte), and, when the output is over `bound`, its texts cut to the bound ([`clip_answer`]).
fn read_answer(tokenizer: Tokenizer, bound: u64, bytes: Bytes) -> WholeAnswer {
    let mut counter = OutputCounter::new(tokenizer);
    let answer = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .filter(|v| v.get("choices").is_some_and(Value::is_array));
    let Some(mut v) = answer else {
        counter.push_unread(bytes.len() as u64);
        let over = counter.over(bound);
        return WholeAnswer {
            body: bytes,
            usage: None,
            output: counter.tally(),
            cut: false,
            unreadable: over,
        };
    };
    let usage = usage_of(&v);
    each_output_text(&mut v, &mut |_, text| {
        counter.push(text);
        counter.end_field();
    });
    let output = counter.tally();
    let cut = output.floor > bound && clip_answer(&mut v, tokenizer, bound);
    let body = if cut {
        serde_json::to_vec(&v).map_or(bytes, Bytes::from)
    } else {
        bytes
    };
    WholeAnswer {
        body,
        usage,
        output,
        cut,
        unreadable: false,
    }
}

/// Cuts the texts of a whole answer to `bound` tokens of output, in the order the model
/// generated them ([`each_output_text`]): each text keeps the longest start that fits
/// ([`OutputCounter::fit`]), a tool call left without a name is removed, and every choice
/// ends as if the upstream had stopped at its bound (`finish_reason: "length"`), as one that
/// honours it would. Whether anything was cut.
fn clip_answer(v: &mut Value, tokenizer: Tokenizer, bound: u64) -> bool {
    let mut counter = OutputCounter::new(tokenizer);
    let mut cut = false;
    each_output_text(v, &mut |_, text| {
        let n = counter.fit(text, bound);
        if n < text.len() {
            text.truncate(n);
            cut = true;
        }
        counter.push(text);
        counter.end_field();
    });
    debug_assert!(!counter.over(bound));
    if !cut {
        return false;
    }
    let choices = v.get_mut("choices").and_then(Value::as_array_mut);
    for choice in choices.into_iter().flatten() {
        if let Some(m) = choice.get_mut("message").and_then(Value::as_object_mut) {
            if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                calls.retain(|c| {
                    ["function", "custom"].iter().any(|h| {
                        c.get(h)
                            .and_then(|h| h.get("name"))
                            .and_then(Value::as_str)
                            .is_some_and(|n| !n.is_empty())
                    })
                });
            }
            let named = m
                .get("function_call")
                .and_then(|h| h.get("name"))
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty());
            if !named {
                m.remove("function_call");
            }
        }
        if let Some(c) = choice.as_object_mut() {
            c.insert("finish_reason".into(), json!("length"));
        }
    }
    true
}

/// Response headers passed through from the upstream, every value of a repeated one (`vary`,
/// `link`, `www-authenticate`). Not passed: hop-by-hop headers (those named in the upstream's
/// `Connection` too), length headers, cookies, and `spendgate-*`, which are ours alone (an
/// upstream's `spendgate-outcome` must not pass for spendgate's).
fn pass_headers(from: &reqwest::header::HeaderMap, to: &mut HeaderMap) {
    let named: Vec<String> = from
        .get_all(reqwest::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    for (k, v) in from {
        let name = k.as_str();
        if matches!(
            name,
            "connection"
                | "keep-alive"
                | "proxy-authenticate"
                | "proxy-authorization"
                | "proxy-connection"
                | "transfer-encoding"
                | "content-length"
                | "te"
                | "trailer"
                | "upgrade"
                | "set-cookie"
        ) || name.starts_with("spendgate-")
            || named.iter().any(|n| n == name)
        {
            continue;
        }
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(k.as_ref()),
            HeaderValue::from_bytes(v.as_bytes()),
        ) {
            to.append(n, v);
        }
    }
}

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
        <api::Body<Value> as axum::extract::FromRequest<Shared>>::from_request(request, &state)
            .await?;
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
    let step_id = ReservationId(api::new_id("stp"));
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
            api::check_id_path("run", r)?;
            let run_id = RunId(r.clone());
            let reserved = state.store.reserve_step(step_of(&run_id), None).await;
            (run_id, false, reserved)
        }
        None => {
            let run_id = RunId(api::new_id("run"));
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
        let out = crate::plant::forwarded_bound(out, requested);
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
        api::rate_limit_headers(&state, left, &mut extra);
    }
    // A run's refusal first (it is checked first), else the step's.
    let dry_run = run_dry_run.as_ref().or(reserved.dry_run.as_ref());
    api::note_dry_run(&state, "proxy_step", dry_run, true, &mut extra);

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
    if !who.guest || model.upstream == crate::config::MOCK_UPSTREAM {
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

/// After a store error before forwarding: nothing was sent upstream, so a step that may
/// have been reserved anyway is released, and a one-step run finished (best effort: what
/// stays held expires and is charged in full).
async fn abandon(state: &api::AppState, step: &ReservationId, run: Option<&RunId>) {
    match state.store.resolve(step.clone(), Resolution::Release).await {
        Ok(_) | Err(StoreError::Ledger(LedgerError::NotFound(_), _)) => {}
        Err(e) => tracing::warn!(error = %e, "could not release an abandoned proxy step"),
    }
    if let Some(run) = run {
        if let Err(e) = state.store.finish(run.clone()).await {
            tracing::warn!(error = %e, "could not finish an abandoned proxy run");
        }
    }
}

/// Request headers passed to the upstream besides the body and its key (the mock's controls).
const FORWARDED_HEADERS: &[&str] = &[
    "x-mock-fault",
    "x-mock-completion-tokens",
    "x-mock-extra-completion-tokens",
    "x-mock-reported-completion-tokens",
    "x-mock-latency-ms",
    "x-mock-linger-ms",
    "x-mock-cached-tokens",
    "x-mock-running-usage",
    "x-mock-running-cached-tokens",
    "x-mock-tokens-per-second",
    "x-mock-stamp",
    "x-mock-tag",
];

/// Only spendgate's own step headers of an answer's headers.
fn extra_only(headers: HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (k, v) in &headers {
        if k.as_str().starts_with("spendgate-") {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

/// Resolves the step and answers an error about the upstream, in the OpenAI shape, with the
/// step's headers (`x-should-retry: false`: each retry would be another paid attempt).
async fn fail(
    guard: StepGuard,
    how: Resolution,
    mut headers: HeaderMap,
    status: StatusCode,
    code: &'static str,
    message: &str,
) -> Response {
    if let Some(a) = guard.resolve(how).await {
        note_resolution(&a, &mut headers);
    }
    // Only the step's own headers: an upstream's content type or length must not survive.
    headers.remove(header::CONTENT_TYPE);
    headers.remove(header::CONTENT_LENGTH);
    let mut r = ApiError::new(status, code, message).into_response();
    r.headers_mut().extend(headers);
    r
}

/// Hides the upstream's key should an error body echo it back.
fn redact(body: Bytes, key: &str) -> Bytes {
    if key.len() < 4 || body.len() < key.len() {
        return body;
    }
    let k = key.as_bytes();
    if !body.windows(k.len()).any(|w| w == k) {
        return body;
    }
    let text = String::from_utf8_lossy(&body).replace(key, "***");
    Bytes::from(text)
}

fn note_resolution(a: &Applied<Resolved>, headers: &mut HeaderMap) {
    if let Ok(v) = HeaderValue::from_str(&a.value.charged.0.to_string()) {
        headers.insert("spendgate-charged-micros", v);
    }
    headers.insert(
        "spendgate-outcome",
        HeaderValue::from_static(a.value.state.name()),
    );
}

/// Reads a whole body of at most [`UPSTREAM_BODY_BYTES_MAX`] by `deadline`; `None` when it
/// is cut off, too large or too slow.
async fn read_capped(
    resp: reqwest::Response,
    deadline: tokio::time::Instant,
    stop: impl std::future::Future<Output = ()>,
) -> Option<Bytes> {
    let mut s = resp.bytes_stream();
    let mut buf = Vec::new();
    tokio::pin!(stop);
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout_at(deadline, s.next()) => next,
            _ = &mut stop => return None,
        };
        match next {
            Ok(Some(Ok(chunk))) => {
                if buf.len() + chunk.len() > UPSTREAM_BODY_BYTES_MAX {
                    return None;
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(Some(Err(_))) | Err(_) => return None,
            Ok(None) => return Some(Bytes::from(buf)),
        }
    }
}

/// Watches an SSE stream line by line as it passes: reads the usage chunk, and drops it when
/// the client did not ask for usage (we did, on its behalf; a client that did not ask may not
/// expect a chunk without choices); counts the output of every event ([`each_output_text`]),
/// and once it is over the bound the upstream was given, forwards nothing more (the event
/// that went over included; [`SseTap::over`]). Bytes are forwarded as soon as their line is
/// complete.
struct SseTap {
    /// The start of a line whose end has not arrived yet.
    line: Vec<u8>,
    /// Inside a line longer than [`SSE_LINE_BYTES_MAX`]: passed through unread.
    overflow: bool,
    /// The largest of each figure of every usage read (an upstream may send several, as
    /// running totals; none is trusted below another).
    usage: Option<TokenUsage>,
    /// Content arrived after the last usage: that usage does not cover it.
    content_after_usage: bool,
    /// The last event was a usage chunk without choices (OpenAI's final one).
    settled: bool,
    /// `data: [DONE]` arrived.
    done: bool,
    /// An event reported an error (an `error` object, or a choice that finished with
    /// `"error"`): no usage of this stream is trusted, one carried by the error included.
    failed: bool,
    strip_usage: bool,
    /// The output counted so far, every event's (also those not forwarded).
    output: OutputCounter,
    /// The output bound the upstream was given.
    bound: u64,
    /// The field the last piece of output belonged to.
    field: Option<FieldKey>,
    /// The output went over `bound`: nothing more is forwarded.
    over: bool,
}

/// Whether a stream's event reports an error: an `error` object (OpenAI's and OpenRouter's
/// mid-stream errors) or a choice whose `finish_reason` is `"error"`.
fn is_error_event(v: &Value) -> bool {
    v.get("error").is_some_and(|e| !e.is_null())
        || v.get("choices")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.get("finish_reason").and_then(Value::as_str) == Some("error"))
            })
}

impl SseTap {
    fn new(strip_usage: bool, tokenizer: Tokenizer, bound: u64) -> SseTap {
        SseTap {
            line: Vec::new(),
            overflow: false,
            usage: None,
            content_after_usage: false,
            settled: false,
            done: false,
            failed: false,
            strip_usage,
            output: OutputCounter::new(tokenizer),
            bound,
            field: None,
            over: false,
        }
    }

    /// The usage to commit when the stream ended cleanly: none if content followed it, if
    /// an event reported an error, or if the stream ended neither with `[DONE]` nor right
    /// after a final usage chunk (an upstream that failed mid-generation may close its body
    /// cleanly after a running total).
    fn end_usage(&self) -> Option<TokenUsage> {
        self.usage
            .filter(|_| !self.content_after_usage && !self.failed && (self.done || self.settled))
    }

    /// The usage to commit when the stream is cut (upstream lost, deadline, client gone):
    /// only a final usage chunk, with nothing after it but the end; a running total on a
    /// chunk with choices may be followed by more generation.
    fn final_usage(&self) -> Option<TokenUsage> {
        self.usage
            .filter(|_| self.settled && !self.content_after_usage && !self.failed)
    }

    fn saw_content(&mut self) {
        self.settled = false;
        if self.usage.is_some() {
            self.content_after_usage = true;
        }
    }

    /// Reads one whole line (with its `\n`): what becomes of it.
    fn line(&mut self, line: &[u8]) -> Fate {
        let keep = |over| if over { Fate::Drop } else { Fate::Keep };
        let text = line.strip_suffix(b"\n").unwrap_or(line);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        let Some(data) = text.strip_prefix(b"data:") else {
            return keep(self.over);
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.done = true;
            return keep(self.over);
        }
        if data.is_empty() {
            return keep(self.over);
        }
        let mut event = serde_json::from_slice::<Value>(data).ok();
        let cut = self.count(event.as_mut(), data);
        let passed = self.read(event.as_ref());
        match cut {
            Some(event) => Fate::Replace(event),
            None if passed => keep(self.over),
            None => Fate::Drop,
        }
    }

    /// Counts the output of an event (or of a payload that is not JSON, as text of its
    /// own), and notes when it goes over the bound. The event that goes over is cut to what
    /// fits under the bound ([`OutputCounter::fit`], each text apart, in order): its new
    /// line, if anything of it fits.
    fn count(&mut self, event: Option<&mut Value>, data: &[u8]) -> Option<Vec<u8>> {
        let Some(v) = event else {
            self.output.end_field();
            self.output.push(&String::from_utf8_lossy(data));
            self.output.end_field();
            self.field = None;
            self.check_bound();
            return None;
        };
        // The count before this event, kept only when the event may take it over the bound.
        let mut bytes = 0u64;
        each_output_text(v, &mut |_, text| {
            bytes = bytes.saturating_add(text.len() as u64)
        });
        let before =
            (!self.over && self.output.most_after(bytes) > self.bound).then(|| self.output.clone());
        let (output, field) = (&mut self.output, &mut self.field);
        each_output_text(v, &mut |key, text| {
            if *field != Some(key) {
                output.end_field();
                *field = Some(key);
            }
            output.push(text);
        });
        self.check_bound();
        let mut fitted = before.filter(|_| self.over)?;
        let (bound, mut kept) = (self.bound, false);
        each_output_text(v, &mut |_, text| {
            let n = fitted.fit(text, bound);
            text.truncate(n);
            kept |= n > 0;
            fitted.end_field();
            fitted.push(text);
            fitted.end_field();
        });
        debug_assert!(!fitted.over(bound));
        // A running usage it carried counts what was cut off.
        if let Some(u) = v.get_mut("usage") {
            *u = Value::Null;
        }
        kept.then(|| format!("data: {v}\n\n").into_bytes())
    }

    fn check_bound(&mut self) {
        if !self.over && self.output.over(self.bound) {
            self.over = true;
        }
    }

    /// Reads an event's usage and errors; false when it is to be dropped (a usage chunk the
    /// client did not ask for).
    fn read(&mut self, event: Option<&Value>) -> bool {
        let Some(v) = event else {
            self.saw_content();
            return true;
        };
        let Some(u) = usage_of(v) else {
            if is_error_event(v) {
                self.failed = true;
            }
            self.saw_content();
            return true;
        };
        // The largest of each figure, but the fewest cached tokens: more cached is cheaper.
        self.usage = Some(match self.usage {
            None => u,
            Some(seen) => TokenUsage {
                prompt_tokens: seen.prompt_tokens.max(u.prompt_tokens),
                completion_tokens: seen.completion_tokens.max(u.completion_tokens),
                cached_tokens: seen.cached_tokens.min(u.cached_tokens),
            },
        });
        self.content_after_usage = false;
        let error = is_error_event(v);
        self.failed |= error;
        let no_choices = v
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty);
        self.settled = no_choices && !error;
        // An error event always reaches the client, usage or not.
        error || !(self.strip_usage && no_choices)
    }

    /// What to forward of `chunk` now.
    fn feed(&mut self, chunk: Bytes) -> Bytes {
        // Fast path: nothing carried over, whole lines only, all kept: forward as is.
        if self.line.is_empty() && !self.overflow && chunk.ends_with(b"\n") {
            let mut keep_all = true;
            // Each line kept (its span) or replaced (its new text).
            let mut kept: Vec<Result<(usize, usize), Vec<u8>>> = Vec::new();
            let mut start = 0;
            for (i, b) in chunk.iter().enumerate() {
                if *b == b'\n' {
                    match self.line(&chunk[start..=i]) {
                        Fate::Keep => kept.push(Ok((start, i + 1))),
                        Fate::Drop => keep_all = false,
                        Fate::Replace(r) => {
                            keep_all = false;
                            kept.push(Err(r));
                        }
                    }
                    start = i + 1;
                }
            }
            if keep_all {
                return chunk;
            }
            let mut out = Vec::with_capacity(chunk.len());
            for k in kept {
                match k {
                    Ok((a, b)) => out.extend_from_slice(&chunk[a..b]),
                    Err(r) => out.extend_from_slice(&r),
                }
            }
            return Bytes::from(out);
        }
        let mut out = Vec::with_capacity(chunk.len() + self.line.len());
        let mut rest: &[u8] = &chunk;
        while let Some(pos) = rest.iter().position(|b| *b == b'\n') {
            let (head, tail) = rest.split_at(pos + 1);
            rest = tail;
            if self.overflow {
                self.unread(head, &mut out);
                self.overflow = false;
                continue;
            }
            let mut line = std::mem::take(&mut self.line);
            line.extend_from_slice(head);
            match self.line(&line) {
                Fate::Keep => out.extend_from_slice(&line),
                Fate::Drop => {}
                Fate::Replace(r) => out.extend_from_slice(&r),
            }
        }
        if self.overflow {
            self.unread(rest, &mut out);
        } else {
            self.line.extend_from_slice(rest);
            if self.line.len() > SSE_LINE_BYTES_MAX {
                // Too long to hold: pass it on unread (a usage in it is not trusted, and
                // it may be content after a usage read before), each byte counted as a
                // token of output.
                self.overflow = true;
                self.saw_content();
                let line = std::mem::take(&mut self.line);
                self.unread(&line, &mut out);
            }
        }
        Bytes::from(out)
    }

    /// Part of a line too long to read: counted a token a byte, and forwarded unless the
    /// output is over its bound.
    fn unread(&mut self, bytes: &[u8], out: &mut Vec<u8>) {
        self.output.push_unread(bytes.len() as u64);
        self.check_bound();
        if !self.over {
            out.extend_from_slice(bytes);
        }
    }

    /// The end of the stream: what is left of an unterminated last line.
    fn finish(&mut self) -> Bytes {
        let line = std::mem::take(&mut self.line);
        if self.overflow || line.is_empty() {
            return Bytes::from(line);
        }
        match self.line(&line) {
            Fate::Keep => Bytes::from(line),
            Fate::Drop => Bytes::new(),
            Fate::Replace(r) => Bytes::from(r),
        }
    }

    /// A line was left unterminated.
    fn mid_line(&self) -> bool {
        self.overflow || !self.line.is_empty()
    }
}

/// What becomes of a line of a stream ([`SseTap::line`]).
enum Fate {
    Keep,
    Drop,
    /// The event that went over the output bound, cut to it.
    Replace(Vec<u8>),
}

/// An SSE event carrying an OpenAI-shaped error: what OpenAI itself sends when a stream fails
/// after its head (the `openai` libraries raise it as an API error).
fn sse_error(code: &str, message: &str, mid_line: bool) -> Bytes {
    let event =
        json!({"error": {"type": "server_error", "code": code, "message": message, "param": null}});
    let lead = if mid_line { "\n\n" } else { "" };
    Bytes::from(format!("{lead}data: {event}\n\n"))
}

/// Completes when a proxied call must stop ([`StepGuard::stopped`]).
type Stop = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Longest the proxy goes on reading a stream it cut at the output bound, to count what the
/// upstream had sent already (and may bill), before it closes the connection.
pub const CUT_DRAIN_MAX: Duration = Duration::from_millis(2000);
/// Most bytes read from a stream after it was cut at the output bound.
pub const CUT_DRAIN_BYTES_MAX: usize = 4 * 1024 * 1024;

/// A stream's step at its end (`[DONE]`, or the body's clean end): committed from a usage
/// the tap trusts, else `unknown` (or committed at the usage read or the output counted,
/// when that costs more; see [`settlement`]).
async fn settle_at_end(tap: &mut SseTap, guard: StepGuard, started: Instant) {
    let trusted = tap.end_usage();
    if trusted.is_none() {
        tracing::warn!(
            usage_read = tap.usage.is_some(),
            error_event = tap.failed,
            "upstream stream ended without a usage to trust; charging the step in full (or at a usage read or the output counted, above it)"
        );
    }
    let how = guard.settlement(trusted, tap.usage, tap.output.tally());
    guard.state.metrics.upstream_call(started.elapsed());
    let _ = guard.resolve(how).await;
}

/// How a stream cut at the output bound ended when it was last read.
enum DrainEnd {
    /// `[DONE]` or the body's clean end: the upstream's answer is whole.
    Whole,
    /// Still going (past [`CUT_DRAIN_MAX`] or [`CUT_DRAIN_BYTES_MAX`], or the run's
    /// deadline), or lost.
    Cut,
}

/// Reads (and counts, forwarding nothing) what an upstream sends after its stream was cut
/// at the output bound, until it ends, for at most [`CUT_DRAIN_MAX`] and
/// [`CUT_DRAIN_BYTES_MAX`]: what it had sent already is billed, and is charged.
async fn drain<U>(upstream: Option<&mut U>, tap: &mut SseTap, stop: &mut Stop) -> DrainEnd
where
    U: futures::Stream<Item = reqwest::Result<Bytes>> + Unpin,
{
    let Some(upstream) = upstream.filter(|_| !tap.done) else {
        // (ended already)
        return DrainEnd::Whole;
    };
    let deadline = tokio::time::Instant::now() + CUT_DRAIN_MAX;
    let mut read = 0usize;
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout_at(deadline, upstream.next()) => next,
            _ = &mut *stop => return DrainEnd::Cut,
        };
        match next {
            Ok(Some(Ok(chunk))) => {
                read = read.saturating_add(chunk.len());
                let _ = tap.feed(chunk);
                if tap.done {
                    return DrainEnd::Whole;
                }
                if read > CUT_DRAIN_BYTES_MAX {
                    return DrainEnd::Cut;
                }
            }
            Ok(None) => {
                let _ = tap.finish();
                return DrainEnd::Whole;
            }
            Ok(Some(Err(_))) | Err(_) => return DrainEnd::Cut,
        }
    }
}

/// The body relayed to the client: upstream chunks as they arrive (idle-bounded), cut at the
/// output bound, then the step's resolution: commit from a usage read whole, else `unknown`
/// (or above the reservation: [`settlement`]).
fn relay<U>(
    upstream: U,
    guard: StepGuard,
    idle: Duration,
    tap: SseTap,
    started: Instant,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static
where
    U: futures::Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static,
{
    struct S<B: futures::Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static> {
        /// The upstream's body; dropped (its connection closed) when the stream is cut.
        upstream: Option<B>,
        guard: Option<StepGuard>,
        stop: Stop,
        tap: SseTap,
        idle: Duration,
        started: Instant,
    }
    impl<B: futures::Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static> Drop for S<B> {
        /// The client went away (or the body was dropped) mid-stream: what the upstream had
        /// sent already (and may bill) is read and counted in the background ([`drain`],
        /// bounded like a cut's), then the step is resolved by its guard ([`StepGuard`]'s
        /// `Drop`) from what the tap read and counted (SPEC I1b: an upstream that wrote its
        /// whole answer before the client left is charged for all of it).
        fn drop(&mut self) {
            let Some(mut guard) = self.guard.take() else {
                return;
            };
            let mut tap = std::mem::replace(&mut self.tap, SseTap::new(false, Tokenizer::Bytes, 0));
            let mut stop: Stop =
                std::mem::replace(&mut self.stop, Box::pin(std::future::pending()));
            let upstream = self.upstream.take();
            let Ok(handle) = tokio::runtime::Handle::try_current() else {
                guard.usage = tap.final_usage();
                guard.seen = tap.usage;
                guard.output = tap.output.tally();
                return;
            };
            handle.spawn(async move {
                let mut upstream = upstream;
                let end = drain(upstream.as_mut(), &mut tap, &mut stop).await;
                guard.usage = match end {
                    DrainEnd::Whole => tap.end_usage(),
                    DrainEnd::Cut => tap.final_usage(),
                };
                guard.seen = tap.usage;
                guard.output = tap.output.tally();
                drop(upstream);
                drop(guard);
            });
        }
    }
    let s = S {
        upstream: Some(upstream),
        stop: Box::pin(guard.stopped()),
        guard: Some(guard),
        tap,
        idle,
        started,
    };
    futures::stream::unfold(s, |mut s| async move {
        loop {
            // The guard stays in `s` while the upstream is awaited, so that a client going
            // away (the body dropped) finds it there ([`S`]'s `Drop`).
            s.guard.as_ref()?;
            let upstream = s.upstream.as_mut()?;
            let next = tokio::select! {
                next = tokio::time::timeout(s.idle, upstream.next()) => next,
                _ = &mut s.stop => {
                    let guard = s.guard.take()?;
                    // The run's time is up (or it ended): the upstream connection is dropped
                    // with the stream, and the step is charged in full unless its usage was
                    // read whole.
                    let how = guard.settlement(s.tap.final_usage(), s.tap.usage, s.tap.output.tally());
                    tracing::warn!(usage_read = s.tap.final_usage().is_some(), "a proxied stream reached its run's deadline; cutting it");
                    guard.state.metrics.upstream_call(s.started.elapsed());
                    let _ = guard.resolve(how).await;
                    s.upstream = None;
                    let event = sse_error(
                        "run_deadline_exceeded",
                        "the run's deadline passed; the stream was cut (charged in full unless its usage had arrived)",
                        s.tap.mid_line(),
                    );
                    return Some((Ok(event), s));
                }
            };
            match next {
                Ok(Some(Ok(chunk))) => {
                    let out = s.tap.feed(chunk);
                    let mut guard = s.guard.take()?;
                    guard.usage = s.tap.final_usage();
                    guard.seen = s.tap.usage;
                    if s.tap.over {
                        let event =
                            cut_at_bound(&mut s.tap, Some(upstream), &mut s.stop, guard, s.started)
                                .await;
                        s.upstream = None;
                        let mut bytes = out.to_vec();
                        bytes.extend_from_slice(&event);
                        return Some((Ok(Bytes::from(bytes)), s));
                    }
                    if s.tap.done {
                        // `[DONE]`: the answer is whole. The step is resolved (and a one-step
                        // run finished, freeing the conversation's slot) before the client
                        // reads `[DONE]`, so that its next call is not refused for a slot
                        // this one still held; whatever the upstream sends after is dropped.
                        settle_at_end(&mut s.tap, guard, s.started).await;
                        return (!out.is_empty()).then_some((Ok(out), s));
                    }
                    s.guard = Some(guard);
                    if out.is_empty() {
                        continue;
                    }
                    return Some((Ok(out), s));
                }
                Ok(None) => {
                    // The stream ended: commit from a usage chunk read whole, else charge in
                    // full (or above, see `settlement`).
                    let guard = s.guard.take()?;
                    let tail = s.tap.finish();
                    if s.tap.over {
                        let event =
                            cut_at_bound::<U>(&mut s.tap, None, &mut s.stop, guard, s.started)
                                .await;
                        s.upstream = None;
                        return Some((Ok(event), s));
                    }
                    settle_at_end(&mut s.tap, guard, s.started).await;
                    if tail.is_empty() {
                        return None;
                    }
                    return Some((Ok(tail), s));
                }
                Ok(Some(Err(_))) | Err(_) => {
                    let guard = s.guard.take()?;
                    guard.state.metrics.upstream_call(s.started.elapsed());
                    // Lost mid-stream: trust a usage chunk that was read whole, else unknown
                    // (or above, see `settlement`).
                    let trusted = s.tap.final_usage();
                    let how = guard.settlement(trusted, s.tap.usage, s.tap.output.tally());
                    let message = match (trusted, &how) {
                        (Some(_), _) => "the upstream stream was cut off after its usage; the call was charged at that usage",
                        (None, Resolution::Unknown) => "the upstream stream was cut off or stalled; the call was charged in full",
                        (None, _) => "the upstream stream was cut off or stalled; the call was charged for what it sent, above its reservation",
                    };
                    tracing::warn!(
                        usage_read = trusted.is_some(),
                        "upstream stream failed mid-way"
                    );
                    let _ = guard.resolve(how).await;
                    s.upstream = None;
                    let event = sse_error("upstream_error", message, s.tap.mid_line());
                    return Some((Ok(event), s));
                }
            }
        }
    })
}

/// A stream whose output went over its bound ([`SseTap::over`]): what the upstream had sent
/// already is read and counted ([`drain`]), the step resolved from it ([`settlement`]), and
/// the event that ends the client's stream returned; the caller then drops the upstream's
/// connection, so that it stops generating.
async fn cut_at_bound<U>(
    tap: &mut SseTap,
    upstream: Option<&mut U>,
    stop: &mut Stop,
    guard: StepGuard,
    started: Instant,
) -> Bytes
where
    U: futures::Stream<Item = reqwest::Result<Bytes>> + Unpin,
{
    let end = drain(upstream, tap, stop).await;
    let trusted = match end {
        DrainEnd::Whole => tap.end_usage(),
        DrainEnd::Cut => tap.final_usage(),
    };
    let output = tap.output.tally();
    tracing::warn!(
        bound = tap.bound,
        counted = output.floor,
        usage_read = trusted.is_some(),
        "an upstream streamed past the output bound it was given; the stream was cut at the bound"
    );
    guard.state.metrics.output_cut();
    guard.state.metrics.upstream_call(started.elapsed());
    let how = guard.settlement(trusted, tap.usage, output);
    let _ = guard.resolve(how).await;
    sse_error(
        "upstream_error",
        &format!(
            "the upstream sent more output than the {} tokens it was given; the stream was cut at that bound, and the call charged for all the upstream sent",
            tap.bound
        ),
        tap.mid_line(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok0\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1,",
        "\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\n",
        "data: [DONE]\n\n",
    );
    const USAGE_LINE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n";

    fn run_tap(strip: bool, cuts: &[usize]) -> (String, SseTap) {
        let mut tap = SseTap::new(strip, Tokenizer::Bytes, u64::MAX);
        let mut out = Vec::new();
        let mut from = 0;
        for &to in cuts.iter().chain([STREAM.len()].iter()) {
            let to = to.min(STREAM.len());
            if to < from {
                continue;
            }
            out.extend_from_slice(&tap.feed(Bytes::copy_from_slice(&STREAM.as_bytes()[from..to])));
            from = to;
        }
        out.extend_from_slice(&tap.finish());
        (String::from_utf8(out).expect("utf8"), tap)
    }

    #[test]
    fn tap_reads_usage_and_passes_everything_when_asked() {
        for cut in 0..STREAM.len() {
            let (out, tap) = run_tap(false, &[cut, cut + 7]);
            assert_eq!(out, STREAM, "cut at {cut}");
            assert_eq!(
                tap.usage,
                Some(TokenUsage {
                    prompt_tokens: 9,
                    completion_tokens: 1,
                    cached_tokens: 2
                })
            );
            assert!(tap.done);
        }
    }

    #[test]
    fn tap_hides_the_usage_chunk_from_clients_that_did_not_ask() {
        let expected = STREAM.replace(USAGE_LINE, "");
        for cut in 0..STREAM.len() {
            let (out, tap) = run_tap(true, &[cut]);
            assert_eq!(out, expected, "cut at {cut}");
            assert!(tap.usage.is_some());
        }
    }

    /// One SSE line of a generated stream, and what the tap must make of it.
    #[derive(Debug, Clone)]
    enum Line {
        Delta(String),
        /// A usage chunk without choices (dropped for clients that did not ask for usage).
        Usage(TokenUsage),
        /// A usage on a chunk that also has choices (always passed on).
        UsageWithChoice(TokenUsage),
        Done,
        Blank,
        /// Anything else: comments, other fields, broken JSON (no quote: never a usage key).
        Other(String),
    }

    impl Line {
        fn text(&self) -> String {
            let usage = |u: &TokenUsage| {
                format!(
                    "{{\"prompt_tokens\":{},\"completion_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":{}}}}}",
                    u.prompt_tokens, u.completion_tokens, u.cached_tokens
                )
            };
            match self {
                Line::Delta(t) => format!(
                    "data: {{\"choices\":[{{\"delta\":{{\"content\":{}}}}}],\"usage\":null}}",
                    json!(t)
                ),
                Line::Usage(u) => format!("data: {{\"choices\":[],\"usage\": {}}}", usage(u)),
                Line::UsageWithChoice(u) => format!(
                    "data:{{\"choices\":[{{\"delta\":{{}}}}],\"usage\":{}}}",
                    usage(u)
                ),
                Line::Done => "data: [DONE]".into(),
                Line::Blank => String::new(),
                Line::Other(t) => t.clone(),
            }
        }
    }

    fn line_strategy() -> impl proptest::strategy::Strategy<Value = Line> {
        use proptest::prelude::*;
        let usage =
            (0u64..100_000, 0u64..100_000, 0u64..100_000).prop_map(|(p, c, k)| TokenUsage {
                prompt_tokens: p,
                completion_tokens: c,
                cached_tokens: k,
            });
        prop_oneof![
            ".{0,40}".prop_map(Line::Delta),
            usage.clone().prop_map(Line::Usage),
            usage.prop_map(Line::UsageWithChoice),
            Just(Line::Done),
            Just(Line::Blank),
            "[a-z0-9 :{}\\[\\],\r]{0,60}".prop_map(Line::Other),
        ]
    }

    proptest::proptest! {
        /// Whatever the lines and wherever the stream is cut: a client that asked for usage
        /// gets every byte in order; one that did not gets every byte but the usage-only
        /// lines; the usage read is the largest of every one sent whole (the fewest cached
        /// tokens), trusted at a clean end only when no content followed it and the stream
        /// sent `[DONE]` or ended on a final, choices-less chunk, and at a cut only when it
        /// came in a final, choices-less chunk with nothing after it.
        #[test]
        fn tap_passes_every_byte_and_reads_every_usage(
            lines in proptest::collection::vec(line_strategy(), 0..24),
            crlf in proptest::bool::ANY,
            terminated in proptest::bool::ANY,
            cuts in proptest::collection::vec(0usize..4096, 0..12),
        ) {
            let eol = if crlf { "\r\n" } else { "\n" };
            let mut stream = String::new();
            let mut stripped = String::new();
            // The model: the field-wise largest usage (the smallest cached count); whether
            // content came after the last usage; whether the last event was a choices-less
            // usage chunk.
            let mut max_usage: Option<TokenUsage> = None;
            let (mut after, mut settled) = (false, false);
            let merge = |m: Option<TokenUsage>, u: &TokenUsage| {
                Some(match m {
                    None => *u,
                    Some(m) => TokenUsage {
                        prompt_tokens: m.prompt_tokens.max(u.prompt_tokens),
                        completion_tokens: m.completion_tokens.max(u.completion_tokens),
                        cached_tokens: m.cached_tokens.min(u.cached_tokens),
                    },
                })
            };
            for (i, l) in lines.iter().enumerate() {
                let end = if i + 1 < lines.len() || terminated { eol } else { "" };
                let text = format!("{}{end}", l.text());
                stream.push_str(&text);
                let content = match l {
                    Line::Usage(u) => {
                        max_usage = merge(max_usage, u);
                        (after, settled) = (false, true);
                        false
                    }
                    Line::UsageWithChoice(u) => {
                        max_usage = merge(max_usage, u);
                        (after, settled) = (false, false);
                        stripped.push_str(&text);
                        false
                    }
                    Line::Delta(_) => {
                        stripped.push_str(&text);
                        true
                    }
                    Line::Other(t) => {
                        stripped.push_str(&text);
                        t.trim_end_matches('\r')
                            .strip_prefix("data:")
                            .is_some_and(|d| !d.trim().is_empty())
                    }
                    Line::Done | Line::Blank => {
                        stripped.push_str(&text);
                        false
                    }
                };
                if content {
                    settled = false;
                    after |= max_usage.is_some();
                }
            }
            let done = lines.iter().any(|l| matches!(l, Line::Done));
            let end_usage = max_usage.filter(|_| !after && (done || settled));
            let final_usage = max_usage.filter(|_| settled && !after);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(stream.len())).collect();
            cuts.sort_unstable();
            for strip in [false, true] {
                let mut tap = SseTap::new(strip, Tokenizer::Bytes, u64::MAX);
                let mut out = Vec::new();
                let mut from = 0;
                for &to in cuts.iter().chain([stream.len()].iter()) {
                    out.extend_from_slice(&tap.feed(Bytes::copy_from_slice(&stream.as_bytes()[from..to])));
                    from = to;
                }
                out.extend_from_slice(&tap.finish());
                let expected = if strip { &stripped } else { &stream };
                proptest::prop_assert_eq!(String::from_utf8_lossy(&out), expected.as_str());
                proptest::prop_assert_eq!(tap.usage, max_usage);
                proptest::prop_assert_eq!(tap.end_usage(), end_usage);
                proptest::prop_assert_eq!(tap.final_usage(), final_usage);
                proptest::prop_assert_eq!(tap.done, done);
            }
        }
    }

    fn tap_of(stream: &str) -> SseTap {
        let mut tap = SseTap::new(false, Tokenizer::Bytes, u64::MAX);
        let out = tap.feed(Bytes::copy_from_slice(stream.as_bytes()));
        assert_eq!(out, stream.as_bytes(), "passed through whole");
        assert!(tap.finish().is_empty());
        tap
    }

    fn usage(p: u64, c: u64, cached: u64) -> TokenUsage {
        TokenUsage {
            prompt_tokens: p,
            completion_tokens: c,
            cached_tokens: cached,
        }
    }

    /// More cached tokens cost less: of several usages, the fewest cached is kept.
    #[test]
    fn tap_keeps_the_fewest_cached_tokens() {
        let tap = tap_of(concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":1000,\"completion_tokens\":0,\"prompt_tokens_details\":{\"cached_tokens\":800}}}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1000,\"completion_tokens\":100,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
            "data: [DONE]\n\n",
        ));
        assert_eq!(tap.end_usage(), Some(usage(1000, 100, 0)));
        assert_eq!(tap.final_usage(), Some(usage(1000, 100, 0)));
    }

    /// An error event's usage is never trusted, nor any usage of its stream; the event
    /// reaches a client that did not ask for usage too.
    #[test]
    fn tap_does_not_trust_a_stream_that_reported_an_error() {
        let content = "data: {\"choices\":[{\"delta\":{\"content\":\"error\"}}]}\n\n";
        let errors = [
            "data: {\"error\":{\"message\":\"overloaded\"},\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":0}}\n\n",
            "data: {\"choices\":[],\"error\":{\"message\":\"x\"},\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":0}}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"error\"}],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}\n\n",
            "data: {\"error\":{\"message\":\"no usage here\"}}\n\n",
        ];
        let final_usage =
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}\n\n";
        for e in errors {
            for stream in [
                format!("{content}{e}data: [DONE]\n\n"),
                format!("{content}{e}{final_usage}data: [DONE]\n\n"),
                format!("{final_usage}{e}"),
            ] {
                let tap = tap_of(&stream);
                assert!(tap.failed, "{stream}");
                assert_eq!(tap.end_usage(), None, "{stream}");
                assert_eq!(tap.final_usage(), None, "{stream}");
            }
            let mut strip = SseTap::new(true, Tokenizer::Bytes, u64::MAX);
            let out = strip.feed(Bytes::copy_from_slice(e.as_bytes()));
            assert!(
                String::from_utf8_lossy(&out).contains("\"error\""),
                "an error event is never dropped: {e}"
            );
        }
        // A content token that happens to be "error" is content, not an error.
        let tap = tap_of(&format!("{content}{final_usage}data: [DONE]\n\n"));
        assert!(!tap.failed);
        assert_eq!(tap.end_usage(), Some(usage(9, 1, 0)));
        let tap = tap_of(&format!(
            "{content}data: {{\"error\":null}}\n\n{final_usage}"
        ));
        assert!(!tap.failed);
    }

    /// A clean end trusts a usage only after `[DONE]` or a final, choices-less usage chunk.
    #[test]
    fn tap_trusts_a_clean_end_only_after_done_or_a_final_usage() {
        let running = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4}}\n\n";
        let final_usage =
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":5}}\n\n";
        assert_eq!(tap_of(running).end_usage(), None);
        assert_eq!(
            tap_of(&format!("{running}data: [DONE]\n\n")).end_usage(),
            Some(usage(9, 4, 0))
        );
        assert_eq!(
            tap_of(&format!("{running}{final_usage}")).end_usage(),
            Some(usage(9, 5, 0))
        );
        assert_eq!(
            tap_of(&format!("{running}{final_usage}: comment\n\n")).end_usage(),
            Some(usage(9, 5, 0))
        );
    }

    /// A trusted usage is committed, never below the output counted; without one, the step
    /// is `unknown` unless the usage read or the output counted costs more than the hold.
    #[test]
    fn settlements_are_never_below_what_was_shown() {
        let price = ModelPrice {
            input_per_million: Micros(1_000_000),
            cached_input_per_million: Micros(1_000_000),
            output_per_million: Micros(2_000_000),
        };
        let u = usage(10, 5, 0);
        assert_eq!(price.charge(&u), Micros(20));
        let tally = |floor, upper| OutputTally { floor, upper };
        let settle = |reserved, trusted, seen, output| {
            settlement(
                (price, Micros(reserved)),
                (10, 5),
                Observed {
                    trusted,
                    seen,
                    output,
                },
            )
        };
        let commit = |p, c, k| Resolution::Commit(Settlement::Tokens(usage(p, c, k)));
        // An untrusted usage: committed only when it costs more than the hold.
        assert_eq!(settle(20, None, Some(u), tally(0, 0)), Resolution::Unknown);
        assert_eq!(settle(100, None, Some(u), tally(0, 0)), Resolution::Unknown);
        assert_eq!(settle(19, None, None, tally(0, 0)), Resolution::Unknown);
        assert_eq!(settle(19, None, Some(u), tally(0, 0)), commit(10, 5, 0));
        // A trusted usage: never below the floor of the output counted.
        assert_eq!(settle(20, Some(u), Some(u), tally(3, 9)), commit(10, 5, 0));
        assert_eq!(settle(20, Some(u), Some(u), tally(8, 40)), commit(10, 8, 0));
        // No usage: the output within the bound is covered by the hold; past it, the most
        // it can have cost (`upper`) is charged, with the prompt bound.
        assert_eq!(settle(20, None, None, tally(5, 30)), Resolution::Unknown);
        assert_eq!(settle(20, None, None, tally(6, 30)), commit(10, 30, 0));
        // An untrusted usage and output past the bound: the usage, its completion lifted.
        let cached = usage(10, 2, 4);
        assert_eq!(
            settle(20, None, Some(cached), tally(7, 12)),
            commit(10, 12, 4)
        );
    }

    /// A mock-like stream of `words` words in chunks of `per_chunk`, with a final usage
    /// chunk and `[DONE]`.
    fn word_stream(words: u64, per_chunk: u64, reported: u64) -> String {
        let mut out = String::new();
        let mut i = 0;
        while i < words {
            let to = (i + per_chunk).min(words);
            let text: String = (i..to)
                .map(|k| {
                    if k == 0 {
                        "tok0".to_string()
                    } else {
                        format!(" tok{k}")
                    }
                })
                .collect();
            out.push_str(&format!(
                "data: {}\n\n",
                json!({"choices": [{"index": 0, "delta": {"content": text}}], "usage": null})
            ));
            i = to;
        }
        out.push_str(&format!(
            "data: {}\n\ndata: [DONE]\n\n",
            json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": reported}})
        ));
        out
    }

    fn words_relayed(out: &str) -> u64 {
        let mut text = String::new();
        for e in out.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if let Ok(v) = serde_json::from_str::<Value>(e) {
                if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                    text.push_str(t);
                }
            }
        }
        text.split_whitespace().count() as u64
    }

    proptest::proptest! {
        /// Wherever the stream is cut into chunks: a stream within its bound passes whole; one
        /// past it passes at most the bound (a word a token, as the mock counts), nothing after
        /// the event that went over, and every word sent is counted.
        #[test]
        fn tap_cuts_a_stream_at_its_bound(
            words in 0u64..60,
            per_chunk in 1u64..6,
            bound in 1u64..40,
            cuts in proptest::collection::vec(0usize..4096, 0..8),
            bpe in proptest::bool::ANY,
        ) {
            let stream = word_stream(words, per_chunk, words);
            let tokenizer = if bpe { Tokenizer::O200kBase } else { Tokenizer::Bytes };
            let mut tap = SseTap::new(false, tokenizer, bound);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(stream.len())).collect();
            cuts.sort_unstable();
            let mut out = Vec::new();
            let mut from = 0;
            for &to in cuts.iter().chain([stream.len()].iter()) {
                out.extend_from_slice(&tap.feed(Bytes::copy_from_slice(&stream.as_bytes()[from..to])));
                from = to;
            }
            out.extend_from_slice(&tap.finish());
            let out = String::from_utf8(out).expect("utf8");
            let floor = tap.output.tally().floor;
            proptest::prop_assert!(floor >= words, "{} < {}", floor, words);
            if !bpe {
                proptest::prop_assert_eq!(floor, words);
            }
            if floor <= bound {
                proptest::prop_assert!(!tap.over);
                proptest::prop_assert_eq!(out.as_str(), stream.as_str());
            } else {
                proptest::prop_assert!(tap.over);
                // The event that went over is cut to what fits: a word a token, exactly.
                if bpe {
                    proptest::prop_assert!(words_relayed(&out) <= bound);
                } else {
                    proptest::prop_assert_eq!(words_relayed(&out), bound);
                }
                let usage_passed = out.contains("\"completion_tokens\"");
                proptest::prop_assert!(!out.contains("[DONE]") && !usage_passed, "{}", out);
                // A usage read after the cut is still read (the step's charge).
                proptest::prop_assert_eq!(tap.end_usage().map(|u| u.completion_tokens), Some(words));
            }
        }
    }

    /// Every text an upstream generates counts, in every field, and nothing else does.
    #[test]
    fn every_generated_text_counts() {
        let mut event = json!({"choices": [{"index": 0, "message": {
            "role": "assistant",
            "reasoning_content": "r1", "reasoning": "r2",
            "content": [{"type": "text", "text": "c1", "annotations": []}, "c2"],
            "refusal": "no",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "call_2", "type": "custom", "custom": {"name": "g", "input": "in"}}
            ],
            "function_call": {"name": "h", "arguments": "a"},
        }, "logprobs": {"content": [{"token": "x"}]}, "finish_reason": "stop"}]});
        let mut seen = Vec::new();
        each_output_text(&mut event, &mut |k, t| seen.push((k, t.clone())));
        let texts: Vec<&str> = seen.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(
            texts,
            ["r1", "r2", "c1", "c2", "no", "f", "{}", "g", "in", "h", "a"]
        );
        // Each field its own key: a stream's pieces of one field are counted as one text.
        let keys: std::collections::BTreeSet<FieldKey> = seen.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys.len(), 10);
    }

    /// A whole answer within its bound passes as it came; one past it is cut to the bound,
    /// in the order generated, ends with `"length"`, and a tool call left without a name goes.
    #[test]
    fn a_whole_answer_past_its_bound_is_cut_to_it() {
        let words = |n: u64| -> String {
            (0..n)
                .map(|k| {
                    if k == 0 {
                        "tok0".to_string()
                    } else {
                        format!(" tok{k}")
                    }
                })
                .collect()
        };
        let answer = |content: String| {
            json!({"id": "x", "choices": [{"index": 0, "message": {"role": "assistant",
                "content": content, "refusal": null}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 9, "completion_tokens": 30}})
        };
        let within = Bytes::from(answer(words(20)).to_string());
        let a = read_answer(Tokenizer::Bytes, 20, within.clone());
        assert!(!a.cut && !a.unreadable);
        assert_eq!(a.body, within, "passed as it came");
        assert_eq!(a.output.floor, 20);
        assert_eq!(a.usage.map(|u| u.completion_tokens), Some(30));

        for t in [Tokenizer::Bytes, Tokenizer::O200kBase] {
            let a = read_answer(t, 20, Bytes::from(answer(words(500)).to_string()));
            assert!(a.cut, "{t:?}");
            assert!(a.output.floor >= 500, "counted whole: {t:?}");
            let v: Value = serde_json::from_slice(&a.body).expect("json");
            let content = v["choices"][0]["message"]["content"]
                .as_str()
                .expect("content");
            let kept = content.split_whitespace().count() as u64;
            assert!((5..=20).contains(&kept), "{t:?}: {kept}");
            assert_eq!(v["choices"][0]["finish_reason"], "length");
            assert_eq!(v["usage"]["completion_tokens"], 30, "the usage as reported");
        }

        // Reasoning first, then content, then tool calls: what comes after the bound goes.
        let v = json!({"choices": [{"index": 0, "message": {"role": "assistant",
            "reasoning_content": words(15), "content": words(10),
            "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "web_search", "arguments": "{\"q\":\"x\"}"}}]},
            "finish_reason": "tool_calls"}]});
        let a = read_answer(Tokenizer::Bytes, 20, Bytes::from(v.to_string()));
        assert!(a.cut);
        let v: Value = serde_json::from_slice(&a.body).expect("json");
        let m = &v["choices"][0]["message"];
        assert_eq!(m["reasoning_content"], words(15));
        assert_eq!(m["content"], words(5));
        assert_eq!(m["tool_calls"], json!([]));
        assert_eq!(v["choices"][0]["finish_reason"], "length");

        // Not JSON: a token a byte; passed on only within the bound.
        let a = read_answer(Tokenizer::Bytes, 20, Bytes::from_static(b"plain text"));
        assert!(!a.unreadable && !a.cut);
        assert_eq!(
            a.output,
            OutputTally {
                floor: 10,
                upper: 10
            }
        );
        let a = read_answer(Tokenizer::Bytes, 20, Bytes::from("z".repeat(21)));
        assert!(a.unreadable);
    }

    #[test]
    fn upstream_headers_pass_whole_but_ours_and_hop_by_hop() {
        let mut from = reqwest::header::HeaderMap::new();
        for (k, v) in [
            ("vary", "accept-encoding"),
            ("vary", "origin"),
            ("link", "<a>; rel=a"),
            ("link", "<b>; rel=b"),
            ("connection", "keep-alive, X-Hop"),
            ("x-hop", "1"),
            ("proxy-authenticate", "Basic"),
            ("spendgate-outcome", "committed"),
            ("spendgate-charged-micros", "0"),
            ("set-cookie", "a=b"),
            ("x-request-id", "r1"),
        ] {
            from.append(
                reqwest::header::HeaderName::from_static(k),
                reqwest::header::HeaderValue::from_static(v),
            );
        }
        let mut to = HeaderMap::new();
        pass_headers(&from, &mut to);
        let all = |k: &str| -> Vec<&str> {
            to.get_all(k)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect()
        };
        assert_eq!(all("vary"), ["accept-encoding", "origin"]);
        assert_eq!(all("link"), ["<a>; rel=a", "<b>; rel=b"]);
        assert_eq!(all("x-request-id"), ["r1"]);
        assert_eq!(to.len(), 5, "{to:?}");
    }

    #[test]
    fn tap_does_not_trust_a_cut_usage_line() {
        let cut = STREAM.find("\"completion_tokens\"").expect("in stream");
        let mut tap = SseTap::new(false, Tokenizer::Bytes, u64::MAX);
        let _ = tap.feed(Bytes::copy_from_slice(&STREAM.as_bytes()[..cut]));
        assert!(tap.usage.is_none());
        assert!(tap.mid_line());
        assert!(sse_error("x", "y", tap.mid_line()).starts_with(b"\n\ndata: "));
    }

    #[test]
    fn tap_passes_over_long_lines_unread() {
        let mut tap = SseTap::new(true, Tokenizer::Bytes, u64::MAX);
        let long = format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":1}},\"pad\":\"{}\"}}\n",
            "x".repeat(2 * SSE_LINE_BYTES_MAX)
        );
        let mut out = Vec::new();
        for piece in long.as_bytes().chunks(64 * 1024) {
            out.extend_from_slice(&tap.feed(Bytes::copy_from_slice(piece)));
        }
        out.extend_from_slice(&tap.finish());
        assert!(out == long.as_bytes(), "passed through whole");
        assert!(tap.usage.is_none(), "an unread usage is not trusted");
        assert!(!tap.mid_line());
    }

    #[test]
    fn reasoning_tokens_are_never_charged_below_what_is_reported() {
        let usage = |details: Value| {
            usage_of(
                &json!({"usage": {"prompt_tokens": 10, "completion_tokens": 50,
                "completion_tokens_details": details}}),
            )
            .map(|u| u.completion_tokens)
        };
        // Included in completion_tokens, as OpenAI reports them.
        assert_eq!(usage(json!({"reasoning_tokens": 40})), Some(50));
        assert_eq!(usage(json!({})), Some(50));
        // More reasoning than completion: reported beside it, so both are charged.
        assert_eq!(usage(json!({"reasoning_tokens": 300})), Some(350));
        // Reasoning beside completion but fewer (xAI's way): the total says what was made.
        let u = usage_of(
            &json!({"usage": {"prompt_tokens": 10, "completion_tokens": 300,
            "total_tokens": 410, "completion_tokens_details": {"reasoning_tokens": 100}}}),
        )
        .expect("usage");
        assert_eq!(u.completion_tokens, 400);
        // A total at or below prompt + completion changes nothing.
        let u = usage_of(
            &json!({"usage": {"prompt_tokens": 10, "completion_tokens": 300,
            "total_tokens": 310}}),
        )
        .expect("usage");
        assert_eq!(u.completion_tokens, 300);
        // Cache writes are charged once more at the input price.
        let u = usage_of(
            &json!({"usage": {"prompt_tokens": 5010, "completion_tokens": 5,
            "prompt_tokens_details": {"cache_write_tokens": 5000, "cached_tokens": 7}}}),
        )
        .expect("usage");
        assert_eq!((u.prompt_tokens, u.cached_tokens), (10_010, 7));
    }

    #[test]
    fn redaction() {
        let key = "sk-secret-123456";
        let body = Bytes::from(format!(
            "{{\"error\":\"Incorrect API key provided: {key}\"}}"
        ));
        let out = redact(body, key);
        assert!(!String::from_utf8_lossy(&out).contains(key));
        assert!(String::from_utf8_lossy(&out).contains("***"));
        let plain = Bytes::from_static(b"{\"error\":\"nothing\"}");
        assert_eq!(redact(plain.clone(), key), plain);
        assert_eq!(redact(plain.clone(), ""), plain);
    }

    /// Text parts are counted at least as each would be alone: pieces that join into fewer
    /// tokens ("hel" + "lo") are not under-counted.
    #[test]
    fn text_parts_count_at_least_their_sum() {
        let pieces = [
            "hel",
            "lo",
            " wor",
            "ld",
            "!",
            "\u{e9}t\u{e9}",
            "12",
            "34",
            "  ",
            "x.",
        ];
        let parts: Vec<Value> = pieces
            .iter()
            .map(|t| json!({"type": "text", "text": t}))
            .collect();
        let body = json!({"messages": [{"role": "user", "content": parts}]});
        let p = prompt_texts(&body).expect("texts");
        let joined = p
            .texts
            .iter()
            .map(|t| tokens::count(Tokenizer::O200kBase, t))
            .sum::<u64>();
        let apart = pieces
            .iter()
            .map(|t| tokens::count(Tokenizer::O200kBase, t))
            .sum::<u64>();
        assert!(joined >= apart, "{joined} < {apart}");
    }

    #[test]
    fn byte_bound_is_never_below_the_mocks_count() {
        let bodies = [
            json!({"messages": [{"role": "user", "content": "hello"}]}),
            json!({"messages": [{"role": "system", "content": "é".repeat(33)},
                {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": "defgh"}]}]}),
            json!({"messages": [{"role": "user", "content": "search"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "web_search", "arguments": "{\"q\":\"rust\"}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "result"}],
                "tools": [{"type": "function", "function": {"name": "web_search"}}]}),
        ];
        for b in &bodies {
            let (ours, _, _) = prompt_tokens(Tokenizer::Bytes, b).expect("bound");
            assert!(ours >= spendgate_mock_upstream::prompt_tokens_of(b), "{b}");
        }
        // The legacy `function_call` is billed by the upstream (and the mock) as prompt text,
        // and so is any message or request field a gateway does not know.
        let args = format!("{{\"q\":\"{}\"}}", "x".repeat(5000));
        let legacy = json!({"messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": args}}]});
        let (ours, _, _) = prompt_tokens(Tokenizer::Bytes, &legacy).expect("bound");
        assert!(
            ours >= spendgate_mock_upstream::prompt_tokens_of(&legacy),
            "{ours}"
        );
        assert!(ours > 5000, "{ours}");
        let plain = json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5});
        let (base, _, _) = prompt_tokens(Tokenizer::Bytes, &plain).expect("bound");
        for extra in [
            json!({"messages": [{"role": "user", "content": "hi", "context": "y".repeat(3000)}]}),
            json!({"messages": [{"role": "user", "content": "hi"}], "documents": ["z".repeat(3000)]}),
        ] {
            let (ours, _, _) = prompt_tokens(Tokenizer::Bytes, &extra).expect("bound");
            assert!(ours >= base + 3000, "{extra}: {ours} vs {base}");
        }
        let e = prompt_tokens(Tokenizer::Bytes, &json!({"messages": ["hi"]})).expect_err("shape");
        assert_eq!(e.code, "invalid_request");
        let (_, tool, user) = prompt_tokens(Tokenizer::Bytes, &bodies[2]).expect("bound");
        assert_eq!((tool, user), (6, 6));
        assert!(prompt_tokens(Tokenizer::Bytes, &json!({"messages": []})).is_err());
    }

    fn message_strategy() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let text = ".{0,80}";
        let content = prop_oneof![
            text.prop_map(Value::from),
            Just(Value::Null),
            proptest::collection::vec(text, 0..4).prop_map(|parts| {
                Value::Array(
                    parts
                        .into_iter()
                        .map(|t| json!({"type": "text", "text": t}))
                        .collect(),
                )
            }),
        ];
        let calls = proptest::collection::vec(text, 0..3).prop_map(|args| {
            Value::Array(
                args.into_iter()
                    .map(|a| json!({"id": "c", "type": "function", "function": {"name": "f", "arguments": a}}))
                    .collect(),
            )
        });
        (
            prop_oneof![
                Just("user"),
                Just("assistant"),
                Just("system"),
                Just("tool")
            ],
            content,
            proptest::option::of(calls),
            proptest::option::of(text),
            proptest::option::of(("[a-z_]{1,12}", text)),
        )
            .prop_map(|(role, content, calls, legacy, extra)| {
                let mut m = json!({"role": role, "content": content});
                if let Some(c) = calls {
                    m["tool_calls"] = c;
                }
                if let Some(a) = legacy {
                    m["function_call"] = json!({"name": "f", "arguments": a});
                }
                if let Some((k, v)) = extra {
                    if !matches!(k.as_str(), "role" | "content" | "audio") {
                        m[k] = Value::from(v);
                    }
                }
                m
            })
    }

    proptest::proptest! {
        /// Whatever text a message carries and wherever it carries it, the one-token-per-byte
        /// bound is never below what the mock upstream bills.
        #[test]
        fn the_byte_bound_covers_every_message_shape(
            messages in proptest::collection::vec(message_strategy(), 1..6),
        ) {
            let body = json!({"model": "m", "messages": messages});
            let (ours, _, _) = prompt_tokens(Tokenizer::Bytes, &body).expect("text only");
            let billed = spendgate_mock_upstream::prompt_tokens_of(&body);
            proptest::prop_assert!(ours >= billed, "{} < {}: {}", ours, billed, body);
        }
    }

    #[test]
    fn what_cannot_be_priced_as_text_is_refused() {
        let user = |content: Value| json!({"messages": [{"role": "user", "content": content}]});
        let refused = [
            user(json!([{"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])),
            user(json!([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])),
            user(json!([{"type": "file", "file": {"file_id": "f"}}])),
            user(json!([{"text": "no type"}])),
            user(json!([{"type": "text"}])),
            json!({"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}),
            json!({"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}}),
            json!({"messages": [{"role": "user", "content": "hi"}], "web_search_options": {}}),
            json!({"messages": [{"role": "user", "content": "hi"}], "service_tier": "priority"}),
            json!({"messages": [{"role": "user", "content": "hi"}],
                "prediction": {"type": "content", "content": "x"}}),
            json!({"messages": [{"role": "assistant", "content": null, "audio": {"id": "audio_1"}},
                {"role": "user", "content": "and?"}]}),
            // Paid options of OpenAI-compatible gateways.
            json!({"messages": [{"role": "user", "content": "hi"}],
                "plugins": [{"id": "web", "max_results": 10}]}),
            json!({"messages": [{"role": "user", "content": "hi"}], "models": ["openai/o1-pro"]}),
            json!({"messages": [{"role": "user", "content": "hi"}],
                "provider": {"order": ["dearest"], "allow_fallbacks": false}}),
            json!({"messages": [{"role": "user", "content": "hi"}], "fallbacks": ["gpt-4.5"]}),
            json!({"messages": [{"role": "user", "content": "hi"}], "best_of": 8}),
            json!({"messages": [{"role": "user", "content": "hi"}], "best_of": "8"}),
            json!({"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true}),
            json!({"messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "openrouter:web_search"}]}),
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]}),
            user(json!([{"type": "text", "text": "long context",
                "cache_control": {"type": "ephemeral", "ttl": "1h"}}])),
        ];
        for b in &refused {
            let e = prompt_tokens(Tokenizer::Bytes, b).expect_err("refused");
            assert_eq!(e.code, "invalid_request", "{b}");
        }
        let accepted = [
            user(json!([{"type": "text", "text": "a"}])),
            json!({"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": "hi"}],
                "modalities": ["text"], "service_tier": "auto", "audio": null}),
            json!({"messages": [{"role": "user", "content": "hi"}], "service_tier": "flex"}),
            json!({"messages": [{"role": "user", "content": "hi"}], "best_of": 1,
                "use_beam_search": false, "provider": null}),
            json!({"messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
        ];
        for b in &accepted {
            assert!(prompt_tokens(Tokenizer::Bytes, b).is_ok(), "{b}");
        }
    }
}
