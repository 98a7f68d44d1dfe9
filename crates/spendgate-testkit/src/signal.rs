use rustix::io::Errno;
use rustix::process::{kill_process, Pid};

use crate::TestkitError;

/// The signals the testkit sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    Term,
    Stop,
    Cont,
}

impl Signal {
    fn name(self) -> &'static str {
        match self {
            Signal::Term => "SIGTERM",
            Signal::Stop => "SIGSTOP",
            Signal::Cont => "SIGCONT",
        }
    }

    fn raw(self) -> rustix::process::Signal {
        match self {
            Signal::Term => rustix::process::Signal::TERM,
            Signal::Stop => rustix::process::Signal::STOP,
            Signal::Cont => rustix::process::Signal::CONT,
        }
    }
}

/// Send `sig` to `pid` (never to a process group: a pid of 0 or one that does not fit is
/// refused as invalid).
pub(crate) fn send(pid: u32, sig: Signal) -> Result<(), TestkitError> {
    let error = |source| TestkitError::Signal {
        signal: sig.name().to_string(),
        pid,
        source,
    };
    let target = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| error(Errno::INVAL))?;
    kill_process(target, sig.raw()).map_err(error)
}
