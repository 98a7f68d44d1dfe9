//! Prompt token counting: the model's BPE tokenizer, or one token per byte (a hard upper
//! bound for every BPE model).

use crate::config::Tokenizer;

/// Tokens added per chat message for role and framing, and per request for priming the reply.
pub const TOKENS_PER_MESSAGE: u64 = 4;
pub const TOKENS_PER_REQUEST: u64 = 3;

/// The tokens of `text` as ordinary text: a special token's spelling in a message
/// (`<|endoftext|>`) is counted as the several tokens of its characters, as the model's API
/// reads message text, never as the one special token (which would let a prompt stuffed with
/// them pass the context bound and reserve a fraction of what it costs).
pub fn count(tokenizer: Tokenizer, text: &str) -> u64 {
    match tokenizer {
        Tokenizer::Bytes => text.len() as u64,
        Tokenizer::O200kBase => tiktoken_rs::o200k_base_singleton()
            .encode_ordinary(text)
            .len() as u64,
        Tokenizer::Cl100kBase => tiktoken_rs::cl100k_base_singleton()
            .encode_ordinary(text)
            .len() as u64,
    }
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
    fn special_token_spellings_count_as_text() {
        let stuffed = "<|endoftext|>".repeat(100);
        for t in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
            let n = count(t, &stuffed);
            assert!(n >= 300, "{t:?}: {n} tokens for 100 spelled special tokens");
        }
    }
}
