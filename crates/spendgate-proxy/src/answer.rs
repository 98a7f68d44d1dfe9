//! A whole (non-streamed) answer: its output texts counted, its usage read, cut to the
//! output bound when it went past it.

use crate::guard::usage_of;
use crate::messages;
use crate::responses::HostedSeen;
use bytes::Bytes;
use serde_json::{json, Value};
use spendgate_core::TokenUsage;
use spendgate_tokens::{OutputCounter, OutputTally, Tokenizer};

/// The API shape an answer is read in: OpenAI's chat completions, or Anthropic's Messages
/// (whose usage is priced per class: [`messages::Pricing`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dialect {
    Chat,
    Messages(messages::Pricing),
    /// `/v1/embeddings`: no output, a usage of prompt tokens.
    Embeddings,
    /// `/v1/responses`: OpenAI's Responses ([`crate::responses`]).
    Responses,
}

impl Dialect {
    /// Every generated text of an answer or an event, as the shape has them.
    pub(crate) fn each_output_text(self, v: &mut Value, f: &mut dyn FnMut(FieldKey, &mut String)) {
        match self {
            Dialect::Chat => each_output_text(v, f),
            Dialect::Messages(_) => messages::each_output_text(v, f),
            Dialect::Embeddings => {}
            Dialect::Responses => crate::responses::each_output_text(v, f),
        }
    }

    /// The usage an answer (or an event) reports, in the ledger's classes.
    pub(crate) fn usage(self, v: &Value) -> Option<TokenUsage> {
        match self {
            Dialect::Chat => usage_of(v),
            Dialect::Messages(p) => messages::usage_in(v).and_then(|u| p.tokens(u)),
            Dialect::Embeddings => crate::embeddings::usage_of(v),
            Dialect::Responses => crate::responses::usage_of(v),
        }
    }

    /// Whether `v` is a whole answer of this shape.
    fn is_answer(self, v: &Value) -> bool {
        match self {
            Dialect::Chat => v.get("choices").is_some_and(Value::is_array),
            Dialect::Messages(_) => {
                v.get("type").and_then(Value::as_str) == Some("message")
                    && v.get("content").is_some_and(Value::is_array)
            }
            Dialect::Embeddings => crate::embeddings::is_answer(v),
            Dialect::Responses => crate::responses::is_answer(v),
        }
    }
}

/// Which text of an answer a piece of output belongs to: the choice's index, the field (see
/// [`each_output_text`]) and the tool call's index. A stream's pieces of one field are
/// counted as one text; fields apart.
pub(crate) type FieldKey = (u64, u8, u64);

/// Most levels of an array `content` searched for text.
pub(crate) const CONTENT_DEPTH_MAX: usize = 8;

/// Calls `f` with every text an upstream generated in an answer or in a stream's event,
/// field by field in the order a model generates them. For each choice's `message` (a whole
/// answer) or `delta` (a stream): its reasoning (`reasoning_content`, `reasoning`), its
/// `content` (a string, or every string of an array of parts but their `type`), its
/// `refusal`, each tool call's name and arguments (`function.name` and `.arguments`, or a
/// custom tool's `custom.name` and `.input`), and the legacy `function_call`. Other fields
/// (roles, ids, annotations, logprobs) are not counted: a reported usage covers them, and
/// else the reservation does.
pub(crate) fn each_output_text(event: &mut Value, f: &mut dyn FnMut(FieldKey, &mut String)) {
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
pub(crate) fn each_string(v: &mut Value, depth: usize, f: &mut dyn FnMut(&mut String)) {
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
pub(crate) struct WholeAnswer {
    /// The answer as the upstream sent it, or cut to the output bound.
    pub(crate) body: Bytes,
    /// Its usage (a whole answer's usage is trusted).
    pub(crate) usage: Option<TokenUsage>,
    /// Its output, counted whole (before any cut).
    pub(crate) output: OutputTally,
    /// The answer's texts were cut to the output bound ([`clip_answer_in`]).
    pub(crate) cut: bool,
    /// The answer is not a JSON object with `choices`, and its bytes are over the output
    /// bound: it cannot be cut, and is not passed on.
    pub(crate) unreadable: bool,
    /// The hosted calls of `hosted_types` it shows (`/v1/responses`), whole when it was read.
    pub(crate) hosted: HostedSeen,
}

/// Reads a whole answer: its usage, its output counted ([`each_output_text`], each text a
/// field of its own; an answer that is not a JSON object with `choices` counts a token a
/// byte), and, when the output is over `bound`, its texts cut to the bound ([`clip_answer_in`]).
#[cfg(test)]
pub(crate) fn read_answer(tokenizer: Tokenizer, bound: u64, bytes: Bytes) -> WholeAnswer {
    read_answer_in(Dialect::Chat, tokenizer, bound, bytes, &[])
}

/// [`read_answer`] in the shape `dialect`.
pub(crate) fn read_answer_in(
    dialect: Dialect,
    tokenizer: Tokenizer,
    bound: u64,
    bytes: Bytes,
    hosted_types: &[String],
) -> WholeAnswer {
    let mut counter = OutputCounter::new(tokenizer);
    let answer = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .filter(|v| dialect.is_answer(v));
    let Some(mut v) = answer else {
        counter.push_unread(bytes.len() as u64);
        let over = counter.over(bound);
        return WholeAnswer {
            body: bytes,
            usage: None,
            output: counter.tally(),
            cut: false,
            unreadable: over,
            hosted: HostedSeen::default(),
        };
    };
    let usage = dialect.usage(&v);
    // Counted before any cut: the calls were made.
    let mut hosted = HostedSeen {
        whole: usage.is_some(),
        ..HostedSeen::default()
    };
    if let Some(items) = v.get("output").and_then(Value::as_array) {
        hosted.count_items(items, hosted_types);
    }
    dialect.each_output_text(&mut v, &mut |_, text| {
        counter.push(text);
        counter.end_field();
    });
    let output = counter.tally();
    let cut = output.floor > bound && clip_answer_in(dialect, &mut v, tokenizer, bound);
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
        hosted,
    }
}

/// Cuts the texts of a whole answer to `bound` tokens of output, in the order the model
/// generated them ([`each_output_text`]): each text keeps the longest start that fits
/// ([`OutputCounter::fit`]), a tool call left without a name is removed, and every choice
/// ends as if the upstream had stopped at its bound (`finish_reason: "length"`), as one that
/// honours it would. Whether anything was cut.
pub(crate) fn clip_answer_in(
    dialect: Dialect,
    v: &mut Value,
    tokenizer: Tokenizer,
    bound: u64,
) -> bool {
    let mut counter = OutputCounter::new(tokenizer);
    let mut cut = false;
    dialect.each_output_text(v, &mut |_, text| {
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
    if let Dialect::Messages(_) = dialect {
        messages::finish_clip(v);
        return true;
    }
    if let Dialect::Responses = dialect {
        crate::responses::finish_clip(v);
        return true;
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
