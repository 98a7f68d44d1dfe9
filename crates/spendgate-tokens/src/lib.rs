//! Prompt token counting: the model's BPE tokenizer, or one token per byte (a hard upper
//! bound for every BPE model). Used by the decision API (a step's `prompt_text`) and by the
//! proxy (prompts, and the incremental count of an upstream's output); no HTTP here.

#![warn(clippy::too_many_lines)]

pub use spendgate_config::Tokenizer;
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

/// Runs `f`, a count over `bytes` of text: where it is called when they are few, else on the
/// blocking pool, at most [`BLOCKING_COUNTS`] at a time; `None` if it could not run.
pub async fn counting<T: Send + 'static>(
    bytes: usize,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    if bytes <= INLINE_BYTES_MAX {
        return Some(f());
    }
    // (the semaphore is never closed)
    let _permit = BLOCKING_COUNTS.acquire().await;
    tokio::task::spawn_blocking(f).await.ok()
}

/// [`count`] where it is called; a long text on the multi-threaded runtime is counted with
/// the worker handed back first (`block_in_place`), so that other tasks move on meanwhile.
fn count_here(tokenizer: Tokenizer, text: &str) -> u64 {
    use tokio::runtime::{Handle, RuntimeFlavor};
    let pool =
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if text.len() > INLINE_BYTES_MAX && tokenizer != Tokenizer::Bytes && pool {
        return tokio::task::block_in_place(|| count(tokenizer, text));
    }
    count(tokenizer, text)
}

/// Most bytes of whole output text an [`OutputCounter`] holds before it counts them.
pub const DONE_BYTES_MAX: usize = INLINE_BYTES_MAX;

/// Most bytes of output text between two [`segment boundaries`](segment_boundary) counted
/// by the tokenizer. A longer run (a very long word, a long sentence of ideographs without
/// punctuation, a run of one character) counts one token per byte up to the next boundary:
/// never less than the tokenizer would count it (every token is at least a byte), and what
/// the counter holds stays bounded.
pub const SEGMENT_BYTES_MAX: usize = 2 * 1024;

/// Letters whose Unicode class is known without tables: ASCII letters, CJK ideographs,
/// kana and Hangul syllables (all `\p{L}`, none a mark).
fn plain_letter(c: char) -> bool {
    c.is_ascii_alphabetic()
        || matches!(c as u32,
            0x3041..=0x3096 | 0x30A1..=0x30FA | 0x3400..=0x4DBF | 0x4E00..=0x9FFF | 0xAC00..=0xD7A3)
}

/// Punctuation whose Unicode class is known without tables: ASCII punctuation and symbols
/// but the apostrophe (which starts the tokenizers' contractions, `'s`), and the common CJK
/// and typographic marks (none a letter, digit, mark or space).
fn plain_punctuation(c: char) -> bool {
    (c.is_ascii_punctuation() && c != '\'')
        || matches!(c as u32,
            0x2018..=0x201F | 0x2026 | 0x3001..=0x3003 | 0x3008..=0x3011 | 0x30FB
                | 0xFF01 | 0xFF08 | 0xFF09 | 0xFF0C | 0xFF0E | 0xFF1A | 0xFF1B | 0xFF1F)
}

/// Whether the `o200k_base` and `cl100k_base` pre-splits always end a piece between `prev`
/// and `next`, whatever comes before and after, so that a text cut there counts exactly as
/// much as its two sides counted apart (the pieces are encoded alone, and no pattern of
/// either looks behind):
/// - a non-space, then a space other than a line break (no pattern runs from a non-space
///   into a following space; a piece's leading space starts it);
/// - a line break, then a non-space other than `/` (the whitespace patterns end at the last
///   break before a non-space; o200k's punctuation pattern takes breaks and `/` after it);
/// - a letter or digit, then punctuation other than the apostrophe (letter and digit pieces
///   take no punctuation after them but a contraction's `'s`);
/// - a letter, then a digit, or a digit, then a letter (digits are pieces of their own, and
///   a letter piece's optional leading character is never a digit).
///
/// Letters and punctuation are only those [`plain_letter`] and [`plain_punctuation`] know:
/// a boundary missed costs a longer piece, never a wrong count.
pub fn segment_boundary(prev: char, next: char) -> bool {
    let digit = |c: char| c.is_ascii_digit();
    (word_boundary(prev, next))
        || ((prev == '\n' || prev == '\r') && !next.is_whitespace() && next != '/')
        || ((plain_letter(prev) || digit(prev)) && plain_punctuation(next))
        || (plain_letter(prev) && digit(next))
        || (digit(prev) && plain_letter(next))
}

/// A non-space followed by a space other than a line break: where a word ends for every
/// tokenizer that splits text at spaces before merging (the start of the next word's piece).
pub fn word_boundary(prev: char, next: char) -> bool {
    !prev.is_whitespace() && next.is_whitespace() && next != '\r' && next != '\n'
}

/// What the output counted so far shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutputTally {
    /// The fewest tokens an upstream that honours its tokenizer generated to send this text:
    /// with the model's tokenizer, its count; with `bytes`, one token a word or a token per
    /// [`BYTES_PER_TOKEN_MAX`] bytes, whichever is more. Compared with the output bound (the
    /// cut) and with a reported usage (never charged below it).
    pub floor: u64,
    /// The most tokens the text can have cost: the model tokenizer's count (the same as
    /// `floor`), or with `bytes` one token per byte (a hard upper bound). Charged when no
    /// usage is trusted and the floor shows the upstream went past its bound.
    pub upper: u64,
}

/// Counts the output an upstream sends as it arrives, piece by piece, each byte once: the
/// text is cut at [`segment_boundary`]s and each stretch counted once, when it is whole, so
/// the sum is the tokenizer's count of the whole text (the stretches of more than
/// [`SEGMENT_BYTES_MAX`] count a token per byte, more). Fields (an answer's content, its
/// reasoning, a tool call's arguments) are counted apart ([`OutputCounter::end_field`]), as
/// the model generates them apart. Holds at most one stretch of text.
#[derive(Clone, Debug)]
pub struct OutputCounter {
    tokenizer: Tokenizer,
    /// BPE: the tokens of the text before `done`. `bytes`: the words begun.
    settled: u64,
    /// BPE: whole stretches (up to the last boundary) of the field under way, not counted
    /// yet: counted together when they could take the count over the bound looked at
    /// ([`OutputCounter::over`]), grow past [`DONE_BYTES_MAX`], or the field ends, so that
    /// the tokenizer runs a few times a stream rather than once a piece.
    done: String,
    /// BPE: the text since the last boundary, not counted yet.
    pending: String,
    /// BPE: the count of `pending`, when known.
    pending_tokens: Option<u64>,
    /// BPE: the stretch under way was longer than [`SEGMENT_BYTES_MAX`]: its bytes are
    /// counted (in `settled`) up to the next boundary.
    long: bool,
    /// The last character of the field under way.
    prev: Option<char>,
    /// Bytes of text counted.
    bytes: u64,
    /// Bytes that could not be read as text: a token each, in `floor` too.
    unread: u64,
}

impl OutputCounter {
    pub fn new(tokenizer: Tokenizer) -> OutputCounter {
        OutputCounter {
            tokenizer,
            settled: 0,
            done: String::new(),
            pending: String::new(),
            pending_tokens: None,
            long: false,
            prev: None,
            bytes: 0,
            unread: 0,
        }
    }

    /// Counts the next piece of the field under way.
    pub fn push(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.bytes = self.bytes.saturating_add(text.len() as u64);
        if self.tokenizer == Tokenizer::Bytes {
            for c in text.chars() {
                if self.prev.is_none_or(|p| word_boundary(p, c)) {
                    self.settled = self.settled.saturating_add(1);
                }
                self.prev = Some(c);
            }
            return;
        }
        // Everything up to the last boundary is whole: it joins `done` (a long stretch under
        // way ends at the first boundary instead, counted by its bytes).
        let (mut start, mut last) = (0, None);
        let mut prev = self.prev;
        for (i, c) in text.char_indices() {
            if prev.is_some_and(|p| segment_boundary(p, c)) {
                if self.long {
                    self.settled = self.settled.saturating_add((i - start) as u64);
                    self.long = false;
                    start = i;
                } else {
                    last = Some(i);
                }
            }
            prev = Some(c);
        }
        self.prev = prev;
        if let Some(i) = last {
            self.done.push_str(&self.pending);
            self.pending.clear();
            self.pending_tokens = None;
            self.done.push_str(&text[start..i]);
            start = i;
            if self.done.len() > DONE_BYTES_MAX {
                self.count_done();
            }
        }
        self.extend(&text[start..]);
    }

    /// Counts the whole stretches held (exactly: they end at a boundary).
    fn count_done(&mut self) {
        if !self.done.is_empty() {
            let n = count_here(self.tokenizer, &self.done);
            self.settled = self.settled.saturating_add(n);
            self.done.clear();
        }
    }

    /// Adds to the stretch under way (counted by bytes when it grows too long).
    fn extend(&mut self, text: &str) {
        if self.long {
            self.settled = self.settled.saturating_add(text.len() as u64);
            return;
        }
        self.pending.push_str(text);
        self.pending_tokens = None;
        if self.pending.len() > SEGMENT_BYTES_MAX {
            self.settled = self.settled.saturating_add(self.pending.len() as u64);
            self.pending.clear();
            self.long = true;
        }
    }

    /// Counts the field's text, which ends here (with the stretch under way, in one call).
    fn close(&mut self) {
        self.done.push_str(&self.pending);
        self.pending.clear();
        self.pending_tokens = None;
        self.count_done();
        self.long = false;
    }

    fn pending_count(&mut self) -> u64 {
        match self.pending_tokens {
            Some(n) => n,
            None => {
                let n = count_here(self.tokenizer, &self.pending);
                self.pending_tokens = Some(n);
                n
            }
        }
    }

    /// The field under way ends: the next piece begins another, counted apart.
    pub fn end_field(&mut self) {
        if self.tokenizer != Tokenizer::Bytes {
            self.close();
        }
        self.prev = None;
    }

    /// Counts `bytes` that could not be read as text (a line too long to parse, an answer
    /// that is not JSON): a token each.
    pub fn push_unread(&mut self, bytes: u64) {
        self.unread = self.unread.saturating_add(bytes);
    }

    /// What the output counted so far shows.
    pub fn tally(&mut self) -> OutputTally {
        let t = match self.tokenizer {
            Tokenizer::Bytes => OutputTally {
                floor: self.settled.max(self.bytes.div_ceil(BYTES_PER_TOKEN_MAX)),
                upper: self.bytes,
            },
            _ => {
                self.count_done();
                let n = self.settled.saturating_add(self.pending_count());
                OutputTally { floor: n, upper: n }
            }
        };
        let t = OutputTally {
            floor: t.floor.saturating_add(self.unread),
            upper: t.upper.saturating_add(self.unread),
        };
        debug_assert!(t.floor <= t.upper);
        t
    }

    /// The most [`OutputTally::floor`] can be once `bytes` more bytes of text are counted:
    /// a cheap bound, which no tokenizer runs for.
    pub fn most_after(&self, bytes: u64) -> u64 {
        let now = match self.tokenizer {
            Tokenizer::Bytes => self.settled.max(self.bytes.div_ceil(BYTES_PER_TOKEN_MAX)),
            // (each byte not counted yet at most a token)
            _ => self
                .settled
                .saturating_add((self.done.len() + self.pending.len()) as u64),
        };
        // A byte more is at most a word or a token more.
        now.saturating_add(self.unread).saturating_add(bytes)
    }

    /// Whether the output counted is over `bound` tokens ([`OutputTally::floor`]). The
    /// tokenizer runs only when the text not counted yet could take the count over, at a
    /// token a byte: for ordinary text (about four bytes a token) a few times a stream, and
    /// piece by piece only in the last few tokens before the bound.
    pub fn over(&mut self, bound: u64) -> bool {
        if self.tokenizer != Tokenizer::Bytes {
            if self.most_after(0) <= bound {
                return false;
            }
            self.count_done();
            if self.most_after(0) <= bound {
                return false;
            }
        }
        self.tally().floor > bound
    }

    /// The longest start of `text` (its length in bytes, at a character boundary) that,
    /// counted as a field of its own after the fields counted so far, keeps the output
    /// within `bound` tokens.
    pub fn fit(&self, text: &str, bound: u64) -> usize {
        let fits = |n: usize| {
            let mut c = self.clone();
            c.end_field();
            c.push(&text[..n]);
            c.end_field();
            !c.over(bound)
        };
        let mut c = self.clone();
        c.end_field();
        if c.over(bound) {
            return 0;
        }
        if c.most_after(text.len() as u64) <= bound || fits(text.len()) {
            return text.len();
        }
        if self.tokenizer == Tokenizer::Bytes {
            // Words and bytes as `push` counts them; stop before the first that is over.
            let room = bound.saturating_sub(self.unread);
            let words_left = room.saturating_sub(self.settled);
            let bytes_left = room
                .saturating_mul(BYTES_PER_TOKEN_MAX)
                .saturating_sub(self.bytes);
            let (mut words, mut prev) = (0u64, None);
            for (i, ch) in text.char_indices() {
                if prev.is_none_or(|p| word_boundary(p, ch)) {
                    words += 1;
                }
                if words > words_left || (i + ch.len_utf8()) as u64 > bytes_left {
                    return i;
                }
                prev = Some(ch);
            }
            return text.len();
        }
        let left = bound.saturating_sub(c.tally().floor);
        // The first `left` tokens of the text, tried as they decode; shorter until they fit.
        // The last resort is `left` bytes, which can never count more than `left` tokens.
        let bpe = match self.tokenizer {
            Tokenizer::O200kBase => tiktoken_rs::o200k_base_singleton(),
            _ => tiktoken_rs::cl100k_base_singleton(),
        };
        let ids = catch_unwind(AssertUnwindSafe(|| bpe.encode_ordinary(text))).unwrap_or_default();
        let mut take = usize::try_from(left).unwrap_or(usize::MAX).min(ids.len());
        for _ in 0..FIT_TRIES {
            let Ok(bytes) = bpe.decode_bytes(&ids[..take]) else {
                break;
            };
            let n = floor_char_boundary(text, bytes.len());
            if fits(n) {
                return n;
            }
            take = take.saturating_sub(take / 8 + 1);
        }
        floor_char_boundary(text, usize::try_from(left).unwrap_or(usize::MAX))
    }
}

/// Attempts of [`OutputCounter::fit`] before it falls back to a byte a token.
const FIT_TRIES: usize = 8;

/// The largest character boundary of `text` at or below `n`.
fn floor_char_boundary(text: &str, n: usize) -> usize {
    let mut n = n.min(text.len());
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    n
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

    /// Pieces of every kind the boundaries look at: letters (ASCII, accented, CJK, kana,
    /// Hangul), digits, punctuation (ASCII, CJK, typographic, the apostrophe and `/`),
    /// spaces and line breaks of every kind, marks, symbols and emoji.
    fn piece_strategy() -> impl proptest::strategy::Strategy<Value = String> {
        proptest::string::string_regex(concat!(
            "([a-zA-Z]{1,6}|[0-9]{1,5}|[éÉßøÅ]|[中文字符漢語]{1,4}|[ひらがなカタ]{1,3}|[한국어]{1,2}",
            "|[ \t]{1,3}|[\r\n]{1,3}|\u{85}|\u{a0}|\u{3000}|[.,;:!?'\"/()\\[\\]{}<>=+*&%$#@_-]{1,3}",
            "|[，。、！？「」“”‘’…・]{1,2}|\u{301}|[😀🎉]|'s|'ll|<\\|endoftext\\|>){0,6}",
        ))
        .expect("regex")
    }

    /// Tokenizer failures (a long run of whitespace) and long stretches aside, the output
    /// counted piece by piece is exactly the count of the whole text.
    #[test]
    fn pieces_count_as_much_as_the_whole() {
        let texts = [
            "Hello, world! It's 2026: the year's 1st test.\n\nDon't stop—ever.",
            "中文的句子，很长。日本語のテキスト、カタカナ！한국어 텍스트",
            "{\"q\":\"tok0 tok1 tok2\"}\n  - item /path/to\r\n/x",
            "camelCaseWords HTTPServer a1b2c3 12345678 x=y+z;",
        ];
        for t in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
            for text in texts {
                let whole = count(t, text);
                for step in 1..8 {
                    let mut c = OutputCounter::new(t);
                    let chars: Vec<char> = text.chars().collect();
                    for piece in chars.chunks(step) {
                        c.push(&piece.iter().collect::<String>());
                    }
                    assert_eq!(c.tally().floor, whole, "{t:?} step {step}: {text}");
                    c.end_field();
                    assert_eq!(c.tally().floor, whole);
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Whatever the text and wherever it is cut into pieces, the pieces count exactly
        /// the whole, with either BPE tokenizer.
        #[test]
        fn pieces_never_count_less_than_the_whole(
            pieces in proptest::collection::vec(piece_strategy(), 0..12),
            bound in 0u64..60,
        ) {
            let whole: String = pieces.concat();
            for t in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
                let mut c = OutputCounter::new(t);
                for p in &pieces {
                    c.push(p);
                    // Looking at a bound counts what is held at whatever point.
                    let _ = c.over(bound);
                }
                let tally = c.tally();
                proptest::prop_assert_eq!(tally.floor, count(t, &whole), "{:?}: {:?}", t, pieces);
                proptest::prop_assert_eq!(tally.upper, tally.floor);
            }
            let mut c = OutputCounter::new(Tokenizer::Bytes);
            for p in &pieces {
                c.push(p);
            }
            let words = whole.split(|ch: char| ch.is_whitespace() && ch != '\r' && ch != '\n');
            let tally = c.tally();
            proptest::prop_assert_eq!(tally.upper, whole.len() as u64);
            proptest::prop_assert!(tally.floor >= (whole.len() as u64).div_ceil(BYTES_PER_TOKEN_MAX));
            proptest::prop_assert!(tally.floor <= words.count() as u64 + (whole.len() as u64).div_ceil(BYTES_PER_TOKEN_MAX));
        }

        /// Fields are counted apart: the sum of each field's count of its own.
        #[test]
        fn fields_count_apart(
            fields in proptest::collection::vec(piece_strategy(), 0..5),
        ) {
            let mut c = OutputCounter::new(Tokenizer::O200kBase);
            for f in &fields {
                let mid = f.char_indices().nth(f.chars().count() / 2).map_or(0, |(i, _)| i);
                c.push(&f[..mid]);
                c.push(&f[mid..]);
                c.end_field();
            }
            let apart: u64 = fields.iter().map(|f| count(Tokenizer::O200kBase, f)).sum();
            proptest::prop_assert_eq!(c.tally().floor, apart);
        }
    }

    /// A stretch without any boundary longer than [`SEGMENT_BYTES_MAX`] counts its bytes
    /// (more than the tokenizer would), and the counter holds no more than that.
    #[test]
    fn a_long_stretch_counts_its_bytes() {
        let long = "中".repeat(SEGMENT_BYTES_MAX); // 3 bytes each, no boundary
        for t in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
            let mut c = OutputCounter::new(t);
            for ch in long.chars() {
                c.push(&ch.to_string());
                assert!(c.pending.len() <= SEGMENT_BYTES_MAX);
                assert!(c.done.len() <= DONE_BYTES_MAX + 4);
            }
            c.push(" next words, counted as usual.");
            let tally = c.tally();
            let exact = count(t, &long) + count(t, " next words, counted as usual.");
            assert!(tally.floor >= exact, "{t:?}: {} < {exact}", tally.floor);
            assert_eq!(
                tally.floor,
                long.len() as u64 + count(t, " next words, counted as usual."),
                "{t:?}"
            );
        }
    }

    #[test]
    fn the_bytes_floor_is_a_word_or_sixteen_bytes_a_token() {
        let mut c = OutputCounter::new(Tokenizer::Bytes);
        c.push("tok0 tok1");
        c.push(" tok2");
        assert_eq!(
            c.tally(),
            OutputTally {
                floor: 3,
                upper: 14
            }
        );
        c.end_field();
        c.push("x".repeat(100).as_str());
        // A field begins a word; 114 bytes are at least 8 tokens.
        assert_eq!(
            c.tally(),
            OutputTally {
                floor: 8,
                upper: 114
            }
        );
        c.push_unread(10);
        assert_eq!(
            c.tally(),
            OutputTally {
                floor: 18,
                upper: 124
            }
        );
        assert!(c.over(17) && !c.over(18));
    }

    #[test]
    fn a_fitted_start_is_the_longest_within_the_bound() {
        let words: String = (0..100).map(|i| format!(" tok{i}")).collect();
        let mut c = OutputCounter::new(Tokenizer::Bytes);
        c.push("one two three");
        c.end_field();
        // 3 words counted: 17 more fit in 20.
        let n = c.fit(&words, 20);
        assert_eq!(
            &words[..n],
            (0..17).map(|i| format!(" tok{i}")).collect::<String>()
        );
        assert_eq!(c.fit(&words, 3), 0);
        assert_eq!(c.fit("short", 20), 5);
        // Sixteen bytes a token bound a text without spaces.
        let blob = "y".repeat(1000);
        assert_eq!(OutputCounter::new(Tokenizer::Bytes).fit(&blob, 10), 160);
        for t in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
            let text =
                "The quick brown fox jumps over the lazy dog, twice; then 12345 more times. "
                    .repeat(20);
            let mut c = OutputCounter::new(t);
            c.push("an answer before");
            c.end_field();
            let before = c.tally().floor;
            for bound in [before, before + 1, before + 7, before + 50, before + 300] {
                let n = c.fit(&text, bound);
                let mut after = c.clone();
                after.push(&text[..n]);
                after.end_field();
                assert!(after.tally().floor <= bound, "{t:?} {bound}");
                // Close to the bound: a word more would not fit.
                if n < text.len() {
                    assert!(
                        after.tally().floor + 4 >= bound,
                        "{t:?} {bound}: {}",
                        after.tally().floor
                    );
                }
            }
        }
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
