//! The config reference and the annotated example, generated from the schema.

/// The config reference (Markdown): every table and key, its type, default and what it does.
pub fn reference_markdown() -> String {
    String::new()
}

/// An annotated example config: every key, each with its doc as a comment.
pub fn example_toml() -> String {
    String::new()
}
