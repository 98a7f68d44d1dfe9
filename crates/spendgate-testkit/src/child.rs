use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::signal::Signal;
use tempfile::TempDir;

use crate::{signal, TestkitError};

const TERMINATE_GRACE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(10);

/// A child process that is killed (SIGKILL) and reaped on `Drop`.
///
/// Its stdout and stderr both go to one file in a private temp dir (so a pipe
/// can never fill up and block it); [`ChildGuard::output`] reads it back.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    pid: u32,
    /// Exit status once the child has been reaped.
    status: Option<ExitStatus>,
    output_path: PathBuf,
    // Kept last so the directory outlives everything else in drop order.
    _dir: TempDir,
}

impl ChildGuard {
    /// Spawn `cmd` with stdin from `/dev/null` and stdout + stderr appended to
    /// one log file in a fresh temp dir.
    pub fn spawn(mut cmd: Command) -> Result<ChildGuard, TestkitError> {
        let dir = tempfile::Builder::new()
            .prefix("spendgate-child-")
            .tempdir()
            .map_err(|e| TestkitError::io("creating temp dir for child output", e))?;
        let output_path = dir.path().join("output.log");
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&output_path)
            .map_err(|e| TestkitError::io(format!("creating {}", output_path.display()), e))?;
        // Same open file description for both streams: writes interleave in order.
        let err = out
            .try_clone()
            .map_err(|e| TestkitError::io("duplicating child output file", e))?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let child = cmd
            .spawn()
            .map_err(|e| TestkitError::io(format!("spawning {cmd:?}"), e))?;
        let pid = child.id();
        Ok(ChildGuard {
            child,
            pid,
            status: None,
            output_path,
            _dir: dir,
        })
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// SIGKILL the child (if still running) and reap it.
    pub fn kill(&mut self) -> Result<(), TestkitError> {
        if self.status.is_some() {
            return Ok(());
        }
        if self.try_reap()?.is_some() {
            return Ok(());
        }
        // std's Child::kill sends SIGKILL; it also works on a stopped process.
        self.child
            .kill()
            .map_err(|e| TestkitError::io(format!("killing pid {}", self.pid), e))?;
        self.wait_blocking()?;
        Ok(())
    }

    /// SIGTERM the child, wait up to 10 s for it to exit, then SIGKILL it.
    /// Returns its exit status (also when it had already exited before).
    pub fn terminate(&mut self) -> Result<ExitStatus, TestkitError> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        if let Some(status) = self.try_reap()? {
            return Ok(status);
        }
        signal::send(self.pid, Signal::Term)?;
        let deadline = Instant::now() + TERMINATE_GRACE;
        while Instant::now() < deadline {
            if let Some(status) = self.try_reap()? {
                return Ok(status);
            }
            std::thread::sleep(POLL);
        }
        self.child
            .kill()
            .map_err(|e| TestkitError::io(format!("killing pid {}", self.pid), e))?;
        self.wait_blocking()
    }

    /// Whether the child is still running (reaps it if it has exited).
    pub fn is_running(&mut self) -> bool {
        if self.status.is_some() {
            return false;
        }
        // An error here means the child cannot be waited for any more.
        !matches!(self.try_reap(), Ok(Some(_)) | Err(_))
    }

    /// The exit status, if the child has exited and been reaped.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            let _ = self.try_reap();
        }
        self.status
    }

    /// What the child printed so far (stdout and stderr, interleaved), for
    /// failure messages. Invalid UTF-8 is replaced.
    pub fn output(&self) -> String {
        read_lossy(&self.output_path)
    }

    /// Path of the file holding the child's stdout + stderr.
    pub fn output_path(&self) -> &std::path::Path {
        &self.output_path
    }

    fn try_reap(&mut self) -> Result<Option<ExitStatus>, TestkitError> {
        let status = self
            .child
            .try_wait()
            .map_err(|e| TestkitError::io(format!("waiting for pid {}", self.pid), e))?;
        if status.is_some() {
            self.status = status;
        }
        Ok(status)
    }

    fn wait_blocking(&mut self) -> Result<ExitStatus, TestkitError> {
        let status = self
            .child
            .wait()
            .map_err(|e| TestkitError::io(format!("waiting for pid {}", self.pid), e))?;
        self.status = Some(status);
        Ok(status)
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub(crate) fn read_lossy(path: &std::path::Path) -> String {
    match File::open(path) {
        Ok(mut f) => {
            let mut buf = Vec::new();
            let _ = std::io::Read::read_to_end(&mut f, &mut buf);
            String::from_utf8_lossy(&buf).into_owned()
        }
        Err(_) => String::new(),
    }
}
