//! The shared state of every handler: the config, the store, the keys, the bounds and the
//! background services, built once at start.

use crate::capacity::Capacity;
use crate::error::ServerError;
use crate::identity::{self, SessionKeys};
use crate::plant;
use crate::tls::install_crypto;
use spendgate_config::Config;
use spendgate_store::Store;
use spendgate_telemetry::{Alerts, Burn, Metered, Metrics, Replica};
use std::sync::Arc;
use std::time::Duration;

/// Idle upstream connections kept per host.
pub const UPSTREAM_IDLE_CONNECTIONS_MAX: usize = 256;

/// One configured upstream, resolved at start.
#[derive(Clone, Debug)]
pub struct Upstream {
    pub base_url: String,
    pub api_key: String,
    pub timeout: Duration,
    pub release_on_error: bool,
}

/// What every handler shares.
pub struct AppState {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    pub keys: SessionKeys,
    pub service_tokens: Vec<String>,
    pub admin_tokens: Vec<String>,
    pub metrics: Metrics,
    pub http: reqwest::Client,
    /// Upstreams by name, resolved at start (the demo adds its built-in mock).
    pub upstreams: std::collections::BTreeMap<String, Upstream>,
    pub alerts: Alerts,
    /// The in-flight bounds per class of caller and per address (`crate::capacity`).
    pub capacity: Capacity,
    /// This process as the store knows it: its id and its policy's fingerprint.
    pub replica: Replica,
    /// The global budgets' burn rates, fed by the alert checker (`serve`).
    pub burn: Arc<Burn>,
}

/// The state as handlers take it.
pub type Shared = Arc<AppState>;

/// Builds the shared state: tokens, session keys (an ephemeral one when none is configured),
/// and `store` timed by [`Metered`] into the metrics.
pub fn build_state(config: Config, store: Arc<dyn Store>) -> Result<Shared, ServerError> {
    plant::announce().map_err(ServerError::Config)?;
    let mut keys: Vec<Vec<u8>> = config
        .sessions
        .keys
        .iter()
        .map(|k| k.expose().as_bytes().to_vec())
        .filter(|k| !k.is_empty())
        .collect();
    if keys.is_empty() {
        // `Config::warnings` tells the operator (sessions end at restart, replicas do not
        // share them).
        keys.push(rand::random::<[u8; 32]>().to_vec());
    }
    let keys = identity::SessionKeys::new(keys)
        .ok_or_else(|| {
            ServerError::Config("sessions.keys: every key must be at least 16 bytes".into())
        })?
        .with_max_ttl(config.sessions.ttl.as_secs());
    let service_tokens = config
        .server
        .service_tokens
        .iter()
        .map(|t| t.expose().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    let admin_tokens = config
        .server
        .admin_tokens
        .iter()
        .map(|t| t.expose().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    install_crypto();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(UPSTREAM_IDLE_CONNECTIONS_MAX)
        .connect_timeout(Duration::from_secs(5))
        // A redirect is answered to the client as an upstream error, never followed (a 307
        // or 308 would send a paid request again, to wherever it points).
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| ServerError::Http(e.to_string()))?;
    let upstreams = config
        .upstreams
        .iter()
        .map(|(name, u)| {
            let up = Upstream {
                base_url: u.base_url.clone(),
                api_key: u.api_key.expose().to_string(),
                timeout: u.timeout,
                release_on_error: u.release_on_error,
            };
            (name.clone(), up)
        })
        .collect();
    let webhook = config
        .alerts
        .webhook_url
        .as_ref()
        .map(|u| u.expose().to_string());
    let alerts = Alerts::start(http.clone(), webhook);
    let capacity = Capacity::new(&config.server.capacity);
    let metrics = Metrics::default();
    // The history's running totals: the store tells them of every record it makes durable.
    store.tap_history(metrics.history_tap());
    let replica = Replica::of(&config);
    let burn = Arc::new(Burn::new(config.alerts.burn_short, config.alerts.burn_long));
    Ok(Arc::new(AppState {
        burn,
        replica,
        alerts,
        upstreams,
        config: Arc::new(config),
        store: Metered::wrap(store, metrics.store_timing()),
        keys,
        service_tokens,
        admin_tokens,
        metrics,
        http,
        capacity,
    }))
}
