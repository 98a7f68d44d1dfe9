//! Warnings about a valid config: settings that admit nothing, or risk a promise.

use crate::types::{Config, StoreKind};
use crate::{MOCK_UPSTREAM, TOKEN_BYTES_ADVISED};
use spendgate_core::{Micros, Window};

impl Config {
    /// Settings under which nothing (of a kind) can ever be admitted, though each is valid
    /// alone: a whole-run reservation above a budget, a model step whose output bound alone
    /// is above the run's cost bound.
    fn unsatisfiable(&self) -> Vec<String> {
        let mut w = Vec::new();
        let (p, run) = (&self.policy, &self.policy.run);
        if p.mode == spendgate_core::ReservationMode::WholeRun {
            for (name, sp) in [
                ("global", &p.global),
                ("ip", &p.ip),
                ("session", &p.session),
                ("conversation", &p.conversation),
            ] {
                for b in sp.budgets.iter().filter(|b| b.amount < run.max_cost) {
                    w.push(format!(
                        "run.max_cost ({}) is above limits.{name}'s {} budget ({}): in \
                         whole_run mode every run reserves run.max_cost, so none is admitted",
                        run.max_cost,
                        b.window.name(),
                        b.amount
                    ));
                }
            }
        }
        for (name, sp) in [
            ("global", &p.global),
            ("ip", &p.ip),
            ("session", &p.session),
            ("conversation", &p.conversation),
        ] {
            for (i, b) in sp.budgets.iter().enumerate() {
                if b.amount == Micros::ZERO {
                    w.push(format!(
                        "limits.{name}.budgets[{i}]: an amount of 0 admits nothing (it is no \
                         \"unlimited\"; leave the budget out for that)"
                    ));
                }
                if b.window == Window::Lifetime && name != "global" {
                    w.push(format!(
                        "limits.{name}.budgets[{i}]: a lifetime budget keeps one counter per \
                         {name} for ever (no window ends to drop it): the store grows with every \
                         new {name} (memory, and the sqlite file or Redis); prefer a month"
                    ));
                }
            }
        }
        for (name, m) in &self.models {
            let out = if run.shrink_to_fit {
                run.min_output_tokens
            } else {
                run.max_output_tokens
            };
            let least = m.price.bound(0, out);
            if least > run.max_cost {
                w.push(format!(
                    "models.{name}: {out} output tokens alone cost {least}, above run.max_cost \
                     ({}): every call to it is refused (run_bound_exceeded); lower \
                     run.{} or raise run.max_cost",
                    run.max_cost,
                    if run.shrink_to_fit {
                        "min_output_tokens"
                    } else {
                        "max_output_tokens (or set shrink_to_fit)"
                    }
                ));
            }
        }
        w
    }

    /// Warnings for the operator at start: unset variables and what they close.
    pub fn warnings(&self) -> Vec<String> {
        let mut w: Vec<String> = self
            .unset_env
            .iter()
            .map(|u| {
                format!(
                    "{}: environment variable {} is unset or empty",
                    u.key, u.var
                )
            })
            .collect();
        if self.server.service_tokens.is_empty() {
            w.push(
                "server.service_tokens: no service token is set: the service API is closed"
                    .to_string(),
            );
        }
        if self.server.admin_tokens.is_empty() {
            w.push(
                "server.admin_tokens: no admin token is set: the admin API is closed".to_string(),
            );
        }
        if self.store.kind == StoreKind::Redis {
            if self.store.ledger_id.is_none() {
                w.push(
                    "store.ledger_id: not set: `spendgate serve` refuses a redis store without \
                     its ledger pinned; run `spendgate store init` once and pin the id it prints"
                        .to_string(),
                );
            }
            if self.store.witness_path.is_none() {
                w.push(
                    "store.witness_path: \"off\": a Redis rollback (an older snapshot reloaded) \
                     while every replica restarts is admitted; see RELIABILITY.md"
                        .to_string(),
                );
            }
        }
        w.extend(self.unsatisfiable());
        for (i, net) in self.server.trusted_proxies.iter().enumerate() {
            if net.prefix_len() < 8 {
                w.push(format!(
                    "server.trusted_proxies[{i}]: {net} trusts X-Forwarded-For from (nearly) \
                     any address: a client can then name any address and escape its per-address \
                     limits; list only your reverse proxies"
                ));
            }
        }
        for (name, m) in &self.models {
            if m.upstream == MOCK_UPSTREAM {
                w.push(format!(
                    "models.{name}.upstream: \"{MOCK_UPSTREAM}\" is served by `spendgate demo` \
                     only; `spendgate serve` refuses calls to this model (run `spendgate \
                     mock-upstream` and name it in [upstreams.NAME] instead)"
                ));
            }
        }
        for (key, tokens) in [
            ("server.service_tokens", &self.server.service_tokens),
            ("server.admin_tokens", &self.server.admin_tokens),
        ] {
            for (i, t) in tokens.iter().enumerate() {
                let n = t.expose().len();
                if n > 0 && n < TOKEN_BYTES_ADVISED {
                    w.push(format!(
                        "{key}[{i}]: a token of {n} bytes is guessable; use at least \
                         {TOKEN_BYTES_ADVISED} random bytes (the admin and service APIs \
                         share the public listener)"
                    ));
                }
            }
        }
        if self.sessions.keys.is_empty() {
            w.push(
                "sessions.keys: no session key is set: an ephemeral key is generated; sessions \
                 end at restart and are not shared between replicas"
                    .to_string(),
            );
        }
        self.dry_runs(&mut w);
        if self.policy.global.budgets.is_empty() {
            w.push(
                "limits.global.unbudgeted: no global budget: nothing bounds what the whole \
                 service spends"
                    .to_string(),
            );
        }
        w
    }
}

impl Config {
    /// A warning for every limit in dry-run: all (`server.dry_run`), a scope's, a single one.
    fn dry_runs(&self, w: &mut Vec<String>) {
        if self.server.dry_run {
            w.push(
                "server.dry_run: rates, concurrency caps and budgets are computed and logged but NOT enforced"
                    .to_string(),
            );
        } else {
            for (name, sp) in [
                ("global", &self.policy.global),
                ("ip", &self.policy.ip),
                ("session", &self.policy.session),
                ("conversation", &self.policy.conversation),
            ] {
                if sp.dry_run {
                    w.push(format!(
                        "limits.{name}.dry_run: this scope's limits are computed and logged but NOT enforced"
                    ));
                    continue;
                }
                Self::limit_dry_runs(w, name, sp);
            }
        }
    }

    /// A warning for each single limit of a scope in dry-run (`rate_dry_run`,
    /// `concurrency_dry_run`, a budget's `dry_run`).
    fn limit_dry_runs(w: &mut Vec<String>, name: &str, sp: &spendgate_core::ScopePolicy) {
        let not = "is computed and logged but NOT enforced";
        if sp.rate_dry_run {
            w.push(format!(
                "limits.{name}.rate_dry_run: this scope's rate {not}"
            ));
        }
        if sp.concurrency_dry_run {
            w.push(format!(
                "limits.{name}.concurrency_dry_run: this scope's concurrency cap {not}"
            ));
        }
        for (i, b) in sp.budgets.iter().enumerate().filter(|(_, b)| b.dry_run) {
            w.push(format!(
                "limits.{name}.budgets[{i}].dry_run: this {} budget {not}",
                b.window.name()
            ));
        }
    }
}
