//! The proxy's named bounds.

use std::time::Duration;

/// Largest proxied request body.
pub const PROXY_BODY_BYTES_MAX: usize = 4 * 1024 * 1024;
/// Largest non-streamed upstream answer read.
pub const UPSTREAM_BODY_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Longest SSE line buffered while looking for the usage chunk.
pub const SSE_LINE_BYTES_MAX: usize = 1024 * 1024;
/// Messages in one request.
pub const MESSAGES_MAX: usize = 4096;
/// Pauses before each retry of a proxied step's resolution that could not reach the store
/// (about 30 s in all). The hold expires, charged in full, if none lands before its lease
/// runs out; a later retry that commits more than that is still charged the difference (a
/// late overrun, SPEC I1b), so retries go on past a lease.
pub const SETTLE_RETRY_PAUSES: [Duration; 7] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
    Duration::from_secs(15),
];
/// Resolutions being retried in the background at most (per process); past it a failed
/// resolution is not retried: its hold expires and is charged in full.
pub const SETTLE_RETRIES_MAX: usize = 4096;
/// The shortest period between two renewals of a proxied run's lease.
pub const LEASE_RENEWAL_MIN: Duration = Duration::from_millis(100);
/// Error statuses by which the upstream itself says it did no paid work: the request was
/// refused (bad, unauthorized, not found, too large, rate limited) or failed in the server
/// (500, 503). Any other error status (a 502 or 504 of a gateway in front of the provider, a
/// 408 or a CDN's 52x) may come after the work was done: charged in full.
pub const NO_WORK_STATUSES: [u16; 11] = [400, 401, 403, 404, 409, 413, 415, 422, 429, 500, 503];
