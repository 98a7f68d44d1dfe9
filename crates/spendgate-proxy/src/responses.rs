//! `POST /v1/responses` (SPEC §6): OpenAI's Responses shape, through the same flow as chat
//! completions ([`crate::chat`]), with its own pieces: the prompt (`instructions`, `input` as a
//! string or as items: messages, function calls and their outputs, reasoning; images, files
//! and audio refused), the output bound (`max_output_tokens`, reasoning inside it), the usage
//! (`usage` of an answer, or of the `response.completed` / `response.incomplete` event:
//! input, cached input, output with reasoning), the output texts (text, refusals, function
//! arguments, reasoning), and **hosted tools**.
//!
//! # Hosted tools
//! A tool the upstream runs itself (web search, file search, code interpreter, image
//! generation, MCP, …: any tool whose `type` is not `function` or `custom`) is billed per
//! call. Each must have a price in `[tools.X]`, X its type (or, for `web_search_preview…`,
//! `web_search`); an unpriced one is refused before the call (no price, no call). The calls
//! one response may make are bounded by the `max_tool_calls` forwarded: the client's, at most
//! `run.max_tool_calls` ([`hosted_calls_bound`]). Each hosted tool offered is reserved with the
//! model call, in the same store round, as a tool step of the run priced per call for that
//! many calls; it is settled with the model step from the calls the answer shows (its output
//! items of the tool's call type, e.g. `web_search_call`): committed at the calls counted when
//! the answer was read whole, else charged in full, or at the calls counted when more.
//!
//! # What spendgate cannot see
//! `previous_response_id`, `conversation`, `prompt` (a stored prompt) and `item_reference`
//! items make the upstream add input spendgate never sees. The bound on input applies to what
//! it sees; such a call is reserved at the whole context bound (`run.max_context_tokens`) of
//! prompt, and what the upstream reports is charged, an overrun when above. `background`
//! (an answer fetched later, its usage never in this one) is refused.

use crate::answer::FieldKey;
use crate::bounds::MESSAGES_MAX;
use crate::prompt::{check_service_tier, push_billed_fields, PromptTexts, OPENAI_TIERS};
use bytes::Bytes;
use serde_json::{json, Value};
use spendgate_core::{Micros, TokenUsage, ToolPrice};
use spendgate_wire::error::{ApiError, ApiResult, ErrorCode};
use std::collections::BTreeMap;

/// Hosted tools one request may offer (each is a reservation of its own).
pub const HOSTED_TOOLS_MAX: usize = 8;
/// Output items whose hosted calls are counted in one answer; past it every further item
/// of a hosted call type counts as one more (the count only ever grows).
pub const HOSTED_CALLS_COUNTED_MAX: u64 = 1 << 20;

/// Top-level request fields that carry no text the upstream bills as prompt tokens; every
/// other field is counted as its JSON text (`tools`, `tool_choice`, `text` with its schema,
/// and any field not known here).
pub(crate) const UNBILLED_FIELDS: [&str; 19] = [
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_logprobs",
    "metadata",
    "store",
    "parallel_tool_calls",
    "service_tier",
    "previous_response_id",
    "truncation",
    "user",
    "safety_identifier",
    "prompt_cache_key",
];

/// Fields that make the upstream add input spendgate cannot see (see the module's docs).
const UNSEEN_INPUT_FIELDS: [&str; 3] = ["previous_response_id", "conversation", "prompt"];

/// Content part types whose text is counted; any other (an image, a file, audio) is refused.
const TEXT_PARTS: [&str; 5] = [
    "input_text",
    "output_text",
    "text",
    "refusal",
    "summary_text",
];

/// A hosted tool offered by a request: its price and the output item type of its calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostedTool {
    /// The `[tools.X]` entry it is priced by (the ledger's tool name).
    pub(crate) tool: String,
    /// The output item type of its calls (`web_search_call`).
    pub(crate) call_type: String,
    /// Its price per call (`per_call + per_unit`: a call is one unit).
    pub(crate) per_call: Micros,
}

impl HostedTool {
    /// The price of its step: every call one unit.
    pub(crate) fn price(&self) -> ToolPrice {
        ToolPrice {
            per_call: Micros::ZERO,
            per_unit: self.per_call,
        }
    }
}

/// The output item type of a hosted tool's calls.
pub(crate) fn call_type(tool_type: &str) -> String {
    match tool_type {
        t if t.starts_with("web_search") => "web_search_call".into(),
        t if t.starts_with("computer_use") => "computer_call".into(),
        t => format!("{t}_call"),
    }
}

/// The hosted tools a request offers, each priced from `tools` (by its type, or `web_search`
/// for a `web_search_preview…`); one offered twice (or two of one call type) is held once, at
/// the higher price. An unpriced one is refused (no price, no call).
pub(crate) fn hosted_tools(
    body: &Value,
    tools: &BTreeMap<String, ToolPrice>,
) -> ApiResult<Vec<HostedTool>> {
    let Some(offered) = body.get("tools").filter(|t| !t.is_null()) else {
        return Ok(Vec::new());
    };
    let offered = offered
        .as_array()
        .ok_or_else(|| ApiError::invalid("\"tools\" must be an array"))?;
    let mut hosted: Vec<HostedTool> = Vec::new();
    for t in offered {
        let kind = t
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid("each tool must have a \"type\""))?;
        if matches!(kind, "function" | "custom") {
            continue;
        }
        let priced = tools.get(kind).map(|p| (kind, p)).or_else(|| {
            kind.starts_with("web_search_preview")
                .then(|| tools.get("web_search").map(|p| ("web_search", p)))
                .flatten()
        });
        let Some((name, price)) = priced else {
            return Err(ApiError::model_not_allowed(format!(
                "the hosted tool {kind:?} has no configured price ([tools.{kind}]); it is refused before the call"
            )));
        };
        let per_call = price.cost(1);
        let call_type = call_type(kind);
        match hosted.iter_mut().find(|h| h.call_type == call_type) {
            Some(h) if h.per_call >= per_call => {}
            Some(h) => {
                h.per_call = per_call;
                h.tool = name.to_string();
            }
            None => hosted.push(HostedTool {
                tool: name.to_string(),
                call_type,
                per_call,
            }),
        }
    }
    if hosted.len() > HOSTED_TOOLS_MAX {
        return Err(ApiError::invalid(format!(
            "at most {HOSTED_TOOLS_MAX} hosted tools may be offered in one request"
        )));
    }
    Ok(hosted)
}

/// The hosted tool calls one response may make: the client's `max_tool_calls`, at most the
/// run's `max_tool_calls`. `None` when the request offers no hosted tool.
pub(crate) fn hosted_calls_bound(
    body: &Value,
    hosted: &[HostedTool],
    run_max: u64,
) -> ApiResult<Option<u64>> {
    let requested =
        match body.get("max_tool_calls") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|n| *n > 0).ok_or_else(|| {
                ApiError::invalid("\"max_tool_calls\" must be a positive integer")
            })?),
        };
    if hosted.is_empty() {
        return Ok(None);
    }
    let bound = requested.map_or(run_max, |r| r.min(run_max));
    if bound == 0 {
        return Err(ApiError::from(&spendgate_core::Refusal {
            code: spendgate_core::RefusalCode::RunBoundExceeded,
            scope: Some(spendgate_core::ScopeKind::Run),
            retry_after_s: None,
            message: "hosted tools are offered, but the run's max_tool_calls is 0".into(),
        }));
    }
    Ok(Some(bound))
}

/// The text of an item's content: a string, or text parts ([`TEXT_PARTS`]); any other part is
/// refused (the upstream bills it by what it holds, which spendgate can neither count nor
/// price).
fn content_text(content: &Value, out: &mut String) -> ApiResult<()> {
    match content {
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
            for (i, p) in parts.iter().enumerate() {
                if i > 0 {
                    out.push('\n');
                }
                let kind = p.get("type").and_then(Value::as_str);
                if !kind.is_some_and(|k| TEXT_PARTS.contains(&k)) {
                    return Err(ApiError::invalid(format!(
                        "content parts of type {} cannot be bounded or priced here; only text is accepted",
                        kind.map_or_else(|| "(none)".to_string(), |k| format!("{k:?}"))
                    )));
                }
                // Its text, and every other field but its type as text (annotations of an
                // earlier answer go back as input).
                for (k, v) in p.as_object().into_iter().flatten() {
                    match (k.as_str(), v) {
                        ("type", _) | (_, Value::Null) => continue,
                        (_, Value::String(s)) => out.push_str(s),
                        (_, other) => out.push_str(&other.to_string()),
                    }
                    out.push('\n');
                }
            }
        }
        Value::Null => {}
        other => out.push_str(&other.to_string()),
    }
    Ok(())
}

/// What [`item_text`] found besides the text.
#[derive(Default)]
struct ItemSeen {
    /// Bytes of its tool output (a tool result).
    result: u64,
    /// Bytes of its content (a message's).
    content: u64,
    /// It refers to input spendgate cannot see (`item_reference`).
    refers: bool,
}

/// One input item's text, appended to `out`: a message's content and other fields, a tool
/// output, any other item's every string.
fn item_text(item: &Value, out: &mut String) -> ApiResult<ItemSeen> {
    let fields = item
        .as_object()
        .ok_or_else(|| ApiError::invalid("each input item must be a JSON object"))?;
    let kind = fields.get("type").and_then(Value::as_str);
    let mut seen = ItemSeen::default();
    if kind == Some("item_reference") {
        seen.refers = true;
        return Ok(seen);
    }
    for (k, v) in fields {
        match (k.as_str(), v) {
            ("type" | "id" | "status" | "call_id", _) | (_, Value::Null) => {}
            ("content", c) => {
                let before = out.len();
                content_text(c, out)?;
                seen.content = (out.len() - before) as u64;
            }
            ("output", o) if kind.is_some_and(|k| k.ends_with("_output")) => {
                let before = out.len();
                match o {
                    Value::String(s) => out.push_str(s),
                    other => content_text(other, out)?,
                }
                seen.result = (out.len() - before) as u64;
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
    Ok(seen)
}

/// What a Responses request costs as prompt: its texts ([`PromptTexts`]), and whether the
/// upstream adds input spendgate cannot see (see the module's docs).
pub(crate) fn prompt_texts(body: &Value) -> ApiResult<(PromptTexts, bool)> {
    use spendgate_tokens::{TOKENS_PER_MESSAGE, TOKENS_PER_REQUEST};
    if body
        .get("background")
        .is_some_and(|b| b.as_bool() == Some(true))
    {
        return Err(ApiError::invalid(
            "\"background\" responses are settled later, out of this call's sight; they are refused",
        ));
    }
    check_service_tier(body, &OPENAI_TIERS)?;
    let input = body
        .get("input")
        .filter(|v| !v.is_null())
        .ok_or_else(|| ApiError::invalid("\"input\" is required"))?;
    let mut unseen = UNSEEN_INPUT_FIELDS
        .iter()
        .any(|k| body.get(*k).is_some_and(|v| !v.is_null()));
    let mut texts = Vec::new();
    let mut overhead = TOKENS_PER_REQUEST;
    if let Some(Value::String(s)) = body.get("instructions") {
        texts.push(s.clone());
        overhead = overhead.saturating_add(TOKENS_PER_MESSAGE);
    }
    let (mut largest_tool_result, mut last_user_bytes) = (0u64, 0u64);
    match input {
        Value::String(s) => {
            last_user_bytes = s.len() as u64;
            texts.push(s.clone());
            overhead = overhead.saturating_add(TOKENS_PER_MESSAGE);
        }
        Value::Array(items) => {
            if items.is_empty() || items.len() > MESSAGES_MAX {
                return Err(ApiError::invalid(format!(
                    "\"input\" must hold 1 to {MESSAGES_MAX} items"
                )));
            }
            for item in items {
                let mut text = String::new();
                let seen = item_text(item, &mut text)?;
                unseen |= seen.refers;
                largest_tool_result = largest_tool_result.max(seen.result);
                if item.get("role").and_then(Value::as_str) == Some("user") {
                    last_user_bytes = seen.content;
                }
                texts.push(text);
                overhead = overhead.saturating_add(TOKENS_PER_MESSAGE);
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "\"input\" must be a string or an array of input items",
            ))
        }
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
        unseen,
    ))
}

/// The request's output bound (`max_output_tokens`, optional) and whether it streams.
pub(crate) fn output_options(body: &Value) -> ApiResult<(Option<u64>, bool)> {
    let requested = match body.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|n| *n > 0).ok_or_else(|| {
            ApiError::invalid("\"max_output_tokens\" must be a positive integer")
        })?),
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("\"stream\" must be true or false")),
    };
    Ok((requested, stream))
}

/// The body for the upstream: the output bound reserved in `max_output_tokens`, the hosted
/// calls reserved in `max_tool_calls`, and the upstream's model name.
pub(crate) fn upstream_body(
    o: &mut serde_json::Map<String, Value>,
    model: Option<&String>,
    out: u64,
    hosted_calls: Option<u64>,
) {
    o.insert("max_output_tokens".into(), json!(out));
    if let Some(n) = hosted_calls {
        o.insert("max_tool_calls".into(), json!(n));
    }
    if let Some(name) = model {
        o.insert("model".into(), json!(name));
    }
}

/// Whether `v` is a whole Responses answer.
pub(crate) fn is_answer(v: &Value) -> bool {
    v.get("object").and_then(Value::as_str) == Some("response")
        && v.get("output").is_some_and(Value::is_array)
}

/// A Responses usage in the ledger's classes: the input (its cached part apart), the output
/// with its reasoning (inside it, as OpenAI counts; a reasoning count above the output is
/// added to it), never below what the total holds beyond the input.
pub(crate) fn usage_of(v: &Value) -> Option<TokenUsage> {
    let u = v.get("usage").filter(|u| !u.is_null())?;
    let input = u.get("input_tokens")?.as_u64()?;
    let mut output = u.get("output_tokens")?.as_u64()?;
    let detail = |holder: &str, k: &str| {
        u.get(holder)
            .and_then(|d| d.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    let reasoning = detail("output_tokens_details", "reasoning_tokens");
    if reasoning > output {
        output = output.saturating_add(reasoning);
    }
    if let Some(total) = u.get("total_tokens").and_then(Value::as_u64) {
        output = output.max(total.saturating_sub(input));
    }
    Some(TokenUsage {
        prompt_tokens: input,
        completion_tokens: output,
        cached_tokens: detail("input_tokens_details", "cached_tokens").min(input),
    })
}

/// The usage a stream's event carries: the answer's, on the events that end a stream
/// (`response.completed`, `response.incomplete`, `response.failed`).
pub(crate) fn event_usage(v: &Value) -> Option<TokenUsage> {
    match v.get("type").and_then(Value::as_str) {
        Some("response.completed" | "response.incomplete" | "response.failed") => {
            v.get("response").and_then(usage_of)
        }
        _ => None,
    }
}

/// Whether a stream's event ends it: the answer whole (`response.completed`,
/// `response.incomplete`) or failed (`response.failed`).
pub(crate) fn is_end_event(v: &Value) -> bool {
    matches!(
        v.get("type").and_then(Value::as_str),
        Some("response.completed" | "response.incomplete" | "response.failed")
    )
}

/// Whether a stream's event reports an error: an `error` event or `response.failed`.
pub(crate) fn is_error_event(v: &Value) -> bool {
    matches!(
        v.get("type").and_then(Value::as_str),
        Some("error" | "response.failed")
    )
}

/// Whether a stream's event is generated content (or unknown, which may be): not one of the
/// events that frame a stream.
pub(crate) fn is_content_event(v: &Value) -> bool {
    let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
    !(matches!(
        kind,
        "response.created" | "response.in_progress" | "response.queued"
    ) || kind.ends_with(".done")
        || kind.ends_with(".in_progress")
        || kind.ends_with(".searching")
        || kind.ends_with(".completed"))
}

/// The texts of one output item (a whole answer's, or a stream's `response.output_item.added`).
fn item_texts(i: u64, item: &mut Value, f: &mut dyn FnMut(FieldKey, &mut String)) {
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "message" => {
            let parts = item.get_mut("content").and_then(Value::as_array_mut);
            for (c, part) in parts.into_iter().flatten().enumerate() {
                for (k, field) in [(2u8, "text"), (3, "refusal")] {
                    if let Some(Value::String(t)) = part.get_mut(field) {
                        f((i, k, c as u64), t);
                    }
                }
            }
        }
        "function_call" | "custom_tool_call" => {
            for (k, field) in [(4u8, "name"), (5, "arguments"), (5, "input")] {
                if let Some(Value::String(t)) = item.get_mut(field) {
                    f((i, k, 0), t);
                }
            }
        }
        "reasoning" => {
            for (k, holder) in [(0u8, "summary"), (1, "content")] {
                let parts = item.get_mut(holder).and_then(Value::as_array_mut);
                for (c, part) in parts.into_iter().flatten().enumerate() {
                    if let Some(Value::String(t)) = part.get_mut("text") {
                        f((i, k, c as u64), t);
                    }
                }
            }
        }
        _ => {}
    }
}

/// Calls `f` with every text the model generated in a whole answer's `output` items, or in a
/// stream's delta events (text, refusal, function arguments, custom tool input, reasoning
/// summary and text; a function call's name from `response.output_item.added`), keyed by the
/// output index, the field and the part. The `…done` events and `response.completed` repeat
/// what the deltas carried and are not counted; hosted calls are charged per call.
pub(crate) fn each_output_text(event: &mut Value, f: &mut dyn FnMut(FieldKey, &mut String)) {
    if is_answer(event) {
        let items = event.get_mut("output").and_then(Value::as_array_mut);
        for (i, item) in items.into_iter().flatten().enumerate() {
            item_texts(i as u64, item, f);
        }
        return;
    }
    let kind = event
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let n = |k: &str| event.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (oi, part) = (
        n("output_index"),
        n("content_index").max(n("summary_index")),
    );
    let field = match kind.as_str() {
        "response.output_item.added" => {
            if let Some(item) = event.get_mut("item") {
                if item.get("type").and_then(Value::as_str) == Some("function_call") {
                    item_texts(oi, item, f);
                }
            }
            return;
        }
        "response.output_text.delta" => 2u8,
        "response.refusal.delta" => 3,
        "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta" => 5,
        "response.reasoning_summary_text.delta" => 0,
        "response.reasoning_text.delta" => 1,
        _ => return,
    };
    if let Some(Value::String(t)) = event.get_mut("delta") {
        f((oi, field, part), t);
    }
}

/// Cuts a whole answer's texts to the output bound ([`crate::answer::clip_answer_in`]'s
/// rules): the answer ends as one the upstream stopped at its bound would
/// (`status: "incomplete"`, `incomplete_details.reason: "max_output_tokens"`).
pub(crate) fn finish_clip(v: &mut Value) {
    if let Some(o) = v.as_object_mut() {
        o.insert("status".into(), json!("incomplete"));
        o.insert(
            "incomplete_details".into(),
            json!({"reason": "max_output_tokens"}),
        );
    }
}

/// The hosted calls an answer or a stream showed, by call type, and whether the count is
/// whole (the answer read whole, or its stream's final event read, with its usage).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct HostedSeen {
    pub(crate) calls: BTreeMap<String, u64>,
    pub(crate) whole: bool,
}

impl HostedSeen {
    /// Counts the hosted calls of `types` among `items` (a whole answer's `output`), keeping
    /// the larger of each count.
    pub(crate) fn count_items(&mut self, items: &[Value], types: &[String]) {
        let mut counted: BTreeMap<&str, u64> = BTreeMap::new();
        for item in items {
            let kind = item.get("type").and_then(Value::as_str).unwrap_or("");
            if let Some(t) = types.iter().find(|t| t.as_str() == kind) {
                let c = counted.entry(t.as_str()).or_default();
                *c = c.saturating_add(1).min(HOSTED_CALLS_COUNTED_MAX);
            }
        }
        for (t, c) in counted {
            let seen = self.calls.entry(t.to_string()).or_default();
            *seen = (*seen).max(c);
        }
    }

    /// Reads a stream's event: a hosted call's item added counts one; the final event's
    /// answer counts them all (the larger count stands) and makes the count whole.
    pub(crate) fn read_event(&mut self, v: &Value, types: &[String]) {
        if types.is_empty() {
            return;
        }
        match v.get("type").and_then(Value::as_str) {
            Some("response.output_item.added") => {
                let kind = v
                    .get("item")
                    .and_then(|i| i.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if let Some(t) = types.iter().find(|t| t.as_str() == kind) {
                    let c = self.calls.entry(t.clone()).or_default();
                    *c = c.saturating_add(1).min(HOSTED_CALLS_COUNTED_MAX);
                }
            }
            Some(end @ ("response.completed" | "response.incomplete" | "response.failed")) => {
                // Whole only with the answer's usage: an answer that cannot say what it
                // cost is charged in full, its hosted calls too.
                self.whole =
                    end != "response.failed" && v.get("response").and_then(usage_of).is_some();
                let items = v
                    .get("response")
                    .and_then(|r| r.get("output"))
                    .and_then(Value::as_array);
                if let Some(items) = items {
                    self.count_items(items, types);
                }
            }
            _ => {}
        }
    }
}

/// An SSE event carrying an OpenAI-shaped error, as a Responses stream sends it
/// (`event: error`; the `openai` libraries raise it as an API error).
pub(crate) fn sse_error(code: ErrorCode, message: &str, mid_line: bool) -> Bytes {
    let event = json!({
        "type": "error",
        "code": code.as_str(),
        "message": message,
        "param": null,
        "sequence_number": 0,
        "error": {"type": code.kind(), "code": code.as_str(), "message": message, "param": null},
    });
    let lead = if mid_line { "\n\n" } else { "" };
    Bytes::from(format!("{lead}event: error\ndata: {event}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prices() -> BTreeMap<String, ToolPrice> {
        let mut t = BTreeMap::new();
        t.insert(
            "web_search".to_string(),
            ToolPrice {
                per_call: Micros(10_000),
                per_unit: Micros::ZERO,
            },
        );
        t.insert(
            "file_search".to_string(),
            ToolPrice {
                per_call: Micros(2_500),
                per_unit: Micros(1),
            },
        );
        t
    }

    #[test]
    fn hosted_tools_are_priced_or_refused() {
        let body = json!({"tools": [
            {"type": "function", "name": "f", "parameters": {}},
            {"type": "web_search_preview"},
            {"type": "web_search"},
            {"type": "file_search", "vector_store_ids": ["v"]},
        ]});
        let hosted = hosted_tools(&body, &prices()).expect("priced");
        assert_eq!(
            hosted,
            vec![
                HostedTool {
                    tool: "web_search".into(),
                    call_type: "web_search_call".into(),
                    per_call: Micros(10_000)
                },
                HostedTool {
                    tool: "file_search".into(),
                    call_type: "file_search_call".into(),
                    per_call: Micros(2_501)
                },
            ]
        );
        let unpriced =
            json!({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]});
        let e = hosted_tools(&unpriced, &prices()).expect_err("unpriced");
        assert_eq!(e.code, ErrorCode::ModelNotAllowed);
        assert!(e.message.contains("code_interpreter"), "{}", e.message);
    }

    #[test]
    fn the_hosted_calls_are_bounded_by_the_run() {
        let hosted =
            hosted_tools(&json!({"tools": [{"type": "web_search"}]}), &prices()).expect("priced");
        let b = |body: Value, run: u64| hosted_calls_bound(&body, &hosted, run);
        assert_eq!(b(json!({}), 16).expect("ok"), Some(16));
        assert_eq!(b(json!({"max_tool_calls": 3}), 16).expect("ok"), Some(3));
        assert_eq!(b(json!({"max_tool_calls": 30}), 16).expect("ok"), Some(16));
        assert!(b(json!({"max_tool_calls": 0}), 16).is_err());
        assert!(b(json!({}), 0).is_err());
        assert_eq!(
            hosted_calls_bound(&json!({"max_tool_calls": 2}), &[], 16).expect("ok"),
            None
        );
    }

    #[test]
    fn the_prompt_is_every_item_and_images_are_refused() {
        let body = json!({
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": "hello there"},
                {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"q\":1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a result of 26 bytes long."},
                {"role": "user", "content": [{"type": "input_text", "text": "and now?"}]},
            ],
            "tools": [{"type": "function", "name": "lookup", "parameters": {}}],
            "max_output_tokens": 50,
        });
        let (p, unseen) = prompt_texts(&body).expect("counted");
        assert!(!unseen);
        let all = p.texts.join("|");
        for needle in [
            "be brief",
            "hello there",
            "lookup",
            "{\"q\":1}",
            "and now?",
            "parameters",
        ] {
            assert!(all.contains(needle), "{needle} in {all}");
        }
        assert_eq!(p.largest_tool_result, 26);
        assert_eq!(p.last_user_bytes, "and now?\n".len() as u64);
        let image = json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]});
        assert!(prompt_texts(&image).is_err());
        let later = json!({"model": "m", "input": "hi", "previous_response_id": "resp_1"});
        assert!(prompt_texts(&later).expect("counted").1);
        let reference = json!({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]});
        assert!(prompt_texts(&reference).expect("counted").1);
        let background = json!({"model": "m", "input": "hi", "background": true});
        assert!(prompt_texts(&background).is_err());
        assert!(prompt_texts(&json!({"model": "m"})).is_err());
    }

    #[test]
    fn usage_counts_reasoning_within_the_output() {
        let v = json!({"usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
            "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 15}, "total_tokens": 30}});
        assert_eq!(
            usage_of(&v),
            Some(TokenUsage {
                prompt_tokens: 10,
                completion_tokens: 20,
                cached_tokens: 4
            })
        );
        let odd = json!({"usage": {"input_tokens": 10, "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 7}, "total_tokens": 40}});
        assert_eq!(usage_of(&odd).map(|u| u.completion_tokens), Some(30));
        assert_eq!(usage_of(&json!({"usage": null})), None);
        let done = json!({"type": "response.completed", "response": v});
        assert_eq!(event_usage(&done).map(|u| u.prompt_tokens), Some(10));
    }

    #[test]
    fn output_texts_of_answers_and_deltas_but_not_repeats() {
        let mut answer = json!({"object": "response", "output": [
            {"type": "web_search_call", "id": "ws", "status": "completed"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thought"}]},
            {"type": "message", "content": [{"type": "output_text", "text": "hello"}]},
            {"type": "function_call", "name": "f", "arguments": "{}"},
        ]});
        let mut seen = Vec::new();
        each_output_text(&mut answer, &mut |k, t| seen.push((k, t.clone())));
        let texts: Vec<&str> = seen.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(texts, ["thought", "hello", "f", "{}"]);
        let mut delta = json!({"type": "response.output_text.delta", "output_index": 1, "content_index": 0, "delta": "tok"});
        let mut done =
            json!({"type": "response.output_text.done", "output_index": 1, "text": "tok tok"});
        let mut completed = json!({"type": "response.completed", "response": answer});
        let mut n = 0;
        for e in [&mut delta, &mut done, &mut completed] {
            each_output_text(e, &mut |_, _| n += 1);
        }
        assert_eq!(n, 1, "only the delta is output");
    }

    #[test]
    fn hosted_calls_are_counted_from_items_and_the_final_answer() {
        let types = vec!["web_search_call".to_string()];
        let mut seen = HostedSeen::default();
        let added =
            json!({"type": "response.output_item.added", "item": {"type": "web_search_call"}});
        seen.read_event(&added, &types);
        seen.read_event(&added, &types);
        assert_eq!(seen.calls.get("web_search_call"), Some(&2));
        let completed = json!({"type": "response.completed", "response": {"output": [
            {"type": "web_search_call"}, {"type": "web_search_call"}, {"type": "web_search_call"},
            {"type": "message"},
        ]}});
        seen.read_event(&completed, &types);
        assert_eq!(seen.calls.get("web_search_call"), Some(&3));
    }
}
