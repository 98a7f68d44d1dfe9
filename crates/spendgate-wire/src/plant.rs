//! Planted bugs, for the chaos run's tests only (`crates/spendgate-chaos/tests`): switches
//! that each put back a realistic bug one chaos check must catch, so that each check is shown
//! to catch something. The switch is the environment variable `SPENDGATE_PLANT=NAME`, read
//! once; each planted site is one line calling [`on`].
//!
//! Compiled in only with the cargo feature `planted-bugs`, which `spendgate-chaos` turns on
//! (so a workspace build has it, inert unless the variable is set); `cargo install` and
//! `cargo build -p spendgate-server` have none of it: [`on`] is then a `const fn` answering
//! `false`, and every planted branch is dead code the compiler removes.
//!
//! The plants (the ledger's own are in `spendgate_redis::plant`):
//! - `drop-releases` (proxy, `StepGuard`'s drop): a client gone mid-stream releases its step
//!   instead of charging it in full; the upstream served it. Caught by `lost`.
//! - `client-bound` (proxy): the forwarded output bound is the client's `max_tokens`, not
//!   the one reserved (the clamp is computed, then not written back): the upstream may
//!   generate past what was held, and the overruns spend past the budgets. Caught by
//!   `overspend`.
//! - `made-up-code` (error shape): a spent budget is refused with the code `quota_exceeded`,
//!   which no contract names. Caught by `codes`.
//! - `shared-capacity`: every class of caller shares the public routes' capacity (no
//!   per-address bound): the hook for the fair-capacity code. Caught by `operator`.
//!
//! The switches live here, in the lowest crate that reads one (the error shape reads
//! `made-up-code`), so the listener, the HTTP surface and the proxy all see the same ones;
//! the start-up check of the name (`spendgate_http::plant::announce`) is spendgate-http's,
//! which also knows the ledger script's plants.

/// A planted bug of the server (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plant {
    DropReleases,
    ClientBound,
    MadeUpCode,
    SharedCapacity,
}

impl Plant {
    pub const ALL: [Plant; 4] = [
        Plant::DropReleases,
        Plant::ClientBound,
        Plant::MadeUpCode,
        Plant::SharedCapacity,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Plant::DropReleases => "drop-releases",
            Plant::ClientBound => "client-bound",
            Plant::MadeUpCode => "made-up-code",
            Plant::SharedCapacity => "shared-capacity",
        }
    }
}

/// Whether `plant` is switched on in this process.
#[cfg(feature = "planted-bugs")]
pub fn on(plant: Plant) -> bool {
    active() == Some(plant.name())
}

/// Without the `planted-bugs` feature no plant is ever on.
#[cfg(not(feature = "planted-bugs"))]
#[inline(always)]
pub const fn on(_plant: Plant) -> bool {
    false
}

/// The environment variable that names the planted bug (the same as
/// `spendgate_redis::plant::PLANT_ENV`; a test in spendgate-http holds them equal).
pub const PLANT_ENV: &str = "SPENDGATE_PLANT";

/// The planted bug named by [`PLANT_ENV`], read once.
#[cfg(feature = "planted-bugs")]
pub fn active() -> Option<&'static str> {
    static ACTIVE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ACTIVE
        .get_or_init(|| std::env::var(PLANT_ENV).ok())
        .as_deref()
}

/// `made-up-code`: the wire code an error answers with.
pub fn code(code: crate::error::ErrorCode) -> &'static str {
    if on(Plant::MadeUpCode) && code == crate::error::ErrorCode::BudgetExhausted {
        "quota_exceeded"
    } else {
        code.as_str()
    }
}

/// `client-bound`: the output bound the proxy forwards (`out`, the one reserved), or the
/// client's own when planted.
pub fn forwarded_bound(out: u64, requested: Option<u64>) -> u64 {
    if on(Plant::ClientBound) {
        requested.unwrap_or(out)
    } else {
        out
    }
}
