//! The `spendgate` binary: the command line, and the wiring of the crates that do the work
//! (`spendgate-config`, `spendgate-http`, `spendgate-proxy`). With the default feature `demo`
//! it also carries `spendgate demo` and `spendgate mock-upstream` (the mock upstream
//! library); `--no-default-features` builds the gateway alone.

#![warn(clippy::too_many_lines)]

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use spendgate_config::{self as config, Config};
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
    /// Spend by scope and window, read from a running gateway's admin API.
    Report {
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        #[arg(long, env = "SPENDGATE_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: String,
        /// Scope kind: global, ip, session, conversation, run.
        #[arg(long)]
        kind: Option<String>,
        #[arg(long, default_value_t = 50)]
        top: usize,
    },
    /// Percentiles of observed usage per run and suggested bounds, from a running gateway.
    Tune {
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        #[arg(long, env = "SPENDGATE_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: String,
        /// Sample for this long (polling every 20 s; the gateway keeps an ended run's
        /// reservations for a minute), at most a day; 0: one look.
        #[arg(long, default_value_t = 0)]
        watch_seconds: u64,
    },
    /// Store maintenance.
    Store {
        #[command(subcommand)]
        action: StoreCmd,
    },
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
        Cmd::Report {
            url,
            admin_token,
            kind,
            top,
        } => {
            spendgate_http::install_crypto();
            print!(
                "{}",
                spendgate_ops::report(&url, &admin_token, kind, top).await?
            );
        }
        Cmd::Tune {
            url,
            admin_token,
            watch_seconds,
        } => {
            spendgate_http::install_crypto();
            print!(
                "{}",
                spendgate_ops::tune(&url, &admin_token, watch_seconds).await?
            );
        }
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
