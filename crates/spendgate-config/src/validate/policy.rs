//! Validation of `[limits]`, `[run]`, `[upstreams]`, `[models]`, `[tools]` and `[alerts]`.

use super::{Resolved, Validator, R};
use crate::diagnostics::{toml_str, KeyPath};
use crate::raw::{
    RawAlerts, RawAmount, RawCount, RawHistory, RawModel, RawRun, RawScope, RawTool, RawUpstream,
};
use crate::text::amount_text;
use crate::types::{
    AlertsConfig, HistoryConfig, ModelConfig, OutputBoundField, Secret, Tokenizer, UpstreamApi,
    UpstreamConfig,
};
use crate::{MOCK_UPSTREAM, TABLE_LEN_MAX, THRESHOLD_PERMILLE_MAX};
use spendgate_core::{
    Budget, Micros, ModelPrice, RunBounds, ScopeKind, ScopePolicy, ToolPrice, Window,
};
use std::collections::BTreeMap;
use std::time::Duration;

impl Validator<'_, '_> {
    pub(crate) fn scope(
        &self,
        name: &str,
        raw: &RawScope,
        default: &ScopePolicy,
        all_dry: bool,
    ) -> R<ScopePolicy> {
        let p = KeyPath::of(&["limits", name]);
        let mut rate = match &raw.rate {
            None => default.rate,
            Some(text) => self.rate(&p.key("rate"), text)?.map(|mut r| {
                // A `rate` without `burst` keeps the scope's default burst (at most the new
                // count): a new rate alone must not let one guest start `count` runs at once.
                if let Some(d) = default.rate {
                    r.burst = d.burst.min(r.count).max(1);
                }
                r
            }),
        };
        if let Some(r) = &rate {
            self.rate_fits(&p.key("rate"), r)?;
        }
        if let Some(burst) = raw.burst {
            let burst = self.int(&p.key("burst"), burst)?;
            match rate.as_mut() {
                Some(r) => {
                    r.burst = burst;
                    self.rate_fits(&p.key("burst"), r)?;
                }
                None => {
                    return Err(self.err(
                        &p.key("burst"),
                        "is set but this scope has no rate (rate = \"off\")",
                    ))
                }
            }
        }
        let concurrency = match raw.concurrency {
            None => default.concurrency,
            Some(RawCount::Off) => None,
            Some(RawCount::N(n)) => {
                let n = self.int(&p.key("concurrency"), n)?;
                Some(u32::try_from(n).unwrap_or(u32::MAX))
            }
        };
        let rate_dry_run = raw.rate_dry_run.unwrap_or(default.rate_dry_run);
        if rate_dry_run && rate.is_none() {
            return Err(self.err(
                &p.key("rate_dry_run"),
                "is true but this scope has no rate (rate = \"off\")",
            ));
        }
        let concurrency_dry_run = raw
            .concurrency_dry_run
            .unwrap_or(default.concurrency_dry_run);
        if concurrency_dry_run && concurrency.is_none() {
            return Err(self.err(
                &p.key("concurrency_dry_run"),
                "is true but this scope has no concurrency cap (concurrency = \"off\")",
            ));
        }
        let budgets = self.budgets(&p, raw, default)?;
        self.unbudgeted(&p, name, raw, &budgets)?;
        Ok(ScopePolicy {
            budgets,
            rate,
            concurrency,
            dry_run: all_dry || raw.dry_run.unwrap_or(default.dry_run),
            rate_dry_run,
            concurrency_dry_run,
        })
    }

    /// `limits.X.unbudgeted`: only `[limits.global]` takes it, and it must say what the
    /// budgets do: a global scope without a budget is refused unless it is `true`, and it is
    /// `true` only without one.
    fn unbudgeted(&self, p: &KeyPath, name: &str, raw: &RawScope, budgets: &[Budget]) -> R<()> {
        let key = p.key("unbudgeted");
        if name != ScopeKind::Global.name() {
            return match raw.unbudgeted {
                Some(_) => Err(self.err(
                    &key,
                    "is a key of [limits.global] only: any other scope may have no budget",
                )),
                None => Ok(()),
            };
        }
        let unbudgeted = raw.unbudgeted.unwrap_or(false);
        match (budgets.is_empty(), unbudgeted) {
            (true, false) => Err(self.err(
                &p.key("budgets"),
                "has no budget: nothing would bound what the whole service spends. Add one \
                 (budgets = [{ amount = \"50\", window = \"day\" }]), or set \
                 limits.global.unbudgeted = true to run without a global budget explicitly",
            )),
            (false, true) => Err(self.err(
                &key,
                format!(
                    "is true but limits.global.budgets has {} budget(s): remove one or the other",
                    budgets.len()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// `limits.X.budgets`: the scope's default when left out.
    fn budgets(&self, p: &KeyPath, raw: &RawScope, default: &ScopePolicy) -> R<Vec<Budget>> {
        Ok(match &raw.budgets {
            None => default.budgets.clone(),
            Some(list) => {
                let bp = p.key("budgets");
                self.list(&bp, list.len())?;
                let mut out: Vec<Budget> = Vec::new();
                for (i, b) in list.iter().enumerate() {
                    let ap = bp.idx(i).key("amount");
                    let amount = match &b.amount {
                        Some(a) => self.amount(&ap, a)?,
                        None => return Err(self.err(&ap, "required key is missing")),
                    };
                    let wp = bp.idx(i).key("window");
                    let window = match &b.window {
                        Some(w) => self.one_of(
                            &wp,
                            w.trim(),
                            &[Window::Hour, Window::Day, Window::Month, Window::Lifetime],
                            Window::name,
                        )?,
                        None => return Err(self.err(&wp, "required key is missing")),
                    };
                    if out.iter().any(|o| o.window == window) {
                        return Err(self.err(
                            &wp,
                            format!("a second {} budget; one per window", window.name()),
                        ));
                    }
                    out.push(Budget {
                        amount,
                        window,
                        dry_run: b.dry_run.unwrap_or(false),
                    });
                }
                out
            }
        })
    }

    pub(crate) fn run(&self, raw: &RawRun) -> R<RunBounds> {
        let p = KeyPath::of(&["run"]);
        let count = |key: &str, v: u64| -> R<u32> {
            let v = self.int(&p.key(key), v)?;
            Ok(u32::try_from(v).unwrap_or(u32::MAX))
        };
        let max_cost = self.amount(&p.key("max_cost"), &raw.max_cost)?;
        if max_cost == Micros::ZERO {
            return Err(self.err(
                &p.key("max_cost"),
                "must be more than 0: no run could do anything",
            ));
        }
        let bounds = RunBounds {
            max_input_bytes: self.int(&p.key("max_input_bytes"), raw.max_input_bytes)?,
            max_context_tokens: self.int(&p.key("max_context_tokens"), raw.max_context_tokens)?,
            max_output_tokens: self.int(&p.key("max_output_tokens"), raw.max_output_tokens)?,
            max_tool_result_bytes: self
                .int(&p.key("max_tool_result_bytes"), raw.max_tool_result_bytes)?,
            max_model_rounds: count("max_model_rounds", raw.max_model_rounds)?,
            max_tool_calls: count("max_tool_calls", raw.max_tool_calls)?,
            max_retries: count("max_retries", raw.max_retries)?,
            max_seconds: self.int(&p.key("max_seconds"), raw.max_seconds)?,
            max_cost,
            shrink_to_fit: raw.shrink_to_fit,
            min_output_tokens: self.int(&p.key("min_output_tokens"), raw.min_output_tokens)?,
        };
        if bounds.min_output_tokens > bounds.max_output_tokens {
            return Err(self.err(
                &p.key("min_output_tokens"),
                format!(
                    "{} is more than max_output_tokens ({})",
                    bounds.min_output_tokens, bounds.max_output_tokens
                ),
            ));
        }
        Ok(bounds)
    }

    pub(crate) fn upstreams(
        &mut self,
        raw: &BTreeMap<String, RawUpstream>,
    ) -> R<BTreeMap<String, UpstreamConfig>> {
        let table = KeyPath::of(&["upstreams"]);
        self.list_len(&table, raw.len(), TABLE_LEN_MAX)?;
        let mut out = BTreeMap::new();
        for (name, u) in raw {
            let p = table.key(name);
            self.name(&p, "upstream", name)?;
            if name == MOCK_UPSTREAM {
                return Err(self.err(
                    &p,
                    "the name \"mock\" is reserved for the built-in mock upstream",
                ));
            }
            let base_url = u
                .base_url
                .as_deref()
                .ok_or_else(|| self.err(&p.key("base_url"), "required key is missing"))?;
            self.http_url(&p.key("base_url"), base_url, true)?;
            let base_url = base_url.trim_end_matches('/').to_string();
            let api_key = match &u.api_key {
                None => Secret::literal(""),
                Some(text) => match self.secret(&p.key("api_key"), text)? {
                    Resolved::Set(s) => s,
                    Resolved::Unset(var) => Secret::from_env(&var, ""),
                },
            };
            let timeout_s = self.int(&p.key("timeout_s"), u.timeout_s)?;
            let api = self.one_of(
                &p.key("api"),
                &u.api,
                &[UpstreamApi::OpenAi, UpstreamApi::Anthropic],
                UpstreamApi::name,
            )?;
            out.insert(
                name.clone(),
                UpstreamConfig {
                    base_url,
                    api_key,
                    timeout: Duration::from_secs(timeout_s),
                    release_on_error: u.release_on_error,
                    api,
                },
            );
        }
        Ok(out)
    }

    pub(crate) fn models(
        &self,
        raw: &BTreeMap<String, RawModel>,
        upstreams: &BTreeMap<String, UpstreamConfig>,
    ) -> R<BTreeMap<String, ModelConfig>> {
        let table = KeyPath::of(&["models"]);
        self.list_len(&table, raw.len(), TABLE_LEN_MAX)?;
        let mut out = BTreeMap::new();
        for (name, m) in raw {
            let p = table.key(name);
            self.name(&p, "model", name)?;
            let up = p.key("upstream");
            let upstream = m.upstream.as_deref().ok_or_else(|| {
                self.err(
                    &up,
                    "required key is missing: name an [upstreams] entry or \"mock\"",
                )
            })?;
            if upstream != MOCK_UPSTREAM && !upstreams.contains_key(upstream) {
                let known: Vec<&str> = upstreams
                    .keys()
                    .map(String::as_str)
                    .chain([MOCK_UPSTREAM])
                    .collect();
                return Err(self.err(
                    &up,
                    format!(
                        "no upstream {} is configured (known: {})",
                        toml_str(upstream),
                        known.join(", ")
                    ),
                ));
            }
            let (price, cache_write) = self.model_price(&p, m)?;
            let tokenizer = self.one_of(
                &p.key("tokenizer"),
                &m.tokenizer,
                &[
                    Tokenizer::O200kBase,
                    Tokenizer::Cl100kBase,
                    Tokenizer::Bytes,
                ],
                Tokenizer::name,
            )?;
            if let Some(um) = &m.upstream_model {
                self.name(&p.key("upstream_model"), "upstream model", um)?;
            }
            let output_bound_field = self.one_of(
                &p.key("output_bound_field"),
                &m.output_bound_field,
                &[
                    OutputBoundField::MaxTokens,
                    OutputBoundField::MaxCompletionTokens,
                ],
                OutputBoundField::name,
            )?;
            out.insert(
                name.clone(),
                ModelConfig {
                    upstream: upstream.to_string(),
                    price,
                    tokenizer,
                    upstream_model: m.upstream_model.clone(),
                    output_bound_field,
                    cache_write_per_million: cache_write,
                },
            );
        }
        Ok(out)
    }

    /// A model's prices: its `ModelPrice` and its cache write price.
    fn model_price(&self, p: &KeyPath, m: &RawModel) -> R<(ModelPrice, Micros)> {
        let price = |key: &str, v: &Option<RawAmount>| -> R<Micros> {
            match v {
                Some(a) => self.amount(&p.key(key), a),
                None => Err(self.err(
                    &p.key(key),
                    "required key is missing: a model without a price is never called",
                )),
            }
        };
        let input = price("input_per_million", &m.input_per_million)?;
        let output = price("output_per_million", &m.output_per_million)?;
        let cached = match &m.cached_input_per_million {
            Some(a) => self.amount(&p.key("cached_input_per_million"), a)?,
            None => input,
        };
        if cached > input {
            return Err(self.err(
                &p.key("cached_input_per_million"),
                format!(
                    "{} is more than input_per_million ({}): reservations price every \
                     prompt token at the input price",
                    amount_text(cached),
                    amount_text(input)
                ),
            ));
        }
        let cache_write = match &m.cache_write_per_million {
            Some(a) => self.amount(&p.key("cache_write_per_million"), a)?,
            None => Micros(input.0.saturating_mul(2)),
        };
        if cache_write < input {
            return Err(self.err(
                &p.key("cache_write_per_million"),
                format!(
                    "{} is less than input_per_million ({}): a prompt token written \
                     to the cache is charged at least as an input token",
                    amount_text(cache_write),
                    amount_text(input)
                ),
            ));
        }
        let price = ModelPrice {
            input_per_million: input,
            cached_input_per_million: cached,
            output_per_million: output,
        };
        Ok((price, cache_write))
    }

    pub(crate) fn tools(&self, raw: &BTreeMap<String, RawTool>) -> R<BTreeMap<String, ToolPrice>> {
        let table = KeyPath::of(&["tools"]);
        self.list_len(&table, raw.len(), TABLE_LEN_MAX)?;
        let mut out = BTreeMap::new();
        for (name, t) in raw {
            let p = table.key(name);
            self.name(&p, "tool", name)?;
            if t.per_call.is_none() && t.per_unit.is_none() {
                return Err(self.err(
                    &p,
                    "needs per_call and/or per_unit: a tool without a price is never called",
                ));
            }
            let per_call = match &t.per_call {
                Some(a) => self.amount(&p.key("per_call"), a)?,
                None => Micros::ZERO,
            };
            let per_unit = match &t.per_unit {
                Some(a) => self.amount(&p.key("per_unit"), a)?,
                None => Micros::ZERO,
            };
            out.insert(name.clone(), ToolPrice { per_call, per_unit });
        }
        Ok(out)
    }

    pub(crate) fn history(&mut self, raw: &RawHistory) -> R<HistoryConfig> {
        let p = KeyPath::of(&["history"]);
        let up = p.key("url");
        let url = if raw.url.trim().is_empty() {
            None
        } else {
            let url = match self.secret(&up, &raw.url)? {
                Resolved::Set(s) => s,
                Resolved::Unset(var) => {
                    return Err(self.err(
                        &up,
                        format!(
                            "environment variable {var} is unset or empty; set it or leave url \
                             empty for no PostgreSQL"
                        ),
                    ));
                }
            };
            let v = url.expose();
            if !(v.starts_with("postgres://") || v.starts_with("postgresql://")) {
                return Err(self.err(
                    &up,
                    "is not a postgres:// URL (value not shown: it may hold a password)",
                ));
            }
            Some(url)
        };
        let days = self.int(&p.key("retention_days"), raw.retention_days)?;
        Ok(HistoryConfig {
            url,
            retention: Duration::from_secs(days * 86_400),
            rows_max: self.int(&p.key("rows_max"), raw.rows_max)?,
            stream_max_len: self.int(&p.key("stream_max_len"), raw.stream_max_len)?,
            drain_lag_alert: Duration::from_secs(
                self.int(&p.key("drain_lag_alert_s"), raw.drain_lag_alert_s)?,
            ),
        })
    }

    pub(crate) fn alerts(&mut self, raw: &RawAlerts) -> R<AlertsConfig> {
        let p = KeyPath::of(&["alerts"]);
        let up = p.key("webhook_url");
        let webhook_url = if raw.webhook_url.trim().is_empty() {
            None
        } else {
            // A webhook URL (Slack's among them) carries its credential: a secret.
            let url = match self.secret(&up, &raw.webhook_url)? {
                Resolved::Set(s) => s,
                Resolved::Unset(var) => {
                    return Err(self.err(
                        &up,
                        format!(
                            "environment variable {var} is unset or empty; set it or leave \
                             webhook_url empty for no webhook"
                        ),
                    ));
                }
            };
            let shown = format!(
                "the URL from {} (not shown: it holds a credential)",
                url.source()
            );
            self.http_url_shown(&up, url.expose(), false, &shown)?;
            Some(url)
        };
        let tp = p.key("thresholds");
        self.list(&tp, raw.thresholds.len())?;
        let mut thresholds_permille: Vec<u32> = Vec::new();
        for (i, t) in raw.thresholds.iter().enumerate() {
            let scaled = t * 1000.0;
            let rounded = scaled.round();
            let max = f64::from(THRESHOLD_PERMILLE_MAX);
            if !scaled.is_finite()
                || rounded < 1.0
                || rounded > max
                || (scaled - rounded).abs() > 1e-6
            {
                return Err(self.err(
                    &tp.idx(i),
                    format!(
                        "{t} must be a fraction of a budget in (0, 10] with at most 3 decimals"
                    ),
                ));
            }
            // In 1..=10000 by the check above.
            let permille = rounded as u32;
            if thresholds_permille
                .last()
                .is_some_and(|last| *last >= permille)
            {
                return Err(self.err(&tp.idx(i), "thresholds must be strictly ascending"));
            }
            thresholds_permille.push(permille);
        }
        let sp = p.key("scopes");
        self.list(&sp, raw.scopes.len())?;
        let mut scopes = Vec::new();
        for (i, name) in raw.scopes.iter().enumerate() {
            let kind = self.one_of(
                &sp.idx(i),
                name,
                &[
                    ScopeKind::Global,
                    ScopeKind::Ip,
                    ScopeKind::Session,
                    ScopeKind::Conversation,
                ],
                ScopeKind::name,
            )?;
            if scopes.contains(&kind) {
                return Err(self.err(&sp.idx(i), format!("{name:?} is listed twice")));
            }
            scopes.push(kind);
        }
        let short = self.int(&p.key("burn_short_s"), raw.burn_short_s)?;
        let long = self.int(&p.key("burn_long_s"), raw.burn_long_s)?;
        if long <= short {
            return Err(self.err(
                &p.key("burn_long_s"),
                format!("{long} must be longer than burn_short_s ({short})"),
            ));
        }
        Ok(AlertsConfig {
            burn_short: std::time::Duration::from_secs(short),
            burn_long: std::time::Duration::from_secs(long),
            scopes,
            webhook_url,
            thresholds_permille,
        })
    }
}
