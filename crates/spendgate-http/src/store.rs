//! Opening the configured store, in its bounds.

use crate::error::ServerError;
use crate::tls::install_crypto;
use spendgate_config::{Config, StoreKind};
use spendgate_store::{MemoryStore, SqliteOptions, SqliteStore, Store, SystemClock, Timed};
use std::sync::Arc;

/// Opens the configured store, wrapped in its bounds ([`Timed`]): `store.timeout_ms`, and
/// `store.slow_grace_ms` more for a slow call while the store is not known to be failing.
pub async fn open_store(config: &Config) -> Result<Arc<dyn Store>, ServerError> {
    Ok(open_store_with_witness(config).await?.store)
}

/// An opened store and, for a Redis store with `store.witness_path`, its witness, to flush at
/// a clean shutdown ([`spendgate_redis::Witness::flush`]).
pub struct OpenedStore {
    pub store: Arc<dyn Store>,
    pub witness: Option<spendgate_redis::Witness>,
    /// A Redis store's history, for [`crate::spawn_history`] once the replica runs.
    pub history: Option<crate::drain::HistorySetup>,
}

/// [`open_store`], keeping the Redis store's witness.
pub async fn open_store_with_witness(config: &Config) -> Result<OpenedStore, ServerError> {
    let policy = config.policy.clone();
    let mut history = None;
    let (inner, witness): (Arc<dyn Store>, _) = match config.store.kind {
        StoreKind::Memory => (
            Arc::new(MemoryStore::with_history(policy, Arc::new(SystemClock))),
            None,
        ),
        StoreKind::Sqlite => {
            let mut opts = SqliteOptions::new(config.store.path.clone());
            opts.history_retention = config.history.retention;
            opts.history_rows_max = config.history.rows_max;
            (
                Arc::new(SqliteStore::open(opts, policy, Arc::new(SystemClock))?),
                None,
            )
        }
        StoreKind::Redis => {
            let (store, pg) = open_redis(config, policy).await?;
            let witness = store.witness();
            history = Some(crate::drain::HistorySetup {
                redis: store.clone(),
                pg,
            });
            (store, witness)
        }
    };
    Ok(OpenedStore {
        store: Arc::new(Timed::with_grace(
            inner,
            config.store.timeout,
            config.store.slow_grace,
        )),
        witness,
        history,
    })
}

/// The Redis options of a replica's config.
pub fn redis_options(config: &Config) -> spendgate_redis::RedisOptions {
    spendgate_redis::RedisOptions {
        url: config.store.url.expose().to_string(),
        prefix: config.store.prefix.clone(),
        timeout: config.store.timeout,
        slow_grace: config.store.slow_grace,
        clock: spendgate_redis::ClockSource::Server,
        ledger_id: config.store.ledger_id.clone(),
        witness: config.store.witness_path.clone(),
    }
}

/// Shortest timeout of an operator's `spendgate store` command: `store.timeout_ms` bounds the
/// gateway's calls on the request path (fail closed), but a command run once by hand (a TLS
/// handshake, a script load) may take longer and must not fail for it.
pub const STORE_COMMAND_TIMEOUT_MIN: std::time::Duration = std::time::Duration::from_secs(5);

/// [`redis_options`] for an operator's `spendgate store` command (which writes no witness:
/// replicas keep theirs, and adopt what the command wrote in Redis).
pub fn redis_command_options(config: &Config) -> spendgate_redis::RedisOptions {
    let mut o = redis_options(config);
    o.timeout = o.timeout.max(STORE_COMMAND_TIMEOUT_MIN);
    o.witness = None;
    o
}

async fn open_redis(
    config: &Config,
    policy: spendgate_core::Policy,
) -> Result<
    (
        Arc<spendgate_redis::RedisStore>,
        Option<Arc<spendgate_history_pg::PgHistory>>,
    ),
    ServerError,
> {
    if config.store.ledger_id.is_none() {
        return Err(ServerError::Config(
            "store.ledger_id is not set: a redis store serves only the ledger it is pinned to. \
             Run `spendgate store init --config FILE` once (it creates the ledger, or names \
             the one the prefix holds) and pin the id it prints: [store] ledger_id = \"lg-...\""
                .into(),
        ));
    }
    // `rediss://` urls: TLS with the system's roots (or `SSL_CERT_FILE`), through rustls.
    install_crypto();
    let mut store = spendgate_redis::RedisStore::open(redis_options(config), policy).await?;
    let pg = crate::drain::HistorySetup::configure(&mut store, config)?;
    Ok((Arc::new(store), pg))
}
