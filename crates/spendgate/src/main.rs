//! The `spendgate` binary: the command line, and the wiring of the crates that do the work
//! (`spendgate-config`, `spendgate-http`, `spendgate-proxy`). With the default feature `demo`
//! it also carries `spendgate demo` and `spendgate mock-upstream` (the mock upstream
//! library); `--no-default-features` builds the gateway alone.

#![warn(clippy::too_many_lines)]

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use spendgate_config::{self as config, Config};
use spendgate_ops::history::GroupBy;
use std::path::PathBuf;

#[cfg(feature = "demo")]
mod demo;

#[derive(Parser)]
#[command(
    name = "spendgate",
    version,
    about = "Keeps a public LLM service from spending more than its owner allows"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ConfigDoc {
    /// An annotated config file that `check-config` accepts.
    Example,
    /// The config reference, in Markdown.
    Reference,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the gateway with a config file (defaults apply to every key it omits).
    Serve {
        #[arg(long, short, env = "SPENDGATE_CONFIG")]
        config: Option<PathBuf>,
        /// Override server.listen.
        #[arg(long)]
        listen: Option<String>,
    },
    /// Validate a config file and print the effective config (secrets masked).
    CheckConfig {
        #[arg(long, short, env = "SPENDGATE_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Print the annotated example config (every key, its default and what it does; the same
    /// text as docs/spendgate.example.toml) or the config reference (docs/configuration.md).
    Config {
        #[arg(value_enum)]
        what: ConfigDoc,
    },
    /// Run a demo with no config: the gateway, the built-in mock upstream and a demo chat
    /// page at /demo/, on the embedded sqlite store.
    #[cfg(feature = "demo")]
    Demo {
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// The sqlite ledger file (default: a temporary file removed at exit).
        #[arg(long)]
        db: Option<PathBuf>,
    },
    /// Run the OpenAI-compatible mock upstream.
    #[cfg(feature = "demo")]
    MockUpstream {
        #[arg(long, default_value = "127.0.0.1:8090")]
        listen: String,
        #[arg(long, default_value_t = 0)]
        latency_ms: u64,
        #[arg(long, default_value_t = 0)]
        tokens_per_second: u64,
    },
    /// Where the money went. With `--since`, `--until`, `--by` or `--format`: the usage
    /// history of a period, grouped, read from the store's history (`--config`) or a running
    /// gateway's admin API (`--url`). Without them: the current windows' counters, by scope,
    /// from the admin API.
    Report(ReportArgs),
    /// Percentiles of every run bound and of each scope's daily spend and rate, with
    /// suggested values and the share of runs (or scopes) each would have refused. With
    /// `--since`/`--until`: over the usage history (`--config` or `--url`); without: sampled
    /// live from a running gateway's recent reservations.
    Tune(TuneArgs),
    /// Store maintenance.
    Store {
        #[command(subcommand)]
        action: StoreCmd,
    },
}

#[derive(clap::Args)]
struct ReportArgs {
    /// A running gateway (default http://127.0.0.1:8080 when no `--config` is given).
    #[arg(long)]
    url: Option<String>,
    #[arg(long, env = "SPENDGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Read the history from this config's store (the sqlite file; PostgreSQL).
    #[arg(long, short, env = "SPENDGATE_CONFIG")]
    config: Option<PathBuf>,
    /// Start of the period: yesterday, today, 7d, 12h, 30m, 2026-12-03, RFC 3339, unix ms
    /// (default: 24h).
    #[arg(long)]
    since: Option<String>,
    /// End of the period, excluded (default: now).
    #[arg(long)]
    until: Option<String>,
    /// day, hour, minute, scope-kind, model, tool, session, address, conversation, state
    /// (default: day).
    #[arg(long)]
    by: Option<String>,
    /// table, csv or json (default: table).
    #[arg(long)]
    format: Option<String>,
    /// The current counters' scope kind: global, ip, session, conversation, run.
    #[arg(long)]
    kind: Option<String>,
    /// Rows kept (ranked groups; the current counters default to 50).
    #[arg(long)]
    top: Option<usize>,
}

#[derive(clap::Args)]
struct TuneArgs {
    #[arg(long)]
    url: Option<String>,
    #[arg(long, env = "SPENDGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// The config in use (its values are shown beside the suggestions), and where the
    /// history is read from when no `--url` is given.
    #[arg(long, short, env = "SPENDGATE_CONFIG")]
    config: Option<PathBuf>,
    /// Start of the period (as `report --since`; default: 7d when `--until` is given).
    #[arg(long)]
    since: Option<String>,
    /// End of the period, excluded (default: now).
    #[arg(long)]
    until: Option<String>,
    /// Sample live for this long (polling every 20 s; the gateway keeps an ended run's
    /// reservations for a minute), at most a day; 0: one look.
    #[arg(long, default_value_t = 0)]
    watch_seconds: u64,
}

#[derive(Subcommand)]
enum StoreCmd {
    /// Create the Redis ledger of a new deployment and print its id to pin in the config
    /// (`[store] ledger_id`); with that pin, check that the prefix holds it (a no-op, safe to
    /// run on every deploy). Refuses where the pinned ledger is lost or another is found.
    /// Replicas never create one themselves: a Redis that came back empty would look new.
    Init {
        #[arg(long, short, env = "SPENDGATE_CONFIG")]
        config: Option<PathBuf>,
        /// Start a new ledger, with new budgets, where the pinned one is lost (or over another
        /// ledger, whose data is kept). Prints a new id: replicas pinned to the old one keep
        /// refusing until their config pins it.
        #[arg(long)]
        new_ledger: bool,
    },
    /// Reopen the pinned Redis ledger after a rollback (Redis reloaded an older snapshot, or a
    /// lagging replica took over), on what Redis holds now. Never reopens an emptied prefix.
    AcceptReset {
        #[arg(long, short, env = "SPENDGATE_CONFIG")]
        config: Option<PathBuf>,
        /// Consent to forget the spend recorded after the state Redis holds now; without it
        /// the command only says what it found.
        #[arg(long)]
        accept_rollback: bool,
    },
}

fn env_lookup(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn load_config(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    match path {
        Some(p) => {
            // (the error names the file and line itself)
            config::load_file(p, &env_lookup).map_err(|e| anyhow::anyhow!("{e}"))
        }
        None => config::load("", &env_lookup).map_err(|e| anyhow::anyhow!("{e}")),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: draining in-flight requests");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Cmd::Serve { config, listen } => serve(config.as_ref(), listen).await?,
        #[cfg(feature = "demo")]
        Cmd::Demo { listen, db } => demo::run(listen, db, shutdown_signal()).await?,
        Cmd::Config { what } => match what {
            ConfigDoc::Example => print!("{}", spendgate_config::example_toml()),
            ConfigDoc::Reference => print!("{}", spendgate_config::reference_markdown()),
        },
        Cmd::CheckConfig { config } => {
            let cfg = load_config(config.as_ref())?;
            print!("{}", cfg.render_effective());
            // (on stderr: stdout stays the effective config, valid TOML)
            for w in cfg.warnings() {
                eprintln!("warning: {w}");
            }
        }
        #[cfg(feature = "demo")]
        Cmd::MockUpstream {
            listen,
            latency_ms,
            tokens_per_second,
        } => demo::mock_upstream(&listen, latency_ms, tokens_per_second).await?,
        Cmd::Report(args) => print!("{}", report(args).await?),
        Cmd::Tune(args) => print!("{}", tune(args).await?),
        Cmd::Store {
            action: StoreCmd::Init { config, new_ledger },
        } => store_init(config.as_ref(), new_ledger).await?,
        Cmd::Store {
            action:
                StoreCmd::AcceptReset {
                    config,
                    accept_rollback,
                },
        } => store_accept_reset(config.as_ref(), accept_rollback).await?,
    }
    Ok(())
}

/// `spendgate report`: the history of a period, or the current counters.
async fn report(args: ReportArgs) -> anyhow::Result<String> {
    let ReportArgs {
        url,
        admin_token,
        config,
        since,
        until,
        by,
        format,
        kind,
        top,
    } = args;
    spendgate_http::install_crypto();
    let history = since.is_some() || until.is_some() || by.is_some() || format.is_some();
    let out = if history {
        let src = history_source(url, admin_token, config.as_ref())?.0;
        let now = spendgate_ops::history::now();
        let ask = spendgate_ops::history::ReportAsk {
                since: when(since.as_deref(), "24h", now)?,
                until: until_of(until.as_deref(), now)?,
                by: match by.as_deref() {
                    None => GroupBy::Day,
                    Some(b) => GroupBy::parse(b).with_context(|| {
                        format!("--by {b:?}: day, hour, minute, scope-kind, model, tool, session, address, conversation or state")
                    })?,
                },
                top,
                format: match format.as_deref() {
                    None => spendgate_ops::history::Format::Table,
                    Some(f) => spendgate_ops::history::Format::parse(f)
                        .with_context(|| format!("--format {f:?}: table, csv or json"))?,
                },
            };
        spendgate_ops::history::report(&src, &ask).await?
    } else {
        let url = url.unwrap_or_else(|| DEFAULT_URL.into());
        let token = admin_token.context(TOKEN_NEEDED)?;
        spendgate_ops::report(&url, &token, kind, top.unwrap_or(50)).await?
    };
    Ok(out)
}

/// `spendgate tune`: over the history of a period, or sampled live.
async fn tune(args: TuneArgs) -> anyhow::Result<String> {
    let TuneArgs {
        url,
        admin_token,
        config,
        since,
        until,
        watch_seconds,
    } = args;
    spendgate_http::install_crypto();
    let out = if since.is_some() || until.is_some() {
        let (src, cfg) = history_source(url, admin_token, config.as_ref())?;
        let now = spendgate_ops::history::now();
        let since = when(since.as_deref(), "7d", now)?;
        let until = until_of(until.as_deref(), now)?;
        let policy = cfg.as_ref().map(|c| &c.policy);
        spendgate_ops::history::tune(&src, since, until, policy).await?
    } else {
        let url = url.unwrap_or_else(|| DEFAULT_URL.into());
        let token = admin_token.context(TOKEN_NEEDED)?;
        spendgate_ops::tune(&url, &token, watch_seconds).await?
    };
    Ok(out)
}

const DEFAULT_URL: &str = "http://127.0.0.1:8080";
const TOKEN_NEEDED: &str =
    "the admin API needs the admin token: --admin-token or SPENDGATE_ADMIN_TOKEN";

fn when(
    given: Option<&str>,
    default: &str,
    now: spendgate_ops::history::UnixMs,
) -> anyhow::Result<spendgate_ops::history::UnixMs> {
    Ok(spendgate_ops::history::parse_when(
        given.unwrap_or(default),
        now,
    )?)
}

/// `--until`, excluded: by default just after now, so the records of this millisecond count.
fn until_of(
    given: Option<&str>,
    now: spendgate_ops::history::UnixMs,
) -> anyhow::Result<spendgate_ops::history::UnixMs> {
    match given {
        Some(g) => Ok(spendgate_ops::history::parse_when(g, now)?),
        None => Ok(now.plus_ms(1)),
    }
}

/// Where `report` and `tune` read the history: a running gateway's admin API when `--url`
/// is given (or no config is), else the config's store. The config, when one is given, comes
/// second (`tune` shows its values).
fn history_source(
    url: Option<String>,
    token: Option<String>,
    config: Option<&PathBuf>,
) -> anyhow::Result<(spendgate_ops::history::Source, Option<Config>)> {
    let cfg = config.map(|c| load_config(Some(c))).transpose()?;
    let src = match (&url, &cfg) {
        (None, Some(cfg)) => {
            spendgate_ops::history::Source::Reader(spendgate_ops::history::open_reader(cfg)?)
        }
        _ => spendgate_ops::history::Source::Admin {
            url: url.unwrap_or_else(|| DEFAULT_URL.into()),
            token: token.context(TOKEN_NEEDED)?,
        },
    };
    Ok((src, cfg))
}

/// `spendgate serve`: the gateway, until SIGINT or SIGTERM.
async fn serve(config: Option<&PathBuf>, listen: Option<String>) -> anyhow::Result<()> {
    let mut cfg = load_config(config)?;
    if let Some(l) = listen {
        cfg.server.listen = l.parse().with_context(|| {
            format!("--listen {l:?} is not an address and port such as 127.0.0.1:8080 or [::]:8080")
        })?;
    }
    for w in cfg.warnings() {
        tracing::warn!("{w}");
    }
    spendgate_tokens::warm_up();
    match spendgate_listener::rlimit::raise_open_files_limit() {
        Some(n) if n < spendgate_listener::rlimit::OPEN_FILES_WANTED => tracing::warn!(
            open_files = n,
            wanted = spendgate_listener::rlimit::OPEN_FILES_WANTED,
            "the open files limit is below what the connection bounds need: raise the \
             hard limit (LimitNOFILE=, ulimit -Hn), or connections past it are reset"
        ),
        _ => {}
    }
    let opened = spendgate_http::open_store_with_witness(&cfg).await?;
    let (store, witness, history) = (opened.store, opened.witness, opened.history);
    let listener = spendgate_listener::bind(cfg.server.listen)
        .with_context(|| format!("binding {}", cfg.server.listen))?;
    let addr = listener.local_addr()?;
    let state = spendgate_http::build_state(cfg, store)?;
    // (a Redis store's history: this replica's drain into PostgreSQL, until it stops)
    let _history = history.map(|h| spendgate_http::spawn_history(&state, h));
    tracing::info!(%addr, store = state.store.kind(), "spendgate listening");
    println!("spendgate listening on http://{addr}");
    let app = spendgate_http::router(state.clone(), spendgate_proxy::routes());
    let served = spendgate_http::serve(state, app, listener, shutdown_signal()).await;
    // (the high-water mark of a clean shutdown; a crash loses at most the last
    // WITNESS_EVERY of it)
    if let Some(w) = witness {
        if let Err(e) = w.flush().await {
            tracing::error!(error = %e, "cannot write the witness at shutdown");
        }
    }
    Ok(served?)
}

/// `spendgate store init`.
async fn store_init(config: Option<&PathBuf>, new_ledger: bool) -> anyhow::Result<()> {
    let cfg = load_config(config)?;
    if cfg.store.kind != config::StoreKind::Redis {
        bail!("store init applies to store.kind = \"redis\" only (sqlite initialises its file itself)");
    }
    let mode = if new_ledger {
        spendgate_redis::InitMode::NewLedger
    } else {
        spendgate_redis::InitMode::Routine
    };
    spendgate_http::install_crypto();
    let done =
        spendgate_redis::RedisStore::init(&spendgate_http::redis_command_options(&cfg), mode)
            .await?;
    print!("{}", spendgate_ops::store::init_report(&cfg, &done));
    Ok(())
}

/// `spendgate store accept-reset`.
async fn store_accept_reset(config: Option<&PathBuf>, accept_rollback: bool) -> anyhow::Result<()> {
    let cfg = load_config(config)?;
    if cfg.store.kind != config::StoreKind::Redis {
        bail!("store accept-reset applies to store.kind = \"redis\" only");
    }
    let consent = if accept_rollback {
        spendgate_redis::RollbackConsent::Given
    } else {
        spendgate_redis::RollbackConsent::NotGiven
    };
    spendgate_http::install_crypto();
    let seq = spendgate_redis::RedisStore::accept_reset(
        &spendgate_http::redis_command_options(&cfg),
        consent,
    )
    .await?;
    println!(
        "rollback accepted for store.prefix {:?} (ledger {}): replicas reopen on what \
         Redis holds now (ledger_seq {seq}), and their witnesses follow",
        cfg.store.prefix,
        cfg.store.ledger_id.as_deref().unwrap_or("")
    );
    Ok(())
}
