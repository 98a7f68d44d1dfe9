//! The config written back as TOML, derived from the schema: `spendgate check-config`'s
//! effective config and the annotated example.
//!
//! A [`Config`] is turned back into the raw structs ([`Config::to_raw`]: the inverse of
//! validation, secrets masked, with what check-config says beside some values), serialized
//! with serde, and written key by key in the order and with the docs of the schema
//! ([`crate::schema`]). No key is named here except to fill the raw structs.

use crate::diagnostics::KeyPath;
use crate::raw::{
    RawAlerts, RawAmount, RawBudget, RawConfig, RawCount, RawHistory, RawIdentity, RawLimits,
    RawModel, RawRun, RawScope, RawServer, RawSessions, RawStore, RawTool, RawUpstream,
};
use crate::schema::{Key, Table, Ty, ROOT};
use crate::text::{amount_text, mode_name, shown_url, MASK};
use crate::{Config, Secret, StoreKind};
use spendgate_core::{Rate, ScopePolicy};
use std::collections::BTreeMap;
use toml::Value;

/// What check-config says beside a value, by key path (`server.service_tokens[0]`).
pub(crate) type Notes = BTreeMap<String, String>;

fn note(notes: &mut Notes, path: &KeyPath, text: impl Into<String>) {
    notes.insert(path.to_string(), text.into());
}

pub(crate) fn rate_text(r: &Rate) -> Option<String> {
    let unit = match r.period_ms {
        1000 => "second",
        60_000 => "minute",
        3_600_000 => "hour",
        86_400_000 => "day",
        _ => return None,
    };
    Some(format!("{}/{unit}", r.count))
}

/// A rate as the file writes it, or `"off"`.
fn rate_or_off(r: &Option<Rate>, path: &KeyPath, notes: &mut Notes) -> String {
    match r {
        None => "off".to_string(),
        Some(r) => rate_text(r).unwrap_or_else(|| {
            note(
                notes,
                path,
                format!("not expressible: {} per {} ms", r.count, r.period_ms),
            );
            "off".to_string()
        }),
    }
}

/// How a secret is shown: its `env:NAME` reference (and whether it is set) or the mask.
pub(crate) fn secret_shown(s: &Secret) -> (String, &'static str) {
    match s.env_var() {
        Some(var) => (
            format!("env:{var}"),
            if s.is_empty() { "unset" } else { "set" },
        ),
        None if s.is_empty() => (String::new(), "empty"),
        None => (MASK.to_string(), "literal, masked"),
    }
}

/// The store URL as check-config shows it: user info and query masked for every scheme
/// (`redis+unix://` and `unix://` URLs carry `user=` and `pass=` in the query, where the redis
/// client reads them), and a value that is not a URL masked whole.
pub(crate) fn url_shown(s: &Secret) -> (String, &'static str) {
    if s.env_var().is_some() {
        return secret_shown(s);
    }
    let v = s.expose();
    if v.is_empty() {
        return (String::new(), "");
    }
    let shown = shown_url(v, false);
    if shown == MASK {
        (shown, "not a URL, masked")
    } else if shown.contains(MASK) {
        (shown, "user info and query masked")
    } else {
        (shown, "")
    }
}

fn secs(d: std::time::Duration) -> u64 {
    d.as_secs()
}

fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Config {
    /// The effective config as TOML, for `spendgate check-config`: every key, secrets masked
    /// (`env:NAME` references stay visible, marked set or unset). Loading it back with the same
    /// environment gives an equal `Config`, except where a literal secret or a webhook URL was
    /// masked (loading a mask is refused).
    pub fn render_effective(&self) -> String {
        let (raw, notes) = self.to_raw();
        let mut w = Writer::new(Mode::Effective(&notes));
        w.line("# spendgate effective configuration (secrets masked)");
        w.document(&raw)
    }

    /// The config as the file would write it (every key the effective config has a value
    /// for), secrets masked, with what check-config says beside some values.
    pub(crate) fn to_raw(&self) -> (RawConfig, Notes) {
        let mut notes = Notes::new();
        let scope = |name: &str, sp: &ScopePolicy, notes: &mut Notes| {
            let mut raw = raw_scope(&KeyPath::of(&["limits", name]), sp, notes);
            if name == "global" {
                raw.unbudgeted = Some(sp.budgets.is_empty());
            }
            raw
        };
        let raw = RawConfig {
            server: self.raw_server(&mut notes),
            store: self.raw_store(&mut notes),
            sessions: self.raw_sessions(&mut notes),
            identity: self.raw_identity(&mut notes),
            limits: RawLimits {
                global: scope("global", &self.policy.global, &mut notes),
                ip: scope("ip", &self.policy.ip, &mut notes),
                session: scope("session", &self.policy.session, &mut notes),
                conversation: scope("conversation", &self.policy.conversation, &mut notes),
            },
            run: self.raw_run(),
            models: self.raw_models(),
            tools: self
                .tools
                .iter()
                .map(|(name, t)| {
                    let tool = RawTool {
                        per_call: Some(RawAmount(amount_text(t.per_call))),
                        per_unit: Some(RawAmount(amount_text(t.per_unit))),
                    };
                    (name.clone(), tool)
                })
                .collect(),
            upstreams: self.raw_upstreams(&mut notes),
            alerts: self.raw_alerts(&mut notes),
            history: self.raw_history(&mut notes),
        };
        (raw, notes)
    }

    /// A secret list: the set entries (an `env:NAME` reference, or the mask for a literal),
    /// then the `env:` entries whose variables were unset (dropped).
    fn raw_secrets(
        &self,
        path: &KeyPath,
        list: &[Secret],
        empty_note: &str,
        notes: &mut Notes,
    ) -> Vec<String> {
        let key = path.to_string();
        let mut out = Vec::new();
        for s in list {
            let (v, n) = secret_shown(s);
            note(notes, &path.idx(out.len()), n);
            out.push(v);
        }
        for u in self.unset_env.iter().filter(|u| u.key == key) {
            note(notes, &path.idx(out.len()), "unset: dropped");
            out.push(format!("env:{}", u.var));
        }
        if list.is_empty() {
            note(notes, path, empty_note);
        }
        out
    }

    fn raw_server(&self, notes: &mut Notes) -> RawServer {
        let s = &self.server;
        let c = &s.capacity;
        let p = KeyPath::of(&["server"]);
        RawServer {
            listen: s.listen.to_string(),
            metrics_listen: s.metrics_listen.map(|a| a.to_string()).unwrap_or_default(),
            trusted_proxies: s.trusted_proxies.iter().map(|n| n.to_string()).collect(),
            service_tokens: self.raw_secrets(
                &p.key("service_tokens"),
                &s.service_tokens,
                "no service token: the service API is closed",
                notes,
            ),
            admin_tokens: self.raw_secrets(
                &p.key("admin_tokens"),
                &s.admin_tokens,
                "no admin token: the admin API is closed",
                notes,
            ),
            browser_direct: s.browser_direct,
            dry_run: s.dry_run,
            public_requests_max: c.public_requests_max as u64,
            service_requests_max: c.service_requests_max as u64,
            admin_requests_max: c.admin_requests_max as u64,
            health_requests_max: c.health_requests_max as u64,
            address_requests_max: c.address_requests_max as u64,
            address_connections_max: Some(c.address_connections_max as u64),
            connections_max: c.connections_max as u64,
            connections_reserved: Some(c.connections_reserved as u64),
            body_min_bytes_per_s: c.body_min_bytes_per_s,
            body_grace_ms: millis(c.body_grace),
        }
    }

    fn raw_store(&self, notes: &mut Notes) -> RawStore {
        let st = &self.store;
        let p = KeyPath::of(&["store"]);
        let (url, url_note) = url_shown(&st.url);
        if !url_note.is_empty() {
            note(notes, &p.key("url"), url_note);
        }
        if st.ledger_id.is_none() && st.kind == StoreKind::Redis {
            note(
                notes,
                &p.key("ledger_id"),
                "not pinned: serve refuses; run `spendgate store init` and pin the id it prints",
            );
        }
        let witness_path = match &st.witness_path {
            Some(w) => w.to_string_lossy().into_owned(),
            None => {
                note(
                    notes,
                    &p.key("witness_path"),
                    "a rollback of Redis while every replica restarts goes unseen",
                );
                "off".to_string()
            }
        };
        RawStore {
            kind: st.kind.name().to_string(),
            path: st.path.to_string_lossy().into_owned(),
            url,
            prefix: st.prefix.clone(),
            ledger_id: st.ledger_id.clone().unwrap_or_default(),
            witness_path,
            timeout_ms: millis(st.timeout),
            slow_grace_ms: millis(st.slow_grace),
            lease_ttl_s: self.policy.lease_ttl_ms / 1000,
        }
    }

    fn raw_sessions(&self, notes: &mut Notes) -> RawSessions {
        let se = &self.sessions;
        let p = KeyPath::of(&["sessions"]);
        let verifier_secret = se.verifier_secret.as_ref().map(|v| {
            let (v, n) = secret_shown(v);
            note(notes, &p.key("verifier_secret"), n);
            v
        });
        RawSessions {
            keys: self.raw_secrets(
                &p.key("keys"),
                &se.keys,
                "no session key: an ephemeral key is generated at start",
                notes,
            ),
            ttl_s: secs(se.ttl),
            secure_cookie: se.secure_cookie,
            challenge: se.challenge.name().to_string(),
            challenge_bits: u64::from(se.challenge_bits),
            create_rate_per_ip: rate_or_off(
                &self.policy.session_create_per_ip,
                &p.key("create_rate_per_ip"),
                notes,
            ),
            create_rate_global: rate_or_off(
                &self.policy.session_create_global,
                &p.key("create_rate_global"),
                notes,
            ),
            verifier_url: se.verifier_url.as_ref().map(|u| shown_url(u, false)),
            verifier_secret,
        }
    }

    fn raw_identity(&self, notes: &mut Notes) -> RawIdentity {
        let id = &self.identity;
        let factors: Vec<String> = id
            .ipv6_wider
            .iter()
            .map(|(p, f)| format!("/{p} x{f}"))
            .collect();
        note(
            notes,
            &KeyPath::of(&["identity", "ipv6_wider_prefixes"]),
            if factors.is_empty() {
                "no wider prefix is limited".to_string()
            } else {
                format!("ip limits multiplied: {}", factors.join(", "))
            },
        );
        RawIdentity {
            ipv4_prefix: u64::from(id.ipv4_prefix),
            ipv6_prefix: u64::from(id.ipv6_prefix),
            ipv6_wider_prefixes: Some(id.ipv6_wider.iter().map(|(p, _)| u64::from(*p)).collect()),
        }
    }

    fn raw_run(&self) -> RawRun {
        let r = &self.policy.run;
        RawRun {
            mode: mode_name(self.policy.mode).to_string(),
            max_input_bytes: r.max_input_bytes,
            max_context_tokens: r.max_context_tokens,
            max_output_tokens: r.max_output_tokens,
            max_tool_result_bytes: r.max_tool_result_bytes,
            max_model_rounds: u64::from(r.max_model_rounds),
            max_tool_calls: u64::from(r.max_tool_calls),
            max_retries: u64::from(r.max_retries),
            max_seconds: r.max_seconds,
            max_cost: RawAmount(amount_text(r.max_cost)),
            shrink_to_fit: r.shrink_to_fit,
            min_output_tokens: r.min_output_tokens,
        }
    }

    fn raw_models(&self) -> BTreeMap<String, RawModel> {
        let amount = |m| Some(RawAmount(amount_text(m)));
        self.models
            .iter()
            .map(|(name, m)| {
                let model = RawModel {
                    upstream: Some(m.upstream.clone()),
                    input_per_million: amount(m.price.input_per_million),
                    output_per_million: amount(m.price.output_per_million),
                    cached_input_per_million: amount(m.price.cached_input_per_million),
                    tokenizer: m.tokenizer.name().to_string(),
                    upstream_model: m.upstream_model.clone(),
                    output_bound_field: m.output_bound_field.name().to_string(),
                    cache_write_per_million: amount(m.cache_write_per_million),
                };
                (name.clone(), model)
            })
            .collect()
    }

    fn raw_upstreams(&self, notes: &mut Notes) -> BTreeMap<String, RawUpstream> {
        let mut out = BTreeMap::new();
        for (name, u) in &self.upstreams {
            let (key, n) = secret_shown(&u.api_key);
            let n = if u.api_key.is_empty() && u.api_key.env_var().is_none() {
                "no key: no Authorization header"
            } else {
                n
            };
            note(notes, &KeyPath::of(&["upstreams", name, "api_key"]), n);
            let upstream = RawUpstream {
                base_url: Some(shown_url(&u.base_url, false)),
                api_key: Some(key),
                timeout_s: secs(u.timeout),
                release_on_error: u.release_on_error,
                api: u.api.name().to_string(),
            };
            out.insert(name.clone(), upstream);
        }
        out
    }

    fn raw_history(&self, notes: &mut Notes) -> RawHistory {
        let h = &self.history;
        let url = match &h.url {
            None => String::new(),
            Some(u) => {
                let (v, n) = url_shown(u);
                note(notes, &KeyPath::of(&["history", "url"]), n);
                v
            }
        };
        RawHistory {
            url,
            retention_days: h.retention.as_secs() / 86_400,
            rows_max: h.rows_max,
            stream_max_len: h.stream_max_len,
            drain_lag_alert_s: h.drain_lag_alert.as_secs(),
        }
    }

    fn raw_alerts(&self, notes: &mut Notes) -> RawAlerts {
        let a = &self.alerts;
        let p = KeyPath::of(&["alerts", "webhook_url"]);
        let webhook_url = match &a.webhook_url {
            None => String::new(),
            Some(u) if u.env_var().is_some() => {
                let (v, n) = secret_shown(u);
                note(notes, &p, n);
                v
            }
            Some(u) => {
                // Webhook URLs (Slack's among them) carry their credential in the path.
                note(notes, &p, "user info, path and query masked");
                shown_url(u.expose(), true)
            }
        };
        RawAlerts {
            webhook_url,
            thresholds: a
                .thresholds_permille
                .iter()
                .map(|p| f64::from(*p) / 1000.0)
                .collect(),
            scopes: a.scopes.iter().map(|k| k.name().to_string()).collect(),
            burn_short_s: a.burn_short.as_secs(),
            burn_long_s: a.burn_long.as_secs(),
        }
    }
}

/// One `[limits.X]` table, every key given.
fn raw_scope(path: &KeyPath, sp: &ScopePolicy, notes: &mut Notes) -> RawScope {
    let budgets = sp
        .budgets
        .iter()
        .map(|b| RawBudget {
            amount: Some(RawAmount(amount_text(b.amount))),
            window: Some(b.window.name().to_string()),
            // (shown only when set: a budget is enforced unless it says otherwise)
            dry_run: b.dry_run.then_some(true),
        })
        .collect();
    RawScope {
        rate: Some(rate_or_off(&sp.rate, &path.key("rate"), notes)),
        burst: sp.rate.map(|r| r.burst),
        concurrency: Some(match sp.concurrency {
            Some(c) => RawCount::N(u64::from(c)),
            None => RawCount::Off,
        }),
        budgets: Some(budgets),
        unbudgeted: None,
        dry_run: Some(sp.dry_run),
        rate_dry_run: Some(sp.rate_dry_run),
        concurrency_dry_run: Some(sp.concurrency_dry_run),
    }
}

// ---------------------------------------------------------------------------------------------
// Writing TOML from the schema.

/// How keys are written.
pub(crate) enum Mode<'a> {
    /// check-config: every key that has a value, with its note beside it.
    Effective(&'a Notes),
    /// The annotated example: every table's and key's doc as comments above it; a key the
    /// file as written (`written`) leaves out is shown commented out, with the value it takes
    /// (or the schema's example).
    Example { written: &'a toml::Table },
}

pub(crate) struct Writer<'a> {
    out: String,
    mode: Mode<'a>,
}

impl<'a> Writer<'a> {
    pub(crate) fn new(mode: Mode<'a>) -> Writer<'a> {
        Writer {
            out: String::new(),
            mode,
        }
    }

    pub(crate) fn line(&mut self, s: impl AsRef<str>) {
        self.out.push_str(s.as_ref());
        self.out.push('\n');
    }

    fn doc(&mut self, key: &Key) {
        for l in key.doc_lines() {
            if l.is_empty() {
                self.line("#");
            } else {
                self.line(format!("# {l}"));
            }
        }
    }

    fn example(&self) -> bool {
        matches!(self.mode, Mode::Example { .. })
    }

    /// Writes `raw`, every table of the schema in order.
    pub(crate) fn document(mut self, raw: &RawConfig) -> String {
        let values = match toml::Table::try_from(raw) {
            Ok(v) => v,
            Err(e) => return format!("# the config cannot be written as TOML: {e}\n"),
        };
        let written = match self.mode {
            Mode::Example { written } => Some(written),
            Mode::Effective(_) => None,
        };
        if let Ty::Table(t) = &ROOT {
            self.table(&KeyPath::default(), None, t, &values, written);
        }
        self.out
    }

    /// A table at `path` (the file itself when empty): its own keys under its header, then
    /// the tables it holds. `doc`: the key whose doc introduces it.
    fn table(
        &mut self,
        path: &KeyPath,
        doc: Option<&Key>,
        table: &'static Table,
        values: &toml::Table,
        written: Option<&toml::Table>,
    ) {
        let own = table.keys.iter().filter(|k| !k.ty.is_section());
        if !path.is_empty() {
            let has_own = own.clone().next().is_some();
            let doc = doc.filter(|_| self.example());
            if has_own || doc.is_some() {
                self.line("");
            }
            if let Some(key) = doc {
                self.doc(key);
            }
            if has_own {
                self.line(format!("[{path}]"));
            }
        }
        for key in own {
            let is_written = written.is_some_and(|w| w.contains_key(key.name));
            self.key(&path.key(key.name), key, values.get(key.name), is_written);
        }
        let empty = toml::Table::new();
        for key in table.keys.iter().filter(|k| k.ty.is_section()) {
            let sub = path.key(key.name);
            let v = values.get(key.name).and_then(Value::as_table);
            let w = written
                .and_then(|w| w.get(key.name))
                .and_then(Value::as_table);
            match &key.ty {
                Ty::Table(t) => self.table(&sub, Some(key), t, v.unwrap_or(&empty), w),
                Ty::Map(Ty::Table(t)) => self.map(&sub, key, t, v.unwrap_or(&empty), w),
                _ => {}
            }
        }
    }

    /// Named tables (`[models.NAME]`).
    fn map(
        &mut self,
        path: &KeyPath,
        key: &Key,
        table: &'static Table,
        values: &toml::Table,
        written: Option<&toml::Table>,
    ) {
        if self.example() {
            self.line("");
            self.doc(key);
            if values.is_empty() {
                self.line(format!("# [{path}.NAME]"));
            }
        }
        for (name, v) in values {
            let w = written.and_then(|w| w.get(name)).and_then(Value::as_table);
            if let Some(v) = v.as_table() {
                self.table(&path.key(name), None, table, v, w);
            }
        }
    }

    /// One `key = value` line (or lines, for an array with notes).
    fn key(&mut self, path: &KeyPath, key: &Key, value: Option<&Value>, written: bool) {
        let name = key.name;
        match self.mode {
            Mode::Effective(notes) => {
                if let Some(v) = value {
                    self.noted(path, name, v, notes);
                }
            }
            Mode::Example { .. } => {
                self.line("");
                self.doc(key);
                match (value, written) {
                    (Some(v), true) => self.line(format!("{name} = {v}")),
                    (Some(v), false) => self.line(format!("# {name} = {v}")),
                    (None, _) => {
                        if let Some(eg) = key.example {
                            self.line(format!("# {name} = {eg}"));
                        }
                    }
                }
            }
        }
    }

    /// A value with check-config's notes: beside it, or beside each element of an array
    /// (one per line, the array's own note after it).
    fn noted(&mut self, path: &KeyPath, name: &str, v: &Value, notes: &Notes) {
        let own = notes.get(&path.to_string());
        if let Value::Array(items) = v {
            let item_notes: Vec<Option<&String>> = (0..items.len())
                .map(|i| notes.get(&path.idx(i).to_string()))
                .collect();
            if item_notes.iter().any(Option::is_some) {
                self.line(format!("{name} = ["));
                for (item, n) in items.iter().zip(item_notes) {
                    match n {
                        Some(n) => self.line(format!("    {item},  # {n}")),
                        None => self.line(format!("    {item},")),
                    }
                }
                self.line("]");
                if let Some(n) = own {
                    self.line(format!("# {n}"));
                }
                return;
            }
        }
        match own {
            Some(n) => self.line(format!("{name} = {v}  # {n}")),
            None => self.line(format!("{name} = {v}")),
        }
    }
}
