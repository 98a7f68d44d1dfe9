//! Values as the config file writes them, and the masking of secrets.

use crate::diagnostics::toml_str;
use spendgate_core::{Micros, ReservationMode};

/// Written by `render_effective` in place of a literal secret; refused when loaded back, so a
/// copied `check-config` output never turns "***" into a real token.
pub(crate) const MASK: &str = "***";

/// A URL as check-config shows it: user info and query masked (they carry credentials), and
/// with `mask_path` the path too.
pub(crate) fn shown_url(u: &str, mask_path: bool) -> String {
    let Ok(mut url) = url::Url::parse(u) else {
        return MASK.to_string();
    };
    if !url.username().is_empty() || url.password().is_some() {
        let _ = url.set_username(MASK);
        let _ = url.set_password(None);
    }
    if url.query().is_some() {
        url.set_query(Some(MASK));
    }
    if mask_path && url.path() != "/" {
        url.set_path(MASK);
    }
    url.to_string()
}

pub(crate) fn masked_problem() -> String {
    format!(
        "contains {}, the mask `spendgate check-config` prints: give the real value or env:NAME",
        toml_str(MASK)
    )
}

/// An amount as the shortest exact decimal: 50 → "50", 0.075 → "0.075".
pub(crate) fn amount_text(m: Micros) -> String {
    let s = m.to_string();
    let s = s.trim_end_matches('0');
    s.strip_suffix('.').unwrap_or(s).to_string()
}

/// `run.mode` as the file writes it.
pub(crate) fn mode_name(mode: ReservationMode) -> &'static str {
    match mode {
        ReservationMode::PerStep => "per_step",
        ReservationMode::WholeRun => "whole_run",
    }
}
