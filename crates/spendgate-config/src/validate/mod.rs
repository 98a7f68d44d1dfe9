//! Stage two: validation, from the raw file to [`Config`](crate::Config).

use crate::diagnostics::{line_col, span_of, toml_str, KeyPath};
use crate::raw::{RawAmount, RawConfig};
use crate::schema::{self, Lookup, Ty};
use crate::text::{masked_problem, mode_name, MASK};
use crate::{
    Config, ConfigError, Secret, StoreKind, UnsetEnv, NAME_BYTES_MAX, RATE_COUNT_MAX,
    RATE_WINDOW_US_MAX,
};
use spendgate_core::{parse_amount, Micros, Policy, Rate, ReservationMode};
use std::fmt;
use toml::de::DeTable;

mod policy;
mod server;

// ---------------------------------------------------------------------------------------------
// Stage two: validation.

pub(crate) struct Validator<'a, 'i> {
    pub(crate) text: &'a str,
    pub(crate) root: &'a DeTable<'i>,
    pub(crate) env: &'a dyn Fn(&str) -> Option<String>,
    pub(crate) unset: Vec<UnsetEnv>,
}

/// An `env:` or literal secret after lookup.
pub(crate) enum Resolved {
    Set(Secret),
    Unset(String),
}

pub(crate) type R<T> = Result<T, ConfigError>;

impl Validator<'_, '_> {
    pub(crate) fn err(&self, path: &KeyPath, problem: impl fmt::Display) -> ConfigError {
        let line = span_of(self.root, path).map(|s| line_col(self.text, s.start).0);
        ConfigError {
            key: path.to_string(),
            message: format!("{path}: {problem}"),
            line,
            column: None,
            origin: None,
        }
    }

    pub(crate) fn range(&self, path: &KeyPath, v: u64, min: u64, max: u64) -> R<u64> {
        if (min..=max).contains(&v) {
            Ok(v)
        } else {
            Err(self.err(path, format!("{v} is out of range {min}..={max}")))
        }
    }

    /// `v` in the static range the schema gives the key at `path`.
    pub(crate) fn int(&self, path: &KeyPath, v: u64) -> R<u64> {
        match schema::lookup(path) {
            Lookup::Found {
                ty: Ty::Int { min, max } | Ty::CountOrOff { min, max },
            } => self.range(path, v, *min, *max),
            _ => Err(self.schema_bug(path, "an integer range")),
        }
    }

    /// A list of `len` entries at `path`, within the schema's bound.
    pub(crate) fn list(&self, path: &KeyPath, len: usize) -> R<()> {
        match schema::lookup(path) {
            Lookup::Found {
                ty: Ty::List { max, .. },
            } => self.list_len(path, len, *max),
            _ => Err(self.schema_bug(path, "a list bound")),
        }
    }

    /// One of `options`, by name; the schema lists the same names in the same order (the
    /// reference and the example print them).
    pub(crate) fn one_of<T: Copy>(
        &self,
        path: &KeyPath,
        v: &str,
        options: &[T],
        name: fn(T) -> &'static str,
    ) -> R<T> {
        let names: &[&str] = match schema::lookup(path) {
            Lookup::Found {
                ty: Ty::Choice(names),
            } => names,
            _ => return Err(self.schema_bug(path, "a list of choices")),
        };
        let same =
            names.len() == options.len() && names.iter().zip(options).all(|(n, o)| *n == name(*o));
        if !same {
            return Err(self.schema_bug(path, "the choices the validator knows"));
        }
        options
            .iter()
            .find(|o| name(**o) == v)
            .copied()
            .ok_or_else(|| {
                self.err(
                    path,
                    format!("{} is not one of {}", toml_str(v), names.join(", ")),
                )
            })
    }

    /// The schema (`raw.rs`) and the validator disagree: a bug, reported rather than panicked
    /// on (every key is validated by the tests' example config).
    fn schema_bug(&self, path: &KeyPath, what: &str) -> ConfigError {
        self.err(
            path,
            format!("the config schema has not {what} for this key (a bug in spendgate)"),
        )
    }

    pub(crate) fn amount(&self, path: &KeyPath, raw: &RawAmount) -> R<Micros> {
        parse_amount(&raw.0).map_err(|e| self.err(path, e))
    }

    /// A rate, or `None` for `"off"`.
    pub(crate) fn rate(&self, path: &KeyPath, text: &str) -> R<Option<Rate>> {
        if text.trim() == "off" {
            return Ok(None);
        }
        let r = Rate::parse(text).map_err(|e| self.err(path, format!("{e} (or \"off\")")))?;
        if r.count > RATE_COUNT_MAX {
            return Err(self.err(
                path,
                format!("at most {RATE_COUNT_MAX} requests per period"),
            ));
        }
        self.rate_fits(path, &r)?;
        Ok(Some(r))
    }

    /// Every store keeps a rate's state exactly: its burst window (`interval × burst`, in
    /// microseconds) must stay within 2^53 (the Redis script's numbers), so that a config that
    /// passes here never stops a Redis deployment from starting.
    pub(crate) fn rate_fits(&self, path: &KeyPath, r: &Rate) -> R<()> {
        let window = r.interval_us().saturating_mul(r.burst.max(1));
        if window > RATE_WINDOW_US_MAX {
            return Err(self.err(
                path,
                format!(
                    "a burst of {} at {} per {} ms spans {} s; at most {} s",
                    r.burst,
                    r.count,
                    r.period_ms,
                    window / 1_000_000,
                    RATE_WINDOW_US_MAX / 1_000_000
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn name(&self, path: &KeyPath, what: &str, name: &str) -> R<()> {
        if name.is_empty()
            || name.len() > NAME_BYTES_MAX
            || name.trim() != name
            || name.chars().any(char::is_control)
        {
            return Err(self.err(
                path,
                format!(
                    "{what} name {} must be 1..={NAME_BYTES_MAX} bytes without surrounding \
                     spaces or control characters",
                    toml_str(name)
                ),
            ));
        }
        Ok(())
    }

    /// An http(s) URL that a request can be built from: a host, a valid port, no spaces.
    /// `base`: a base that paths are appended to (no user info, query or fragment, which
    /// would swallow the path or end up in logs).
    pub(crate) fn http_url(&self, path: &KeyPath, url: &str, base: bool) -> R<()> {
        self.http_url_shown(path, url, base, &toml_str(url))
    }

    /// [`Self::http_url`] naming the URL in errors as `shown` (a secret one is not shown).
    pub(crate) fn http_url_shown(
        &self,
        path: &KeyPath,
        url: &str,
        base: bool,
        shown: &str,
    ) -> R<()> {
        if url.contains(MASK) {
            return Err(self.err(path, masked_problem()));
        }
        let not_url = |why: &str| {
            self.err(
                path,
                format!("{shown} is not an http:// or https:// URL ({why})"),
            )
        };
        if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(not_url("it holds spaces or control characters"));
        }
        let parsed = url::Url::parse(url).map_err(|e| not_url(&e.to_string()))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(not_url("the scheme must be http or https"));
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(not_url("no host"));
        }
        if base
            && (parsed.query().is_some()
                || parsed.fragment().is_some()
                || !parsed.username().is_empty()
                || parsed.password().is_some())
        {
            return Err(not_url(
                "a base URL takes no user info, query or fragment: paths are appended to it",
            ));
        }
        Ok(())
    }

    pub(crate) fn list_len(&self, path: &KeyPath, len: usize, max: usize) -> R<()> {
        if len > max {
            return Err(self.err(
                path,
                format!("has {len} entries; at most {max} are allowed"),
            ));
        }
        Ok(())
    }

    /// Resolves `env:NAME` or takes a literal; records unset variables under `path`'s list.
    pub(crate) fn secret(&mut self, path: &KeyPath, text: &str) -> R<Resolved> {
        if let Some(var) = text.strip_prefix("env:") {
            let valid = var
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                && var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !valid {
                return Err(self.err(
                    path,
                    format!(
                        "{} does not name an environment variable (env:NAME, NAME of letters, \
                         digits and _)",
                        toml_str(text)
                    ),
                ));
            }
            let value = (self.env)(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty());
            return Ok(match value {
                Some(v) => Resolved::Set(Secret::from_env(var, v)),
                None => {
                    self.unset.push(UnsetEnv {
                        key: path.without_indices().to_string(),
                        var: var.to_string(),
                    });
                    Resolved::Unset(var.to_string())
                }
            });
        }
        if text.contains(MASK) {
            return Err(self.err(path, masked_problem()));
        }
        Ok(Resolved::Set(Secret::literal(text)))
    }

    /// A token or key list: unset variables are dropped; empty literals are errors.
    /// Set values shorter than `min_bytes` are errors (the value is never shown).
    pub(crate) fn secret_list(
        &mut self,
        path: &KeyPath,
        texts: &[String],
        what: &str,
        min_bytes: usize,
    ) -> R<Vec<Secret>> {
        self.list(path, texts.len())?;
        let mut out = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            let p = path.idx(i);
            match self.secret(&p, text)? {
                Resolved::Set(s) if s.expose().trim().is_empty() => {
                    return Err(self.err(&p, format!("an empty {what} is not allowed")));
                }
                Resolved::Set(s) if s.expose().len() < min_bytes => {
                    return Err(self.err(
                        &p,
                        format!(
                            "the {what} from {} is {} bytes; at least {min_bytes} are needed",
                            s.source(),
                            s.expose().len()
                        ),
                    ));
                }
                Resolved::Set(s) => out.push(s),
                Resolved::Unset(_) => {}
            }
        }
        Ok(out)
    }

    pub(crate) fn config(&mut self, raw: RawConfig) -> R<Config> {
        let server = self.server(&raw.server)?;
        let (store, lease_ttl_ms) = self.store(&raw.store)?;
        let (sessions, create_per_ip, create_global) = self.sessions(&raw.sessions)?;
        if store.kind == StoreKind::Redis && sessions.keys.is_empty() {
            // Each replica would sign with a key of its own: a session (and a challenge)
            // from one would be refused by the others.
            return Err(self.err(
                &KeyPath::of(&["sessions", "keys"]),
                "no session key is set (or its environment variable is unset): replicas on \
                 one Redis must share one",
            ));
        }
        let identity = self.identity(&raw.identity)?;
        let defaults = Policy::default();
        let limits = &raw.limits;
        let all_dry = server.dry_run;
        let policy = Policy {
            global: self.scope("global", &limits.global, &defaults.global, all_dry)?,
            ip: self.scope("ip", &limits.ip, &defaults.ip, all_dry)?,
            session: self.scope("session", &limits.session, &defaults.session, all_dry)?,
            conversation: self.scope(
                "conversation",
                &limits.conversation,
                &defaults.conversation,
                all_dry,
            )?,
            run: self.run(&raw.run)?,
            mode: self.one_of(
                &KeyPath::of(&["run", "mode"]),
                &raw.run.mode,
                &[ReservationMode::PerStep, ReservationMode::WholeRun],
                mode_name,
            )?,
            lease_ttl_ms,
            session_create_per_ip: create_per_ip,
            session_create_global: create_global,
        };
        let upstreams = self.upstreams(&raw.upstreams)?;
        let models = self.models(&raw.models, &upstreams)?;
        let tools = self.tools(&raw.tools)?;
        let alerts = self.alerts(&raw.alerts)?;
        let history = self.history(&raw.history)?;
        Ok(Config {
            server,
            store,
            sessions,
            identity,
            policy,
            models,
            tools,
            upstreams,
            alerts,
            history,
            unset_env: std::mem::take(&mut self.unset),
        })
    }
}
