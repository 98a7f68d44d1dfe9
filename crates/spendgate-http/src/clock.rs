//! The wall clock, in seconds (session and challenge expiry).

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (0 before it).
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
