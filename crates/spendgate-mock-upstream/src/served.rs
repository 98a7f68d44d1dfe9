//! The per-request ground truth: what the mock served for each request tagged `x-mock-tag: T`,
//! so that a test can compare, reservation by reservation, what a gateway charged with what
//! the upstream really did. Bounded: the newest [`SERVED_TAGS_MAX`] tags are kept, and the
//! number evicted is reported so that a reader knows its record is incomplete.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Header naming the request's tag (printable ASCII, at most [`TAG_BYTES_MAX`] bytes).
pub const TAG_HEADER: &str = "x-mock-tag";
/// Longest tag accepted.
pub const TAG_BYTES_MAX: usize = 128;
/// Most tags remembered; past it the oldest is dropped (and counted in `evicted`).
pub const SERVED_TAGS_MAX: usize = 100_000;

/// What the mock served for one tag, counted exactly as the aggregate stats count (see the
/// crate docs): prompt and cached tokens once generation started, completion tokens as they
/// were emitted.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Served {
    pub tag: String,
    /// Requests that carried this tag (a tag is meant to be used once).
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// The output bound the (last) request carried: the smaller of `max_tokens` and
    /// `max_completion_tokens`, `None` when it carried neither.
    pub max_tokens: Option<u64>,
    /// The status of the answer's head, once one was produced (`None`: none yet, e.g. a
    /// `hang`, or a client gone during the latency wait).
    pub status: Option<u16>,
    /// The answer finished, as the stats' `completed` counts it.
    pub finished: bool,
    /// The fault mode of the (last) request.
    pub fault: String,
    pub stream: bool,
    /// The API shape of the (last) request: `"chat"` (`/v1/chat/completions`),
    /// `"messages"` (`/v1/messages`), `"embeddings"` or `"responses"` (`/v1/responses`).
    #[serde(default)]
    pub shape: String,
    /// Prompt tokens written to the cache (Messages' `cache_creation_input_tokens`), within
    /// `prompt_tokens`.
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// Hosted tool calls served (Responses), as the stats count them.
    #[serde(default)]
    pub hosted_tool_calls: u64,
}

/// `GET /mock/served`: every tag remembered, oldest first, and how many were dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedTags {
    pub served: Vec<Served>,
    pub evicted: u64,
}

/// The bounded record (kept under the counters' lock).
#[derive(Debug, Default)]
pub(crate) struct ServedLog {
    by_tag: HashMap<Arc<str>, Served>,
    order: VecDeque<Arc<str>>,
    evicted: u64,
}

impl ServedLog {
    /// A request with `tag` arrived (planned): counted, and its record created or updated.
    pub(crate) fn open(
        &mut self,
        tag: &Arc<str>,
        (fault, shape): (&str, &str),
        stream: bool,
        max: Option<u64>,
    ) {
        if !self.by_tag.contains_key(tag) {
            if self.order.len() >= SERVED_TAGS_MAX {
                if let Some(old) = self.order.pop_front() {
                    self.by_tag.remove(&old);
                    self.evicted = self.evicted.saturating_add(1);
                }
            }
            self.order.push_back(tag.clone());
            self.by_tag.insert(
                tag.clone(),
                Served {
                    tag: tag.to_string(),
                    ..Served::default()
                },
            );
        }
        if let Some(s) = self.by_tag.get_mut(tag) {
            s.requests = s.requests.saturating_add(1);
            s.fault = fault.to_owned();
            s.shape = shape.to_owned();
            s.stream = stream;
            s.max_tokens = max;
        }
        debug_assert!(self.order.len() == self.by_tag.len() && self.order.len() <= SERVED_TAGS_MAX);
    }

    /// Applies `f` to the record of `tag`, if it is still kept.
    pub(crate) fn update(&mut self, tag: &str, f: impl FnOnce(&mut Served)) {
        if let Some(s) = self.by_tag.get_mut(tag) {
            f(s);
        }
    }

    pub(crate) fn snapshot(&self) -> ServedTags {
        ServedTags {
            served: self
                .order
                .iter()
                .filter_map(|t| self.by_tag.get(t).cloned())
                .collect(),
            evicted: self.evicted,
        }
    }
}

/// The tag of a request, if it carries a valid one.
pub(crate) fn tag_of(headers: &axum::http::HeaderMap) -> Result<Option<Arc<str>>, String> {
    let Some(v) = headers.get(TAG_HEADER) else {
        return Ok(None);
    };
    let s = v
        .to_str()
        .map_err(|_| format!("header {TAG_HEADER} must be ASCII"))?
        .trim();
    if s.is_empty() || s.len() > TAG_BYTES_MAX {
        return Err(format!(
            "header {TAG_HEADER} must be 1 to {TAG_BYTES_MAX} bytes"
        ));
    }
    Ok(Some(Arc::from(s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_tags_and_counts_the_rest() {
        let mut log = ServedLog::default();
        for i in 0..SERVED_TAGS_MAX + 3 {
            let t: Arc<str> = Arc::from(format!("t{i}"));
            log.open(&t, ("none", "chat"), false, Some(5));
        }
        log.update("t2", |s| s.completion_tokens = 9);
        log.update("t3", |s| s.completion_tokens = 9);
        let snap = log.snapshot();
        assert_eq!(snap.evicted, 3);
        assert_eq!(snap.served.len(), SERVED_TAGS_MAX);
        assert_eq!(snap.served[0].tag, "t3");
        assert_eq!(snap.served[0].completion_tokens, 9);
        assert_eq!(snap.served[0].max_tokens, Some(5));
    }

    #[test]
    fn a_tag_used_twice_is_one_record_of_two_requests() {
        let mut log = ServedLog::default();
        let t: Arc<str> = Arc::from("a");
        log.open(&t, ("none", "chat"), false, None);
        log.open(&t, ("http_500", "chat"), true, Some(3));
        let snap = log.snapshot();
        assert_eq!(snap.served.len(), 1);
        assert_eq!(
            (snap.served[0].requests, snap.served[0].fault.as_str()),
            (2, "http_500")
        );
    }
}
