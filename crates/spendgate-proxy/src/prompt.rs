//! What a prompt costs: its texts, its bytes, its tokens; and what cannot be priced as text.

use crate::bounds::MESSAGES_MAX;
use serde_json::Value;
use spendgate_tokens::{self as tokens, Tokenizer, TOKENS_PER_MESSAGE, TOKENS_PER_REQUEST};
use spendgate_wire::error::{ApiError, ApiResult};

/// The text of a message's content: a string, or an array of `text` (and, in an assistant's
/// earlier answer, `refusal`) parts. Any other part (an image, audio, a file) is refused: the
/// upstream charges it by what it holds (an image URL of 50 bytes can cost a thousand
/// tokens), which spendgate can neither count nor price (SPEC §6: no price, no call).
pub(crate) fn content_text(content: &Value, out: &mut String) -> ApiResult<()> {
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
pub(crate) fn check_priced_as_text(body: &Value) -> ApiResult<()> {
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
    check_service_tier(body, &OPENAI_TIERS)
}

/// The `service_tier`s of OpenAI's shapes billed at the configured prices.
pub(crate) const OPENAI_TIERS: [&str; 3] = ["auto", "default", "flex"];

/// A `service_tier` other than `allowed` may be billed above the configured prices: refused
/// (SPEC §6: no price, no call).
pub(crate) fn check_service_tier(body: &Value, allowed: &[&str]) -> ApiResult<()> {
    let Some(tier) = body.get("service_tier").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    if tier.as_str().is_some_and(|t| allowed.contains(&t)) {
        return Ok(());
    }
    let allowed: Vec<String> = allowed.iter().map(|t| format!("{t:?}")).collect();
    Err(ApiError::invalid(format!(
        "service_tier {tier} may be charged above the configured prices; use {}",
        allowed.join(" or ")
    )))
}

/// Pushes the JSON text of every request field but `unbilled` (and nulls): what an upstream
/// may put before the model as prompt, counted (a field counted needlessly costs a few tokens
/// of headroom; one not counted would be input nobody reserved).
pub(crate) fn push_billed_fields(body: &Value, unbilled: &[&str], texts: &mut Vec<String>) {
    for (k, v) in body.as_object().into_iter().flatten() {
        if !v.is_null() && !unbilled.contains(&k.as_str()) {
            texts.push(v.to_string());
        }
    }
}

/// Top-level request fields that carry no text an upstream bills as prompt tokens. Every
/// other field is counted as its JSON text: `tools`, `functions`, `response_format`,
/// `tool_choice`, and any field this list does not know, which an OpenAI-compatible upstream
/// may put before the model (a field counted needlessly costs a few tokens of headroom; one
/// not counted would be input nobody reserved).
pub(crate) const UNBILLED_FIELDS: [&str; 24] = [
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
    push_billed_fields(body, &UNBILLED_FIELDS, &mut texts);
    let bytes = texts.iter().map(|t| t.len() as u64).sum();
    Ok(PromptTexts {
        texts,
        overhead,
        bytes,
        largest_tool_result,
        last_user_bytes,
    })
}
