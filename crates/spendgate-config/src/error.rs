//! Config errors: the key, the problem, where it came from.

use std::fmt;
use std::path::{Path, PathBuf};

/// A config error: the key it is about, the problem, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub(crate) key: String,
    pub(crate) message: String,
    pub(crate) line: Option<usize>,
    pub(crate) column: Option<usize>,
    pub(crate) origin: Option<PathBuf>,
}

impl ConfigError {
    /// The key in TOML path syntax (`limits.global.budgets[1].amount`); empty for errors that
    /// are about no key (syntax errors, an unreadable file).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The problem, naming the key, without the location.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// 1-based line in the file, when known.
    pub fn line(&self) -> Option<usize> {
        self.line
    }

    /// The file it came from ([`load_file`](crate::load_file)).
    pub fn origin(&self) -> Option<&Path> {
        self.origin.as_deref()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.origin, self.line, self.column) {
            (Some(o), Some(l), Some(c)) => write!(f, "{}:{l}:{c}: ", o.display())?,
            (Some(o), Some(l), None) => write!(f, "{}:{l}: ", o.display())?,
            (Some(o), None, _) => write!(f, "{}: ", o.display())?,
            (None, Some(l), Some(c)) => write!(f, "line {l}, column {c}: ")?,
            (None, Some(l), None) => write!(f, "line {l}: ")?,
            (None, None, _) => {}
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}
