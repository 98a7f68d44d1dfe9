//! Money as integer micros, exact decimal parsing, prices, and costs that always round up.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Millionths of the configured currency unit. Never floating point.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Micros(pub u64);

/// Largest amount any configured or computed figure may reach: 2^53 - 1, so that every amount
/// stays exact in a Lua number (a double) inside a Redis script.
pub const MICROS_MAX: Micros = Micros((1 << 53) - 1);

/// Micros in one currency unit.
pub const MICROS_PER_UNIT: u64 = 1_000_000;

impl Micros {
    pub const ZERO: Micros = Micros(0);

    pub fn checked_add(self, other: Micros) -> Option<Micros> {
        self.0.checked_add(other.0).map(Micros)
    }

    /// Saturates at zero: used where a hold is being freed and can never go negative.
    pub fn saturating_sub(self, other: Micros) -> Micros {
        Micros(self.0.saturating_sub(other.0))
    }

    /// Adds, saturating at [`MICROS_MAX`]: charging more than the representable maximum is
    /// still "everything", which is the conservative answer.
    pub fn add_capped(self, other: Micros) -> Micros {
        Micros(self.0.saturating_add(other.0).min(MICROS_MAX.0))
    }
}

impl fmt::Display for Micros {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{:06}",
            self.0 / MICROS_PER_UNIT,
            self.0 % MICROS_PER_UNIT
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmountError {
    #[error("empty amount")]
    Empty,
    #[error("amount {0:?} is not a plain non-negative decimal like \"0.15\"")]
    Syntax(String),
    #[error("amount {0:?} has more than 6 decimal places (the smallest unit is one micro)")]
    TooPrecise(String),
    #[error("amount {0:?} is larger than the maximum of 9007199254.740991")]
    TooLarge(String),
}

/// Parses a decimal string in currency units ("0.15", "50", "1000.000001") into micros,
/// exactly. Signs, exponents, separators and more than six decimals are errors, never rounded.
pub fn parse_amount(text: &str) -> Result<Micros, AmountError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(AmountError::Empty);
    }
    let (whole, frac) = match s.split_once('.') {
        Some((w, f)) => (w, f),
        None => (s, ""),
    };
    let digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(frac) || (s.contains('.') && frac.is_empty()) {
        return Err(AmountError::Syntax(text.to_string()));
    }
    // Zeros past the sixth decimal change nothing ("1.0000000" is exact); any other digit
    // there would have to be rounded.
    let frac = match frac.get(6..) {
        Some(rest) if rest.bytes().all(|b| b == b'0') => &frac[..6],
        Some(_) => return Err(AmountError::TooPrecise(text.to_string())),
        None => frac,
    };
    let too_large = || AmountError::TooLarge(text.to_string());
    let whole: u64 = whole.parse().map_err(|_| too_large())?;
    let mut frac_micros: u64 = 0;
    for (i, b) in frac.bytes().enumerate() {
        frac_micros += u64::from(b - b'0') * 10u64.pow(5 - i as u32);
    }
    let total = whole
        .checked_mul(MICROS_PER_UNIT)
        .and_then(|w| w.checked_add(frac_micros))
        .ok_or_else(too_large)?;
    if total > MICROS_MAX.0 {
        return Err(too_large());
    }
    Ok(Micros(total))
}

/// Divides rounding up. `den` must be non-zero.
fn div_ceil_u128(num: u128, den: u128) -> u128 {
    debug_assert!(den > 0);
    num.div_ceil(den)
}

/// Converts a u128 cost to micros, saturating at the maximum (charging "everything" when a
/// product overflows the representable range is the conservative answer).
fn to_micros(v: u128) -> Micros {
    Micros(u64::try_from(v).unwrap_or(u64::MAX).min(MICROS_MAX.0))
}

/// Price of a model: micros per million tokens (so "0.15" per million is 150_000).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelPrice {
    pub input_per_million: Micros,
    pub cached_input_per_million: Micros,
    pub output_per_million: Micros,
}

/// Observed usage of one model call, as an upstream reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

impl ModelPrice {
    /// The most a call with this prompt bound and output bound can cost: every prompt token at
    /// the full input price, every allowed output token at the output price, rounded up once.
    pub fn bound(&self, prompt_tokens: u64, max_output_tokens: u64) -> Micros {
        let num = u128::from(prompt_tokens) * u128::from(self.input_per_million.0)
            + u128::from(max_output_tokens) * u128::from(self.output_per_million.0);
        to_micros(div_ceil_u128(num, 1_000_000))
    }

    /// The charge for observed usage, rounded up. Cached tokens never exceed prompt tokens.
    pub fn charge(&self, usage: &TokenUsage) -> Micros {
        let cached = usage.cached_tokens.min(usage.prompt_tokens);
        let uncached = usage.prompt_tokens - cached;
        let num = u128::from(uncached) * u128::from(self.input_per_million.0)
            + u128::from(cached) * u128::from(self.cached_input_per_million.0)
            + u128::from(usage.completion_tokens) * u128::from(self.output_per_million.0);
        to_micros(div_ceil_u128(num, 1_000_000))
    }

    /// The largest output bound such that `bound(prompt_tokens, out) <= budget`, if any.
    pub fn max_output_within(&self, prompt_tokens: u64, budget: Micros) -> Option<u64> {
        let avail = u128::from(budget.0) * 1_000_000;
        let fixed = u128::from(prompt_tokens) * u128::from(self.input_per_million.0);
        if fixed > avail {
            return None;
        }
        if self.output_per_million.0 == 0 {
            return Some(u64::MAX);
        }
        let out = (avail - fixed) / u128::from(self.output_per_million.0);
        Some(u64::try_from(out).unwrap_or(u64::MAX))
    }
}

/// Price of a paid tool: per call and/or per unit (e.g. per page fetched).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolPrice {
    pub per_call: Micros,
    pub per_unit: Micros,
}

impl ToolPrice {
    /// Cost of one call of `units` units, saturating (conservatively) at the maximum.
    pub fn cost(&self, units: u64) -> Micros {
        let num = u128::from(self.per_call.0) + u128::from(self.per_unit.0) * u128::from(units);
        to_micros(num)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_exact_decimals() {
        assert_eq!(parse_amount("0.15"), Ok(Micros(150_000)));
        assert_eq!(parse_amount("50.00"), Ok(Micros(50_000_000)));
        assert_eq!(parse_amount("1000"), Ok(Micros(1_000_000_000)));
        assert_eq!(parse_amount("0.000001"), Ok(Micros(1)));
        assert_eq!(parse_amount(" 0.075 "), Ok(Micros(75_000)));
        assert_eq!(parse_amount("1.0000000"), Ok(Micros(1_000_000)));
        assert_eq!(parse_amount("0.00000100"), Ok(Micros(1)));
        assert!(matches!(
            parse_amount("1.0000000100"),
            Err(AmountError::TooPrecise(_))
        ));
    }

    #[test]
    fn rejects_what_is_not_a_plain_amount() {
        for bad in [
            "",
            "-1",
            "+1",
            "1e3",
            "1.",
            ".5",
            "0x10",
            "1,5",
            "1.0000001",
            "NaN",
            "1 000",
        ] {
            assert!(parse_amount(bad).is_err(), "{bad:?} must be refused");
        }
        assert!(matches!(
            parse_amount("9007199255"),
            Err(AmountError::TooLarge(_))
        ));
        assert!(matches!(
            parse_amount("99999999999999999999999"),
            Err(AmountError::TooLarge(_))
        ));
        assert_eq!(parse_amount("9007199254.740991"), Ok(MICROS_MAX));
    }

    #[test]
    fn costs_round_up() {
        let p = ModelPrice {
            input_per_million: Micros(150_000),
            cached_input_per_million: Micros(75_000),
            output_per_million: Micros(600_000),
        };
        // 1 prompt token costs 0.15 micros: charged 1.
        assert_eq!(p.bound(1, 0), Micros(1));
        assert_eq!(p.bound(0, 0), Micros(0));
        // 1000 prompt + 100 output = 150 + 60 = 210 micros exactly.
        assert_eq!(p.bound(1000, 100), Micros(210));
        // 1001 prompt = 150.15 -> 151
        assert_eq!(p.bound(1001, 0), Micros(151));
        let u = TokenUsage {
            prompt_tokens: 1000,
            completion_tokens: 100,
            cached_tokens: 400,
        };
        // 600*0.15 + 400*0.075 + 100*0.6 = 90 + 30 + 60 = 180
        assert_eq!(p.charge(&u), Micros(180));
        let u = TokenUsage {
            prompt_tokens: 10,
            completion_tokens: 0,
            cached_tokens: 99,
        };
        assert_eq!(
            p.charge(&u),
            Micros(1),
            "cached never exceeds prompt; 10*0.075 rounds up"
        );
        assert_eq!(p.max_output_within(1000, Micros(210)), Some(100));
        assert_eq!(p.max_output_within(1000, Micros(209)), Some(98));
        assert_eq!(p.max_output_within(1000, Micros(100)), None);
    }

    #[test]
    fn overflow_saturates_to_everything() {
        let p = ModelPrice {
            input_per_million: MICROS_MAX,
            cached_input_per_million: MICROS_MAX,
            output_per_million: MICROS_MAX,
        };
        assert_eq!(p.bound(u64::MAX, u64::MAX), MICROS_MAX);
        let t = ToolPrice {
            per_call: MICROS_MAX,
            per_unit: MICROS_MAX,
        };
        assert_eq!(t.cost(u64::MAX), MICROS_MAX);
    }

    proptest! {
        #[test]
        fn parse_display_roundtrip(v in 0u64..=MICROS_MAX.0) {
            let m = Micros(v);
            prop_assert_eq!(parse_amount(&m.to_string()), Ok(m));
        }

        #[test]
        fn charge_never_below_exact_cost(pt in 0u64..1_000_000, ct in 0u64..100_000, ip in 0u64..10_000_000, op in 0u64..10_000_000) {
            let p = ModelPrice { input_per_million: Micros(ip), cached_input_per_million: Micros(ip), output_per_million: Micros(op) };
            let exact_times_million = u128::from(pt) * u128::from(ip) + u128::from(ct) * u128::from(op);
            let charged = p.bound(pt, ct).0 as u128;
            prop_assert!(charged * 1_000_000 >= exact_times_million);
            prop_assert!(charged * 1_000_000 < exact_times_million + 1_000_000);
            if let Some(out) = p.max_output_within(pt, p.bound(pt, ct)) {
                prop_assert!(out >= ct);
                if out < u64::MAX { prop_assert!(p.bound(pt, out) <= p.bound(pt, ct)); }
            }
        }
    }
}
