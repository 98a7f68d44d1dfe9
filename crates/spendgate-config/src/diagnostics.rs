//! Key paths, locations in the file, and the errors that name them.
//!
//! An error serde meets while reading the file is described from where it happened, never from
//! serde's message: the key path `serde_path_to_error` recorded, the schema's type for that key
//! ([`crate::schema`]) and the value the file holds there (its span gives the line).

use crate::schema::{self, nearest, quoted, Lookup, Table, Ty};
use crate::ConfigError;
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
    /// The path from what `serde_path_to_error` recorded (map keys and sequence indices; the
    /// file has no other kind of step).
    pub(crate) fn from_serde(path: &serde_path_to_error::Path) -> KeyPath {
        use serde_path_to_error::Segment;
        KeyPath(
            path.iter()
                .filter_map(|seg| match seg {
                    Segment::Map { key } => Some(Seg::Key(key.clone())),
                    Segment::Seq { index } => Some(Seg::Index(*index)),
                    Segment::Enum { variant } => Some(Seg::Key(variant.clone())),
                    Segment::Unknown => None,
                })
                .collect(),
        )
    }
    pub(crate) fn segs(&self) -> &[Seg] {
        &self.0
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// The first `n` steps.
    pub(crate) fn prefix(&self, n: usize) -> KeyPath {
        KeyPath(self.0.iter().take(n).cloned().collect())
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

/// The value at `path`, if the file has one.
pub(crate) fn value_at<'a, 'i>(
    root: &'a DeTable<'i>,
    path: &KeyPath,
) -> Option<&'a Spanned<DeValue<'i>>> {
    let mut current: Option<&Spanned<DeValue<'i>>> = None;
    for seg in &path.0 {
        current = match (seg, current.map(Spanned::get_ref)) {
            (Seg::Key(k), None) => root
                .iter()
                .find(|(key, _)| key.get_ref() == k)
                .map(|(_, v)| v),
            (Seg::Key(k), Some(DeValue::Table(t))) => {
                t.iter().find(|(key, _)| key.get_ref() == k).map(|(_, v)| v)
            }
            (Seg::Index(i), Some(DeValue::Array(a))) => a.get(*i),
            _ => None,
        };
        current?;
    }
    current
}

/// A serde error while reading the file, described from the key path it happened at: an
/// unknown key (with the nearest known one), or a value of the wrong type (what the key
/// expects, what the file has).
pub(crate) fn serde_error(
    text: &str,
    root: &DeTable<'_>,
    path: &serde_path_to_error::Path,
) -> ConfigError {
    let path = KeyPath::from_serde(path);
    match schema::lookup(&path) {
        Lookup::Unknown { known, table } => {
            let name = match path.segs().get(known) {
                Some(Seg::Key(k)) => k.as_str(),
                _ => "",
            };
            unknown_key(text, root, &path.prefix(known), name, table)
        }
        Lookup::Found { ty } => wrong_value(text, root, &path, ty),
        Lookup::TooDeep { known } => {
            let at = path.prefix(known);
            match schema::lookup(&at) {
                Lookup::Found { ty } => wrong_value(text, root, &at, ty),
                _ => wrong_value(text, root, &at, &schema::ROOT),
            }
        }
    }
}

fn located(text: &str, root: &DeTable<'_>, key: &KeyPath, message: String) -> ConfigError {
    ConfigError {
        key: key.to_string(),
        message,
        line: span_of(root, key).map(|s| line_col(text, s.start).0),
        column: None,
        origin: None,
    }
}

/// `name` is no key of `table`, the table at `parent`.
fn unknown_key(
    text: &str,
    root: &DeTable<'_>,
    parent: &KeyPath,
    name: &str,
    table: &Table,
) -> ConfigError {
    let place = if parent.is_empty() {
        "at the top level".to_string()
    } else {
        format!("in [{parent}]")
    };
    let known: Vec<&str> = table.keys.iter().map(|k| k.name).collect();
    let hint = nearest(name, known.iter().copied())
        .map(|n| format!(" (did you mean {}?)", toml_str(n)))
        .unwrap_or_default();
    let message = format!(
        "unknown key {} {place}{hint}; expected one of {}",
        toml_str(name),
        quoted(&known)
    );
    located(text, root, &parent.key(name), message)
}

/// The value at `path` is not a `ty`.
fn wrong_value(text: &str, root: &DeTable<'_>, path: &KeyPath, ty: &Ty) -> ConfigError {
    let value = value_at(root, path);
    let found = value.map_or_else(|| "nothing".to_string(), |v| found(text, v, ty.is_secret()));
    let mut problem = format!("expected {}, found {found}", ty.expected());
    if let (Ty::Amount, Some(v)) = (ty, value) {
        if let DeValue::Float(_) = v.get_ref() {
            let written = text.get(v.span()).unwrap_or_default();
            problem.push_str(&format!(
                "; a float is not exact: write the amount as a string such as \"{written}\""
            ));
        }
    }
    let message = if path.is_empty() {
        problem
    } else {
        format!("{path}: {problem}")
    };
    located(text, root, path, message)
}

/// Longest string value echoed in an error, in characters.
const ECHO_CHARS_MAX: usize = 60;

/// A value as an error names it: its type, and (unless `secret`) the value as written.
fn found(text: &str, v: &Spanned<DeValue<'_>>, secret: bool) -> String {
    let kind = v.get_ref().type_str();
    let article = if kind.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    if secret {
        return format!("{article} {kind}");
    }
    let shown = match v.get_ref() {
        DeValue::String(s) => {
            let mut s: String = s.chars().take(ECHO_CHARS_MAX + 1).collect();
            if s.chars().count() > ECHO_CHARS_MAX {
                s = s.chars().take(ECHO_CHARS_MAX).collect();
                s.push('…');
            }
            Some(toml_str(&s))
        }
        DeValue::Integer(_) | DeValue::Float(_) | DeValue::Boolean(_) => {
            text.get(v.span()).map(str::to_string)
        }
        DeValue::Datetime(_) | DeValue::Array(_) | DeValue::Table(_) => None,
    };
    match shown {
        Some(shown) => format!("the {kind} {shown}"),
        None => format!("{article} {kind}"),
    }
}
