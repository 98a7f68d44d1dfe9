//! `POST /v1/messages` (SPEC §6): Anthropic's Messages shape, through the same flow as chat
//! completions ([`crate::chat`]), with its own pieces: the prompt (system, messages, tool
//! results, text blocks; images and documents refused), the output options (`max_tokens`
//! required, extended thinking's `budget_tokens` within it), the usage (`usage` of an
//! answer, or of `message_start` and `message_delta` events: input, cache writes, cache reads,
//! output, each priced), the output texts (text, thinking, tool input), and a stream's error
//! event in Anthropic's shape. Every error answer on the path leaves in Anthropic's shape too
//! (`spendgate_wire::anthropic`, applied by the router's outer layers to every answer on
//! [`MESSAGES_PATH`](spendgate_http::router::MESSAGES_PATH), the capacity layer's included).
//!
//! Cache writes are priced at the model's `cache_write_per_million` and cache reads at its
//! `cached_input_per_million`. The ledger prices a step's tokens in three classes (input,
//! cached input, output), so a call whose request asks for caching (any `cache_control`) is
//! reserved with its input priced at the cache write price (every prompt token may be
//! written), and its usage is committed with the input and the cache writes as input tokens
//! at that price, rounded up: exact when the cache write price is a multiple of the input
//! price (the default is twice it), else at most one input token's price above.

use crate::bounds::MESSAGES_MAX;
use crate::prompt::{check_service_tier, push_billed_fields, PromptTexts};
use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use bytes::Bytes;
use serde_json::{json, Value};
use spendgate_core::{Micros, ModelPrice, TokenUsage};
use spendgate_tokens::{TOKENS_PER_MESSAGE, TOKENS_PER_REQUEST};
use spendgate_wire::anthropic;
use spendgate_wire::error::{ApiError, ApiResult, ErrorCode};

/// The `anthropic-version` sent upstream when the client sends none.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// Tokens Anthropic adds to the system prompt of a request with tools (346 at most for the
/// models documented), reserved on top of the tools' own text.
pub const TOOLS_SYSTEM_TOKENS: u64 = 512;

/// Top-level request fields that carry no text Anthropic bills as prompt tokens; every other
/// field is counted as its JSON text (`tools`, `tool_choice`, and any field not known here).
pub(crate) const UNBILLED_FIELDS: [&str; 13] = [
    "model",
    "messages",
    "system",
    "max_tokens",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "metadata",
    "thinking",
    "service_tier",
    "cache_control",
];

/// Content block types whose text is counted. Any other (an image, a document, a search
/// result, a server tool's result) is refused: Anthropic bills it by what it holds, which
/// spendgate can neither count nor price (SPEC §6: no price, no call).
const TEXT_BLOCKS: [&str; 5] = [
    "text",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
];

/// The texts of one content block (or a `content` string) appended to `out`; `cache`: the
/// block asks for caching. A block of another type is refused.
fn block_text(block: &Value, out: &mut String, cache: &mut bool, depth: usize) -> ApiResult<()> {
    let fields = match block {
        Value::String(s) => {
            out.push_str(s);
            return Ok(());
        }
        Value::Object(fields) => fields,
        _ => {
            return Err(ApiError::invalid(
                "each content block must be a JSON object",
            ))
        }
    };
    let kind = fields.get("type").and_then(Value::as_str);
    if !kind.is_some_and(|k| TEXT_BLOCKS.contains(&k)) {
        return Err(ApiError::invalid(format!(
            "content blocks of type {} cannot be bounded or priced here; only text, tool use, \
             tool result and thinking blocks are accepted",
            kind.map_or_else(|| "(none)".to_string(), |k| format!("{k:?}"))
        )));
    }
    for (k, v) in fields {
        match (k.as_str(), v) {
            ("type", _) | (_, Value::Null) => {}
            ("cache_control", _) => *cache = true,
            ("content", Value::Array(parts)) if depth > 0 => {
                for (i, p) in parts.iter().enumerate() {
                    if i > 0 {
                        out.push('\n');
                    }
                    block_text(p, out, cache, depth - 1)?;
                }
            }
            (_, Value::String(s)) => {
                out.push('\n');
                out.push_str(s);
            }
            (_, other) => {
                out.push('\n');
                out.push_str(&other.to_string());
            }
        }
    }
    Ok(())
}

/// A message's (or the system prompt's) content: a string or an array of blocks. The bytes
/// of its tool results apart, and the largest of them.
fn content_texts(content: &Value, out: &mut String, cache: &mut bool) -> ApiResult<(u64, u64)> {
    let (mut results, mut largest) = (0u64, 0u64);
    match content {
        Value::String(s) => out.push_str(s),
        Value::Array(blocks) => {
            for (i, b) in blocks.iter().enumerate() {
                if i > 0 {
                    out.push('\n');
                }
                let before = out.len();
                block_text(b, out, cache, 2)?;
                if b.get("type").and_then(Value::as_str) == Some("tool_result") {
                    let n = (out.len() - before) as u64;
                    results = results.saturating_add(n);
                    largest = largest.max(n);
                }
            }
        }
        Value::Null => {}
        _ => {
            return Err(ApiError::invalid(
                "\"content\" must be a string or an array of content blocks",
            ))
        }
    }
    Ok((results, largest))
}

/// What a Messages request costs as prompt: its texts ([`PromptTexts`]) and whether it asks
/// for prompt caching.
pub(crate) fn prompt_texts(body: &Value) -> ApiResult<(PromptTexts, bool)> {
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
    let mut cache = body.get("cache_control").is_some_and(|c| !c.is_null());
    let mut texts = Vec::with_capacity(messages.len() + 2);
    let mut overhead = TOKENS_PER_REQUEST;
    if let Some(system) = body.get("system").filter(|s| !s.is_null()) {
        let mut text = String::new();
        content_texts(system, &mut text, &mut cache)?;
        texts.push(text);
        overhead = overhead.saturating_add(TOKENS_PER_MESSAGE);
    }
    let (mut largest_tool_result, mut last_user_bytes) = (0u64, 0u64);
    for m in messages {
        let fields = m
            .as_object()
            .ok_or_else(|| ApiError::invalid("each message must be a JSON object"))?;
        let mut text = String::new();
        let mut tool_results = 0u64;
        for (k, v) in fields {
            match (k.as_str(), v) {
                (_, Value::Null) => {}
                ("content", c) => {
                    let (results, largest) = content_texts(c, &mut text, &mut cache)?;
                    tool_results = results;
                    largest_tool_result = largest_tool_result.max(largest);
                }
                (_, Value::String(s)) => text.push_str(s),
                (_, other) => text.push_str(&other.to_string()),
            }
        }
        if m.get("role").and_then(Value::as_str) == Some("user") {
            last_user_bytes = (text.len() as u64).saturating_sub(tool_results);
        }
        texts.push(text);
        overhead = overhead.saturating_add(TOKENS_PER_MESSAGE);
    }
    if body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        overhead = overhead.saturating_add(TOOLS_SYSTEM_TOKENS);
    }
    push_billed_fields(body, &UNBILLED_FIELDS, &mut texts);
    let bytes = texts.iter().map(|t| t.len() as u64).sum();
    Ok((
        PromptTexts {
            texts,
            overhead,
            bytes,
            largest_tool_result,
            last_user_bytes,
        },
        cache,
    ))
}

/// Request options Anthropic bills beyond the text tokens reserved here are refused (SPEC §6:
/// no price, no call): server tools (web search, web fetch, code execution) and
/// Anthropic-defined client tools (their hidden prompts), MCP servers, containers, and a
/// service tier above the standard one.
fn check_priced_as_text(body: &Value) -> ApiResult<()> {
    for k in ["mcp_servers", "container"] {
        if body.get(k).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(format!(
                "\"{k}\" is charged beyond the text tokens reserved here"
            )));
        }
    }
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        let tools = tools
            .as_array()
            .ok_or_else(|| ApiError::invalid("\"tools\" must be an array"))?;
        for t in tools {
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(kind) => {
                    return Err(ApiError::invalid(format!(
                        "tools of type {kind:?} are run or billed by the upstream; only custom \
                         tools (name, description, input_schema) are accepted"
                    )))
                }
            }
        }
    }
    check_service_tier(body, &["auto", "standard_only"])
}

/// The request's output bound (`max_tokens`, required) and whether it streams. Extended
/// thinking's `budget_tokens` must be a positive integer; it is clamped under the forwarded
/// bound ([`clamp_thinking`]).
pub(crate) fn output_options(body: &Value) -> ApiResult<(Option<u64>, bool)> {
    let requested = body
        .get("max_tokens")
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
        .ok_or_else(|| ApiError::invalid("\"max_tokens\" is required: a positive integer"))?;
    if let Some(t) = body.get("thinking").filter(|t| !t.is_null()) {
        match t.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                t.get("budget_tokens")
                    .and_then(Value::as_u64)
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        ApiError::invalid("\"thinking.budget_tokens\" must be a positive integer")
                    })?;
            }
            Some("disabled" | "adaptive") => {}
            _ => {
                return Err(ApiError::invalid(
                    "\"thinking.type\" must be \"enabled\", \"disabled\" or \"adaptive\"",
                ))
            }
        }
    }
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("\"stream\" must be true or false")),
    };
    Ok((Some(requested), stream))
}

/// Extended thinking's tokens are output tokens, inside `max_tokens`, and Anthropic wants
/// `budget_tokens` below `max_tokens`: a budget at or above the forwarded bound is clamped
/// to one below it (the whole output stays within the bound either way).
pub(crate) fn clamp_thinking(o: &mut serde_json::Map<String, Value>, out: u64) {
    let Some(t) = o.get_mut("thinking").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(b) = t.get("budget_tokens").and_then(Value::as_u64) {
        if b >= out {
            t.insert("budget_tokens".into(), json!(out.saturating_sub(1).max(1)));
        }
    }
}

/// The price a Messages step is reserved and committed at: the model's, with the input priced
/// at the cache write price when the request asks for caching (see the module's docs).
pub(crate) fn step_price(model: ModelPrice, cache_write: Micros, caching: bool) -> ModelPrice {
    if caching && cache_write > model.input_per_million {
        ModelPrice {
            input_per_million: cache_write,
            ..model
        }
    } else {
        model
    }
}

/// How a Messages usage becomes the ledger's three classes ([`TokenUsage`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pricing {
    /// The step's price ([`step_price`]).
    pub(crate) step: ModelPrice,
    /// The model's own input and cache write prices.
    pub(crate) input: Micros,
    pub(crate) cache_write: Micros,
}

/// A Messages usage as Anthropic reports it, each class apart (`input_tokens` excludes the
/// cache's). `None`: not reported (yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub(crate) input: Option<u64>,
    pub(crate) cache_write: Option<u64>,
    pub(crate) cache_read: Option<u64>,
    pub(crate) output: Option<u64>,
}

impl Usage {
    /// The usage an object reports (`usage` of an answer, of `message_start`'s message or of
    /// `message_delta`); `None` without one.
    pub(crate) fn of(u: &Value) -> Option<Usage> {
        let u = u.as_object()?;
        let n = |k: &str| u.get(k).and_then(Value::as_u64);
        let usage = Usage {
            input: n("input_tokens"),
            cache_write: n("cache_creation_input_tokens"),
            cache_read: n("cache_read_input_tokens"),
            output: n("output_tokens"),
        };
        (usage != Usage::default()).then_some(usage)
    }

    /// The larger of each figure (a later event repeats or raises an earlier one; the classes
    /// are apart, so more of any costs more).
    pub(crate) fn merge(self, other: Usage) -> Usage {
        let max = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        Usage {
            input: max(self.input, other.input),
            cache_write: max(self.cache_write, other.cache_write),
            cache_read: max(self.cache_read, other.cache_read),
            output: max(self.output, other.output),
        }
    }
}

impl Pricing {
    /// The ledger's usage of a Messages usage, never cheaper: the input and the cache writes
    /// as input tokens at the step's input price, rounded up; the cache reads as cached
    /// tokens; the output as is. `None` (not usable: charged in full) without the input and
    /// the output, or when a cache write has a price and the step prices neither input nor
    /// output.
    pub(crate) fn tokens(&self, u: Usage) -> Option<TokenUsage> {
        let (input, output) = (u.input?, u.output?);
        let (write, read) = (u.cache_write.unwrap_or(0), u.cache_read.unwrap_or(0));
        let cost = u128::from(input) * u128::from(self.input.0)
            + u128::from(write) * u128::from(self.cache_write.0);
        let (mut prompt, mut completion) = (0u64, output);
        if self.step.input_per_million.0 > 0 {
            let n = cost.div_ceil(u128::from(self.step.input_per_million.0));
            prompt = u64::try_from(n).unwrap_or(u64::MAX);
        } else if cost > 0 {
            let per = u128::from(self.step.output_per_million.0);
            if per == 0 {
                return None;
            }
            let n = u64::try_from(cost.div_ceil(per)).unwrap_or(u64::MAX);
            completion = completion.saturating_add(n);
        }
        Some(TokenUsage {
            prompt_tokens: prompt.saturating_add(read),
            completion_tokens: completion,
            cached_tokens: read,
        })
    }
}

/// The usage an event or an answer carries: an answer's (or `message_delta`'s) `usage`, or
/// `message_start`'s `message.usage`.
pub(crate) fn usage_in(v: &Value) -> Option<Usage> {
    v.get("usage").and_then(Usage::of).or_else(|| {
        v.get("message")
            .and_then(|m| m.get("usage"))
            .and_then(Usage::of)
    })
}

/// Calls `f` with every text the model generated in an answer's `content` or in a stream's
/// event (`content_block_start`'s block, `content_block_delta`'s delta), keyed by the block's
/// index and the field: text, thinking, a tool use's name and input (an answer's input
/// object as its JSON text, which `f` may cut: the block's input is then dropped), redacted
/// thinking. Signatures and citations are not counted: the usage covers them, and else the
/// reservation does.
pub(crate) fn each_output_text(
    event: &mut Value,
    f: &mut dyn FnMut(crate::answer::FieldKey, &mut String),
) {
    let blocks: Vec<(u64, &mut Value)> = match event.get("type").and_then(Value::as_str) {
        Some("message") => match event.get_mut("content").and_then(Value::as_array_mut) {
            Some(c) => c
                .iter_mut()
                .enumerate()
                .map(|(i, b)| (i as u64, b))
                .collect(),
            None => return,
        },
        Some("content_block_start") => {
            let i = event.get("index").and_then(Value::as_u64).unwrap_or(0);
            match event.get_mut("content_block") {
                Some(b) => vec![(i, b)],
                None => return,
            }
        }
        Some("content_block_delta") => {
            let i = event.get("index").and_then(Value::as_u64).unwrap_or(0);
            match event.get_mut("delta") {
                Some(b) => vec![(i, b)],
                None => return,
            }
        }
        _ => return,
    };
    for (i, b) in blocks {
        let Some(o) = b.as_object_mut() else { continue };
        for (kind, k) in [
            (0u8, "thinking"),
            (1, "data"),
            (2, "text"),
            (3, "name"),
            (4, "partial_json"),
        ] {
            if let Some(Value::String(t)) = o.get_mut(k) {
                f((i, kind, 0), t);
            }
        }
        let input = o.get("input").filter(|v| match v {
            Value::Object(m) => !m.is_empty(),
            Value::Null => false,
            _ => true,
        });
        if let Some(input) = input {
            let mut text = input.to_string();
            let len = text.len();
            f((i, 4, 0), &mut text);
            if text.len() < len {
                o.insert("input".into(), Value::Null);
            }
        }
    }
}

/// Cuts a whole answer's texts to `bound` tokens of output ([`crate::answer::clip_answer_in`]'s
/// rules): a tool use whose input was cut is removed, and the answer ends as if the upstream
/// had stopped at its bound (`stop_reason: "max_tokens"`).
pub(crate) fn finish_clip(v: &mut Value) {
    if let Some(content) = v.get_mut("content").and_then(Value::as_array_mut) {
        content.retain(|b| {
            b.get("type").and_then(Value::as_str) != Some("tool_use")
                || b.get("input").is_some_and(|i| !i.is_null())
        });
    }
    if let Some(o) = v.as_object_mut() {
        o.insert("stop_reason".into(), json!("max_tokens"));
        o.insert("stop_sequence".into(), Value::Null);
    }
}

/// Whether a stream's event reports an error (`type: "error"`).
pub(crate) fn is_error_event(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str) == Some("error")
}

/// Whether a stream's event is generated content (or unknown, which may be): not one of the
/// events that frame a stream.
pub(crate) fn is_content_event(v: &Value) -> bool {
    !matches!(
        v.get("type").and_then(Value::as_str),
        Some("ping" | "content_block_stop" | "message_stop" | "message_start" | "message_delta")
    )
}

/// An SSE error event in Anthropic's shape, what Anthropic sends when a stream fails after
/// its head (its clients raise it as an API error).
pub(crate) fn sse_error(code: ErrorCode, message: &str, mid_line: bool) -> Bytes {
    let status = code.status();
    let body = anthropic::error_body(status, code.as_str(), message, &Value::Null);
    let lead = if mid_line { "\n\n" } else { "" };
    Bytes::from(format!("{lead}event: error\ndata: {body}\n\n"))
}

/// `POST /v1/messages`.
pub async fn messages(
    axum::extract::State(state): axum::extract::State<spendgate_http::Shared>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    request: Request,
) -> ApiResult<Response> {
    crate::chat::proxy(state, peer, request, crate::chat::Shape::Messages).await
}

/// The headers Anthropic's clients send, read as spendgate's: the service token may come as
/// `x-api-key` (Anthropic's key header) instead of `Authorization: Bearer`; an
/// `anthropic-beta` header is refused (a beta may be billed beyond the prices configured:
/// no price, no call); an `anthropic-version` must be a header value spendgate can forward.
pub(crate) fn check_headers(headers: &mut axum::http::HeaderMap) -> ApiResult<()> {
    if headers.contains_key("anthropic-beta") {
        return Err(ApiError::invalid(
            "\"anthropic-beta\" features may be charged beyond the prices configured here",
        ));
    }
    if let Some(v) = headers.get("anthropic-version") {
        if v.to_str().map_or(true, |s| s.is_empty() || s.len() > 64) {
            return Err(ApiError::invalid("\"anthropic-version\" is not a version"));
        }
    }
    if !headers.contains_key(header::AUTHORIZATION) {
        if let Some(key) = headers.remove("x-api-key") {
            let bearer = key
                .to_str()
                .ok()
                .and_then(|k| HeaderValue::from_str(&format!("Bearer {}", k.trim())).ok())
                .ok_or_else(|| ApiError::unauthorized("the x-api-key header is not a token"))?;
            headers.insert(header::AUTHORIZATION, bearer);
        }
    }
    Ok(())
}

/// The body for the upstream: the output bound reserved in `max_tokens`, extended thinking's
/// budget under it ([`clamp_thinking`]), and the upstream's model name.
pub(crate) fn upstream_body(
    o: &mut serde_json::Map<String, Value>,
    model: &spendgate_config::ModelConfig,
    out: u64,
) {
    o.insert("max_tokens".into(), json!(out));
    clamp_thinking(o, out);
    if let Some(name) = &model.upstream_model {
        o.insert("model".into(), json!(name));
    }
}

/// The upstream's headers: its key as `x-api-key`, and the client's `anthropic-version`
/// (else [`ANTHROPIC_VERSION`]).
pub(crate) fn upstream_headers(
    mut builder: reqwest::RequestBuilder,
    key: &str,
    client: &axum::http::HeaderMap,
) -> reqwest::RequestBuilder {
    if !key.is_empty() {
        builder = builder.header("x-api-key", key);
    }
    let version = client
        .get("anthropic-version")
        .and_then(|v| v.to_str().ok())
        .unwrap_or(ANTHROPIC_VERSION);
    builder.header("anthropic-version", version)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::{read_answer_in, Dialect};
    use crate::sse::SseTap;
    use spendgate_tokens::Tokenizer;

    fn price(input: u64, cached: u64, output: u64) -> ModelPrice {
        ModelPrice {
            input_per_million: Micros(input),
            cached_input_per_million: Micros(cached),
            output_per_million: Micros(output),
        }
    }

    fn pricing(caching: bool) -> Pricing {
        let model = price(10_000_000, 1_000_000, 30_000_000);
        Pricing {
            step: step_price(model, Micros(25_000_000), caching),
            input: model.input_per_million,
            cache_write: Micros(25_000_000),
        }
    }

    fn usage(input: u64, write: u64, read: u64, output: u64) -> Usage {
        Usage {
            input: Some(input),
            cache_write: Some(write),
            cache_read: Some(read),
            output: Some(output),
        }
    }

    /// Exact without caching; with it, never below the exact cost and at most one token at
    /// the cache write price above it.
    #[test]
    fn every_class_is_priced_never_below_its_cost() {
        let exact = |u: Usage| {
            let n = u.input.unwrap_or(0) * 10_000_000
                + u.cache_write.unwrap_or(0) * 25_000_000
                + u.cache_read.unwrap_or(0) * 1_000_000
                + u.output.unwrap_or(0) * 30_000_000;
            n.div_ceil(1_000_000)
        };
        for caching in [false, true] {
            let p = pricing(caching);
            for u in [
                usage(7, 0, 0, 3),
                usage(33, 20, 7, 10),
                usage(1, 1, 1, 1),
                usage(0, 0, 0, 0),
            ] {
                let charged = p.step.charge(&p.tokens(u).expect("usable")).0;
                assert!(charged >= exact(u), "{u:?} {caching}");
                assert!(charged <= exact(u) + 25, "{u:?} {caching}");
                if !caching && u.cache_write == Some(0) {
                    assert_eq!(charged, exact(u), "{u:?}");
                }
            }
        }
        assert_eq!(pricing(false).tokens(Usage::default()), None);
        let no_input = Usage {
            input: None,
            ..usage(0, 0, 0, 5)
        };
        assert_eq!(pricing(false).tokens(no_input), None, "input unknown");
    }

    #[test]
    fn the_prompt_is_counted_and_unpriced_inputs_are_refused() {
        let body = json!({"model": "m", "max_tokens": 5, "system": "be brief",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"},
                {"type": "tool_result", "tool_use_id": "t1", "content": "result!"}]}]});
        let (p, cache) = prompt_texts(&body).expect("counted");
        assert!(!cache);
        assert!(p.texts.iter().any(|t| t.contains("be brief")));
        assert_eq!(p.largest_tool_result, "result!\nt1".len() as u64 + 1);
        for bad in [
            json!({"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}),
            json!({"type": "document", "source": {}}),
            json!({"type": "tool_result", "content": [{"type": "image", "source": {}}]}),
        ] {
            let body = json!({"model": "m", "max_tokens": 5,
                "messages": [{"role": "user", "content": [bad]}]});
            assert!(prompt_texts(&body).is_err(), "{body}");
        }
        let server_tool = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user",
            "content": "hi"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
        assert!(prompt_texts(&server_tool).is_err());
        let cached = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user",
            "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]});
        assert!(
            prompt_texts(&cached).expect("counted").1,
            "asks for caching"
        );
    }

    #[test]
    fn max_tokens_is_required_and_thinking_kept_under_it() {
        let base = json!({"model": "m", "messages": []});
        assert!(output_options(&base).is_err());
        let mut body = json!({"model": "m", "max_tokens": 4000, "stream": true,
            "thinking": {"type": "enabled", "budget_tokens": 3000}});
        assert_eq!(output_options(&body).expect("ok"), (Some(4000), true));
        let o = body.as_object_mut().expect("object");
        clamp_thinking(o, 100);
        assert_eq!(o["thinking"]["budget_tokens"], 99);
        let bad = json!({"model": "m", "max_tokens": 10, "thinking": {"type": "enabled"}});
        assert!(output_options(&bad).is_err());
    }

    fn feed(tap: &mut SseTap, events: &[Value]) {
        for e in events {
            let kind = e["type"].as_str().unwrap_or("");
            let _ = tap.feed(Bytes::from(format!("event: {kind}\ndata: {e}\n\n")));
        }
    }

    /// A stream's usage: `message_start`'s raised by `message_delta`'s, trusted after
    /// `message_stop`; not after content that follows it, nor after an error event.
    #[test]
    fn a_streams_usage_is_trusted_at_its_end_only() {
        let p = pricing(false);
        let tap = || SseTap::new(false, Tokenizer::Bytes, 1000).in_dialect(Dialect::Messages(p));
        let start = json!({"type": "message_start", "message": {"type": "message",
            "usage": {"input_tokens": 9, "output_tokens": 1}}});
        let delta = json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "tok0 tok1"}});
        let end = json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 2}});
        let stop = json!({"type": "message_stop"});
        let mut t = tap();
        feed(
            &mut t,
            &[start.clone(), delta.clone(), end.clone(), stop.clone()],
        );
        let want = TokenUsage {
            prompt_tokens: 9,
            completion_tokens: 2,
            cached_tokens: 0,
        };
        assert_eq!(t.end_usage(), Some(want));
        assert_eq!(t.final_usage(), Some(want), "settled by message_delta");
        let mut t = tap();
        feed(&mut t, &[start.clone(), delta.clone()]);
        assert_eq!(t.end_usage(), None, "content after message_start's usage");
        let mut t = tap();
        feed(
            &mut t,
            &[
                start.clone(),
                delta.clone(),
                end.clone(),
                delta.clone(),
                stop.clone(),
            ],
        );
        assert_eq!(t.end_usage(), None, "content after the final usage");
        let mut t = tap();
        let error = json!({"type": "error", "error": {"type": "overloaded_error"}});
        feed(&mut t, &[start, delta, error, end, stop]);
        assert_eq!(t.end_usage(), None, "an error event");
        assert!(t
            .error_event(ErrorCode::UpstreamError, "x")
            .starts_with(b"event: error\n"));
    }

    /// A whole answer past its bound is cut to it: its text shortened, a tool use whose
    /// input was cut removed, `stop_reason: "max_tokens"`.
    #[test]
    fn a_whole_answer_past_its_bound_is_cut() {
        let words: String = (0..300).map(|i| format!("tok{i} ")).collect();
        let answer = json!({"type": "message", "content": [{"type": "text", "text": words},
            {"type": "tool_use", "id": "t", "name": "f", "input": {"q": words}}],
            "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 600}});
        let a = read_answer_in(
            Dialect::Messages(pricing(false)),
            Tokenizer::Bytes,
            20,
            Bytes::from(answer.to_string()),
            &[],
        );
        assert!(a.cut);
        assert_eq!(a.usage.map(|u| u.completion_tokens), Some(600));
        let v: Value = serde_json::from_slice(&a.body).expect("json");
        assert_eq!(v["stop_reason"], "max_tokens");
        let content = v["content"].as_array().expect("content");
        assert_eq!(content.len(), 1, "the cut tool use is removed: {v}");
        assert!(content[0]["text"].as_str().expect("text").len() < 200);
    }
}
