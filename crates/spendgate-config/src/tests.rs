use super::*;
use crate::diagnostics::toml_str;
use crate::render::url_shown;
use crate::text::shown_url;
use spendgate_core::{
    Budget, Micros, ModelPrice, Policy, Rate, ReservationMode, ScopeKind, ScopePolicy, ToolPrice,
    Window,
};
use std::path::PathBuf;
use std::time::Duration;

fn no_env(_: &str) -> Option<String> {
    None
}

fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |name| {
        pairs
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_string())
    }
}

fn load_err(text: &str) -> ConfigError {
    match load(text, &no_env) {
        Ok(_) => panic!("expected an error for:\n{text}"),
        Err(e) => e,
    }
}

const SPEC_EXAMPLE: &str = r#"
[server]
listen = "127.0.0.1:8080"
trusted_proxies = []                 # CIDRs whose X-Forwarded-For is believed
service_tokens = ["env:SPENDGATE_SERVICE_TOKEN"]
admin_tokens = ["env:SPENDGATE_ADMIN_TOKEN"]
browser_direct = false               # cookie-authenticated /v1/chat/completions
dry_run = false                      # decide, log and count, but do not enforce

[store]
kind = "sqlite"                      # memory | sqlite | redis
path = "spendgate.db"                # sqlite
url = "redis://127.0.0.1:6379/0"     # redis
prefix = "spendgate"                 # redis key prefix (one deployment per prefix)
ledger_id = ""                       # redis: the id `spendgate store init` printed (required to serve)
witness_path = "spendgate.witness"   # redis: the ledger's high-water mark on this replica's disk, or "off"
timeout_ms = 100                     # a failing store's calls refuse (503) after this
slow_grace_ms = 1000                 # a slow call (store answering) may wait this much more
lease_ttl_s = 30                     # concurrency slots and reservations, renewed by heartbeat

[sessions]
keys = ["env:SPENDGATE_SESSION_KEY"] # first signs, all verify
ttl_s = 86400
secure_cookie = true
challenge = "off"                    # off | always | adaptive
challenge_bits = 18
create_rate_per_ip = "10/hour"
create_rate_global = "600/minute"

[identity]
ipv4_prefix = 32
ipv6_prefix = 64

[limits.global]                      # also [limits.ip], [limits.session], [limits.conversation]
rate = "100/second"
burst = 20
concurrency = 64
budgets = [{ amount = "50.00", window = "day" }, { amount = "1000", window = "month" }]

[run]
mode = "per_step"                    # per_step | whole_run
max_input_bytes = 16384
max_context_tokens = 16000
max_output_tokens = 1024
max_tool_result_bytes = 65536
max_model_rounds = 8
max_tool_calls = 16
max_retries = 2
max_seconds = 120
max_cost = "0.20"
shrink_to_fit = false
min_output_tokens = 64

[models."gpt-4o-mini"]
upstream = "openai"
input_per_million = "0.15"
output_per_million = "0.60"
cached_input_per_million = "0.075"
tokenizer = "o200k_base"             # or "bytes": one token per byte, a hard upper bound

[tools.web_search]
per_call = "0.01"                    # and/or per_unit

[upstreams.openai]
base_url = "https://api.openai.com/v1"
api_key = "env:OPENAI_API_KEY"
timeout_s = 60

[alerts]
webhook_url = ""                     # JSON POST; Slack-compatible "text" field
thresholds = [0.5, 0.8, 1.0]
"#;

const SPEC_ENV: &[(&str, &str)] = &[
    ("SPENDGATE_SERVICE_TOKEN", "svc-token-value-0123456789"),
    ("SPENDGATE_ADMIN_TOKEN", "adm-token-value-0123456789"),
    (
        "SPENDGATE_SESSION_KEY",
        "session-key-value-0123456789abcdef",
    ),
    ("OPENAI_API_KEY", "sk-openai-value-0123456789"),
];

#[test]
fn urls_must_be_usable_and_are_shown_masked() {
    for (text, key) in [
        (
            "[upstreams.u]\nbase_url = \"http://127.0.0.1:99999/v1\"\n",
            "upstreams.u.base_url",
        ),
        (
            "[upstreams.u]\nbase_url = \"https://api.example.com/v1?x=1\"\n",
            "upstreams.u.base_url",
        ),
        (
            "[upstreams.u]\nbase_url = \"https://user:pw@api.example.com/v1\"\n",
            "upstreams.u.base_url",
        ),
        (
            "[alerts]\nwebhook_url = \"https://\"\n",
            "alerts.webhook_url",
        ),
    ] {
        assert_eq!(load_err(text).key(), key, "{text}");
    }
    assert_eq!(
        shown_url(
            "https://user:s3cret@hooks.example.com/T0/B0/XX?token=abc",
            true
        ),
        "https://***@hooks.example.com/***?***"
    );
    assert_eq!(
        shown_url("https://v.example.com/siteverify?k=1", false),
        "https://v.example.com/siteverify?***"
    );
}

#[test]
fn store_url_query_is_masked_for_every_scheme() {
    for (url, secret, shown) in [
        (
            "redis+unix:///run/redis.sock?db=0&pass=hunter2secret",
            "hunter2secret",
            "redis+unix:///run/redis.sock?***",
        ),
        (
            "unix:///run/redis.sock?user=app&pass=hunter2secret",
            "hunter2secret",
            "unix:///run/redis.sock?***",
        ),
        (
            "unix:///run/redis.sock?pass=hunter2@secret",
            "hunter2",
            "unix:///run/redis.sock?***",
        ),
        (
            "rediss://app:hunter2secret@redis.internal:6380/1?protocol=resp3",
            "hunter2secret",
            "rediss://***@redis.internal:6380/1?***",
        ),
    ] {
        let text = format!(
            "[sessions]\nkeys = [\"session-key-0123456789abcdef\"]\n\n[store]\nkind = \"redis\"\nurl = {}\n",
            toml_str(url)
        );
        let c = load(&text, &no_env).expect("valid");
        assert_eq!(c.store.url.expose(), url);
        let rendered = c.render_effective();
        assert!(
            !rendered.contains(secret),
            "{secret} leaked into:\n{rendered}"
        );
        let line = format!("url = {}  # user info and query masked", toml_str(shown));
        assert!(rendered.contains(&line), "{line} not in:\n{rendered}");
    }
    let (shown, note) = url_shown(&Secret::literal("redis://127.0.0.1:6379/0"));
    assert_eq!((shown.as_str(), note), ("redis://127.0.0.1:6379/0", ""));
    let (shown, note) = url_shown(&Secret::literal("not a url pass=hunter2"));
    assert_eq!((shown.as_str(), note), ("***", "not a URL, masked"));
}

#[test]
fn webhook_url_is_a_secret_given_by_env() {
    const HOOK: &str = "https://hooks.example.com/services/T0/B0/hooksecret42";
    const ENV: &[(&str, &str)] = &[("HOOK", HOOK), ("BAD_HOOK", "ftp://x/hooksecret42")];
    let text = "[alerts]\nwebhook_url = \"env:HOOK\"\n";
    let c = load(text, &env_of(ENV)).expect("valid");
    let url = c.alerts.webhook_url.as_ref().expect("a webhook");
    assert_eq!(url.expose(), HOOK);
    assert_eq!(url.env_var(), Some("HOOK"));
    let rendered = c.render_effective();
    assert!(!rendered.contains("hooksecret42"), "{rendered}");
    assert!(
        rendered.contains("webhook_url = \"env:HOOK\"  # set"),
        "{rendered}"
    );
    assert_eq!(load(&rendered, &env_of(ENV)).expect("valid"), c);

    // An unset variable is an error naming the key and the variable.
    let e = load(text, &no_env).expect_err("unset");
    assert_eq!(e.key(), "alerts.webhook_url");
    assert!(e.to_string().contains("HOOK"), "{e}");
    // The value from the environment is validated, and not shown.
    let e = load("[alerts]\nwebhook_url = \"env:BAD_HOOK\"\n", &env_of(ENV)).expect_err("not http");
    assert_eq!(e.key(), "alerts.webhook_url");
    assert!(!e.to_string().contains("hooksecret42"), "{e}");
    assert!(e.to_string().contains("env:BAD_HOOK"), "{e}");

    // A literal still works, and check-config still masks it.
    let c = load(&format!("[alerts]\nwebhook_url = \"{HOOK}\"\n"), &no_env).expect("valid");
    assert_eq!(
        c.alerts.webhook_url.as_ref().map(Secret::expose),
        Some(HOOK)
    );
    let rendered = c.render_effective();
    assert!(!rendered.contains("hooksecret42"), "{rendered}");
    assert!(
        rendered.contains("webhook_url = \"https://hooks.example.com/***\""),
        "{rendered}"
    );
    let e = load_err("[alerts]\nwebhook_url = \"ftp://x/hooksecret42\"\n");
    assert_eq!(e.key(), "alerts.webhook_url");
    assert!(!e.to_string().contains("hooksecret42"), "{e}");
}

#[test]
fn rates_a_store_cannot_keep_exactly_are_refused() {
    let e = load_err("[limits.global]\nrate = \"10000000000000000/second\"\n");
    assert_eq!(e.key(), "limits.global.rate");
    let e = load_err("[limits.session]\nrate = \"1/day\"\nburst = 200000\n");
    assert_eq!(e.key(), "limits.session.burst");
    assert!(e.to_string().contains("spans"), "{e}");
    load(
        "[limits.session]\nrate = \"1/day\"\nburst = 1000\n",
        &no_env,
    )
    .expect("valid");
    let e = load_err("[store]\ntimeout_ms = 30000\n");
    assert_eq!(e.key(), "store.timeout_ms");
    let e = load_err("[store]\nslow_grace_ms = 5001\n");
    assert_eq!(e.key(), "store.slow_grace_ms");
    let c = load("[store]\nslow_grace_ms = 0\n", &no_env).expect("no grace is valid");
    assert_eq!(c.store.slow_grace, Duration::ZERO);
    assert!(
        c.render_effective().contains("slow_grace_ms = 0"),
        "check-config shows it"
    );
}

#[test]
fn settings_that_admit_nothing_draw_a_warning() {
    let c = load(
        "[run]\nmode = \"whole_run\"\nmax_cost = \"1.00\"\n[limits.session]\nbudgets = [{ amount = \"0.50\", window = \"day\" }]\n",
        &no_env,
    )
    .expect("valid");
    let w = c.warnings();
    assert!(
        w.iter()
            .any(|w| w.starts_with("run.max_cost") && w.contains("limits.session")),
        "{w:?}"
    );
    let c = load(
        "[models.m]\nupstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"300\"\n",
        &no_env,
    )
    .expect("valid");
    let w = c.warnings();
    assert!(
        w.iter()
            .any(|w| w.starts_with("models.m: 1024 output tokens")),
        "{w:?}"
    );
    assert!(
        w.iter().any(|w| w.starts_with("models.m.upstream")),
        "{w:?}"
    );
    let quiet = load("", &no_env).expect("valid").warnings();
    assert!(
        !quiet
            .iter()
            .any(|w| w.starts_with("run.max_cost") || w.starts_with("models.")),
        "{quiet:?}"
    );
}

#[test]
fn a_redis_ledger_is_pinned_by_id_and_witnessed_by_default() {
    let redis = "[store]\nkind = \"redis\"\n[sessions]\nkeys = [\"0123456789abcdef0123\"]\n";
    let c = load(redis, &no_env).expect("valid: store init runs without a pin");
    assert_eq!(c.store.ledger_id, None);
    assert_eq!(
        c.store.witness_path.as_deref(),
        Some(Path::new("spendgate.witness"))
    );
    assert!(c
        .warnings()
        .iter()
        .any(|w| w.starts_with("store.ledger_id")));
    let c = load(
        &redis.replace(
            "kind = \"redis\"\n",
            "kind = \"redis\"\nledger_id = \"lg-0123456789abcdef0123456789abcdef\"\nwitness_path = \"off\"\n",
        ),
        &no_env,
    )
    .expect("valid");
    assert_eq!(
        c.store.ledger_id.as_deref(),
        Some("lg-0123456789abcdef0123456789abcdef")
    );
    assert_eq!(c.store.witness_path, None);
    assert!(c
        .warnings()
        .iter()
        .any(|w| w.starts_with("store.witness_path")));
    assert!(!c
        .warnings()
        .iter()
        .any(|w| w.starts_with("store.ledger_id")));
    for bad in ["LG-0123", "lg-0123456789ABCDEF0123456789abcdef", "f8-0123"] {
        let e = load_err(&format!("[store]\nledger_id = \"{bad}\"\n"));
        assert_eq!(e.key(), "store.ledger_id");
    }
    let e = load_err("[store]\nwitness_path = \" \"\n");
    assert_eq!(e.key(), "store.witness_path");
    // sqlite: no pin needed, no warning.
    let c = load("", &no_env).expect("valid");
    assert!(!c.warnings().iter().any(|w| w.starts_with("store.")));
}

#[test]
fn replicas_on_redis_need_a_shared_session_key_and_risky_values_warn() {
    let e = load_err("[store]\nkind = \"redis\"\n[sessions]\nkeys = []\n");
    assert_eq!(e.key(), "sessions.keys");
    load(
        "[store]\nkind = \"redis\"\n[sessions]\nkeys = [\"0123456789abcdef0123\"]\n",
        &no_env,
    )
    .expect("valid");
    let c = load(
        "[server]\ntrusted_proxies = [\"0.0.0.0/0\", \"10.0.0.0/8\"]\n[limits.ip]\nbudgets = [{ amount = \"0\", window = \"day\" }]\n",
        &no_env,
    )
    .expect("valid");
    let w = c.warnings();
    assert!(
        w.iter().any(|w| w.starts_with("server.trusted_proxies[0]")),
        "{w:?}"
    );
    assert!(
        !w.iter().any(|w| w.starts_with("server.trusted_proxies[1]")),
        "{w:?}"
    );
    assert!(
        w.iter().any(|w| w.starts_with("limits.ip.budgets[0]")),
        "{w:?}"
    );
    let c = load(
        "[limits.session]
budgets = [{ amount = \"1\", window = \"lifetime\" }]
[limits.global]
budgets = [{ amount = \"1\", window = \"lifetime\" }]
",
        &no_env,
    )
    .expect("valid");
    let w = c.warnings();
    assert!(
        w.iter()
            .any(|w| w.starts_with("limits.session.budgets[0]: a lifetime budget")),
        "{w:?}"
    );
    assert!(
        !w.iter().any(|w| w.starts_with("limits.global.budgets[0]")),
        "{w:?}"
    );
}

#[test]
fn an_empty_verifier_secret_is_refused() {
    let e = load_err(
        "[sessions]\nverifier_url = \"https://v.example.com/siteverify\"\nverifier_secret = \"\"\n",
    );
    assert_eq!(e.key(), "sessions.verifier_secret");
}

#[test]
fn short_tokens_draw_a_warning() {
    let c = load(
        "[server]\nservice_tokens = [\"0123456789abcdef\"]\nadmin_tokens = [\"x\"]\n",
        &no_env,
    )
    .expect("valid");
    let w = c.warnings();
    assert!(
        w.iter()
            .any(|w| w.starts_with("server.admin_tokens[0]: a token of 1 bytes")),
        "{w:?}"
    );
    assert!(
        !w.iter().any(|w| w.starts_with("server.service_tokens[0]")),
        "{w:?}"
    );
}

#[test]
fn dry_run_globally_or_per_limit() {
    let c = load("", &no_env).expect("valid");
    assert!(!c.policy.global.dry_run && !c.policy.ip.dry_run);
    let c = load("[limits.ip]\ndry_run = true\n", &no_env).expect("valid");
    assert!(c.policy.ip.dry_run, "per limit");
    assert!(!c.policy.global.dry_run && !c.policy.session.dry_run);
    assert!(c
        .warnings()
        .iter()
        .any(|w| w.starts_with("limits.ip.dry_run")));
    let c = load("[server]\ndry_run = true\n", &no_env).expect("valid");
    for p in [
        &c.policy.global,
        &c.policy.ip,
        &c.policy.session,
        &c.policy.conversation,
    ] {
        assert!(p.dry_run, "server.dry_run covers every [limits.X]");
    }
    assert!(c.warnings().iter().any(|w| w.starts_with("server.dry_run")));
    let e = load_err("[limits.ip]\ndry_run = \"yes\"\n");
    assert_eq!(e.key(), "limits.ip.dry_run");
}

/// A single limit in dry-run: one budget, a scope's rate, its concurrency cap; the scope's
/// other limits stay enforced.
#[test]
fn dry_run_on_a_single_limit() {
    let c = load(
        "[limits.session]\nbudgets = [{ amount = \"5\", window = \"day\", dry_run = true }, \
         { amount = \"1\", window = \"hour\" }]\nrate_dry_run = true\n\n\
         [limits.ip]\nconcurrency_dry_run = true\n",
        &no_env,
    )
    .expect("valid");
    let s = &c.policy.session;
    assert!(!s.dry_run, "the scope itself stays enforced");
    assert_eq!(
        s.budgets,
        vec![
            Budget {
                amount: Micros(5_000_000),
                window: Window::Day,
                dry_run: true
            },
            Budget::new(Micros(1_000_000), Window::Hour)
        ]
    );
    assert!(s.budget_dry(Window::Day) && !s.budget_dry(Window::Hour));
    assert!(s.rate_dry_run && s.rate_dry() && !s.concurrency_dry());
    assert!(c.policy.ip.concurrency_dry() && !c.policy.ip.rate_dry());
    assert!(!c.policy.global.any_dry() && !c.policy.conversation.any_dry());
    let w = c.warnings();
    for key in [
        "limits.session.budgets[0].dry_run",
        "limits.session.rate_dry_run",
        "limits.ip.concurrency_dry_run",
    ] {
        assert!(w.iter().any(|w| w.starts_with(key)), "{key}: {w:?}");
    }
    assert!(!w.iter().any(|w| w.starts_with("limits.session.budgets[1]")));
    // check-config prints them, and what it prints loads back the same.
    let rendered = c.render_effective();
    assert!(
        rendered.contains("dry_run = true, window = \"day\" }"),
        "{rendered}"
    );
    assert!(rendered.contains("rate_dry_run = true"), "{rendered}");
    assert_eq!(load(&rendered, &no_env).expect("valid"), c, "{rendered}");

    // Errors name the key.
    let e = load_err(
        "[limits.session]\nbudgets = [{ amount = \"5\", window = \"day\", dry_run = 1 }]\n",
    );
    assert_eq!(e.key(), "limits.session.budgets[0].dry_run");
    let e = load_err("[limits.conversation]\nrate_dry_run = true\n");
    assert_eq!(e.key(), "limits.conversation.rate_dry_run");
    assert!(e.to_string().contains("no rate"), "{e}");
    assert_eq!(e.line(), Some(2));
    let e = load_err("[limits.ip]\nconcurrency = \"off\"\nconcurrency_dry_run = true\n");
    assert_eq!(e.key(), "limits.ip.concurrency_dry_run");
    assert!(e.to_string().contains("no concurrency cap"), "{e}");
    let e = load_err("[limits.ip]\nrate_dry_run = \"yes\"\n");
    assert_eq!(e.key(), "limits.ip.rate_dry_run");
}

/// The global budget is never configured away silently: without one the config is refused,
/// with an error that names the key and the way to opt out, unless `unbudgeted = true`.
#[test]
fn a_config_without_a_global_budget_is_refused_unless_it_says_so() {
    let e = load_err("[limits.global]\nbudgets = []\n");
    assert_eq!(e.key(), "limits.global.budgets");
    assert_eq!(e.line(), Some(2));
    assert!(
        e.to_string().contains("limits.global.unbudgeted = true"),
        "the error says how to opt out: {e}"
    );
    // Said explicitly: accepted, with a warning, and check-config's output says it too.
    let c = load(
        "[limits.global]\nbudgets = []\nunbudgeted = true\n",
        &no_env,
    )
    .expect("valid");
    assert!(c.policy.global.budgets.is_empty());
    assert!(c
        .warnings()
        .iter()
        .any(|w| w.starts_with("limits.global.unbudgeted")));
    let rendered = c.render_effective();
    assert!(rendered.contains("unbudgeted = true"), "{rendered}");
    assert_eq!(load(&rendered, &no_env).expect("valid"), c, "{rendered}");
    // The defaults keep their global budgets, and say so.
    let d = load("", &no_env).expect("valid");
    assert_eq!(d.policy.global.budgets.len(), 2);
    assert!(d.render_effective().contains("unbudgeted = false"));
    assert!(!d
        .warnings()
        .iter()
        .any(|w| w.starts_with("limits.global.unbudgeted")));
    // A stale opt-out beside a budget is refused, and so is the key in another scope.
    let e = load_err("[limits.global]\nunbudgeted = true\n");
    assert_eq!(e.key(), "limits.global.unbudgeted");
    assert!(e.to_string().contains("2 budget(s)"), "{e}");
    let e = load_err("[limits.session]\nunbudgeted = true\nbudgets = []\n");
    assert_eq!(e.key(), "limits.session.unbudgeted");
    assert!(e.to_string().contains("[limits.global] only"), "{e}");
    // Other scopes may have no budget.
    load("[limits.ip]\nbudgets = []\n", &no_env).expect("valid");
    // A global budget in dry-run is still a budget (it is explicit, and warned of).
    load(
        "[limits.global]\nbudgets = [{ amount = \"5\", window = \"day\", dry_run = true }]\n",
        &no_env,
    )
    .expect("valid");
}

#[test]
fn empty_file_gives_the_spec_defaults() {
    let c = load("", &no_env).expect("an empty file is valid");
    assert_eq!(c.server.listen, "127.0.0.1:8080".parse().expect("addr"));
    assert!(c.server.trusted_proxies.is_empty());
    assert!(c.server.service_tokens.is_empty(), "env unset: dropped");
    assert!(c.server.admin_tokens.is_empty());
    assert!(!c.server.browser_direct);
    assert!(!c.server.dry_run);

    assert_eq!(c.store.kind, StoreKind::Sqlite);
    assert_eq!(c.store.path, PathBuf::from("spendgate.db"));
    assert_eq!(c.store.url.expose(), "redis://127.0.0.1:6379/0");
    assert_eq!(c.store.prefix, "spendgate");
    assert_eq!(c.store.timeout, Duration::from_millis(100));
    assert_eq!(
        c.store.slow_grace,
        Duration::from_millis(SLOW_GRACE_MS_DEFAULT)
    );
    assert_eq!(c.store.lease_ttl, Duration::from_secs(30));

    assert!(c.sessions.keys.is_empty());
    assert_eq!(c.sessions.ttl, Duration::from_secs(86_400));
    assert!(c.sessions.secure_cookie);
    assert_eq!(c.sessions.challenge, ChallengeMode::Off);
    assert_eq!(c.sessions.challenge_bits, 18);
    assert_eq!(c.sessions.verifier_url, None);
    assert_eq!(c.sessions.verifier_secret, None);

    assert_eq!(c.identity.ipv4_prefix, 32);
    assert_eq!(c.identity.ipv6_prefix, 64);
    assert_eq!(c.identity.ipv6_wider, vec![(56, 4), (48, 16)]);

    // Global and run are SPEC §9; the rest are the core's defaults.
    assert_eq!(c.policy, Policy::default());
    let g = &c.policy.global;
    assert_eq!(
        g.rate,
        Some(Rate {
            count: 100,
            period_ms: 1000,
            burst: 20
        })
    );
    assert_eq!(g.concurrency, Some(64));
    assert_eq!(
        g.budgets,
        vec![
            Budget::new(Micros(50_000_000), Window::Day),
            Budget::new(Micros(1_000_000_000), Window::Month)
        ]
    );
    assert_eq!(c.policy.mode, ReservationMode::PerStep);
    assert_eq!(c.policy.run.max_cost, Micros(200_000));
    assert_eq!(c.policy.run.max_input_bytes, 16_384);
    assert_eq!(c.policy.run.min_output_tokens, 64);
    assert_eq!(c.policy.lease_ttl_ms, 30_000);
    assert_eq!(c.policy.session_create_per_ip, Rate::parse("10/hour").ok());
    assert_eq!(
        c.policy.session_create_global,
        Rate::parse("600/minute").ok()
    );

    assert!(c.models.is_empty());
    assert!(c.tools.is_empty());
    assert!(c.upstreams.is_empty());
    assert_eq!(c.alerts.webhook_url, None);
    assert_eq!(c.alerts.thresholds_permille, vec![500, 800, 1000]);

    let vars: Vec<&str> = c.unset_env.iter().map(|u| u.var.as_str()).collect();
    assert_eq!(
        vars,
        [
            "SPENDGATE_SERVICE_TOKEN",
            "SPENDGATE_ADMIN_TOKEN",
            "SPENDGATE_SESSION_KEY"
        ]
    );
    assert!(c
        .warnings()
        .iter()
        .any(|w| w.contains("service API is closed")));
}

#[test]
fn the_spec_example_loads() {
    let c = load(SPEC_EXAMPLE, &env_of(SPEC_ENV)).expect("SPEC §9 example is valid");
    assert_eq!(c.server.service_tokens.len(), 1);
    assert_eq!(
        c.server.service_tokens[0].expose(),
        "svc-token-value-0123456789"
    );
    assert_eq!(
        c.server.service_tokens[0].source(),
        "env:SPENDGATE_SERVICE_TOKEN"
    );
    assert_eq!(c.sessions.keys.len(), 1);
    assert!(c.unset_env.is_empty());
    let m = &c.models["gpt-4o-mini"];
    assert_eq!(m.upstream, "openai");
    assert_eq!(m.tokenizer, Tokenizer::O200kBase);
    assert_eq!(
        m.price,
        ModelPrice {
            input_per_million: Micros(150_000),
            cached_input_per_million: Micros(75_000),
            output_per_million: Micros(600_000),
        }
    );
    assert_eq!(m.upstream_model, None);
    assert_eq!(
        c.tools["web_search"],
        ToolPrice {
            per_call: Micros(10_000),
            per_unit: Micros::ZERO
        }
    );
    let u = &c.upstreams["openai"];
    assert_eq!(u.base_url, "https://api.openai.com/v1");
    assert_eq!(u.api_key.expose(), "sk-openai-value-0123456789");
    assert_eq!(u.timeout, Duration::from_secs(60));
    assert!(u.release_on_error);
    // The example restates the defaults for everything else.
    let defaults = load("", &env_of(SPEC_ENV)).expect("defaults");
    assert_eq!(c.policy, defaults.policy);
    assert_eq!(c.server, defaults.server);
    assert_eq!(c.store, defaults.store);
    assert_eq!(c.sessions, defaults.sessions);
    assert_eq!(c.identity, defaults.identity);
    assert_eq!(c.alerts, defaults.alerts);
}

/// The capacity keys: defaults, values given, and ranges that name the key.
#[test]
fn capacity_keys_have_defaults_and_ranges() {
    let d = load("", &no_env).expect("defaults").server.capacity;
    assert_eq!(d, CapacityConfig::default());
    assert_eq!(d.connections_max, crate::CONNECTIONS_MAX);
    let c = load(
        "[server]\npublic_requests_max = 10\nservice_requests_max = 20\n\
         admin_requests_max = 3\nhealth_requests_max = 4\naddress_requests_max = 5\n\
         address_connections_max = 6\nconnections_max = 100\nconnections_reserved = 50\n\
         body_min_bytes_per_s = 1000\nbody_grace_ms = 500\n",
        &no_env,
    )
    .expect("config")
    .server
    .capacity;
    assert_eq!(
        c,
        CapacityConfig {
            public_requests_max: 10,
            service_requests_max: 20,
            admin_requests_max: 3,
            health_requests_max: 4,
            address_requests_max: 5,
            address_connections_max: 6,
            connections_max: 100,
            connections_reserved: 50,
            body_min_bytes_per_s: 1000,
            body_grace: Duration::from_millis(500),
        }
    );
    // Not given, the reserve follows a smaller connection bound.
    let c = load("[server]\nconnections_max = 100\n", &no_env).expect("config");
    assert_eq!(c.server.capacity.connections_reserved, 6);
    assert_eq!(c.server.capacity.address_connections_max, 100);
    for (text, key) in [
        ("public_requests_max = 0", "server.public_requests_max"),
        (
            "service_requests_max = 100000",
            "server.service_requests_max",
        ),
        ("address_requests_max = 0", "server.address_requests_max"),
        ("connections_max = 100000", "server.connections_max"),
        (
            "connections_max = 100\nconnections_reserved = 51",
            "server.connections_reserved",
        ),
        (
            "connections_max = 100\naddress_connections_max = 101",
            "server.address_connections_max",
        ),
        // A slower body rate would let a body hold its slot for hours.
        ("body_min_bytes_per_s = 10", "server.body_min_bytes_per_s"),
        // A longer grace would outlast the decision API's request timeout.
        ("body_grace_ms = 15000", "server.body_grace_ms"),
    ] {
        let e = load_err(&format!("[server]\n{text}\n"));
        assert_eq!(e.key(), key, "{text}: {e}");
    }
}

#[test]
fn unknown_keys_are_errors_that_name_them() {
    let e = load_err("foo = 1\n");
    assert_eq!(e.key(), "foo");
    assert!(
        e.to_string()
            .contains("unknown key \"foo\" at the top level"),
        "{e}"
    );
    assert_eq!(e.line(), Some(1));

    let e = load_err("[server]\nlisten = \"127.0.0.1:1\"\nfoo = true\n");
    assert_eq!(e.key(), "server.foo");
    assert!(
        e.to_string()
            .starts_with("line 3: unknown key \"foo\" in [server]"),
        "{e}"
    );
    assert!(
        e.to_string().contains("\"listen\""),
        "lists known keys: {e}"
    );

    let e = load_err("[limits.global]\nrate = \"1/second\"\ndry_rn = true\n");
    assert!(
        e.to_string()
            .contains("unknown key \"dry_rn\" in [limits.global]"),
        "{e}"
    );

    let e = load_err("[limits.everyone]\nrate = \"1/second\"\n");
    assert!(
        e.to_string()
            .contains("unknown key \"everyone\" in [limits]"),
        "{e}"
    );

    let e = load_err(
        "[models.\"gpt-4.1\"]\nupstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\nprice = \"1\"\n",
    );
    assert_eq!(e.key(), "models.\"gpt-4.1\".price");
    assert!(
        e.to_string()
            .contains("unknown key \"price\" in [models.\"gpt-4.1\"]"),
        "{e}"
    );

    let e = load_err("[limits.ip]\nbudgets = [{ amount = \"1\", windw = \"day\" }]\n");
    assert!(
        e.to_string()
            .contains("unknown key \"windw\" in [limits.ip.budgets[0]]"),
        "{e}"
    );
}

#[test]
fn bad_values_name_their_key_path() {
    let e = load_err(
        "[limits.global]\nbudgets = [{ amount = \"50\", window = \"day\" }, { amount = \"1.0000001\", window = \"month\" }]\n",
    );
    assert_eq!(e.key(), "limits.global.budgets[1].amount");
    assert!(
        e.message().starts_with(
            "limits.global.budgets[1].amount: amount \"1.0000001\" has more than 6 decimal places"
        ),
        "{e}"
    );
    assert_eq!(e.line(), Some(2));

    let e = load_err("[limits.ip]\nrate = \"10/week\"\n");
    assert_eq!(e.key(), "limits.ip.rate");
    assert!(e.to_string().contains("\"10/week\""), "{e}");

    let e = load_err("[limits.session]\nbudgets = [{ amount = \"1\", window = \"week\" }]\n");
    assert_eq!(e.key(), "limits.session.budgets[0].window");
    assert!(
        e.to_string()
            .contains("not one of hour, day, month, lifetime"),
        "{e}"
    );

    let e = load_err("[limits.session]\nbudgets = [{ amount = 0.1, window = \"day\" }]\n");
    assert_eq!(e.key(), "limits.session.budgets[0].amount");
    assert!(e.to_string().contains("float"), "{e}");

    let e = load_err("[limits.session]\nbudgets = [{ amount = \"1\" }]\n");
    assert_eq!(e.key(), "limits.session.budgets[0].window");
    assert!(e.to_string().contains("required key is missing"), "{e}");

    let e = load_err("[run]\nmax_cost = \"-1\"\n");
    assert_eq!(e.key(), "run.max_cost");

    let e = load_err("[store]\ntimeout_ms = \"fast\"\n");
    assert_eq!(e.key(), "store.timeout_ms");
    assert!(
        e.to_string()
            .contains("expected an integer in 1..=5000, found the string \"fast\""),
        "{e}"
    );

    let e = load_err("[store]\ntimeout_ms = 0\n");
    assert_eq!(e.key(), "store.timeout_ms");
    let e = load_err("[store]\nlease_ttl_s = 3601\n");
    assert_eq!(e.key(), "store.lease_ttl_s");
    let e = load_err("[store]\nkind = \"mysql\"\n");
    assert!(
        e.to_string()
            .contains("store.kind: \"mysql\" is not one of memory, sqlite, redis"),
        "{e}"
    );
    let e = load_err("[store]\nprefix = \"a{b}\"\n");
    assert_eq!(e.key(), "store.prefix");
    let e = load_err("[server]\nlisten = \"localhost\"\n");
    assert_eq!(e.key(), "server.listen");
    let e = load_err("[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"nope\"]\n");
    assert_eq!(e.key(), "server.trusted_proxies[1]");
    let e = load_err("[identity]\nipv4_prefix = 33\n");
    assert_eq!(e.key(), "identity.ipv4_prefix");
    let e = load_err("[identity]\nipv6_prefix = 0\n");
    assert_eq!(e.key(), "identity.ipv6_prefix");
    let e = load_err("[identity]\nipv6_wider_prefixes = [48, 56]\n");
    assert_eq!(e.key(), "identity.ipv6_wider_prefixes[1]");
    // The client's prefix and three wider ones are what the ledger limits a request by.
    let e = load_err("[identity]\nipv6_wider_prefixes = [60, 56, 52, 48]\n");
    assert_eq!(e.key(), "identity.ipv6_wider_prefixes");
    let e = load_err("[sessions]\nchallenge_bits = 33\n");
    assert_eq!(e.key(), "sessions.challenge_bits");
    let e = load_err("[sessions]\nchallenge = \"sometimes\"\n");
    assert_eq!(e.key(), "sessions.challenge");
    let e = load_err("[run]\nmin_output_tokens = 2000\n");
    assert_eq!(e.key(), "run.min_output_tokens");
    let e = load_err("[run]\nmax_model_rounds = 0\n");
    assert_eq!(e.key(), "run.max_model_rounds");
    let e = load_err("[run]\nmode = \"yolo\"\n");
    assert_eq!(e.key(), "run.mode");
    let e = load_err("[alerts]\nthresholds = [0.8, 0.5]\n");
    assert_eq!(e.key(), "alerts.thresholds[1]");
    let e = load_err("[alerts]\nthresholds = [0]\n");
    assert_eq!(e.key(), "alerts.thresholds[0]");
    let e = load_err("[alerts]\nthresholds = [10.5]\n");
    assert_eq!(e.key(), "alerts.thresholds[0]");
    let e = load_err("[alerts]\nwebhook_url = \"ftp://x\"\n");
    assert_eq!(e.key(), "alerts.webhook_url");
    let e = load_err("[limits.global]\nburst = 0\n");
    assert_eq!(e.key(), "limits.global.burst");
    let e = load_err("[limits.conversation]\nburst = 5\n");
    assert!(e.to_string().contains("has no rate"), "{e}");
    let e = load_err("[limits.ip]\nconcurrency = 0\n");
    assert_eq!(e.key(), "limits.ip.concurrency");
    let e = load_err("[limits.ip]\nconcurrency = \"many\"\n");
    assert_eq!(e.key(), "limits.ip.concurrency");
    let e = load_err(
        "[limits.ip]\nbudgets = [{ amount = \"1\", window = \"day\" }, { amount = \"2\", window = \"day\" }]\n",
    );
    assert_eq!(e.key(), "limits.ip.budgets[1].window");
    let e = load_err("[server]\nlisten = 8080\n");
    assert_eq!(e.key(), "server.listen");
    let e = load_err("server = 5\n");
    assert_eq!(e.key(), "server");
    assert!(e.to_string().contains("expected a table"), "{e}");

    let e = load_err("[server\nlisten = 1\n");
    assert_eq!(e.key(), "");
    assert!(e.to_string().starts_with("line 1, column"), "{e}");
}

#[test]
fn limits_keep_defaults_per_key_and_can_be_switched_off() {
    let c = load(
        "[limits.ip]\nrate = \"5/minute\"\n\n[limits.session]\nrate = \"off\"\nconcurrency = \"off\"\nbudgets = []\n\n[limits.global]\nburst = 7\n",
        &no_env,
    )
    .expect("valid");
    let d = Policy::default();
    assert_eq!(
        c.policy.ip.rate,
        Some(Rate {
            count: 5,
            period_ms: 60_000,
            burst: 5
        })
    );
    assert_eq!(c.policy.ip.budgets, d.ip.budgets);
    assert_eq!(c.policy.ip.concurrency, d.ip.concurrency);
    assert_eq!(c.policy.session.rate, None);
    assert_eq!(c.policy.session.concurrency, None);
    assert!(c.policy.session.budgets.is_empty());
    assert_eq!(
        c.policy.global.rate.map(|r| (r.count, r.burst)),
        Some((100, 7))
    );
}

#[test]
fn a_secret_of_the_wrong_type_is_not_echoed() {
    for (toml, key) in [
        (
            "[server]\nadmin_tokens = \"SUPERSECRETADMINTOKEN123456\"\n",
            "server.admin_tokens",
        ),
        (
            "[server]\nservice_tokens = \"SUPERSECRETADMINTOKEN123456\"\n",
            "server.service_tokens",
        ),
        (
            "[sessions]\nkeys = \"SUPERSECRETADMINTOKEN123456\"\n",
            "sessions.keys",
        ),
        (
            "[store]\nurl = [\"redis://:SUPERSECRETADMINTOKEN123456@h\"]\n",
            "store.url",
        ),
    ] {
        let e = load_err(toml);
        assert_eq!(e.key(), key, "{e}");
        assert!(!e.to_string().contains("SUPERSECRET"), "{e}");
        assert!(
            e.to_string().contains("expected"),
            "still says what is wrong: {e}"
        );
    }
    // Other values are still shown.
    let e = load_err("[run]\nmode = 3\n");
    assert!(
        e.to_string().contains("3") || e.to_string().contains("integer"),
        "{e}"
    );
}

#[test]
fn a_rate_without_burst_keeps_the_scope_default_burst() {
    let d = Policy::default();
    let burst_of = |p: &ScopePolicy| p.rate.map(|r| (r.count, r.period_ms, r.burst));
    let c = load(
        "[limits.session]\nrate = \"600/hour\"\n\n[limits.ip]\nrate = \"2/minute\"\n\n\
         [limits.global]\nrate = \"5000/second\"\n\n[limits.conversation]\nrate = \"10/minute\"\n",
        &no_env,
    )
    .expect("valid");
    let session_default = d.session.rate.map(|r| r.burst).unwrap_or(0);
    assert_eq!(session_default, 5);
    // The scope's default burst, not the rate's count: one guest cannot start 600 at once.
    assert_eq!(burst_of(&c.policy.session), Some((600, 3_600_000, 5)));
    // At most the new count.
    assert_eq!(burst_of(&c.policy.ip), Some((2, 60_000, 2)));
    assert_eq!(burst_of(&c.policy.global), Some((5000, 1000, 20)));
    // No default rate to take a burst from: the rate's own.
    assert_eq!(burst_of(&c.policy.conversation), Some((10, 60_000, 10)));
    // An explicit burst still wins, above or below the default.
    let c = load(
        "[limits.session]\nrate = \"600/hour\"\nburst = 50\n",
        &no_env,
    )
    .expect("valid");
    assert_eq!(burst_of(&c.policy.session), Some((600, 3_600_000, 50)));
    // Session creation has no burst key; its burst stays its count, as in its defaults.
    let c = load("[sessions]\ncreate_rate_per_ip = \"20/hour\"\n", &no_env).expect("valid");
    assert_eq!(c.policy.session_create_per_ip.map(|r| r.burst), Some(20));
    assert_eq!(
        d.session_create_per_ip.map(|r| (r.count, r.burst)),
        Some((10, 10))
    );
}

#[test]
fn secrets_resolve_from_env_and_never_show() {
    let text = r#"
[server]
service_tokens = ["env:SVC", "env:MISSING", "literal-service-token"]
admin_tokens = ["env:ADM"]

[store]
kind = "redis"
url = "redis://user:hunter2@redis.internal:6379/0"

[sessions]
keys = ["env:KEY_NEW", "env:KEY_OLD"]
verifier_url = "https://challenges.example.com/siteverify"
verifier_secret = "env:VERIFIER"

[upstreams.local]
base_url = "http://127.0.0.1:11434/v1/"

[upstreams.openai]
base_url = "https://api.openai.com/v1"
api_key = "env:OPENAI_API_KEY"
"#;
    const ENV: &[(&str, &str)] = &[
        ("SVC", "svc-secret-aaaa"),
        ("ADM", "adm-secret-bbbb\n"),
        ("KEY_NEW", "key-new-cccc-cccc-cccc"),
        ("KEY_OLD", "key-old-dddd-dddd-dddd"),
        ("VERIFIER", "verifier-eeee"),
        ("MISSING", "   "),
    ];
    let c = load(text, &env_of(ENV)).expect("valid");
    let svc: Vec<&str> = c.server.service_tokens.iter().map(Secret::expose).collect();
    assert_eq!(svc, ["svc-secret-aaaa", "literal-service-token"]);
    assert_eq!(c.server.service_tokens[1].source(), "literal");
    assert_eq!(
        c.server.admin_tokens[0].expose(),
        "adm-secret-bbbb",
        "trimmed"
    );
    assert!(c.server.admin_tokens[0].matches(b"adm-secret-bbbb"));
    assert!(!c.server.admin_tokens[0].matches(b"adm-secret-bbbc"));
    assert!(!Secret::literal("").matches(b""));
    assert_eq!(c.sessions.keys[0].expose(), "key-new-cccc-cccc-cccc");
    assert_eq!(
        c.sessions.verifier_secret.as_ref().map(Secret::expose),
        Some("verifier-eeee")
    );
    assert_eq!(c.upstreams["local"].base_url, "http://127.0.0.1:11434/v1");
    assert!(c.upstreams["local"].api_key.is_empty());
    let oa = &c.upstreams["openai"].api_key;
    assert!(oa.is_empty(), "unset api_key is an empty secret");
    assert_eq!(oa.env_var(), Some("OPENAI_API_KEY"));
    assert_eq!(
        c.unset_env,
        vec![
            UnsetEnv {
                key: "server.service_tokens".to_string(),
                var: "MISSING".to_string()
            },
            UnsetEnv {
                key: "upstreams.openai.api_key".to_string(),
                var: "OPENAI_API_KEY".to_string()
            },
        ]
    );

    let rendered = c.render_effective();
    let debug = format!("{c:?}");
    for secret in [
        "svc-secret-aaaa",
        "adm-secret",
        "key-new",
        "key-old",
        "verifier-eeee",
        "literal-service-token",
        "hunter2",
    ] {
        assert!(
            !rendered.contains(secret),
            "{secret} leaked into:\n{rendered}"
        );
        assert!(!debug.contains(secret), "{secret} leaked into Debug");
    }
    assert!(rendered.contains("\"env:SVC\",  # set"), "{rendered}");
    assert!(rendered.contains("\"env:MISSING\",  # unset"), "{rendered}");
    assert!(rendered.contains("\"***\",  # literal"), "{rendered}");
    assert!(
        rendered.contains("api_key = \"env:OPENAI_API_KEY\"  # unset"),
        "{rendered}"
    );
    assert!(
        rendered.contains("redis://***@redis.internal:6379/0"),
        "{rendered}"
    );
    assert_eq!(format!("{}", c.sessions.keys[0]), "***");
    assert_eq!(format!("{:?}", c.sessions.keys[0]), "***");

    // A copied check-config output is refused rather than turned into a "***" token.
    let e = load(&rendered, &env_of(ENV)).expect_err("a mask is not a secret");
    assert_eq!(e.key(), "server.service_tokens[1]");
    assert!(e.to_string().contains("mask"), "{e}");
}

#[test]
fn secret_lists_refuse_empty_and_shared_tokens() {
    let e = load_err("[server]\nservice_tokens = [\"\"]\n");
    assert_eq!(e.key(), "server.service_tokens[0]");
    let e = load_err("[server]\nservice_tokens = [\"env:\"]\n");
    assert_eq!(e.key(), "server.service_tokens[0]");
    let e =
        load_err("[server]\nservice_tokens = [\"same-token\"]\nadmin_tokens = [\"same-token\"]\n");
    assert_eq!(e.key(), "server.admin_tokens[0]");
    let e = load_err("[store]\nkind = \"redis\"\nurl = \"env:REDIS_URL\"\n");
    assert_eq!(e.key(), "store.url");
    let e = load_err("[store]\nkind = \"redis\"\nurl = \"http://x\"\n");
    assert!(
        !e.to_string().contains("http://x"),
        "a URL may hold a password: {e}"
    );
    let e = load_err("[sessions]\nkeys = [\"short\"]\n");
    assert_eq!(e.key(), "sessions.keys[0]");
    assert!(!e.to_string().contains("short"), "{e}");
    let e = load_err("[sessions]\nverifier_url = \"https://v.example/siteverify\"\n");
    assert_eq!(e.key(), "sessions.verifier_secret");
}

#[test]
fn models_need_an_upstream_and_prices() {
    let model = |body: &str| format!("[models.\"m.1\"]\n{body}\n");
    let e = load_err(&model(
        "upstream = \"openai\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"",
    ));
    assert_eq!(e.key(), "models.\"m.1\".upstream");
    assert!(
        e.to_string()
            .contains("no upstream \"openai\" is configured"),
        "{e}"
    );
    assert_eq!(e.line(), Some(2));

    let e = load_err(&model(
        "input_per_million = \"1\"\noutput_per_million = \"1\"",
    ));
    assert_eq!(e.key(), "models.\"m.1\".upstream");

    let e = load_err(&model("upstream = \"mock\"\ninput_per_million = \"1\""));
    assert_eq!(e.key(), "models.\"m.1\".output_per_million");
    assert!(e.to_string().contains("without a price"), "{e}");

    let e = load_err(&model(
        "upstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\ncached_input_per_million = \"2\"",
    ));
    assert_eq!(e.key(), "models.\"m.1\".cached_input_per_million");

    let e = load_err(&model(
        "upstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\ntokenizer = \"gpt2\"",
    ));
    assert_eq!(e.key(), "models.\"m.1\".tokenizer");

    let c = load(
        &model("upstream = \"mock\"\ninput_per_million = \"1.5\"\noutput_per_million = \"2\"\nupstream_model = \"real-name\""),
        &no_env,
    )
    .expect("the built-in mock needs no [upstreams] table");
    let m = &c.models["m.1"];
    assert_eq!(
        m.price.cached_input_per_million,
        Micros(1_500_000),
        "defaults to input"
    );
    assert_eq!(m.tokenizer, Tokenizer::Bytes, "the conservative default");
    assert_eq!(m.upstream_model.as_deref(), Some("real-name"));
    assert_eq!(m.output_bound_field, OutputBoundField::MaxTokens);

    let e = load_err(&model(
        "upstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\noutput_bound_field = \"max_output\"",
    ));
    assert_eq!(e.key(), "models.\"m.1\".output_bound_field");
    let c = load(
        &model("upstream = \"mock\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\noutput_bound_field = \"max_completion_tokens\""),
        &no_env,
    )
    .expect("valid");
    assert_eq!(
        c.models["m.1"].output_bound_field,
        OutputBoundField::MaxCompletionTokens
    );

    let e = load_err("[upstreams.mock]\nbase_url = \"http://127.0.0.1:1\"\n");
    assert_eq!(e.key(), "upstreams.mock");
    let e = load_err("[upstreams.x]\napi_key = \"k\"\n");
    assert_eq!(e.key(), "upstreams.x.base_url");
    let e = load_err("[upstreams.x]\nbase_url = \"https://x\"\ntimeout_s = 0\n");
    assert_eq!(e.key(), "upstreams.x.timeout_s");

    let e = load_err("[tools.fetch]\n");
    assert_eq!(e.key(), "tools.fetch");
    let c = load("[tools.fetch]\nper_unit = \"0.001\"\n", &no_env).expect("valid");
    assert_eq!(
        c.tools["fetch"],
        ToolPrice {
            per_call: Micros::ZERO,
            per_unit: Micros(1_000)
        }
    );
}

#[test]
fn identity_wider_prefixes() {
    let c = load("[identity]\nipv6_prefix = 56\n", &no_env).expect("valid");
    assert_eq!(
        c.identity.ipv6_wider,
        vec![(48, 4)],
        "defaults narrower than the base drop"
    );
    let c = load("[identity]\nipv6_wider_prefixes = [60, 52, 44]\n", &no_env).expect("valid");
    assert_eq!(c.identity.ipv6_wider, vec![(60, 4), (52, 16), (44, 64)]);
    let c = load("[identity]\nipv6_wider_prefixes = []\n", &no_env).expect("valid");
    assert!(c.identity.ipv6_wider.is_empty());
}

#[test]
fn render_effective_round_trips() {
    let env = env_of(SPEC_ENV);
    let mut text = SPEC_EXAMPLE.to_string();
    text.push_str(
        r#"
[limits.ip]
rate = "7/minute"
burst = 3
concurrency = "off"
budgets = [{ amount = "0.000001", window = "hour" }, { amount = "9007199254.740991", window = "lifetime" }]

[limits.conversation]
rate = "off"

[models."llama-3.1-8b"]
upstream = "mock"
input_per_million = "0"
output_per_million = 3
upstream_model = "meta/llama-3.1"
"#,
    );
    let text = text
        .replace(
            "thresholds = [0.5, 0.8, 1.0]",
            "thresholds = [0.333, 0.9, 2.5]",
        )
        .replace(
            "trusted_proxies = []",
            "trusted_proxies = [\"10.0.0.0/8\", \"192.0.2.7\", \"2001:db8::/32\"]",
        )
        .replace("mode = \"per_step\"", "mode = \"whole_run\"")
        .replace("kind = \"sqlite\"", "kind = \"memory\"")
        .replace(
            "ipv6_prefix = 64",
            "ipv6_prefix = 64\nipv6_wider_prefixes = [48]",
        );
    let c = load(&text, &env).expect("valid");
    assert_eq!(c.alerts.thresholds_permille, vec![333, 900, 2500]);
    let rendered = c.render_effective();
    let again = load(&rendered, &env).unwrap_or_else(|e| panic!("{e}\n{rendered}"));
    assert_eq!(again, c, "{rendered}");
    // And with every variable unset (tokens dropped, api_key empty).
    let bare = load(&text, &no_env).expect("valid");
    let rendered = bare.render_effective();
    assert_eq!(load(&rendered, &no_env).expect("valid"), bare, "{rendered}");
    // The defaults, too.
    let d = load("", &no_env).expect("valid");
    assert_eq!(load(&d.render_effective(), &no_env).expect("valid"), d);
}

#[test]
fn load_file_names_the_file() {
    let dir = std::env::temp_dir().join(format!("spendgate-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("spendgate.toml");
    std::fs::write(&path, "[run]\nmax_seconds = 0\n").expect("write");
    let e = load_file(&path, &no_env).expect_err("invalid");
    assert_eq!(e.origin(), Some(path.as_path()));
    assert!(
        e.to_string()
            .starts_with(&format!("{}:2: run.max_seconds:", path.display())),
        "{e}"
    );
    std::fs::write(&path, "[run]\nmax_seconds = 10\n").expect("write");
    let c = load_file(&path, &no_env).expect("valid");
    assert_eq!(c.policy.run.max_seconds, 10);
    let missing = load_file(&dir.join("absent.toml"), &no_env).expect_err("missing");
    assert!(missing.to_string().contains("cannot read"), "{missing}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn alert_scopes() {
    let c = load("[alerts]\nscopes = [\"global\", \"ip\"]\n", &no_env).expect("valid");
    assert_eq!(c.alerts.scopes, vec![ScopeKind::Global, ScopeKind::Ip]);
    let d = load("", &no_env).expect("valid");
    assert_eq!(d.alerts.scopes, vec![ScopeKind::Global]);
    let e = load_err("[alerts]\nscopes = [\"ip\", \"run\"]\n");
    assert_eq!(e.key, "alerts.scopes[1]", "{e}");
    let e = load_err("[alerts]\nscopes = [\"ip\", \"ip\"]\n");
    assert_eq!(e.key, "alerts.scopes[1]", "{e}");
}

/// Values of the wrong type: the key, its line, what the key takes (from the schema) and what
/// the file has there (from its spans), never serde's wording.
#[test]
fn wrong_types_say_what_is_expected_and_what_was_found() {
    for (text, expected) in [
        (
            "[server]\nlisten = 8080\n",
            "line 2: server.listen: expected an address and port such as \"127.0.0.1:8080\" \
             or \"[::]:8080\" (a string), found the integer 8080",
        ),
        (
            "[store]\n\ntimeout_ms = -4\n",
            "line 3: store.timeout_ms: expected an integer in 1..=5000, found the integer -4",
        ),
        (
            "[run]\nmode = 3\n",
            "line 2: run.mode: expected one of \"per_step\", \"whole_run\", found the integer 3",
        ),
        (
            "[limits.ip]\nconcurrency = \"many\"\n",
            "line 2: limits.ip.concurrency: expected an integer in 1..=1000000 or \"off\", \
             found the string \"many\"",
        ),
        (
            "[limits.ip]\ndry_run = \"yes\"\n",
            "line 2: limits.ip.dry_run: expected true or false, found the string \"yes\"",
        ),
        (
            "[alerts]\nthresholds = [0.5,\n  \"x\"]\n",
            "line 3: alerts.thresholds[1]: expected a number, found the string \"x\"",
        ),
        (
            "[upstreams.x]\nbase_url = \"https://x\"\ntimeout_s = 1979-05-27T07:32:00Z\n",
            "line 3: upstreams.x.timeout_s: expected an integer in 1..=3600, found a datetime",
        ),
        (
            "[limits.session]\nbudgets = [{ amount = 0.1, window = \"day\" }]\n",
            "line 2: limits.session.budgets[0].amount: expected an amount as a decimal string \
             such as \"0.15\", found the float 0.1; a float is not exact: write the amount as a \
             string such as \"0.1\"",
        ),
        (
            "[server]\nadmin_tokens = \"SUPERSECRETADMINTOKEN123456\"\n",
            "line 2: server.admin_tokens: expected an array of at most 64, each a token or \
             \"env:NAME\" (a string), found a string",
        ),
    ] {
        assert_eq!(load_err(text).to_string(), expected, "{text}");
    }
    // A long string is shortened.
    let e = load_err(&format!("[run]\nmax_seconds = \"{}\"\n", "x".repeat(500)));
    assert!(e.to_string().len() < 200, "{e}");
}

#[test]
fn unknown_keys_suggest_the_nearest_known_key() {
    for (text, key, hint) in [
        ("[sesions]\nkeys = []\n", "sesions", Some("sessions")),
        (
            "[server]\nlisten_addr = \"x\"\n",
            "server.listen_addr",
            Some("listen"),
        ),
        (
            "[limits.session]\nbugdets = []\n",
            "limits.session.bugdets",
            Some("budgets"),
        ),
        (
            "[upstreams.a]\nbase_url = \"https://a\"\napi-key = \"k\"\n",
            "upstreams.a.api-key",
            Some("api_key"),
        ),
        ("[server]\nfoo = 1\n", "server.foo", None),
    ] {
        let e = load_err(text);
        assert_eq!(e.key(), key, "{e}");
        match hint {
            Some(h) => assert!(
                e.to_string().contains(&format!("(did you mean \"{h}\"?)")),
                "{e}"
            ),
            None => assert!(!e.to_string().contains("did you mean"), "{e}"),
        }
    }
}

#[test]
fn history_keys_have_defaults_ranges_and_a_masked_postgres_url() {
    let c = load("", &no_env).expect("valid");
    assert_eq!(c.history.url, None);
    assert_eq!(c.history.retention, Duration::from_secs(90 * 86_400));
    assert_eq!(
        c.history.stream_max_len,
        crate::HISTORY_STREAM_MAX_LEN_DEFAULT
    );
    assert_eq!(c.history.drain_lag_alert, Duration::from_secs(60));
    assert_eq!(c.history.rows_max, crate::HISTORY_ROWS_MAX_DEFAULT);

    const URL: &str = "postgres://spend:pgsecret42@db.example.com:5432/history";
    let text = format!("[history]\nurl = \"{URL}\"\nretention_days = 7\nstream_max_len = 5000\n");
    let c = load(&text, &no_env).expect("valid");
    assert_eq!(c.history.url.as_ref().map(Secret::expose), Some(URL));
    assert_eq!(c.history.retention, Duration::from_secs(7 * 86_400));
    assert_eq!(c.history.stream_max_len, 5000);
    let rendered = c.render_effective();
    assert!(!rendered.contains("pgsecret42"), "{rendered}");
    assert_eq!(
        load(&rendered.replace("***", "x"), &no_env)
            .map(|c| c.history.stream_max_len)
            .ok(),
        Some(5000)
    );

    let e = load_err("[history]\nurl = \"mysql://u:pgsecret42@h/db\"\n");
    assert_eq!(e.key(), "history.url");
    assert!(!e.to_string().contains("pgsecret42"), "{e}");
    assert_eq!(
        load_err("[history]\nstream_max_len = 0\n").key(),
        "history.stream_max_len"
    );
    assert_eq!(
        load_err("[history]\nretention_days = 0\n").key(),
        "history.retention_days"
    );
    let e = load("[history]\nurl = \"env:PG\"\n", &no_env).expect_err("unset");
    assert_eq!(e.key(), "history.url");
}

#[test]
fn metrics_listen_and_burn_windows() {
    let c = load("", &no_env).expect("valid");
    assert_eq!(c.server.metrics_listen, None, "off by default");
    assert_eq!(
        (c.alerts.burn_short.as_secs(), c.alerts.burn_long.as_secs()),
        (300, 3600)
    );
    let c = load(
        "[server]\nmetrics_listen = \"127.0.0.1:9090\"\n[alerts]\nburn_short_s = 5\nburn_long_s = 30\n",
        &no_env,
    )
    .expect("valid");
    assert_eq!(
        c.server.metrics_listen,
        Some("127.0.0.1:9090".parse().expect("addr"))
    );
    assert_eq!(
        (c.alerts.burn_short.as_secs(), c.alerts.burn_long.as_secs()),
        (5, 30)
    );
    let rendered = c.render_effective();
    assert!(
        rendered.contains("metrics_listen = \"127.0.0.1:9090\""),
        "{rendered}"
    );
    assert!(rendered.contains("burn_long_s = 30"), "{rendered}");
    let e = load_err("[server]\nmetrics_listen = \"9090\"\n");
    assert_eq!(e.key(), "server.metrics_listen");
    let e =
        load_err("[server]\nlisten = \"127.0.0.1:9090\"\nmetrics_listen = \"127.0.0.1:9090\"\n");
    assert_eq!(e.key(), "server.metrics_listen");
    let e = load_err("[alerts]\nburn_short_s = 600\nburn_long_s = 300\n");
    assert_eq!(e.key(), "alerts.burn_long_s");
    let e = load_err("[alerts]\nburn_short_s = 0\n");
    assert_eq!(e.key(), "alerts.burn_short_s");
}
