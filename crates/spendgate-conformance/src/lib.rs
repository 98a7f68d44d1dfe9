//! spendgate-conformance: the one suite every store backend must pass (SPEC §3, §7).
//!
//! A backend implements [`Backend`] (open a fresh store on a hand-driven clock, move that
//! clock, and for durable backends reopen the same data after a simulated crash) and expands
//! [`conformance_tests!`] once in its own test crate:
//!
//! ```text
//! struct MyBackend { /* ... */ }
//! #[async_trait::async_trait]
//! impl spendgate_conformance::Backend for MyBackend { /* ... */ }
//! spendgate_conformance::conformance_tests!(MyBackend::new());
//! ```
//!
//! The macro lists every case of the suite, so a backend cannot skip one silently; the crate
//! that expands it needs `tokio` with the `macros` and `rt-multi-thread` features.
//!
//! Every case is a backend-independent `pub async fn case(b: &dyn Backend)` that opens one
//! store and panics on the first answer that breaks the contract. The cases only use the
//! [`Store`] trait and its typed helpers; the reference model of [`model_based`] is written
//! from the SPEC, not from `spendgate_core::Ledger`.

mod bounds;
mod conservation;
mod failure;
mod hammer;
mod held;
mod history;
mod leases;
mod limits;
mod model;
mod overspend;
mod presence;
pub mod support;

pub use async_trait::async_trait;
pub use bounds::*;
pub use conservation::*;
pub use failure::*;
pub use hammer::*;
pub use held::*;
pub use history::*;
pub use leases::*;
pub use limits::*;
pub use model::*;
pub use overspend::*;
pub use presence::*;

use spendgate_core::{Policy, UnixMs};
use spendgate_store::Store;
use std::sync::Arc;

/// What a store backend provides to the suite.
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// A fresh, empty store with this policy, whose clock starts at `start` and moves only by
    /// `advance`.
    async fn open(&self, policy: Policy, start: UnixMs) -> Arc<dyn Store>;
    /// Moves the clock of the store last opened forward by `ms`.
    fn advance(&self, ms: u64);
    /// Drops the last opened store as a crash would and opens the same data again (same
    /// policy, same clock); `None` for backends that are not durable.
    ///
    /// The suite drops every handle it holds on the old store before it calls this, so a
    /// backend must not keep one itself (an exclusive file lock would stay taken). Every
    /// answer the old store gave must survive: the suite compares the reopened ledger with
    /// what it was told before.
    async fn reopen(&self) -> Option<Arc<dyn Store>>;

    /// Makes the store last opened fail (`true`) or recover (`false`), as a store that cannot
    /// be written does (SPEC §3 I3): while failing, every command that would change the
    /// ledger must be refused with an error for which `StoreError::is_unavailable()` holds,
    /// and must change nothing; once recovered, service resumes on the same handles.
    /// Returns `false` when the backend has no way to fail (then the I3 cases say so and
    /// skip); the default.
    async fn set_failing(&self, failing: bool) -> bool {
        let _ = failing;
        false
    }

    /// A second handle on the data of `store` (the store last opened), as another replica
    /// of the gateway opens it: same data, same policy, same clock, its own connection.
    /// `None` for backends whose data one process holds alone (then the I4 case says so and
    /// skips); the default. Handing back `store` itself would not be a second handle.
    async fn replica(&self, store: &Arc<dyn Store>) -> Option<Arc<dyn Store>> {
        let _ = store;
        None
    }
}

/// Calls `$callback!($($args)*; every case name)`: the one list of the suite's cases.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_conformance_cases {
    ($callback:ident ! ( $($args:tt)* )) => {
        $crate::$callback! {$($args)*;
            i1_admission_is_all_or_nothing,
            i1_refused_admission_holds_nothing,
            i1_overrun_is_charged_and_blocks_until_next_window,
            i1_a_refusal_waits_for_the_spent_budget_that_frees_last,
            i1_a_refusal_by_holds_is_a_wait,
            i2_each_reservation_ends_once,
            i2_expired_reservations_are_closed,
            i2_a_repeated_commit_keeps_its_result_size_verdict,
            i3_nothing_is_admitted_while_the_store_fails,
            i3_a_commit_that_cannot_reach_the_store_leaves_the_hold,
            i4_two_handles_enforce_one_limit,
            session_creation_rates,
            adjustments_apply_once_per_key,
            many_commands_apply_in_order,
            durable_reopen_keeps_the_ledger,
            i5_rounds_tools_and_retries,
            i5_deadline_refuses_steps,
            i5_context_and_output_tokens,
            i5_input_bytes,
            i5_run_max_cost,
            i5_a_run_bound_held_by_its_own_steps_is_a_wait,
            i5_shrink_to_fit,
            i6_expired_lease_charges_and_frees,
            i6_a_lapsed_lease_is_seen_behind_a_backlog_of_timers,
            i6_heartbeat_extends_lease,
            i6_lease_never_extends_past_deadline,
            i6_finish_resolves_held_steps,
            concurrency_caps,
            rate_limits_gcra,
            idempotent_admission,
            idempotent_step,
            ledger_seq,
            whole_run_reserves_and_reconciles,
            whole_run_expiry_charges_the_hold,
            whole_run_finish_answers_what_the_budgets_were_charged,
            whole_run_overrun_reaches_the_scopes_at_commit,
            whole_run_admission_held_by_other_runs_is_a_wait,
            cutoff_refuses_admission,
            replicas_publish_policy_fingerprints,
            dry_run_reports_instead_of_refusing,
            hammer_one_budget,
            hammer_last_cent,
            model_based,
            model_based_dry_run,
            history_is_as_exact_as_the_ledger,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_test_fns {
    ($make:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let backend = $make;
                $crate::$case(&backend).await;
            }
        )*
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_run_all {
    ($backend:expr; $($case:ident),* $(,)?) => {
        $(
            $crate::$case($backend).await;
        )*
    };
}

/// Runs every case in order against one backend, in one test: for a backend that is slow to
/// start (a Redis in cluster mode waits 2 s before it serves). Each case opens its own store.
#[macro_export]
macro_rules! run_all_conformance_cases {
    ($backend:expr) => {
        $crate::__with_conformance_cases!(__conformance_run_all!($backend))
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_case_names {
    (; $($case:ident),* $(,)?) => {
        &[$(stringify!($case)),*]
    };
}

/// Expands to one `#[tokio::test(flavor = "multi_thread", worker_threads = 4)]` per case of
/// the suite, each calling the case with `$make` (an expression producing a fresh
/// [`Backend`], evaluated inside the test's runtime).
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::__with_conformance_cases!(__conformance_test_fns!($make));
    };
}

/// The name of every case [`conformance_tests!`] expands to, in order.
pub const CASES: &[&str] = __with_conformance_cases!(__conformance_case_names!());
