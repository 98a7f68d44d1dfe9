//! A streamed answer: relayed as it arrives, its usage read, its output counted, cut at the
//! output bound, and settled at its end.

use crate::answer::{Dialect, FieldKey};
use crate::bounds::SSE_LINE_BYTES_MAX;
use crate::guard::{usage_of, StepGuard};
use crate::messages;
use crate::responses::{self, HostedSeen};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};
use spendgate_core::{Resolution, TokenUsage};
use spendgate_tokens::{OutputCounter, Tokenizer};
use spendgate_wire::error::ErrorCode;
use spendgate_wire::plant;
use std::time::{Duration, Instant};

/// Watches an SSE stream line by line as it passes: reads the usage chunk, and drops it when
/// the client did not ask for usage (we did, on its behalf; a client that did not ask may not
/// expect a chunk without choices); counts the output of every event ([`each_output_text`]),
/// and once it is over the bound the upstream was given, forwards nothing more (the event
/// that went over included; [`SseTap::over`]). Bytes are forwarded as soon as their line is
/// complete.
pub(crate) struct SseTap {
    /// The start of a line whose end has not arrived yet.
    pub(crate) line: Vec<u8>,
    /// Inside a line longer than [`SSE_LINE_BYTES_MAX`]: passed through unread.
    pub(crate) overflow: bool,
    /// The largest of each figure of every usage read (an upstream may send several, as
    /// running totals; none is trusted below another).
    pub(crate) usage: Option<TokenUsage>,
    /// Content arrived after the last usage: that usage does not cover it.
    pub(crate) content_after_usage: bool,
    /// The last event was a usage chunk without choices (OpenAI's final one).
    pub(crate) settled: bool,
    /// `data: [DONE]` arrived.
    pub(crate) done: bool,
    /// An event reported an error (an `error` object, or a choice that finished with
    /// `"error"`): no usage of this stream is trusted, one carried by the error included.
    pub(crate) failed: bool,
    pub(crate) strip_usage: bool,
    /// The output counted so far, every event's (also those not forwarded).
    pub(crate) output: OutputCounter,
    /// The output bound the upstream was given.
    pub(crate) bound: u64,
    /// The field the last piece of output belonged to.
    pub(crate) field: Option<FieldKey>,
    /// The output went over `bound`: nothing more is forwarded.
    pub(crate) over: bool,
    /// The API shape of the stream's events.
    pub(crate) dialect: Dialect,
    /// A Messages stream's usage so far, each class apart (`message_start`'s, raised by
    /// `message_delta`'s).
    pub(crate) classes: messages::Usage,
    /// The call types of the hosted tools reserved with the call (`/v1/responses`), and the
    /// calls of them seen so far.
    pub(crate) hosted_types: Vec<String>,
    pub(crate) hosted: HostedSeen,
}

/// Whether a stream's event reports an error: an `error` object (OpenAI's and OpenRouter's
/// mid-stream errors) or a choice whose `finish_reason` is `"error"`.
pub(crate) fn is_error_event(v: &Value) -> bool {
    v.get("error").is_some_and(|e| !e.is_null())
        || v.get("choices")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.get("finish_reason").and_then(Value::as_str) == Some("error"))
            })
}

impl SseTap {
    pub(crate) fn new(strip_usage: bool, tokenizer: Tokenizer, bound: u64) -> SseTap {
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
            dialect: Dialect::Chat,
            classes: messages::Usage::default(),
            hosted_types: Vec::new(),
            hosted: HostedSeen::default(),
        }
    }

    /// The same tap, counting the calls of these hosted tools' types.
    pub(crate) fn with_hosted(mut self, types: Vec<String>) -> SseTap {
        self.hosted_types = types;
        self
    }

    /// Gives the guard the hosted calls seen, before it is resolved.
    pub(crate) fn hand_hosted(&self, guard: &mut StepGuard) {
        if !guard.hosted.is_empty() {
            guard.hosted_seen = self.hosted.clone();
        }
    }

    /// The same tap for a stream of another shape (a Messages stream keeps its usage).
    pub(crate) fn in_dialect(mut self, dialect: Dialect) -> SseTap {
        if let Dialect::Messages(_) | Dialect::Responses = dialect {
            self.strip_usage = false;
        }
        self.dialect = dialect;
        self
    }

    /// The event that ends a client's stream with an error, in the stream's shape.
    pub(crate) fn error_event(&self, code: ErrorCode, message: &str) -> Bytes {
        match self.dialect {
            Dialect::Chat | Dialect::Embeddings => sse_error(code, message, self.mid_line()),
            Dialect::Messages(_) => messages::sse_error(code, message, self.mid_line()),
            Dialect::Responses => responses::sse_error(code, message, self.mid_line()),
        }
    }

    /// The usage to commit when the stream ended cleanly: none if content followed it, if
    /// an event reported an error, or if the stream ended neither with `[DONE]` nor right
    /// after a final usage chunk (an upstream that failed mid-generation may close its body
    /// cleanly after a running total).
    pub(crate) fn end_usage(&self) -> Option<TokenUsage> {
        self.usage
            .filter(|_| !self.content_after_usage && !self.failed && (self.done || self.settled))
    }

    /// The usage to commit when the stream is cut (upstream lost, deadline, client gone):
    /// only a final usage chunk, with nothing after it but the end; a running total on a
    /// chunk with choices may be followed by more generation.
    pub(crate) fn final_usage(&self) -> Option<TokenUsage> {
        self.usage
            .filter(|_| self.settled && !self.content_after_usage && !self.failed)
    }

    pub(crate) fn saw_content(&mut self) {
        self.settled = false;
        if self.usage.is_some() {
            self.content_after_usage = true;
        }
    }

    /// Reads one whole line (with its `\n`): what becomes of it.
    pub(crate) fn line(&mut self, line: &[u8]) -> Fate {
        let keep = |over| if over { Fate::Drop } else { Fate::Keep };
        let text = line.strip_suffix(b"\n").unwrap_or(line);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        let Some(data) = text.strip_prefix(b"data:") else {
            return keep(self.over);
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" && matches!(self.dialect, Dialect::Chat) {
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
    pub(crate) fn count(&mut self, event: Option<&mut Value>, data: &[u8]) -> Option<Vec<u8>> {
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
        let dialect = self.dialect;
        dialect.each_output_text(v, &mut |_, text| {
            bytes = bytes.saturating_add(text.len() as u64)
        });
        let before =
            (!self.over && self.output.most_after(bytes) > self.bound).then(|| self.output.clone());
        let (output, field) = (&mut self.output, &mut self.field);
        dialect.each_output_text(v, &mut |key, text| {
            if *field != Some(key) {
                output.end_field();
                *field = Some(key);
            }
            output.push(text);
        });
        self.check_bound();
        let mut fitted = before.filter(|_| self.over)?;
        let (bound, mut kept) = (self.bound, false);
        dialect.each_output_text(v, &mut |_, text| {
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

    pub(crate) fn check_bound(&mut self) {
        if !self.over && self.output.over(self.bound) {
            self.over = true;
        }
    }

    /// Reads an event's usage and errors; false when it is to be dropped (a usage chunk the
    /// client did not ask for).
    pub(crate) fn read(&mut self, event: Option<&Value>) -> bool {
        let Some(v) = event else {
            self.saw_content();
            return true;
        };
        if let Dialect::Messages(pricing) = self.dialect {
            self.read_messages(v, pricing);
            return true;
        }
        if let Dialect::Responses = self.dialect {
            self.read_responses(v);
            return true;
        }
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

    /// Reads a Messages stream's event: its usage (`message_start`'s, then `message_delta`'s,
    /// which settles the stream: only `message_stop` follows it), its end (`message_stop`,
    /// the `[DONE]` of this shape), an `error` event, or content. Nothing is dropped.
    fn read_messages(&mut self, v: &Value, pricing: messages::Pricing) {
        let kind = v.get("type").and_then(Value::as_str);
        if messages::is_error_event(v) {
            self.failed = true;
            self.saw_content();
            return;
        }
        if kind == Some("message_stop") {
            self.done = true;
            return;
        }
        if let Some(u) = messages::usage_in(v) {
            self.classes = self.classes.merge(u);
            self.usage = pricing.tokens(self.classes);
            self.content_after_usage = false;
            self.settled = kind == Some("message_delta");
            return;
        }
        if messages::is_content_event(v) {
            self.saw_content();
        }
    }

    /// Reads a Responses stream's event: the hosted calls it shows, its usage (on the
    /// events that end the stream, `response.completed` and `response.incomplete`, the
    /// answer whole, or `response.failed`), an error (`error`, `response.failed`), or
    /// content. Nothing is dropped.
    fn read_responses(&mut self, v: &Value) {
        self.hosted.read_event(v, &self.hosted_types);
        if responses::is_error_event(v) {
            self.failed = true;
            self.saw_content();
        }
        if let Some(u) = responses::event_usage(v) {
            self.usage = Some(u);
            self.content_after_usage = false;
            self.settled = !self.failed;
        }
        if responses::is_end_event(v) {
            self.done = true;
            return;
        }
        if responses::is_content_event(v) {
            self.saw_content();
        }
    }

    /// What to forward of `chunk` now.
    pub(crate) fn feed(&mut self, chunk: Bytes) -> Bytes {
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
    pub(crate) fn unread(&mut self, bytes: &[u8], out: &mut Vec<u8>) {
        self.output.push_unread(bytes.len() as u64);
        self.check_bound();
        if !self.over {
            out.extend_from_slice(bytes);
        }
    }

    /// The end of the stream: what is left of an unterminated last line.
    pub(crate) fn finish(&mut self) -> Bytes {
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
    pub(crate) fn mid_line(&self) -> bool {
        self.overflow || !self.line.is_empty()
    }
}

/// What becomes of a line of a stream ([`SseTap::line`]).
pub(crate) enum Fate {
    Keep,
    Drop,
    /// The event that went over the output bound, cut to it.
    Replace(Vec<u8>),
}

/// An SSE event carrying an OpenAI-shaped error: what OpenAI itself sends when a stream fails
/// after its head (the `openai` libraries raise it as an API error).
pub(crate) fn sse_error(code: ErrorCode, message: &str, mid_line: bool) -> Bytes {
    let event = json!({"error": {"type": code.kind(), "code": code.as_str(), "message": message, "param": null}});
    let lead = if mid_line { "\n\n" } else { "" };
    Bytes::from(format!("{lead}data: {event}\n\n"))
}

/// Completes when a proxied call must stop ([`StepGuard::stopped`]).
pub(crate) type Stop = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Longest the proxy goes on reading a stream it cut at the output bound, to count what the
/// upstream had sent already (and may bill), before it closes the connection.
pub const CUT_DRAIN_MAX: Duration = Duration::from_millis(2000);
/// Most bytes read from a stream after it was cut at the output bound.
pub const CUT_DRAIN_BYTES_MAX: usize = 4 * 1024 * 1024;

/// A stream's step at its end (`[DONE]`, or the body's clean end): committed from a usage
/// the tap trusts, else `unknown` (or committed at the usage read or the output counted,
/// when that costs more; see [`settlement`]).
pub(crate) async fn settle_at_end(tap: &mut SseTap, mut guard: StepGuard, started: Instant) {
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
    tap.hand_hosted(&mut guard);
    let _ = guard.resolve(how).await;
}

/// How a stream cut at the output bound ended when it was last read.
pub(crate) enum DrainEnd {
    /// `[DONE]` or the body's clean end: the upstream's answer is whole.
    Whole,
    /// Still going (past [`CUT_DRAIN_MAX`] or [`CUT_DRAIN_BYTES_MAX`], or the run's
    /// deadline), or lost.
    Cut,
}

/// Reads (and counts, forwarding nothing) what an upstream sends after its stream was cut
/// at the output bound (or its client left), until it ends, for at most [`CUT_DRAIN_MAX`]
/// and [`CUT_DRAIN_BYTES_MAX`], and never past the run's `deadline` (a run that ended under
/// the call does not stop it: what the upstream had sent is billed, and is charged, by a
/// late overrun if need be).
pub(crate) async fn drain<U>(
    upstream: Option<&mut U>,
    tap: &mut SseTap,
    deadline: &mut Stop,
) -> DrainEnd
where
    U: futures::Stream<Item = reqwest::Result<Bytes>> + Unpin,
{
    let Some(upstream) = upstream.filter(|_| !tap.done) else {
        // (ended already)
        return DrainEnd::Whole;
    };
    let until = tokio::time::Instant::now() + CUT_DRAIN_MAX;
    let mut read = 0usize;
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout_at(until, upstream.next()) => next,
            _ = &mut *deadline => return DrainEnd::Cut,
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
pub(crate) fn relay<U>(
    upstream: U,
    guard: StepGuard,
    idle: Duration,
    tap: SseTap,
    started: Instant,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static
where
    U: futures::Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static,
{
    let s = Relayed {
        upstream: Some(upstream),
        stop: Box::pin(guard.stopped()),
        deadline: Box::pin(guard.deadline()),
        guard: Some(guard),
        tap,
        idle,
        started,
    };
    futures::stream::unfold(s, |mut s| async move {
        loop {
            // The guard stays in `s` while the upstream is awaited, so that a client going
            // away (the body dropped) finds it there ([`Relayed`]'s `Drop`).
            s.guard.as_ref()?;
            let upstream = s.upstream.as_mut()?;
            let next = tokio::select! {
                next = tokio::time::timeout(s.idle, upstream.next()) => next,
                _ = &mut s.stop => {
                    let guard = s.guard.take()?;
                    let event = if *guard.ended.borrow() {
                        s.ended_under(guard).await
                    } else {
                        s.past_deadline(guard).await
                    };
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
                        let event = cut_at_bound(
                            &mut s.tap,
                            Some(upstream),
                            &mut s.deadline,
                            guard,
                            s.started,
                        )
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
                            cut_at_bound::<U>(&mut s.tap, None, &mut s.deadline, guard, s.started)
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
                    let event = s.lost(guard).await;
                    return Some((Ok(event), s));
                }
            }
        }
    })
}

/// A stream being relayed (see [`relay`]).
struct Relayed<B: futures::Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static> {
    /// The upstream's body; dropped (its connection closed) when the stream is cut.
    upstream: Option<B>,
    guard: Option<StepGuard>,
    /// The run's deadline, or the run ended under the call: the relay stops.
    stop: Stop,
    /// The run's deadline only: a drain stops ([`drain`]).
    deadline: Stop,
    tap: SseTap,
    idle: Duration,
    started: Instant,
}

impl<B: futures::Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static> Drop
    for Relayed<B>
{
    /// The client went away (or the body was dropped) mid-stream: what the upstream had
    /// sent already (and may bill) is read and counted in the background ([`drain`],
    /// bounded like a cut's), then the step is resolved by its guard ([`StepGuard`]'s
    /// `Drop`) from what the tap read and counted (I1b: an upstream that wrote its whole
    /// answer before the client left is charged for all of it).
    fn drop(&mut self) {
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        let mut tap = std::mem::replace(&mut self.tap, SseTap::new(false, Tokenizer::Bytes, 0));
        let mut stop: Stop =
            std::mem::replace(&mut self.deadline, Box::pin(std::future::pending()));
        let upstream = self.upstream.take();
        // With the planted bug `drop-releases` (chaos tests only), a client gone is not
        // drained, and its step is released ([`StepGuard`]'s `Drop`).
        let handle = tokio::runtime::Handle::try_current()
            .ok()
            .filter(|_| !plant::on(plant::Plant::DropReleases));
        let Some(handle) = handle else {
            guard.usage = tap.final_usage();
            guard.seen = tap.usage;
            guard.output = tap.output.tally();
            tap.hand_hosted(&mut guard);
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
            tap.hand_hosted(&mut guard);
            drop(upstream);
            drop(guard);
        });
    }
}

impl<B: futures::Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static> Relayed<B> {
    /// The run's time is up (or it ended): the upstream connection is dropped with the
    /// stream, and the step is charged in full unless its usage was read whole. The event
    /// that ends the client's stream.
    async fn past_deadline(&mut self, mut guard: StepGuard) -> Bytes {
        let how = guard.settlement(
            self.tap.final_usage(),
            self.tap.usage,
            self.tap.output.tally(),
        );
        tracing::warn!(
            usage_read = self.tap.final_usage().is_some(),
            "a proxied stream reached its run's deadline; cutting it"
        );
        guard.state.metrics.upstream_call(self.started.elapsed());
        self.tap.hand_hosted(&mut guard);
        let _ = guard.resolve(how).await;
        self.upstream = None;
        self.tap.error_event(
            ErrorCode::RunDeadlineExceeded,
            "the run's deadline passed; the stream was cut (charged in full unless its usage had arrived)",
        )
    }

    /// The run ended under the call (finished by its backend, or expired): nothing more is
    /// relayed, what the upstream had sent is read and counted ([`drain`], bounded, never
    /// past the deadline), and the step settled from it; its run already charged it in full,
    /// and a count above that is a late overrun. The event that ends the client's stream.
    async fn ended_under(&mut self, mut guard: StepGuard) -> Bytes {
        let end = drain(self.upstream.as_mut(), &mut self.tap, &mut self.deadline).await;
        self.upstream = None;
        let trusted = match end {
            DrainEnd::Whole => self.tap.end_usage(),
            DrainEnd::Cut => self.tap.final_usage(),
        };
        tracing::warn!(
            usage_read = trusted.is_some(),
            "a proxied stream's run ended under it; cutting it"
        );
        guard.state.metrics.upstream_call(self.started.elapsed());
        let how = guard.settlement(trusted, self.tap.usage, self.tap.output.tally());
        self.tap.hand_hosted(&mut guard);
        let _ = guard.resolve(how).await;
        self.tap.error_event(
            ErrorCode::RunClosed,
            "the run ended while its call was streaming; the stream was cut (charged in full unless its usage had arrived)",
        )
    }

    /// The upstream's stream failed mid-way. The event that ends the client's stream.
    async fn lost(&mut self, mut guard: StepGuard) -> Bytes {
        guard.state.metrics.upstream_call(self.started.elapsed());
        // Lost mid-stream: trust a usage chunk that was read whole, else unknown
        // (or above, see `settlement`).
        let trusted = self.tap.final_usage();
        let how = guard.settlement(trusted, self.tap.usage, self.tap.output.tally());
        let message = match (trusted, &how) {
            (Some(_), _) => "the upstream stream was cut off after its usage; the call was charged at that usage",
            (None, Resolution::Unknown) => "the upstream stream was cut off or stalled; the call was charged in full",
            (None, _) => "the upstream stream was cut off or stalled; the call was charged for what it sent, above its reservation",
        };
        tracing::warn!(
            usage_read = trusted.is_some(),
            "upstream stream failed mid-way"
        );
        self.tap.hand_hosted(&mut guard);
        let _ = guard.resolve(how).await;
        self.upstream = None;
        self.tap.error_event(ErrorCode::UpstreamError, message)
    }
}

/// A stream whose output went over its bound ([`SseTap::over`]): what the upstream had sent
/// already is read and counted ([`drain`]), the step resolved from it ([`settlement`]), and
/// the event that ends the client's stream returned; the caller then drops the upstream's
/// connection, so that it stops generating.
pub(crate) async fn cut_at_bound<U>(
    tap: &mut SseTap,
    upstream: Option<&mut U>,
    deadline: &mut Stop,
    mut guard: StepGuard,
    started: Instant,
) -> Bytes
where
    U: futures::Stream<Item = reqwest::Result<Bytes>> + Unpin,
{
    let end = drain(upstream, tap, deadline).await;
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
    tap.hand_hosted(&mut guard);
    let _ = guard.resolve(how).await;
    tap.error_event(
        ErrorCode::UpstreamError,
        &format!(
            "the upstream sent more output than the {} tokens it was given; the stream was cut at that bound, and the call charged for all the upstream sent",
            tap.bound
        ),
    )
}
