//! The mock upstream (the `mock-upstream` binary, or `spendgate mock-upstream`): an
//! OpenAI-compatible server for tests, demos and benchmarks.
//!
//! It answers `POST /v1/chat/completions` deterministically, can misbehave on demand, and
//! counts what it served so that tests can compare spendgate's books with the upstream's
//! ground truth.
//!
//! # Routes
//! - `POST /v1/chat/completions`: OpenAI Chat Completions; streams Server-Sent Events when the
//!   body has `"stream": true`, answers one JSON object otherwise.
//! - `POST /v1/messages`: Anthropic's Messages, with the same rules, fault modes and ground
//!   truth in Anthropic's shapes (see [Messages](#messages)).
//! - `POST /v1/embeddings`: OpenAI's Embeddings (see [Embeddings](#embeddings)).
//! - `POST /v1/responses`: OpenAI's Responses, with the same rules, fault modes and ground
//!   truth, plus hosted tool calls and reasoning tokens (see [Responses](#responses)).
//! - `GET /v1/models`: the model list (`mock-model`).
//! - `GET /mock/stats`: the [`MockStats`] counters as JSON.
//! - `POST /mock/reset`: zero the counters.
//!
//! Request bodies are limited to 4 MiB. A body that is not JSON, not an object, or has no
//! `messages` array, or a malformed `x-mock-*` header, is refused with status 400 and the
//! OpenAI error shape `{"error": {"message", "type": "invalid_request_error", "code": null}}`.
//!
//! # Deterministic usage
//! - `prompt_tokens` = [`prompt_tokens_of`] the body:
//!   `3 + Σ over messages of (ceil(text bytes / 4) + 4)`; text is the string content, or the
//!   concatenated `text` parts of array content, plus the tool-call arguments of assistant
//!   messages.
//! - `cached_tokens` = 0, or `min(N, prompt_tokens)` with the header `x-mock-cached-tokens: N`.
//! - `completion_tokens` = `min(length, max_tokens) + extra`, where `length` is
//!   [`MockConfig::completion_tokens`] or the header `x-mock-completion-tokens: N`,
//!   `max_tokens` is the smaller of the body's `max_tokens` and `max_completion_tokens` when
//!   either is present (a `null` counts as absent), and `extra` is 0 or the header
//!   `x-mock-extra-completion-tokens: N` (an upstream that does not honour the output
//!   bound). The result is capped at [`MAX_COMPLETION_TOKENS`].
//! - With the header `x-mock-reported-completion-tokens: N`, every usage the answer carries
//!   (final, running, or in an error event) reports at most N completion tokens, and
//!   `total_tokens` accordingly, whatever was generated (an upstream that under-reports its
//!   output); the stats count what was generated and sent, as always.
//! - The answer is `completion_tokens` words `"tok0 tok1 tok2 ..."`, one token each.
//!   `finish_reason` is `"length"` when `max_tokens` cut the answer short, `"stop"` otherwise.
//! - Non-streaming answers carry `usage: {prompt_tokens, completion_tokens, total_tokens,
//!   prompt_tokens_details: {cached_tokens}, completion_tokens_details: {reasoning_tokens: 0}}`.
//! - Streaming answers send chunks of [`MockConfig::chunk_tokens`] tokens each
//!   (`data: {chat.completion.chunk}\n\n`; the first also carries `"role": "assistant"`),
//!   paced by the token rate when it is nonzero, then one chunk with an empty delta and the
//!   `finish_reason`, then — only when the body has `stream_options.include_usage: true` — a
//!   chunk with `"choices": []` and the usage, then `data: [DONE]\n\n`.
//! - With the header `x-mock-running-usage: 1` (streams), every content chunk and the finish
//!   chunk also carry the running usage, as some providers send it: the prompt tokens, the
//!   completion tokens sent so far, and `cached_tokens` = the header
//!   `x-mock-running-cached-tokens: N` (capped at the prompt tokens) or else the final
//!   count. The final usage chunk (when asked for) reports the final usage as usual.
//!
//! # Timing
//! With the header `x-mock-linger-ms: N` a stream's body ends N ms after its `[DONE]`.
//! `latency_ms` ([`MockConfig::latency_ms`] or the header `x-mock-latency-ms`) is waited before
//! the first byte of every answer, errors included. `tokens_per_second`
//! ([`MockConfig::tokens_per_second`] or the header `x-mock-tokens-per-second`; 0 = as fast as
//! possible) paces generation: a streamed chunk of `n` tokens is sent `n / rate` seconds after
//! the previous one; a non-streamed answer waits `completion_tokens / rate` seconds. Both
//! waits are capped at 600 s.
//!
//! # Fault modes
//! Chosen per request by the header `x-mock-fault: MODE` (which wins; an unknown mode is a 400),
//! or by a model name ending in `:MODE` (e.g. `mock-model:http_500`; an unknown suffix is just
//! part of the model name):
//! - `none`: behave.
//! - `http_429`: status 429 with `retry-after: 1` and an OpenAI-shaped error
//!   (`type: "rate_limit_error"`, `code: "rate_limit_exceeded"`). No usage counted.
//! - `http_500`: status 500 with an OpenAI-shaped error (`type: "server_error"`). No usage
//!   counted.
//! - `http_504`: the work is done (its full usage is counted, as a non-streaming answer
//!   would count it) and then answered with status 504, as a gateway in front of a provider
//!   that timed out after the provider had generated.
//! - `drop_mid_stream`: streaming: send the first 2 content chunks (fewer if the answer is
//!   shorter), then abort the connection without a finish chunk, usage or `[DONE]`.
//!   Non-streaming: abort the connection without a complete response.
//! - `hang`: accept and answer nothing; after 600 s the connection is aborted.
//! - `no_usage`: no usage chunk even when asked for; non-streaming answers have no `usage`.
//! - `usage_over`: answer, and report, `max_tokens + 10` completion tokens (or the completion
//!   length + 10 when the request has no `max_tokens`).
//! - `tool_call`: answer with an assistant message whose `content` is `null` and whose
//!   `tool_calls` hold one call `{"id": "call_mock_<n>", "type": "function", "function":
//!   {"name": "web_search", "arguments": "{\"q\":\"tok0 tok1 ...\"}"}}`, finish_reason
//!   `"tool_calls"`. The query has `completion_tokens` words, which is what the usage reports.
//!   Streaming sends it in OpenAI delta form: the first chunk has the call's `index`, `id`,
//!   `type`, `name` and the first argument fragment; later chunks only argument fragments.
//! - `content_after_usage`: streaming: after the usage chunk, one more content chunk of one
//!   token (counted), then `[DONE]`: a usage that does not cover everything sent.
//!   Non-streaming: behave.
//! - `error_event`: streaming: the content chunks, then instead of the finish chunk an error
//!   event `{"error": {...}, "usage": {...}}` carrying the usage so far, then `[DONE]`.
//!   Non-streaming: behave.
//! - `clean_cut`: streaming: the first 2 content chunks (fewer if the answer is shorter),
//!   then the body ends cleanly, without a finish chunk, usage or `[DONE]` (an upstream that
//!   failed mid-generation but closed its body). Non-streaming: behave.
//! - `no_done`: streaming: everything but the final `[DONE]`; the body ends cleanly after
//!   the usage chunk (or the finish chunk). Non-streaming: behave.
//! - `http_307`: status 307 with `location: /v1/models` (a client that follows it sends its
//!   POST there and is refused 405). No usage counted.
//! - `odd_headers`: behave, and the answer also carries the headers [`ODD_HEADERS`]: repeated
//!   ones, `spendgate-*` ones a gateway must not pass for its own, and hop-by-hop ones (one
//!   named by `Connection`).
//!
//! # What the stats count (the ground truth)
//! - `requests`: every `POST` to a model route (`/v1/chat/completions`, `/v1/messages`,
//!   `/v1/embeddings`, `/v1/responses`) received, refused ones included; `by_shape` counts
//!   them per shape (`chat`, `messages`, `embeddings`, `responses`).
//! - `by_fault`: the same requests by fault mode (`"none"` for normal ones,
//!   `"invalid_request"` for those refused with 4xx before any fault mode applied); the values
//!   add up to `requests`.
//! - `completed`: answers that finished: a non-streaming answer with status 200 was produced,
//!   or a stream sent its `[DONE]` (`error_event` excluded) or, with `no_done`, its last
//!   chunk.
//! - `prompt_tokens`, `cached_tokens`, `completion_tokens`: the tokens the mock generated and
//!   would bill, counted when generation starts (after the latency wait):
//!   - a non-streaming answer counts its full usage when it is produced (with `usage_over`
//!     the over-sized count, with `no_usage` the usage it would have reported);
//!   - a stream counts its prompt (and cached) tokens when it sends its first chunk, and the
//!     completion tokens of every chunk as that chunk is sent; so a stream that completes
//!     counts exactly the usage it reports, and one that is dropped — by the `drop_mid_stream`
//!     fault or by the client going away — counts the full prompt and only the tokens it
//!     emitted before the end;
//!   - `hang` and the non-streaming `drop_mid_stream` count the full prompt (and cached) tokens
//!     and no completion tokens: they emit none;
//!   - `http_504` counts the full usage of the answer it did not deliver;
//!   - `http_429`, `http_500`, `http_307` and refused requests count nothing; neither does a request whose
//!     client went away during the latency wait.
//! - `max_tokens_seen`: for each accepted request, the smaller of `max_tokens` /
//!   `max_completion_tokens` it carried, or 0 when it carried neither; the last 1024 values.
//! - `last_request`: the last request body that parsed as JSON.
//!
//! # Messages
//! `POST /v1/messages` answers as Anthropic does: `max_tokens` is required (a 400 without
//! it), the prompt is [`prompt_tokens_of`] the body plus its `system` text as one more
//! message, and the usage is `{input_tokens, cache_creation_input_tokens,
//! cache_read_input_tokens, output_tokens}`: the cache reads are the header
//! `x-mock-cached-tokens: N` (capped at the prompt), the cache writes the header
//! `x-mock-cache-write-tokens: N` (capped at what is left), `input_tokens` the rest. A stream
//! sends `message_start` (the usage with `output_tokens: 1`), `content_block_start`, `ping`,
//! one `content_block_delta` per chunk (`text_delta`, or `input_json_delta` of a `tool_use`
//! block with `tool_call`), `content_block_stop`, `message_delta` (the stop reason and
//! `usage.output_tokens`), `message_stop`, each as `event: TYPE` and `data: {...}`. Errors
//! are `{"type": "error", "error": {"type", "message"}}`. The fault modes behave as for chat
//! completions, in these events: `no_usage` leaves `usage` out of every event and answer;
//! `content_after_usage` sends one more `content_block_delta` after `message_delta`;
//! `error_event` sends an `error` event in place of `message_delta`; `clean_cut` and
//! `drop_mid_stream` end after 2 deltas; `no_done` leaves out `message_stop`; running usage
//! and stamps are for chat completions only. The stats count the same way (`by_shape` counts
//! requests per shape), and each tagged record names its `shape`.
//!
//! # Embeddings
//! `POST /v1/embeddings` answers `{"object": "list", "data": [one embedding of 8 numbers per
//! input], "model", "usage": {"prompt_tokens", "total_tokens"}}`: the prompt is each input
//! string's `ceil(bytes / 4)` and each token array's length. Its faults: the error statuses,
//! `hang`, `drop_mid_stream` (the connection aborted), `no_usage`, and `usage_over` (10
//! prompt tokens more, reported and counted); the others behave. Its requests count under
//! `by_shape["embeddings"]`, its prompt tokens as the others'.
//!
//! # Responses
//! `POST /v1/responses` answers as OpenAI's Responses API does. The body needs `input` (a
//! string or an array of items; without it, a 400 in the OpenAI error shape); `model`,
//! `instructions`, `max_output_tokens` (the output bound; `null` counts as absent),
//! `stream`, `tools`, `max_tool_calls`, `reasoning`, `previous_response_id` and `store` are
//! optional (`max_tokens` / `max_completion_tokens` are ignored here).
//! - `input_tokens` = [`responses_prompt_tokens_of`] the body: `3`, plus `ceil(bytes / 4) + 4`
//!   for `instructions`, for a string `input`, and for each input item (a message's string
//!   content or concatenated part `text`s, a `function_call`'s `arguments`, a
//!   `function_call_output`'s string `output`, nothing for other items), plus
//!   `ceil(bytes / 4)` of the compact JSON of each tool of type `function`.
//! - `output_tokens` follow the chat rules (`x-mock-completion-tokens`, capped by
//!   `max_output_tokens`, plus `x-mock-extra-completion-tokens`, at most
//!   [`MAX_COMPLETION_TOKENS`]; `usage_over` makes it `max_output_tokens + 10`). With the
//!   header `x-mock-reasoning-tokens: N` ([`REASONING_TOKENS_HEADER`]), `min(N,
//!   output_tokens)` of them are reasoning: counted in `output_tokens` and in
//!   `output_tokens_details.reasoning_tokens`, not shown; the text is the other
//!   `output_tokens - reasoning_tokens` words `tok0 tok1 ...`. `cached_tokens` and
//!   `x-mock-reported-completion-tokens` (which caps the reported `output_tokens`, and the
//!   reasoning within it) apply as for chat.
//! - Hosted tools: every tool whose `type` is neither `function` nor `custom` is hosted. Each
//!   gets `x-mock-hosted-tool-calls: N` calls ([`HOSTED_TOOL_CALLS_HEADER`], default 1), in
//!   tool order, at most `max_tool_calls` in all when the body has it (and at most
//!   [`MAX_HOSTED_TOOL_CALLS`]); then `x-mock-extra-hosted-tool-calls: M`
//!   ([`EXTRA_HOSTED_TOOL_CALLS_HEADER`]) more calls of the first hosted tool beyond that bound
//!   (an upstream that ignores it). Each call is an output item before the message:
//!   `{"type": "<kind>_call", "id": "<kind>_mock_<seq>_<i>", "status": "completed"}`, where
//!   kind is `web_search` for `web_search` and every `web_search_preview...`, else the tool's
//!   type, `<seq>` the response's number and `<i>` the call's output index.
//! - A whole answer is `{"id": "resp_mock_<n>", "object": "response", "created_at", "status":
//!   "completed" | "incomplete", "incomplete_details": null | {"reason":
//!   "max_output_tokens"}, "model", "output": [hosted calls..., {"type": "message", "id":
//!   "msg_mock_<n>", "status": "completed", "role": "assistant", "content": [{"type":
//!   "output_text", "text", "annotations": []}]}], "usage": {"input_tokens",
//!   "input_tokens_details": {"cached_tokens"}, "output_tokens", "output_tokens_details":
//!   {"reasoning_tokens"}, "total_tokens"}, "error": null, ...}`, echoing `instructions`,
//!   `max_output_tokens`, `max_tool_calls`, `previous_response_id`, `reasoning` (each `null`
//!   when absent), `store` (default `true`) and `tools` (default `[]`), with
//!   `parallel_tool_calls: true`, `tool_choice: "auto"`, `text: {"format": {"type":
//!   "text"}}`, `temperature` and `top_p` 1.0, `metadata: {}`. It is `"incomplete"` when
//!   `max_output_tokens` cut the answer short.
//! - A stream (`"stream": true`) sends events `event: TYPE\ndata: {"type": TYPE,
//!   "sequence_number": k, ...}\n\n` (k = 0, 1, ...): `response.created` and
//!   `response.in_progress` (the response `in_progress`, `output: []`, `usage: null`); per
//!   hosted call `response.output_item.added` (`in_progress`) and `response.output_item.done`
//!   (`completed`); for the message `response.output_item.added` (`content: []`),
//!   `response.content_part.added`, one `response.output_text.delta` (`item_id`,
//!   `output_index`, `content_index: 0`, `delta`) per chunk of
//!   [`MockConfig::chunk_tokens`] visible tokens paced as chat's, `response.output_text.done`
//!   (the whole `text`), `response.content_part.done`, `response.output_item.done`; and last
//!   `response.completed` (or `response.incomplete`) with the whole answer as `response`.
//!   There is no `[DONE]`. The reasoning tokens are generated (paced, and counted) just
//!   before the message's `output_item.added`.
//! - `tool_call`: the message is replaced by `{"type": "function_call", "id": "fc_mock_<n>",
//!   "call_id": "call_mock_<n>", "name": "web_search", "arguments": "{\"q\":\"tok0 ...\"}",
//!   "status": "completed"}` whose query has the visible output tokens; streamed, as
//!   `response.function_call_arguments.delta` events (`item_id`, `output_index`, `delta`) and
//!   `response.function_call_arguments.done` (`arguments`), with no content part events.
//! - The fault modes behave as for chat completions, in these shapes: the error statuses in
//!   the OpenAI error shape (`http_504` counts the work, hosted calls included); `hang`;
//!   `drop_mid_stream` aborts after 2 deltas (a whole answer: at once); `clean_cut` ends the
//!   body cleanly after 2 deltas; `no_usage` makes `usage` `null` in the whole answer and the
//!   final event; `content_after_usage` sends one more `response.output_text.delta` of one
//!   token after `response.completed`; `error_event` sends, after the deltas, `event: error`
//!   with `{"type": "error", "code": "server_error", "message": "mock error event", "param":
//!   null, "sequence_number"}`, then `response.failed` (status `failed`, the usage generated
//!   so far), and no `response.completed`; `no_done` behaves; `odd_headers`, latency and pace
//!   headers as for chat; running usage, stamps and linger are for chat completions only.
//! - Ground truth: counted as for chat completions (the prompt when generation starts, output
//!   tokens as sent, `completed` when the whole answer is produced or `response.completed` /
//!   `response.incomplete` is sent). Hosted tool calls are counted as each call item is
//!   produced (a whole answer: all at once; a stream: as its `output_item` events are sent)
//!   in [`MockStats::hosted_tool_calls`] and by item type in
//!   [`MockStats::hosted_tool_calls_by_type`] (`"web_search_call"`, ...), and per tag in
//!   [`Served::hosted_tool_calls`].
//!
//! # Per-request ground truth
//! A request with the header `x-mock-tag: T` (1 to 128 bytes of ASCII) has what was served
//! for it recorded under `T` ([`Served`]): the prompt, cached and completion tokens counted as
//! above, the output bound it carried, the status of the answer's head, whether it finished,
//! its fault mode, and how many requests carried `T`. `GET /mock/served` (and
//! [`MockUpstream::served`]) lists the newest [`SERVED_TAGS_MAX`] tags, oldest first, with the
//! number of older ones dropped (`evicted`). The chaos run (`crates/spendgate-chaos`)
//! compares what a gateway charged for each reservation against this record.

#![forbid(unsafe_code)]

mod embeddings;
mod messages;
mod responses;
mod served;
mod stream;
mod tokens;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub use responses::{
    responses_prompt_tokens_of, EXTRA_HOSTED_TOOL_CALLS_HEADER, HOSTED_TOOL_CALLS_HEADER,
    MAX_HOSTED_TOOL_CALLS, REASONING_TOKENS_HEADER,
};
pub use served::{Served, ServedTags, SERVED_TAGS_MAX, TAG_BYTES_MAX, TAG_HEADER};
pub use tokens::prompt_tokens_of;

/// Largest request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Largest number of completion tokens the mock ever generates for one answer.
pub const MAX_COMPLETION_TOKENS: u64 = 1 << 20;
/// How many `max_tokens` values [`MockStats::max_tokens_seen`] keeps.
pub const MAX_TOKENS_SEEN_KEPT: usize = 1024;
/// Longest a `hang` holds a request, and the cap on any configured wait.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

/// The extra headers of the `odd_headers` fault, in order (`vary` and `link` twice).
pub const ODD_HEADERS: [(&str, &str); 9] = [
    ("vary", "accept-encoding"),
    ("vary", "origin"),
    ("link", "<https://example.com/a>; rel=\"a\""),
    ("link", "<https://example.com/b>; rel=\"b\""),
    ("spendgate-outcome", "released"),
    ("spendgate-charged-micros", "0"),
    ("connection", "x-mock-hop"),
    ("x-mock-hop", "1"),
    ("proxy-authenticate", "Basic realm=\"mock\""),
];

/// The model the mock lists.
pub const MODEL_ID: &str = "mock-model";

/// Header choosing a fault mode.
pub const FAULT_HEADER: &str = "x-mock-fault";
/// Header overriding the completion length.
pub const COMPLETION_TOKENS_HEADER: &str = "x-mock-completion-tokens";
/// Header setting the reported cached prompt tokens.
pub const CACHED_TOKENS_HEADER: &str = "x-mock-cached-tokens";
/// Header setting the prompt tokens a Messages answer reports written to the cache.
pub const CACHE_WRITE_TOKENS_HEADER: &str = "x-mock-cache-write-tokens";
/// Header adding completion tokens beyond the output bound (generated and reported).
pub const EXTRA_COMPLETION_TOKENS_HEADER: &str = "x-mock-extra-completion-tokens";
/// Header capping the completion tokens every usage reports (what is sent is not capped).
pub const REPORTED_COMPLETION_TOKENS_HEADER: &str = "x-mock-reported-completion-tokens";
/// Header `x-mock-running-usage: 1`: streamed content chunks carry the running usage.
pub const RUNNING_USAGE_HEADER: &str = "x-mock-running-usage";
/// Header setting the cached tokens the running usages report (default: the final count).
pub const RUNNING_CACHED_TOKENS_HEADER: &str = "x-mock-running-cached-tokens";
/// Header overriding the latency before the first byte, in milliseconds.
pub const LATENCY_HEADER: &str = "x-mock-latency-ms";
/// Header `x-mock-linger-ms: N`: a stream's body stays open N ms after its `[DONE]` (an
/// upstream whose connection lingers).
pub const LINGER_HEADER: &str = "x-mock-linger-ms";
/// Header overriding the token rate (0 = as fast as possible).
pub const TOKENS_PER_SECOND_HEADER: &str = "x-mock-tokens-per-second";
/// Header `x-mock-stamp: 1`: every streamed content chunk carries `x_mock_sent_unix_ns`, the
/// wall-clock time it was built, so a client on the same machine can measure each chunk's
/// transit (how much a proxy in between delays each chunk).
pub const STAMP_HEADER: &str = "x-mock-stamp";
/// The field a stamped chunk carries (see [`STAMP_HEADER`]).
pub const STAMP_FIELD: &str = "x_mock_sent_unix_ns";

/// How the mock behaves when a request does not say otherwise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MockConfig {
    /// Wait before the first byte of every answer, in milliseconds.
    pub latency_ms: u64,
    /// Generation pace in tokens per second; 0 = as fast as possible.
    pub tokens_per_second: u64,
    /// Default completion length in tokens (before `max_tokens` clamping).
    pub completion_tokens: u64,
    /// Tokens per streamed chunk (0 is treated as 1).
    pub chunk_tokens: u64,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            latency_ms: 0,
            tokens_per_second: 0,
            completion_tokens: 16,
            chunk_tokens: 4,
        }
    }
}

/// A snapshot of what the mock served. See the crate docs for exactly what each field counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MockStats {
    /// Requests received on the model routes (every shape).
    pub requests: u64,
    /// Answers that finished (non-streaming 200 produced, or stream reached `[DONE]`).
    pub completed: u64,
    /// Prompt tokens of every answer whose generation started.
    pub prompt_tokens: u64,
    /// Completion tokens generated and sent.
    pub completion_tokens: u64,
    /// Cached prompt tokens of every answer whose generation started.
    pub cached_tokens: u64,
    /// Requests by fault mode (`"none"` for normal, `"invalid_request"` for refused).
    pub by_fault: BTreeMap<String, u64>,
    /// Requests by API shape (`"chat"`, `"messages"`, `"embeddings"`, `"responses"`), refused
    /// ones included.
    #[serde(default)]
    pub by_shape: BTreeMap<String, u64>,
    /// Hosted tool calls served (Responses), counted as each call item is sent or produced.
    #[serde(default)]
    pub hosted_tool_calls: u64,
    /// The same calls by item type (`"web_search_call"`, `"file_search_call"`, ...).
    #[serde(default)]
    pub hosted_tool_calls_by_type: BTreeMap<String, u64>,
    /// The last 1024 `max_tokens` values requests carried (0 when absent).
    pub max_tokens_seen: Vec<u64>,
    /// The last request body received that parsed as JSON.
    pub last_request: Option<Value>,
}

/// The mock server. Cheap to clone: clones share the same counters.
#[derive(Clone, Debug)]
pub struct MockUpstream {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: MockConfig,
    seq: AtomicU64,
    counters: Mutex<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    requests: u64,
    completed: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
    by_fault: BTreeMap<String, u64>,
    by_shape: BTreeMap<String, u64>,
    hosted_tool_calls: u64,
    hosted_tool_calls_by_type: BTreeMap<String, u64>,
    max_tokens_seen: VecDeque<u64>,
    last_request: Option<Value>,
    served: served::ServedLog,
}

impl MockUpstream {
    /// A mock with this configuration and zeroed counters.
    pub fn new(config: MockConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                config,
                seq: AtomicU64::new(0),
                counters: Mutex::new(Counters::default()),
            }),
        }
    }

    /// The configuration this mock was built with.
    pub fn config(&self) -> &MockConfig {
        &self.inner.config
    }

    /// The routes: `POST /v1/chat/completions`, `/v1/messages`, `/v1/embeddings`,
    /// `/v1/responses`, `GET /v1/models`, `GET /mock/stats`,
    /// `POST /mock/reset`, `GET /mock/served`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/messages", post(messages))
            .route("/v1/embeddings", post(embeddings_handler))
            .route("/v1/responses", post(responses_handler))
            .route("/v1/models", get(models))
            .route("/mock/stats", get(stats_handler))
            .route("/mock/reset", post(reset_handler))
            .route("/mock/served", get(served_handler))
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self.clone())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> MockStats {
        let c = self.counters();
        MockStats {
            requests: c.requests,
            completed: c.completed,
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            cached_tokens: c.cached_tokens,
            by_fault: c.by_fault.clone(),
            by_shape: c.by_shape.clone(),
            hosted_tool_calls: c.hosted_tool_calls,
            hosted_tool_calls_by_type: c.hosted_tool_calls_by_type.clone(),
            max_tokens_seen: c.max_tokens_seen.iter().copied().collect(),
            last_request: c.last_request.clone(),
        }
    }

    /// What was served for each tagged request ([`TAG_HEADER`]), oldest first.
    pub fn served(&self) -> ServedTags {
        self.counters().served.snapshot()
    }

    /// Zero the counters (and forget every tag).
    pub fn reset(&self) {
        *self.counters() = Counters::default();
    }

    /// Serve the router on `listener` until the process ends or the listener fails.
    ///
    /// Every connection has `TCP_NODELAY`: without it, Nagle's algorithm holds a small
    /// streamed chunk until the previous one is acknowledged, and with the peer's delayed ACK
    /// that is up to 40 ms per chunk, which no real upstream does.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, self.router()).await
    }

    fn counters(&self) -> MutexGuard<'_, Counters> {
        // The counters stay consistent even if a holder panicked: every update is a few adds.
        self.inner
            .counters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn next_seq(&self) -> u64 {
        self.inner.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn count_request(&self, shape: Shape) {
        let mut c = self.counters();
        c.requests = c.requests.saturating_add(1);
        let n = c.by_shape.entry(shape.name().to_owned()).or_insert(0);
        *n = n.saturating_add(1);
    }

    fn count_fault(&self, name: &str) {
        let mut c = self.counters();
        let n = c.by_fault.entry(name.to_owned()).or_insert(0);
        *n = n.saturating_add(1);
    }

    fn record_body(&self, body: &Value) {
        self.counters().last_request = Some(body.clone());
    }

    fn record_max_tokens(&self, max_tokens: Option<u64>) {
        let mut c = self.counters();
        if c.max_tokens_seen.len() >= MAX_TOKENS_SEEN_KEPT {
            c.max_tokens_seen.pop_front();
        }
        c.max_tokens_seen.push_back(max_tokens.unwrap_or(0));
    }

    /// Count the prompt side of an answer whose generation started.
    pub(crate) fn count_prompt(&self, plan: &Plan) {
        let (prompt_tokens, cached_tokens) = (plan.prompt_tokens, plan.cached_tokens);
        let mut c = self.counters();
        c.prompt_tokens = c.prompt_tokens.saturating_add(prompt_tokens);
        c.cached_tokens = c.cached_tokens.saturating_add(cached_tokens);
        if let Some(tag) = &plan.tag {
            let writes = plan.cache_write_tokens;
            c.served.update(tag, |s| {
                s.prompt_tokens = s.prompt_tokens.saturating_add(prompt_tokens);
                s.cached_tokens = s.cached_tokens.saturating_add(cached_tokens);
                s.cache_write_tokens = s.cache_write_tokens.saturating_add(writes);
            });
        }
    }

    /// Count completion tokens that were generated and sent.
    pub(crate) fn count_completion(&self, plan: &Plan, tokens: u64) {
        let mut c = self.counters();
        c.completion_tokens = c.completion_tokens.saturating_add(tokens);
        if let Some(tag) = &plan.tag {
            c.served.update(tag, |s| {
                s.completion_tokens = s.completion_tokens.saturating_add(tokens);
            });
        }
    }

    /// Count one hosted tool call of `kind` (its item type is `{kind}_call`), served.
    pub(crate) fn count_hosted(&self, plan: &Plan, kind: &str) {
        let mut c = self.counters();
        c.hosted_tool_calls = c.hosted_tool_calls.saturating_add(1);
        let n = c
            .hosted_tool_calls_by_type
            .entry(format!("{kind}_call"))
            .or_insert(0);
        *n = n.saturating_add(1);
        if let Some(tag) = &plan.tag {
            c.served.update(tag, |s| {
                s.hosted_tool_calls = s.hosted_tool_calls.saturating_add(1);
            });
        }
    }

    /// Count an answer that finished.
    pub(crate) fn count_completed(&self, plan: &Plan) {
        let mut c = self.counters();
        c.completed = c.completed.saturating_add(1);
        if let Some(tag) = &plan.tag {
            c.served.update(tag, |s| s.finished = true);
        }
    }

    /// A tagged request was planned: its record is opened.
    fn open_tag(&self, plan: &Plan) {
        if let Some(tag) = &plan.tag {
            let mut c = self.counters();
            c.served.open(
                tag,
                (plan.fault.name(), plan.shape.name()),
                plan.stream,
                plan.max_tokens,
            );
        }
    }

    /// The head of a tagged request's answer is ready.
    fn tag_status(&self, tag: Option<&str>, status: u16) {
        if let Some(tag) = tag {
            self.counters()
                .served
                .update(tag, |s| s.status = Some(status));
        }
    }
}

/// The API shape of a request (its route).
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
    /// The prompt tokens of a request of this shape (a Messages request without
    /// `max_tokens` is refused, as Anthropic refuses it).
    fn prompt_tokens(self, body: &Value) -> Result<u64, String> {
        match self {
            Shape::Chat => Ok(prompt_tokens_of(body)),
            Shape::Messages if body_u64(body, "max_tokens")?.is_none() => {
                Err("max_tokens: Field required".to_owned())
            }
            Shape::Messages => Ok(messages::prompt_tokens(body)),
            Shape::Embeddings => embeddings::prompt_tokens(body),
            Shape::Responses => responses::prompt_tokens(body),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Shape::Chat => "chat",
            Shape::Messages => "messages",
            Shape::Embeddings => "embeddings",
            Shape::Responses => "responses",
        }
    }
}

/// A fault mode, chosen per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    None,
    Http429,
    Http500,
    DropMidStream,
    Hang,
    NoUsage,
    UsageOver,
    ToolCall,
    Http504,
    ContentAfterUsage,
    ErrorEvent,
    CleanCut,
    NoDone,
    Http307,
    OddHeaders,
}

impl Fault {
    const ALL: [Fault; 15] = [
        Fault::None,
        Fault::Http429,
        Fault::Http500,
        Fault::DropMidStream,
        Fault::Hang,
        Fault::NoUsage,
        Fault::UsageOver,
        Fault::ToolCall,
        Fault::Http504,
        Fault::ContentAfterUsage,
        Fault::ErrorEvent,
        Fault::CleanCut,
        Fault::NoDone,
        Fault::Http307,
        Fault::OddHeaders,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::Http429 => "http_429",
            Fault::Http500 => "http_500",
            Fault::DropMidStream => "drop_mid_stream",
            Fault::Hang => "hang",
            Fault::NoUsage => "no_usage",
            Fault::UsageOver => "usage_over",
            Fault::ToolCall => "tool_call",
            Fault::Http504 => "http_504",
            Fault::ContentAfterUsage => "content_after_usage",
            Fault::ErrorEvent => "error_event",
            Fault::CleanCut => "clean_cut",
            Fault::NoDone => "no_done",
            Fault::Http307 => "http_307",
            Fault::OddHeaders => "odd_headers",
        }
    }

    fn parse(s: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == s)
    }
}

const INVALID_REQUEST: &str = "invalid_request";

/// Everything decided about one request before answering it.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub(crate) shape: Shape,
    pub(crate) id: String,
    pub(crate) call_id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) fault: Fault,
    pub(crate) max_tokens: Option<u64>,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    /// Prompt tokens written to the cache (Messages), within `prompt_tokens`.
    pub(crate) cache_write_tokens: u64,
    /// The inputs of an embeddings request (one embedding each).
    pub(crate) inputs: usize,
    /// Tokens generated and reported.
    pub(crate) completion_tokens: u64,
    pub(crate) finish_reason: &'static str,
    pub(crate) chunk_tokens: u64,
    pub(crate) tokens_per_second: u64,
    pub(crate) latency: Duration,
    /// How long a stream's body stays open after its `[DONE]` ([`LINGER_HEADER`]).
    pub(crate) linger: Duration,
    /// Stamp each streamed content chunk with its send time ([`STAMP_HEADER`]).
    pub(crate) stamp: bool,
    /// The cached tokens of the running usage on every streamed content chunk
    /// ([`RUNNING_USAGE_HEADER`]), when it is sent.
    pub(crate) running_cached: Option<u64>,
    /// The most completion tokens a usage reports ([`REPORTED_COMPLETION_TOKENS_HEADER`]).
    pub(crate) reported_cap: u64,
    /// The request's [`TAG_HEADER`]: what is served for it is recorded under it.
    pub(crate) tag: Option<Arc<str>>,
    /// What a Responses request adds (reasoning, hosted calls, echoed fields).
    pub(crate) responses: responses::Extras,
}

impl Plan {
    /// A `chat.completion.chunk` event of this answer, with `fields` (an object) added.
    pub(crate) fn event(&self, fields: Value) -> Value {
        let mut event = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
        });
        if let (Some(e), Value::Object(f)) = (event.as_object_mut(), fields) {
            e.extend(f);
        }
        event
    }

    pub(crate) fn usage(&self) -> Value {
        self.usage_with(self.completion_tokens, self.cached_tokens)
    }

    /// A usage of `completion_tokens` so far with `cached_tokens` (at most the reported cap).
    pub(crate) fn usage_with(&self, completion_tokens: u64, cached_tokens: u64) -> Value {
        let completion_tokens = completion_tokens.min(self.reported_cap);
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens.saturating_add(completion_tokens),
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0},
        })
    }

    /// How long generating `tokens` takes at the planned rate (zero when unpaced).
    pub(crate) fn generation_time(&self, tokens: u64) -> Duration {
        if self.tokens_per_second == 0 || tokens == 0 {
            return Duration::ZERO;
        }
        let nanos = u128::from(tokens) * 1_000_000_000 / u128::from(self.tokens_per_second);
        let nanos = u64::try_from(nanos).unwrap_or(u64::MAX);
        Duration::from_nanos(nanos).min(MAX_WAIT)
    }

    /// The tool-call arguments text for tokens `from..to`, as the fragment a stream sends.
    pub(crate) fn arguments_fragment(&self, from: u64, to: u64) -> String {
        tokens::arguments(from, to, self.completion_tokens)
    }
}

fn header_u64(headers: &HeaderMap, name: &str) -> Result<Option<u64>, String> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(Some)
            .ok_or_else(|| format!("header {name} must be a non-negative integer")),
    }
}

fn body_u64(body: &Value, field: &str) -> Result<Option<u64>, String> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("{field} must be a non-negative integer")),
    }
}

fn body_bool(body: &Value, field: &str) -> Result<bool, String> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("{field} must be a boolean")),
    }
}

#[cfg(test)]
fn plan_request(
    config: &MockConfig,
    seq: u64,
    headers: &HeaderMap,
    body: &Value,
) -> Result<Plan, String> {
    plan_shaped(Shape::Chat, config, seq, headers, body)
}

/// The fault mode: the header's, else the model name's `:MODE` suffix, else none.
fn fault_of(headers: &HeaderMap, model: &str) -> Result<Fault, String> {
    Ok(match headers.get(FAULT_HEADER) {
        Some(v) => {
            let s = v
                .to_str()
                .map_err(|_| format!("header {FAULT_HEADER} must be ASCII"))?;
            Fault::parse(s.trim())
                .ok_or_else(|| format!("unknown fault mode in {FAULT_HEADER}: {s:?}"))?
        }
        None => model
            .rsplit_once(':')
            .and_then(|(_, suffix)| Fault::parse(suffix))
            .unwrap_or(Fault::None),
    })
}

/// The output bound a request carries: Responses' `max_output_tokens`, else the smaller of
/// `max_tokens` and `max_completion_tokens`.
fn output_bound(shape: Shape, body: &Value) -> Result<Option<u64>, String> {
    if shape == Shape::Responses {
        return body_u64(body, "max_output_tokens");
    }
    Ok(
        match (
            body_u64(body, "max_tokens")?,
            body_u64(body, "max_completion_tokens")?,
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        },
    )
}

fn plan_shaped(
    shape: Shape,
    config: &MockConfig,
    seq: u64,
    headers: &HeaderMap,
    body: &Value,
) -> Result<Plan, String> {
    if !body.is_object() {
        return Err("the request body must be a JSON object".to_owned());
    }
    if matches!(shape, Shape::Chat | Shape::Messages)
        && !body.get("messages").is_some_and(Value::is_array)
    {
        return Err("messages must be an array".to_owned());
    }
    let model = match body.get("model") {
        None | Some(Value::Null) => MODEL_ID.to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("model must be a string".to_owned()),
    };
    let fault = fault_of(headers, &model)?;
    let stream = body_bool(body, "stream")?;
    let include_usage = stream
        && body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
    let max_tokens = output_bound(shape, body)?;
    let length = header_u64(headers, COMPLETION_TOKENS_HEADER)?.unwrap_or(config.completion_tokens);
    let cached = header_u64(headers, CACHED_TOKENS_HEADER)?.unwrap_or(0);
    let latency_ms = header_u64(headers, LATENCY_HEADER)?.unwrap_or(config.latency_ms);
    let linger_ms = header_u64(headers, LINGER_HEADER)?.unwrap_or(0);
    let tokens_per_second =
        header_u64(headers, TOKENS_PER_SECOND_HEADER)?.unwrap_or(config.tokens_per_second);
    let stamp = header_u64(headers, STAMP_HEADER)?.unwrap_or(0) != 0;
    let extra = header_u64(headers, EXTRA_COMPLETION_TOKENS_HEADER)?.unwrap_or(0);
    let running_usage = header_u64(headers, RUNNING_USAGE_HEADER)?.unwrap_or(0) != 0;
    let running_cached = header_u64(headers, RUNNING_CACHED_TOKENS_HEADER)?;
    let reported_cap = header_u64(headers, REPORTED_COMPLETION_TOKENS_HEADER)?.unwrap_or(u64::MAX);
    let tag = served::tag_of(headers)?;

    let prompt_tokens = shape.prompt_tokens(body)?;
    let cache_write_tokens = header_u64(headers, CACHE_WRITE_TOKENS_HEADER)?
        .unwrap_or(0)
        .min(prompt_tokens.saturating_sub(cached.min(prompt_tokens)));
    let clamped = max_tokens.map_or(length, |m| length.min(m));
    let (completion_tokens, finish_reason) = match fault {
        Fault::UsageOver => (max_tokens.unwrap_or(length).saturating_add(10), "length"),
        Fault::ToolCall => (clamped, "tool_calls"),
        _ if clamped < length => (clamped, "length"),
        _ => (clamped, "stop"),
    };
    let completion_tokens = completion_tokens
        .saturating_add(extra)
        .min(MAX_COMPLETION_TOKENS);
    let cached_tokens = cached.min(prompt_tokens);
    let responses = if shape == Shape::Responses {
        responses::extras(headers, body, completion_tokens)?
    } else {
        responses::Extras::default()
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(Plan {
        shape,
        id: match shape {
            Shape::Chat => format!("chatcmpl-mock-{seq}"),
            Shape::Messages => format!("msg_mock_{seq}"),
            Shape::Embeddings => format!("emb-mock-{seq}"),
            Shape::Responses => format!("resp_mock_{seq}"),
        },
        call_id: format!("call_mock_{seq}"),
        created,
        model,
        stream,
        include_usage,
        fault,
        max_tokens,
        prompt_tokens,
        cached_tokens,
        cache_write_tokens,
        inputs: embeddings::count(body),
        completion_tokens,
        finish_reason,
        chunk_tokens: config.chunk_tokens.max(1),
        tokens_per_second,
        latency: Duration::from_millis(latency_ms).min(MAX_WAIT),
        linger: Duration::from_millis(linger_ms).min(MAX_WAIT),
        stamp,
        running_cached: running_usage
            .then(|| running_cached.map_or(cached_tokens, |c| c.min(prompt_tokens))),
        reported_cap,
        tag,
        responses,
    })
}

/// An OpenAI-shaped error answer.
fn error_response(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Response {
    let body = json!({
        "error": {
            "message": message,
            "type": kind,
            "param": null,
            "code": code,
        }
    });
    (status, Json(body)).into_response()
}

fn invalid_request(status: StatusCode, message: &str) -> Response {
    error_response(status, "invalid_request_error", None, message)
}

/// An answer whose body fails at once: the server aborts the connection.
fn aborted_response() -> Response {
    let failing = futures::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "mock upstream: connection dropped on purpose",
        ))
    });
    let mut response = Response::new(Body::from_stream(failing));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

async fn chat_completions(
    State(mock): State<MockUpstream>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(mock, Shape::Chat, headers, body).await
}

async fn messages(
    State(mock): State<MockUpstream>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(mock, Shape::Messages, headers, body).await
}

async fn responses_handler(
    State(mock): State<MockUpstream>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(mock, Shape::Responses, headers, body).await
}

async fn embeddings_handler(
    State(mock): State<MockUpstream>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(mock, Shape::Embeddings, headers, body).await
}

/// A request refused before any fault mode applied, in its shape's error shape.
fn refused(shape: Shape, status: StatusCode, message: &str) -> Response {
    match shape {
        Shape::Chat | Shape::Embeddings | Shape::Responses => invalid_request(status, message),
        Shape::Messages => messages::error_response(status, "invalid_request_error", message),
    }
}

async fn handle(
    mock: MockUpstream,
    shape: Shape,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    mock.count_request(shape);
    let seq = mock.next_seq();
    let raw = match body {
        Ok(raw) => raw,
        Err(rejection) => {
            mock.count_fault(INVALID_REQUEST);
            return refused(shape, rejection.status(), &rejection.body_text());
        }
    };
    let body: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => {
            mock.count_fault(INVALID_REQUEST);
            return refused(
                shape,
                StatusCode::BAD_REQUEST,
                &format!("the request body is not valid JSON: {e}"),
            );
        }
    };
    mock.record_body(&body);
    let plan = match plan_shaped(shape, mock.config(), seq, &headers, &body) {
        Ok(plan) => plan,
        Err(message) => {
            mock.count_fault(INVALID_REQUEST);
            return refused(shape, StatusCode::BAD_REQUEST, &message);
        }
    };
    drop(body);
    mock.count_fault(plan.fault.name());
    mock.record_max_tokens(plan.max_tokens);
    mock.open_tag(&plan);
    tracing::debug!(
        id = %plan.id,
        fault = plan.fault.name(),
        stream = plan.stream,
        prompt_tokens = plan.prompt_tokens,
        completion_tokens = plan.completion_tokens,
        shape = plan.shape.name(),
        "mock answer"
    );

    if !plan.latency.is_zero() {
        tokio::time::sleep(plan.latency).await;
    }

    let odd_headers = plan.fault == Fault::OddHeaders;
    let tag = plan.tag.clone();
    let mut response = answer(mock.clone(), plan).await;
    mock.tag_status(tag.as_deref(), response.status().as_u16());
    if odd_headers {
        let headers = response.headers_mut();
        for (k, v) in ODD_HEADERS {
            headers.append(k, HeaderValue::from_static(v));
        }
    }
    response
}

/// The answer to a planned request, after its latency.
async fn answer(mock: MockUpstream, plan: Plan) -> Response {
    match plan.shape {
        Shape::Messages => return messages::answer(mock, plan).await,
        Shape::Embeddings => return embeddings::answer(mock, plan).await,
        Shape::Chat | Shape::Responses => {}
    }
    match plan.fault {
        Fault::Http429 => {
            let mut response = error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("rate_limit_exceeded"),
                "mock upstream: rate limited (fault http_429)",
            );
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            response
        }
        Fault::Http500 => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            None,
            "mock upstream: internal error (fault http_500)",
        ),
        Fault::Http307 => {
            let mut response = error_response(
                StatusCode::TEMPORARY_REDIRECT,
                "invalid_request_error",
                None,
                "mock upstream: moved (fault http_307)",
            );
            response
                .headers_mut()
                .insert(header::LOCATION, HeaderValue::from_static("/v1/models"));
            response
        }
        Fault::Http504 => {
            mock.count_prompt(&plan);
            mock.count_completion(&plan, plan.completion_tokens);
            responses::count_hosted_all(&mock, &plan);
            error_response(
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                None,
                "mock upstream: gateway timeout after the work was done (fault http_504)",
            )
        }
        Fault::Hang => {
            mock.count_prompt(&plan);
            tokio::time::sleep(MAX_WAIT).await;
            aborted_response()
        }
        Fault::DropMidStream if !plan.stream => {
            mock.count_prompt(&plan);
            aborted_response()
        }
        _ if plan.shape == Shape::Responses && plan.stream => responses::stream(mock, plan),
        _ if plan.shape == Shape::Responses => responses::whole(mock, plan).await,
        _ if plan.stream => stream::response(mock, plan),
        _ => complete_response(mock, plan).await,
    }
}

/// A non-streaming answer.
async fn complete_response(mock: MockUpstream, plan: Plan) -> Response {
    let generation = plan.generation_time(plan.completion_tokens);
    if !generation.is_zero() {
        tokio::time::sleep(generation).await;
    }
    let message = if plan.fault == Fault::ToolCall {
        json!({
            "role": "assistant",
            "content": null,
            "refusal": null,
            "tool_calls": [{
                "id": plan.call_id,
                "type": "function",
                "function": {
                    "name": "web_search",
                    "arguments": plan.arguments_fragment(0, plan.completion_tokens),
                },
            }],
        })
    } else {
        json!({
            "role": "assistant",
            "content": tokens::words(0, plan.completion_tokens),
            "refusal": null,
        })
    };
    let mut body = json!({
        "id": plan.id,
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.model,
        "system_fingerprint": null,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": plan.finish_reason,
        }],
    });
    if plan.fault != Fault::NoUsage {
        if let Some(obj) = body.as_object_mut() {
            obj.insert("usage".to_owned(), plan.usage());
        }
    }
    mock.count_prompt(&plan);
    mock.count_completion(&plan, plan.completion_tokens);
    mock.count_completed(&plan);
    (StatusCode::OK, Json(body)).into_response()
}

async fn models() -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": MODEL_ID,
            "object": "model",
            "created": 0,
            "owned_by": "spendgate-mock",
        }],
    }))
}

async fn stats_handler(State(mock): State<MockUpstream>) -> Json<MockStats> {
    Json(mock.stats())
}

async fn served_handler(State(mock): State<MockUpstream>) -> Json<ServedTags> {
    Json(mock.served())
}

async fn reset_handler(State(mock): State<MockUpstream>) -> Json<Value> {
    mock.reset();
    Json(json!({"reset": true}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(headers: &[(&'static str, &'static str)], body: Value) -> Result<Plan, String> {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(*k, HeaderValue::from_static(v));
        }
        plan_request(&MockConfig::default(), 7, &map, &body)
    }

    #[test]
    fn fault_names_round_trip() {
        for f in Fault::ALL {
            assert_eq!(Fault::parse(f.name()), Some(f));
        }
        assert_eq!(Fault::parse("nope"), None);
    }

    #[test]
    fn header_beats_model_suffix_and_unknown_suffix_is_ignored() {
        let p = plan(
            &[(FAULT_HEADER, "tool_call")],
            json!({"model": "m:http_500", "messages": []}),
        )
        .expect("plan");
        assert_eq!(p.fault, Fault::ToolCall);
        let p = plan(&[], json!({"model": "m:http_500", "messages": []})).expect("plan");
        assert_eq!(p.fault, Fault::Http500);
        let p = plan(&[], json!({"model": "ft:gpt:org", "messages": []})).expect("plan");
        assert_eq!(p.fault, Fault::None);
        assert!(plan(&[(FAULT_HEADER, "bogus")], json!({"messages": []})).is_err());
    }

    #[test]
    fn clamping_rules() {
        let p = plan(&[], json!({"messages": [], "max_tokens": 5})).expect("plan");
        assert_eq!((p.completion_tokens, p.finish_reason), (5, "length"));
        let p = plan(
            &[],
            json!({"messages": [], "max_tokens": 9, "max_completion_tokens": 6}),
        )
        .expect("plan");
        assert_eq!(p.completion_tokens, 6);
        let p = plan(&[], json!({"messages": [], "max_tokens": 100})).expect("plan");
        assert_eq!((p.completion_tokens, p.finish_reason), (16, "stop"));
        let p = plan(
            &[(FAULT_HEADER, "usage_over")],
            json!({"messages": [], "max_tokens": 5}),
        )
        .expect("plan");
        assert_eq!(p.completion_tokens, 15);
        let p = plan(&[(FAULT_HEADER, "usage_over")], json!({"messages": []})).expect("plan");
        assert_eq!(p.completion_tokens, 26);
        let p = plan(
            &[(COMPLETION_TOKENS_HEADER, "999999999999")],
            json!({"messages": []}),
        )
        .expect("plan");
        assert_eq!(p.completion_tokens, MAX_COMPLETION_TOKENS);
    }

    #[test]
    fn a_reported_cap_lowers_the_usage_not_the_answer() {
        let p = plan(
            &[
                (EXTRA_COMPLETION_TOKENS_HEADER, "30"),
                (REPORTED_COMPLETION_TOKENS_HEADER, "5"),
            ],
            json!({"messages": [], "max_tokens": 5}),
        )
        .expect("plan");
        assert_eq!(p.completion_tokens, 35, "generated");
        assert_eq!(p.usage()["completion_tokens"], 5);
        assert_eq!(p.usage()["total_tokens"], p.prompt_tokens + 5);
        assert_eq!(p.usage_with(3, 0)["completion_tokens"], 3);
        assert!(plan(
            &[(REPORTED_COMPLETION_TOKENS_HEADER, "-1")],
            json!({"messages": []})
        )
        .is_err());
    }

    #[test]
    fn invalid_inputs_are_refused() {
        assert!(plan(&[], json!([])).is_err());
        assert!(plan(&[], json!({"model": "m"})).is_err());
        assert!(plan(&[], json!({"messages": [], "max_tokens": -1})).is_err());
        assert!(plan(&[], json!({"messages": [], "max_tokens": "5"})).is_err());
        assert!(plan(&[], json!({"messages": [], "stream": "yes"})).is_err());
        assert!(plan(&[(CACHED_TOKENS_HEADER, "x")], json!({"messages": []})).is_err());
        assert!(plan(&[], json!({"messages": [], "max_tokens": null})).is_ok());
    }

    #[test]
    fn cached_tokens_are_capped_by_prompt() {
        let p = plan(&[(CACHED_TOKENS_HEADER, "1000")], json!({"messages": []})).expect("plan");
        assert_eq!(p.cached_tokens, p.prompt_tokens);
        let p = plan(&[(CACHED_TOKENS_HEADER, "2")], json!({"messages": []})).expect("plan");
        assert_eq!(p.cached_tokens, 2);
    }

    #[test]
    fn arguments_fragments_concatenate_to_json() {
        let p = plan(
            &[(FAULT_HEADER, "tool_call"), (COMPLETION_TOKENS_HEADER, "5")],
            json!({"messages": []}),
        )
        .expect("plan");
        let joined = format!(
            "{}{}",
            p.arguments_fragment(0, 4),
            p.arguments_fragment(4, 5)
        );
        assert_eq!(joined, p.arguments_fragment(0, 5));
        let v: Value = serde_json::from_str(&joined).expect("json");
        assert_eq!(v, json!({"q": "tok0 tok1 tok2 tok3 tok4"}));
    }

    #[test]
    fn generation_time() {
        let mut p = plan(&[], json!({"messages": []})).expect("plan");
        assert_eq!(p.generation_time(10), Duration::ZERO);
        p.tokens_per_second = 20;
        assert_eq!(p.generation_time(4), Duration::from_millis(200));
        p.tokens_per_second = 1;
        assert_eq!(p.generation_time(u64::MAX), MAX_WAIT);
    }
}
