//! The process's open files limit, raised for the connection bounds.

use crate::CONNECTIONS_MAX;

/// Open files a gateway wants: every client connection ([`CONNECTIONS_MAX`]), as many to
/// upstreams, and room for the store, the alert webhook and logs.
pub const OPEN_FILES_WANTED: u64 = 2 * CONNECTIONS_MAX as u64 + 1024;

/// Raises this process's soft limit on open files to [`OPEN_FILES_WANTED`] (at most the hard
/// limit; never lowers it), so the gateway's own connection bound is what binds, not a
/// distribution's default of 1,024 (past it `accept` fails and clients see resets). Returns
/// the soft limit now in force (`None`: unlimited).
pub fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let now = getrlimit(Resource::Nofile);
    let current = now.current?;
    let target = now
        .maximum
        .map_or(OPEN_FILES_WANTED, |hard| hard.min(OPEN_FILES_WANTED));
    if target <= current {
        return Some(current);
    }
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(target),
            maximum: now.maximum,
        },
    ) {
        Ok(()) => Some(target),
        Err(e) => {
            tracing::warn!(error = %e, current, target, "could not raise the open files limit");
            Some(current)
        }
    }
}
