//! Deterministic token accounting and answer text.

use serde_json::Value;

/// Fixed per-message overhead, in tokens.
pub(crate) const PER_MESSAGE_TOKENS: u64 = 4;
/// Fixed per-request overhead (the reply priming), in tokens.
pub(crate) const PER_REQUEST_TOKENS: u64 = 3;

/// The deterministic prompt-token count the mock reports for a request body's messages.
///
/// ```text
/// prompt_tokens = 3 + Σ over messages of (ceil(text_bytes(message) / 4) + 4)
/// ```
///
/// where `text_bytes(message)` is the number of UTF-8 bytes of:
/// - the message's `content` when it is a string, or, when it is an array, the concatenation of
///   the string `text` fields of its parts (image or audio parts count nothing);
/// - plus, for assistant messages that carry them, the `function.arguments` strings of every
///   entry of `tool_calls` (and the legacy `function_call.arguments`).
///
/// A body without a `messages` array counts only the request overhead (3). Since
/// `ceil(n / 4) <= n` for every `n`, this never exceeds a one-token-per-byte count with the same
/// (or a larger) per-message and per-request overhead, so a gateway that estimates prompts
/// byte-per-token never reserves less than the mock later reports.
pub fn prompt_tokens_of(body: &Value) -> u64 {
    let messages = match body.get("messages").and_then(Value::as_array) {
        Some(m) => m,
        None => return PER_REQUEST_TOKENS,
    };
    messages.iter().fold(PER_REQUEST_TOKENS, |acc, message| {
        let bytes = message_text_bytes(message);
        acc.saturating_add(bytes.div_ceil(4))
            .saturating_add(PER_MESSAGE_TOKENS)
    })
}

/// Bytes of a message's text content plus its tool-call arguments.
fn message_text_bytes(message: &Value) -> u64 {
    let mut bytes: u64 = 0;
    match message.get("content") {
        Some(Value::String(s)) => bytes = bytes.saturating_add(len_u64(s)),
        Some(Value::Array(parts)) => {
            for part in parts {
                if let Some(text) = part.get("text").and_then(Value::as_str) {
                    bytes = bytes.saturating_add(len_u64(text));
                }
            }
        }
        _ => {}
    }
    if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
        for call in calls {
            if let Some(args) = call
                .get("function")
                .and_then(|f| f.get("arguments"))
                .and_then(Value::as_str)
            {
                bytes = bytes.saturating_add(len_u64(args));
            }
        }
    }
    if let Some(args) = message
        .get("function_call")
        .and_then(|f| f.get("arguments"))
        .and_then(Value::as_str)
    {
        bytes = bytes.saturating_add(len_u64(args));
    }
    bytes
}

fn len_u64(s: &str) -> u64 {
    u64::try_from(s.len()).unwrap_or(u64::MAX)
}

/// The answer words for tokens `from..to`: `"tok{from} tok{from+1} ..."`, each word one token,
/// with a leading space before every word but token 0, so that concatenating the pieces of
/// consecutive ranges gives the words of the whole range joined by single spaces.
pub(crate) fn words(from: u64, to: u64) -> String {
    let mut out = String::new();
    for i in from..to {
        if i > 0 {
            out.push(' ');
        }
        out.push_str("tok");
        out.push_str(&i.to_string());
    }
    out
}

/// A tool call's arguments text `{"q":"tok0 tok1 ..."}` of `total` tokens, the fragment for
/// tokens `from..to`: the fragments of consecutive ranges concatenate to the whole.
pub(crate) fn arguments(from: u64, to: u64, total: u64) -> String {
    let mut out = String::new();
    if from == 0 {
        out.push_str("{\"q\":\"");
    }
    out.push_str(&words(from, to));
    if to >= total {
        out.push_str("\"}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn empty_and_missing_messages() {
        assert_eq!(prompt_tokens_of(&json!({})), 3);
        assert_eq!(prompt_tokens_of(&json!({"messages": []})), 3);
        assert_eq!(prompt_tokens_of(&json!({"messages": "x"})), 3);
    }

    #[test]
    fn string_content_rounds_up() {
        // "hello" = 5 bytes -> 2 tokens + 4 overhead + 3 request overhead
        let body = json!({"messages": [{"role": "user", "content": "hello"}]});
        assert_eq!(prompt_tokens_of(&body), 2 + 4 + 3);
        // exactly 8 bytes -> 2 tokens
        let body = json!({"messages": [{"role": "user", "content": "12345678"}]});
        assert_eq!(prompt_tokens_of(&body), 2 + 4 + 3);
        // empty content -> overhead only
        let body = json!({"messages": [{"role": "user", "content": ""}]});
        assert_eq!(prompt_tokens_of(&body), 4 + 3);
    }

    #[test]
    fn multibyte_counts_bytes() {
        // "é" is 2 bytes, 3 of them = 6 bytes -> 2 tokens
        let body = json!({"messages": [{"role": "user", "content": "ééé"}]});
        assert_eq!(prompt_tokens_of(&body), 2 + 4 + 3);
    }

    #[test]
    fn array_content_concatenates_text_parts() {
        let body = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "abc"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/x.png"}},
            {"type": "text", "text": "defgh"}
        ]}]});
        // 3 + 5 = 8 bytes -> 2 tokens (not ceil(3/4)+ceil(5/4) = 3)
        assert_eq!(prompt_tokens_of(&body), 2 + 4 + 3);
    }

    #[test]
    fn tool_call_arguments_count() {
        let body = json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "web_search", "arguments": "{\"q\":\"rust\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "result"}
        ]});
        // "be brief" 8 -> 2; args 12 bytes -> 3; "result" 6 -> 2
        assert_eq!(prompt_tokens_of(&body), (2 + 4) + (3 + 4) + (2 + 4) + 3);
    }

    #[test]
    fn never_exceeds_byte_count_with_overhead() {
        for n in 0..200usize {
            let text = "x".repeat(n);
            let body = json!({"messages": [{"role": "user", "content": text}]});
            let bytes = u64::try_from(n).unwrap_or(u64::MAX);
            assert!(prompt_tokens_of(&body) <= bytes + 4 + 3);
        }
    }

    #[test]
    fn words_concatenate() {
        assert_eq!(words(0, 0), "");
        assert_eq!(words(0, 3), "tok0 tok1 tok2");
        assert_eq!(format!("{}{}", words(0, 2), words(2, 4)), words(0, 4));
        assert_eq!(words(2, 4), " tok2 tok3");
    }
}
