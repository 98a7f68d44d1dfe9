//! spendgate-telemetry: what spendgate tells its operator, apart from its answers. The
//! Prometheus [`metrics`] (counters and latency histograms, rendered in the text format), the
//! [`metered`] store decorator that times every store call into them, [`totals`] (the
//! running totals of the usage history, told by the store as its `HistoryTap`), [`burn`] (the
//! global budgets' burn rates and forecasts, and the burn-rate alert), [`alerts`] (a log line
//! and a webhook POST on spend thresholds, overruns, expiries, store outages and policy drift,
//! deduplicated across replicas through the store), and policy [`drift`] (each replica
//! publishes a fingerprint of its policy; different fingerprints among the live replicas are
//! reported).
//!
//! It observes and reports; it decides nothing: no admission or charge depends on it (SPEC
//! I4: limits are the core's, through the store). It builds on `spendgate-core`,
//! `spendgate-store` and `spendgate-config` only; the HTTP surface (`spendgate-http`) holds
//! its pieces in the shared state and serves them (`/metrics`, `/admin/v1/summary`).
//!
//! Modules depend one way: [`metered`] on [`metrics`], [`metrics`] on [`totals`] and [`burn`],
//! [`burn`] and [`drift`] on [`alerts`].

pub mod alerts;
pub mod burn;
pub mod drift;
pub mod metered;
pub mod metrics;
pub mod totals;

pub use alerts::Alerts;
pub use burn::{Burn, Forecast};
pub use drift::{PolicyView, Replica};
pub use metered::Metered;
pub use metrics::{HistoryDrain, Metrics, StoreTiming};
pub use totals::HistoryTotals;
