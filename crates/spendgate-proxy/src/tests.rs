use crate::answer::{each_output_text, read_answer, FieldKey};
use crate::bounds::SSE_LINE_BYTES_MAX;
use crate::guard::{settlement, usage_of, Observed};
use crate::prompt::{prompt_texts, prompt_tokens};
use crate::sse::{sse_error, SseTap};
use crate::upstream::{pass_headers, redact};
use axum::http::HeaderMap;
use bytes::Bytes;
use serde_json::{json, Value};
use spendgate_core::{Micros, ModelPrice, Resolution, Settlement, TokenUsage};
use spendgate_tokens::{self as tokens, OutputTally, Tokenizer};

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
    let usage = (0u64..100_000, 0u64..100_000, 0u64..100_000).prop_map(|(p, c, k)| TokenUsage {
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
    assert!(sse_error(
        spendgate_wire::error::ErrorCode::UpstreamError,
        "y",
        tap.mid_line()
    )
    .starts_with(b"\n\ndata: "));
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
    assert_eq!(e.code.as_str(), "invalid_request");
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
        assert_eq!(e.code.as_str(), "invalid_request", "{b}");
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
