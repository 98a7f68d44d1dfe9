//! Prompt token counting: the model's BPE tokenizer, or one token per byte (a hard upper
//! bound for every BPE model).

use crate::config::Tokenizer;

/// Tokens added per chat message for role and framing, and per request for priming the reply.
pub const TOKENS_PER_MESSAGE: u64 = 4;
pub const TOKENS_PER_REQUEST: u64 = 3;

pub fn count(tokenizer: Tokenizer, text: &str) -> u64 {
    match tokenizer {
        Tokenizer::Bytes => text.len() as u64,
        Tokenizer::O200kBase => tiktoken_rs::o200k_base_singleton()
            .encode_with_special_tokens(text)
            .len() as u64,
        Tokenizer::Cl100kBase => tiktoken_rs::cl100k_base_singleton()
            .encode_with_special_tokens(text)
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
}
