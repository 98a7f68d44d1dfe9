//! Key paths, locations in the file, and the errors that name them.

use crate::error::ConfigError;
use std::fmt;
use std::ops::Range;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

// ---------------------------------------------------------------------------------------------
// Key paths and locations.

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Seg {
    Key(String),
    Index(usize),
}

/// A key in TOML path syntax.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct KeyPath(Vec<Seg>);

impl KeyPath {
    pub(crate) fn of(keys: &[&str]) -> KeyPath {
        KeyPath(keys.iter().map(|k| Seg::Key((*k).to_string())).collect())
    }
    pub(crate) fn key(&self, k: &str) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Key(k.to_string()));
        p
    }
    pub(crate) fn idx(&self, i: usize) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Index(i));
        p
    }
    pub(crate) fn parent(&self) -> KeyPath {
        let mut p = self.clone();
        p.0.pop();
        p
    }
    pub(crate) fn last_key(&self) -> Option<&str> {
        match self.0.last() {
            Some(Seg::Key(k)) => Some(k),
            _ => None,
        }
    }
    /// The path without array indices (the list a token came from).
    pub(crate) fn without_indices(&self) -> KeyPath {
        KeyPath(
            self.0
                .iter()
                .filter(|s| matches!(s, Seg::Key(_)))
                .cloned()
                .collect(),
        )
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    f.write_str(&toml_key(k))?;
                }
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// A key as TOML writes it: bare when it can be, quoted otherwise.
pub(crate) fn toml_key(k: &str) -> String {
    let bare = !k.is_empty()
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        k.to_string()
    } else {
        toml_str(k)
    }
}

/// A string as a TOML basic string literal.
pub(crate) fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

pub(crate) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let bytes = text.as_bytes();
    let offset = offset.min(bytes.len());
    let before = &bytes[..offset];
    let line = before.iter().filter(|b| **b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |p| p + 1);
    // Columns count characters, not bytes.
    let col = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    (line, col)
}

pub(crate) fn contains(outer: &Range<usize>, inner: &Range<usize>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

/// The deepest key whose key or value span contains `span`.
pub(crate) fn path_at(root: &DeTable<'_>, span: &Range<usize>) -> KeyPath {
    pub(crate) fn table(
        t: &DeTable<'_>,
        span: &Range<usize>,
        path: &mut Vec<Seg>,
        best: &mut Vec<Seg>,
    ) {
        for (k, v) in t.iter() {
            path.push(Seg::Key(k.get_ref().to_string()));
            if contains(&k.span(), span) && path.len() > best.len() {
                *best = path.clone();
            }
            value(v, span, path, best);
            path.pop();
        }
    }
    pub(crate) fn value(
        v: &Spanned<DeValue<'_>>,
        span: &Range<usize>,
        path: &mut Vec<Seg>,
        best: &mut Vec<Seg>,
    ) {
        if contains(&v.span(), span) && path.len() > best.len() {
            *best = path.clone();
        }
        match v.get_ref() {
            DeValue::Table(t) => table(t, span, path, best),
            DeValue::Array(a) => {
                for (i, item) in a.iter().enumerate() {
                    path.push(Seg::Index(i));
                    value(item, span, path, best);
                    path.pop();
                }
            }
            _ => {}
        }
    }
    let mut best = Vec::new();
    table(root, span, &mut Vec::new(), &mut best);
    KeyPath(best)
}

/// Where `path` (or its deepest present ancestor) starts in the file.
pub(crate) fn span_of(root: &DeTable<'_>, path: &KeyPath) -> Option<Range<usize>> {
    let mut found = None;
    let mut current: Option<&DeValue<'_>> = None;
    for seg in &path.0 {
        let next = match (seg, current) {
            (Seg::Key(k), None) => root.iter().find(|(key, _)| key.get_ref() == k),
            (Seg::Key(k), Some(DeValue::Table(t))) => t.iter().find(|(key, _)| key.get_ref() == k),
            (Seg::Index(i), Some(DeValue::Array(a))) => {
                let item = a.get(*i);
                if let Some(item) = item {
                    found = Some(item.span());
                    current = Some(item.get_ref());
                    continue;
                }
                None
            }
            _ => None,
        };
        match next {
            Some((key, value)) => {
                found = Some(key.span());
                current = Some(value.get_ref());
            }
            None => break,
        }
    }
    found
}

pub(crate) fn syntax_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let (line, column) = match e.span() {
        Some(s) => {
            let (l, c) = line_col(text, s.start);
            (Some(l), Some(c))
        }
        None => (None, None),
    };
    ConfigError {
        key: String::new(),
        message: format!("invalid TOML: {}", e.message().trim()),
        line,
        column,
        origin: None,
    }
}

/// Rewords a serde error and names the key it is about.
pub(crate) fn serde_error(
    text: &str,
    root: &Spanned<DeTable<'_>>,
    e: &toml::de::Error,
) -> ConfigError {
    let msg = e.message().trim();
    let span = e.span();
    let at = span
        .as_ref()
        .map(|s| path_at(root.get_ref(), s))
        .unwrap_or_default();
    let line = span.as_ref().map(|s| line_col(text, s.start).0);
    let field = |prefix: &str| {
        msg.strip_prefix(prefix)
            .and_then(|rest| rest.split('`').next())
            .map(str::to_string)
    };
    let (key, message) = if let Some(name) = field("unknown field `") {
        // The span is the unknown key itself; its table is the parent.
        let parent = if at.last_key() == Some(name.as_str()) {
            at.parent()
        } else {
            at.clone()
        };
        let place = if parent.0.is_empty() {
            "at the top level".to_string()
        } else {
            format!("in [{parent}]")
        };
        let expected = msg
            .split_once(", expected ")
            .map(|(_, rest)| format!("; expected {}", rest.replace('`', "\"")))
            .or_else(|| {
                msg.contains("there are no fields")
                    .then(|| "; this table takes no keys".to_string())
            })
            .unwrap_or_default();
        let key = parent.key(&name);
        (
            key.to_string(),
            format!("unknown key {} {place}{expected}", toml_str(&name)),
        )
    } else if let Some(name) = field("missing field `") {
        let key = at.key(&name);
        (key.to_string(), format!("{key}: required key is missing"))
    } else {
        let problem = msg
            .replace("expected u64", "expected a non-negative integer")
            .replace("expected f64", "expected a number")
            .replace("expected a sequence", "expected an array")
            .replace('`', "\"");
        // A secret written with the wrong type (a string where a list belongs) is not echoed:
        // errors reach logs.
        let secret = at.0.iter().rev().find_map(|seg| match seg {
            Seg::Key(k) => Some(SECRET_KEYS.contains(&k.as_str())),
            _ => None,
        });
        let problem = if secret == Some(true) {
            redact_quoted(&problem)
        } else {
            problem
        };
        let problem = match problem.find("expected struct ") {
            Some(i) => format!("{}expected a table", &problem[..i]),
            None => match problem.find("expected a map") {
                Some(i) => format!("{}expected a table", &problem[..i]),
                None => problem,
            },
        };
        if at.0.is_empty() {
            (String::new(), problem)
        } else {
            (at.to_string(), format!("{at}: {problem}"))
        }
    };
    ConfigError {
        key,
        message,
        line,
        column: None,
        origin: None,
    }
}

/// Keys whose values are secrets, or may carry one (a URL's credentials): never echoed in an
/// error.
pub(crate) const SECRET_KEYS: [&str; 8] = [
    "service_tokens",
    "admin_tokens",
    "keys",
    "url",
    "api_key",
    "verifier_secret",
    "verifier_url",
    "webhook_url",
];

/// `problem` with every quoted value replaced by `"…"`.
pub(crate) fn redact_quoted(problem: &str) -> String {
    let mut out = String::with_capacity(problem.len());
    let mut inside = false;
    for c in problem.chars() {
        if c == '"' {
            if inside {
                out.push_str("…\"");
            } else {
                out.push('"');
            }
            inside = !inside;
        } else if !inside {
            out.push(c);
        }
    }
    out
}
