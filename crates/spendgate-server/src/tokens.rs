//! Prompt token counting: the model's BPE tokenizer, or one token per byte (a hard upper
//! bound for every BPE model).

use crate::config::Tokenizer;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::LazyLock;
use tokio::sync::Semaphore;

/// Tokens added per chat message for role and framing, and per request for priming the reply.
pub const TOKENS_PER_MESSAGE: u64 = 4;
pub const TOKENS_PER_REQUEST: u64 = 3;

/// Most bytes per token a prompt may average. Counting is the expensive part of a request
/// and comes before any rate limit, so a prompt of more bytes than its context bound times
/// this is refused as over the bound without being counted (ordinary text and code average
/// about 4 bytes per token; only long runs of one character average more).
pub const BYTES_PER_TOKEN_MAX: u64 = 16;

/// Texts of more bytes than this (together) are counted on the blocking pool, at most
/// [`BLOCKING_COUNTS`] at a time, so that a large prompt never holds an async worker (every
/// other request and stream of the process would wait for it).
pub const INLINE_BYTES_MAX: usize = 16 * 1024;

/// Large counts running at a time: all cores but one, which stays with the async workers.
static BLOCKING_COUNTS: LazyLock<Semaphore> = LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    Semaphore::new(cores.saturating_sub(1).max(1))
});

/// Whether `bytes` of prompt text are certainly over `max_tokens` ([`BYTES_PER_TOKEN_MAX`]).
pub fn over_countable(bytes: u64, max_tokens: u64) -> bool {
    bytes > max_tokens.saturating_mul(BYTES_PER_TOKEN_MAX)
}

/// The tokens of `text` as ordinary text: a special token's spelling in a message
/// (`<|endoftext|>`) is counted as the several tokens of its characters, as the model's API
/// reads message text, never as the one special token (which would let a prompt stuffed with
/// them pass the context bound and reserve a fraction of what it costs). When the tokenizer
/// fails (its pattern engine gives up on some inputs, such as a million spaces), the text
/// counts one token per byte: a hard upper bound, never an undercount.
pub fn count(tokenizer: Tokenizer, text: &str) -> u64 {
    let bpe = match tokenizer {
        Tokenizer::Bytes => return text.len() as u64,
        Tokenizer::O200kBase => tiktoken_rs::o200k_base_singleton(),
        Tokenizer::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
    };
    catch_unwind(AssertUnwindSafe(|| bpe.encode_ordinary(text).len() as u64)).unwrap_or_else(|_| {
        tracing::warn!(
            bytes = text.len(),
            "the tokenizer failed on a prompt; counting one token per byte"
        );
        text.len() as u64
    })
}

/// The sum of [`count`] over `texts`: where they arrive when they are short, on the blocking
/// pool when they are long ([`INLINE_BYTES_MAX`]).
pub async fn count_all(tokenizer: Tokenizer, texts: Vec<String>) -> u64 {
    let sum = move |texts: &[String]| {
        texts
            .iter()
            .fold(0u64, |n, t| n.saturating_add(count(tokenizer, t)))
    };
    let bytes: usize = texts.iter().map(String::len).sum();
    if bytes <= INLINE_BYTES_MAX || tokenizer == Tokenizer::Bytes {
        return sum(&texts);
    }
    // (the semaphore is never closed)
    let _permit = BLOCKING_COUNTS.acquire().await;
    let upper = bytes as u64;
    tokio::task::spawn_blocking(move || sum(&texts))
        .await
        // A count that could not run: every byte a token, the upper bound.
        .unwrap_or(upper)
}

/// Loads the BPE tables now rather than on the first request.
pub fn warm_up() {
    let _ = tiktoken_rs::o200k_base_singleton();
    let _ = tiktoken_rs::cl100k_base_singleton();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts() {
        assert_eq!(count(Tokenizer::Bytes, "héllo"), 6);
        let n = count(Tokenizer::O200kBase, "hello world, this is a test");
        assert!(n > 3 && n < 27, "{n}");
        assert!(count(Tokenizer::Cl100kBase, "hello world") <= "hello world".len() as u64);
    }

    #[test]
    fn a_prompt_the_tokenizer_fails_on_counts_its_bytes() {
        // fancy-regex gives up (a stack overflow error, unwrapped by tiktoken) on a long run
        // of whitespace.
        let spaces = " ".repeat(1_000_000);
        assert_eq!(count(Tokenizer::O200kBase, &spaces), 1_000_000);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn long_texts_count_as_short_ones() {
        let texts: Vec<String> = (0..40)
            .map(|i| format!("message {i}: {}", "the quick brown fox ".repeat(100)))
            .collect();
        assert!(texts.iter().map(String::len).sum::<usize>() > INLINE_BYTES_MAX);
        let one_by_one: u64 = texts.iter().map(|t| count(Tokenizer::O200kBase, t)).sum();
        assert_eq!(count_all(Tokenizer::O200kBase, texts).await, one_by_one);
    }

    #[test]
    fn special_token_spellings_count_as_text() {
        let stuffed = "<|endoftext|>".repeat(100);
        for t in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
            let n = count(t, &stuffed);
            assert!(n >= 300, "{t:?}: {n} tokens for 100 spelled special tokens");
        }
    }
}
