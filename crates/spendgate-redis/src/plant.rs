//! Planted bugs in the ledger script, for the chaos run's tests only (`crates/spendgate-chaos`):
//! each one, named by `SPENDGATE_PLANT`, puts back a realistic bug that one chaos check must
//! catch. Compiled in only with the cargo feature `planted-bugs` (which the chaos crate turns
//! on); without it [`script`] is the identity and nothing reads the variable. The patched
//! script has another digest, so it loads as a library of its own name.
//!
//! - `expiry-releases`: a run that expires charges its held steps nothing (expiry refunds,
//!   as TigerBeetle's pending transfers do; ours must charge in full). Caught by `lost`.
//! - `expiry-skips-counters`: an expiry marks its steps charged but never applies the charge
//!   (and the freed hold) to the scopes' counters: the accumulator is not flushed. Caught
//!   by `books`.
//! - `lease-too-long`: a renewal extends a run's lease by the TTL read as seconds where it is
//!   milliseconds (capped at the run's deadline), so a vanished holder's slots and
//!   reservations outlive the TTL. Caught by `open`.

use std::borrow::Cow;

/// The environment variable naming the planted bug (the server's `plant` module reads it too).
pub const PLANT_ENV: &str = "SPENDGATE_PLANT";

/// The ledger plants, with the text each one replaces and its replacement.
pub const PLANTS: [(&str, &str, &str); 3] = [
    (
        "expiry-releases",
        "settle(s, step_end, r[S_AMOUNT], now, acc, r)",
        "settle(s, step_end, (endstate == 'expired') and 0 or r[S_AMOUNT], now, acc, r)",
    ),
    (
        "expiry-skips-counters",
        "  acc_flush(acc)\n  local imm = run_imm(run, true)",
        "  if endstate ~= 'expired' then acc_flush(acc) end\n  local imm = run_imm(run, true)",
    ),
    (
        "lease-too-long",
        "local new = mmax(mmin(now + ttl, deadline), mmin(lease, deadline))",
        "local new = mmax(mmin(now + ttl * 1000, deadline), mmin(lease, deadline))",
    ),
];

/// The script with the planted bug named by [`PLANT_ENV`] applied, when it names a ledger
/// plant. Panics when the text a plant replaces is not found exactly once: a plant that
/// silently does nothing would let its test pass for the wrong reason.
#[cfg(feature = "planted-bugs")]
pub(crate) fn script(body: &'static str) -> Cow<'static, str> {
    let Ok(name) = std::env::var(PLANT_ENV) else {
        return Cow::Borrowed(body);
    };
    match PLANTS.iter().find(|(n, _, _)| *n == name) {
        Some((name, from, to)) => {
            assert_eq!(
                body.matches(from).count(),
                1,
                "planted bug {name}: the text it replaces is not in ledger.lua exactly once"
            );
            tracing::warn!(plant = name, "PLANTED BUG ACTIVE in the ledger script");
            Cow::Owned(body.replacen(from, to, 1))
        }
        None => Cow::Borrowed(body),
    }
}

/// Without the `planted-bugs` feature: the script as written.
#[cfg(not(feature = "planted-bugs"))]
pub(crate) fn script(body: &'static str) -> Cow<'static, str> {
    Cow::Borrowed(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every plant's text is in the script exactly once (a change to ledger.lua that moves
    /// it must move the plant too).
    #[test]
    fn every_plant_applies_exactly_once() {
        for (name, from, to) in PLANTS {
            assert_eq!(crate::SCRIPT_BODY.matches(from).count(), 1, "plant {name}");
            assert_ne!(from, to);
        }
    }
}
