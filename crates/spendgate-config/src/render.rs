//! The effective config as TOML (`spendgate check-config`).

use crate::diagnostics::{toml_key, toml_str};
use crate::text::{amount_text, shown_url, MASK};
use crate::types::{Config, Secret, StoreKind, UnsetEnv};
use spendgate_core::{Rate, ReservationMode};
use std::fmt;

// ---------------------------------------------------------------------------------------------
// Rendering the effective config.

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

pub(crate) fn permille_text(p: u32) -> String {
    let s = format!("{}.{:03}", p / 1000, p % 1000);
    let s = s.trim_end_matches('0');
    if s.ends_with('.') {
        format!("{s}0")
    } else {
        s.to_string()
    }
}

/// How a secret is shown: its `env:NAME` reference (and whether it is set) or the mask.
pub(crate) fn secret_shown(s: &Secret) -> (String, &'static str) {
    match s.env_var() {
        Some(var) => (
            toml_str(&format!("env:{var}")),
            if s.is_empty() { "unset" } else { "set" },
        ),
        None if s.is_empty() => (toml_str(""), "empty"),
        None => (toml_str(MASK), "literal, masked"),
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
        return (toml_str(v), "");
    }
    let shown = shown_url(v, false);
    if shown == MASK {
        (toml_str(MASK), "not a URL, masked")
    } else if shown.contains(MASK) {
        (toml_str(&shown), "user info and query masked")
    } else {
        (toml_str(&shown), "")
    }
}

pub(crate) struct Out(String);

impl Out {
    fn line(&mut self, s: impl AsRef<str>) {
        self.0.push_str(s.as_ref());
        self.0.push('\n');
    }
    fn kv(&mut self, key: &str, value: impl fmt::Display) {
        self.line(format!("{key} = {value}"));
    }
    fn kv_note(&mut self, key: &str, value: impl fmt::Display, note: &str) {
        if note.is_empty() {
            self.kv(key, value);
        } else {
            self.line(format!("{key} = {value}  # {note}"));
        }
    }
    fn secrets(&mut self, key: &str, list: &[Secret], unset: &[&UnsetEnv], empty_note: &str) {
        if list.is_empty() && unset.is_empty() {
            self.kv_note(key, "[]", empty_note);
            return;
        }
        self.line(format!("{key} = ["));
        for s in list {
            let (v, note) = secret_shown(s);
            self.line(format!("    {v},  # {note}"));
        }
        for u in unset {
            self.line(format!(
                "    {},  # unset: dropped",
                toml_str(&format!("env:{}", u.var))
            ));
        }
        self.line("]");
        if list.is_empty() {
            self.line(format!("# {empty_note}"));
        }
    }
}

impl Config {
    /// The effective config as TOML, for `spendgate check-config`: every key, secrets masked
    /// (`env:NAME` references stay visible, marked set or unset). Loading it back with the same
    /// environment gives an equal `Config`, except where a literal secret or a webhook URL was
    /// masked (loading a mask is refused).
    pub fn render_effective(&self) -> String {
        let mut o = Out(String::new());
        o.line("# spendgate effective configuration (secrets masked)");
        o.line("");
        self.render_server(&mut o);
        self.render_store(&mut o);
        self.render_sessions(&mut o);
        self.render_identity(&mut o);
        self.render_limits(&mut o);
        self.render_run(&mut o);
        self.render_prices(&mut o);
        self.render_alerts(&mut o);
        o.0
    }

    /// The `env:` secrets of `key` whose variables were unset.
    fn unset_for(&self, key: &str) -> Vec<&UnsetEnv> {
        self.unset_env.iter().filter(|u| u.key == key).collect()
    }

    /// `[server]`.
    fn render_server(&self, o: &mut Out) {
        let s = &self.server;
        o.line("[server]");
        o.kv("listen", toml_str(&s.listen.to_string()));
        let proxies: Vec<String> = s
            .trusted_proxies
            .iter()
            .map(|n| toml_str(&n.to_string()))
            .collect();
        o.kv("trusted_proxies", format!("[{}]", proxies.join(", ")));
        o.secrets(
            "service_tokens",
            &s.service_tokens,
            &self.unset_for("server.service_tokens"),
            "no service token: the service API is closed",
        );
        o.secrets(
            "admin_tokens",
            &s.admin_tokens,
            &self.unset_for("server.admin_tokens"),
            "no admin token: the admin API is closed",
        );
        o.kv("browser_direct", s.browser_direct);
        o.kv("dry_run", s.dry_run);
        let c = &s.capacity;
        o.kv("public_requests_max", c.public_requests_max);
        o.kv("service_requests_max", c.service_requests_max);
        o.kv("admin_requests_max", c.admin_requests_max);
        o.kv("health_requests_max", c.health_requests_max);
        o.kv("address_requests_max", c.address_requests_max);
        o.kv("address_connections_max", c.address_connections_max);
        o.kv("connections_max", c.connections_max);
        o.kv("connections_reserved", c.connections_reserved);
        o.kv("body_min_bytes_per_s", c.body_min_bytes_per_s);
        o.kv("body_grace_ms", c.body_grace.as_millis());
    }

    /// `[store]`.
    fn render_store(&self, o: &mut Out) {
        let st = &self.store;
        o.line("");
        o.line("[store]");
        o.kv("kind", toml_str(st.kind.name()));
        o.kv("path", toml_str(&st.path.to_string_lossy()));
        let (url, note) = url_shown(&st.url);
        o.kv_note("url", url, note);
        o.kv("prefix", toml_str(&st.prefix));
        let pin_note = match (&st.ledger_id, st.kind) {
            (None, StoreKind::Redis) => {
                "not pinned: serve refuses; run `spendgate store init` and pin the id it prints"
            }
            _ => "",
        };
        o.kv_note(
            "ledger_id",
            toml_str(st.ledger_id.as_deref().unwrap_or("")),
            pin_note,
        );
        match &st.witness_path {
            Some(w) => o.kv("witness_path", toml_str(&w.to_string_lossy())),
            None => o.kv_note(
                "witness_path",
                toml_str("off"),
                "a rollback of Redis while every replica restarts goes unseen",
            ),
        }
        o.kv("timeout_ms", st.timeout.as_millis());
        o.kv("slow_grace_ms", st.slow_grace.as_millis());
        o.kv("lease_ttl_s", self.policy.lease_ttl_ms / 1000);
    }

    /// `[sessions]`.
    fn render_sessions(&self, o: &mut Out) {
        let se = &self.sessions;
        o.line("");
        o.line("[sessions]");
        o.secrets(
            "keys",
            &se.keys,
            &self.unset_for("sessions.keys"),
            "no session key: an ephemeral key is generated at start",
        );
        o.kv("ttl_s", se.ttl.as_secs());
        o.kv("secure_cookie", se.secure_cookie);
        o.kv("challenge", toml_str(se.challenge.name()));
        o.kv("challenge_bits", se.challenge_bits);
        o.kv(
            "create_rate_per_ip",
            rate_or_off(&self.policy.session_create_per_ip),
        );
        o.kv(
            "create_rate_global",
            rate_or_off(&self.policy.session_create_global),
        );
        if let Some(u) = &se.verifier_url {
            o.kv("verifier_url", toml_str(&shown_url(u, false)));
        }
        if let Some(v) = &se.verifier_secret {
            let (v, note) = secret_shown(v);
            o.kv_note("verifier_secret", v, note);
        }
    }

    /// `[identity]`.
    fn render_identity(&self, o: &mut Out) {
        let id = &self.identity;
        o.line("");
        o.line("[identity]");
        o.kv("ipv4_prefix", id.ipv4_prefix);
        o.kv("ipv6_prefix", id.ipv6_prefix);
        let wider: Vec<String> = id.ipv6_wider.iter().map(|(p, _)| p.to_string()).collect();
        let factors: Vec<String> = id
            .ipv6_wider
            .iter()
            .map(|(p, f)| format!("/{p} x{f}"))
            .collect();
        o.kv_note(
            "ipv6_wider_prefixes",
            format!("[{}]", wider.join(", ")),
            &format!("ip limits multiplied: {}", factors.join(", ")),
        );
    }

    /// `[limits.*]`.
    fn render_limits(&self, o: &mut Out) {
        let scopes = [
            ("global", &self.policy.global),
            ("ip", &self.policy.ip),
            ("session", &self.policy.session),
            ("conversation", &self.policy.conversation),
        ];
        for (name, sp) in scopes {
            o.line("");
            o.line(format!("[limits.{name}]"));
            o.kv("rate", rate_or_off(&sp.rate));
            if let Some(r) = &sp.rate {
                o.kv("burst", r.burst);
            }
            match sp.concurrency {
                Some(c) => o.kv("concurrency", c),
                None => o.kv("concurrency", toml_str("off")),
            }
            let budgets: Vec<String> = sp
                .budgets
                .iter()
                .map(|b| {
                    format!(
                        "{{ amount = {}, window = {} }}",
                        toml_str(&amount_text(b.amount)),
                        toml_str(b.window.name())
                    )
                })
                .collect();
            o.kv("budgets", format!("[{}]", budgets.join(", ")));
            o.kv("dry_run", sp.dry_run);
        }
    }

    /// `[run]`.
    fn render_run(&self, o: &mut Out) {
        let r = &self.policy.run;
        o.line("");
        o.line("[run]");
        o.kv(
            "mode",
            toml_str(match self.policy.mode {
                ReservationMode::PerStep => "per_step",
                ReservationMode::WholeRun => "whole_run",
            }),
        );
        o.kv("max_input_bytes", r.max_input_bytes);
        o.kv("max_context_tokens", r.max_context_tokens);
        o.kv("max_output_tokens", r.max_output_tokens);
        o.kv("max_tool_result_bytes", r.max_tool_result_bytes);
        o.kv("max_model_rounds", r.max_model_rounds);
        o.kv("max_tool_calls", r.max_tool_calls);
        o.kv("max_retries", r.max_retries);
        o.kv("max_seconds", r.max_seconds);
        o.kv("max_cost", toml_str(&amount_text(r.max_cost)));
        o.kv("shrink_to_fit", r.shrink_to_fit);
        o.kv("min_output_tokens", r.min_output_tokens);
    }

    /// `[models.*]`, `[tools.*]` and `[upstreams.*]`.
    fn render_prices(&self, o: &mut Out) {
        for (name, m) in &self.models {
            o.line("");
            o.line(format!("[models.{}]", toml_str(name)));
            o.kv("upstream", toml_str(&m.upstream));
            o.kv(
                "input_per_million",
                toml_str(&amount_text(m.price.input_per_million)),
            );
            o.kv(
                "output_per_million",
                toml_str(&amount_text(m.price.output_per_million)),
            );
            o.kv(
                "cached_input_per_million",
                toml_str(&amount_text(m.price.cached_input_per_million)),
            );
            o.kv("tokenizer", toml_str(m.tokenizer.name()));
            if let Some(um) = &m.upstream_model {
                o.kv("upstream_model", toml_str(um));
            }
            o.kv("output_bound_field", toml_str(m.output_bound_field.name()));
        }
        for (name, t) in &self.tools {
            o.line("");
            o.line(format!("[tools.{}]", toml_key(name)));
            o.kv("per_call", toml_str(&amount_text(t.per_call)));
            o.kv("per_unit", toml_str(&amount_text(t.per_unit)));
        }
        for (name, u) in &self.upstreams {
            o.line("");
            o.line(format!("[upstreams.{}]", toml_key(name)));
            o.kv("base_url", toml_str(&shown_url(&u.base_url, false)));
            let (k, note) = secret_shown(&u.api_key);
            let note = if u.api_key.is_empty() && u.api_key.env_var().is_none() {
                "no key: no Authorization header"
            } else {
                note
            };
            o.kv_note("api_key", k, note);
            o.kv("timeout_s", u.timeout.as_secs());
            o.kv("release_on_error", u.release_on_error);
        }
    }

    /// `[alerts]`.
    fn render_alerts(&self, o: &mut Out) {
        let a = &self.alerts;
        o.line("");
        o.line("[alerts]");
        match &a.webhook_url {
            None => o.kv("webhook_url", toml_str("")),
            Some(u) if u.env_var().is_some() => {
                let (v, note) = secret_shown(u);
                o.kv_note("webhook_url", v, note);
            }
            Some(u) => {
                // Webhook URLs (Slack's among them) carry their credential in the path.
                o.kv_note(
                    "webhook_url",
                    toml_str(&shown_url(u.expose(), true)),
                    "user info, path and query masked",
                );
            }
        }
        let th: Vec<String> = a
            .thresholds_permille
            .iter()
            .map(|p| permille_text(*p))
            .collect();
        o.kv("thresholds", format!("[{}]", th.join(", ")));
        let sc: Vec<String> = a.scopes.iter().map(|k| toml_str(k.name())).collect();
        o.kv("scopes", format!("[{}]", sc.join(", ")));
    }
}

/// A rate as the file writes it, or `"off"`.
fn rate_or_off(r: &Option<Rate>) -> String {
    match r {
        None => toml_str("off"),
        Some(r) => match rate_text(r) {
            Some(t) => toml_str(&t),
            None => format!(
                "{}  # not expressible: {} per {} ms",
                toml_str("off"),
                r.count,
                r.period_ms
            ),
        },
    }
}
