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

/// The planted bug named by `SPENDGATE_PLANT`, read once.
#[cfg(feature = "planted-bugs")]
fn active() -> Option<&'static str> {
    static ACTIVE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ACTIVE
        .get_or_init(|| std::env::var(spendgate_redis::plant::PLANT_ENV).ok())
        .as_deref()
}

/// Every plant name this build knows: the server's and the ledger script's.
#[cfg(feature = "planted-bugs")]
pub fn names() -> Vec<&'static str> {
    Plant::ALL
        .iter()
        .map(|p| p.name())
        .chain(spendgate_redis::plant::PLANTS.iter().map(|(n, _, _)| *n))
        .collect()
}

/// At start: refuses an unknown plant name (a typo must not run a test without its bug) and
/// says loudly, on stderr, which bug is planted.
#[cfg(feature = "planted-bugs")]
pub fn announce() -> Result<(), String> {
    let Some(name) = active() else {
        return Ok(());
    };
    if !names().contains(&name) {
        return Err(format!(
            "{}={name:?} names no planted bug; known: {}",
            spendgate_redis::plant::PLANT_ENV,
            names().join(", ")
        ));
    }
    tracing::warn!(
        plant = name,
        "PLANTED BUG ACTIVE: this process is broken on purpose"
    );
    eprintln!("spendgate: PLANTED BUG ACTIVE: {name}");
    Ok(())
}

/// Without the feature there is nothing to announce (the variable is not read).
#[cfg(not(feature = "planted-bugs"))]
pub fn announce() -> Result<(), String> {
    Ok(())
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
