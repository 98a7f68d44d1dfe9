use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::TestkitError;

/// Send `sig` to `pid`.
pub(crate) fn send(pid: u32, sig: Signal) -> Result<(), TestkitError> {
    let raw = i32::try_from(pid).map_err(|_| TestkitError::Signal {
        signal: sig.to_string(),
        pid,
        source: nix::Error::EINVAL,
    })?;
    kill(Pid::from_raw(raw), sig).map_err(|source| TestkitError::Signal {
        signal: sig.to_string(),
        pid,
        source,
    })
}
