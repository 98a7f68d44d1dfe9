//! `POST /v1/embeddings` (SPEC §6): OpenAI's Embeddings shape, through the same flow as chat
//! completions ([`crate::chat`]). The input (a string, an array of strings, or token arrays)
//! is counted as a whole and bounded by the context bound before any reservation; the call is
//! reserved and charged as input alone (an output bound of 0 tokens), from the answer's
//! `usage.prompt_tokens`. Its errors are OpenAI's, as on chat completions.

use crate::prompt::{push_billed_fields, PromptTexts};
use serde_json::{json, Value};
use spendgate_core::TokenUsage;
use spendgate_wire::error::{ApiError, ApiResult};

/// Inputs in one request (OpenAI's own limit).
pub const EMBEDDING_INPUTS_MAX: usize = 2048;

/// Request fields that carry no billed text; every other field but `input` is counted as its
/// JSON text.
const UNBILLED_FIELDS: [&str; 5] = ["model", "input", "encoding_format", "dimensions", "user"];

/// A token array's tokens, or `None` when `v` is not one.
fn token_array(v: &Value) -> Option<u64> {
    let items = v.as_array()?;
    items
        .iter()
        .all(Value::is_u64)
        .then_some(items.len() as u64)
}

/// The input of an embeddings request, counted as a whole: each string a text of its own, each
/// token array its length (added to the overhead). Its bytes are the run's input
/// (`max_input_bytes`), whoever calls: the whole batch is what a caller sends.
pub(crate) fn prompt_texts(body: &Value) -> ApiResult<PromptTexts> {
    let input = body
        .get("input")
        .filter(|v| !v.is_null())
        .ok_or_else(|| ApiError::invalid("\"input\" is required"))?;
    let items: Vec<&Value> = match input {
        Value::String(_) => vec![input],
        Value::Array(a) if token_array(input).is_some() && !a.is_empty() => vec![input],
        Value::Array(a) => a.iter().collect(),
        _ => {
            return Err(ApiError::invalid(
                "\"input\" must be a string, an array of strings or token arrays",
            ))
        }
    };
    if items.is_empty() || items.len() > EMBEDDING_INPUTS_MAX {
        return Err(ApiError::invalid(format!(
            "\"input\" must hold 1 to {EMBEDDING_INPUTS_MAX} inputs"
        )));
    }
    let (mut texts, mut overhead) = (Vec::with_capacity(items.len()), 0u64);
    for item in items {
        match item {
            Value::String(s) => texts.push(s.clone()),
            other => {
                let n = token_array(other).ok_or_else(|| {
                    ApiError::invalid("each input must be a string or an array of token ids")
                })?;
                overhead = overhead.saturating_add(n);
            }
        }
    }
    let input_bytes: u64 = texts.iter().map(|t| t.len() as u64).sum::<u64>() + overhead;
    push_billed_fields(body, &UNBILLED_FIELDS, &mut texts);
    let bytes = texts.iter().map(|t| t.len() as u64).sum::<u64>() + overhead;
    Ok(PromptTexts {
        texts,
        overhead,
        bytes,
        largest_tool_result: 0,
        last_user_bytes: input_bytes,
    })
}

/// An embeddings call has no output to bound (0 tokens reserved) and never streams.
pub(crate) fn output_options(body: &Value) -> ApiResult<(Option<u64>, bool)> {
    if body.get("stream").is_some_and(|s| !s.is_null()) {
        return Err(ApiError::invalid("embeddings do not stream"));
    }
    Ok((Some(0), false))
}

/// The body for the upstream: the upstream's model name.
pub(crate) fn upstream_body(o: &mut serde_json::Map<String, Value>, model: Option<&String>) {
    if let Some(name) = model {
        o.insert("model".into(), json!(name));
    }
}

/// Whether `v` is an embeddings answer.
pub(crate) fn is_answer(v: &Value) -> bool {
    v.get("data").is_some_and(Value::is_array)
}

/// An embeddings answer's usage: its prompt tokens, and whatever its total holds beyond them
/// as output (none is expected; a total above the prompt is charged).
pub(crate) fn usage_of(v: &Value) -> Option<TokenUsage> {
    let u = v.get("usage")?;
    let prompt_tokens = u.get("prompt_tokens")?.as_u64()?;
    let total = u.get("total_tokens").and_then(Value::as_u64).unwrap_or(0);
    Some(TokenUsage {
        prompt_tokens,
        completion_tokens: total.saturating_sub(prompt_tokens),
        cached_tokens: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_counted_as_a_whole() {
        let p = prompt_texts(&json!({"model": "e", "input": ["ab", "cde"]})).expect("ok");
        assert_eq!((p.texts.len(), p.bytes, p.last_user_bytes), (2, 5, 5));
        let p = prompt_texts(&json!({"model": "e", "input": [[1, 2, 3], [4]]})).expect("ok");
        assert_eq!((p.overhead, p.last_user_bytes), (4, 4));
        let p = prompt_texts(&json!({"model": "e", "input": [1, 2, 3]})).expect("ok");
        assert_eq!(p.overhead, 3);
        for bad in [json!(null), json!([]), json!(5), json!([{"a": 1}])] {
            assert!(prompt_texts(&json!({"model": "e", "input": bad})).is_err());
        }
        assert!(output_options(&json!({"stream": true})).is_err());
        assert_eq!(
            usage_of(&json!({"usage": {"prompt_tokens": 7, "total_tokens": 7}})),
            Some(TokenUsage {
                prompt_tokens: 7,
                completion_tokens: 0,
                cached_tokens: 0
            })
        );
    }
}
