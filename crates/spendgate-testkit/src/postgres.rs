//! A private PostgreSQL server for tests: Debian's `initdb` and `postgres` binaries
//! (`/usr/lib/postgresql/<version>/bin`), a cluster in a temp dir, a free port on 127.0.0.1
//! only, trust authentication, killed and removed on `Drop`. Never the shared server on 5432.

use std::fs::File;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::child::read_lossy;
use crate::net::free_port;
use crate::TestkitError;

/// Where Debian's PostgreSQL packages put their binaries (one dir per major version).
pub const POSTGRES_LIB_DIR: &str = "/usr/lib/postgresql";
/// How long `start`/`restart` wait for the server to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `initdb` may take.
const INITDB_TIMEOUT: Duration = Duration::from_secs(60);
/// How many fresh ports `start` tries when the chosen one turns out taken.
const START_ATTEMPTS: usize = 5;
const POLL: Duration = Duration::from_millis(20);
const LOG_FILE: &str = "postgres.log";
/// The user the server runs as when the tests run as root (PostgreSQL refuses root).
const SERVER_USER: &str = "postgres";

/// A private `postgres` child process. Killed (SIGKILL) and its dir removed on `Drop`.
#[derive(Debug)]
pub struct PostgresServer {
    child: Option<Child>,
    port: u16,
    bin: PathBuf,
    /// (uid, gid) the server runs as, when this process is root.
    user: Option<(u32, u32)>,
    // Last, so the directory is removed after the process is gone.
    dir: TempDir,
}

/// The newest `/usr/lib/postgresql/*/bin` holding both `initdb` and `postgres`.
fn find_bin() -> Result<PathBuf, TestkitError> {
    let missing = || TestkitError::PostgresNotInstalled {
        searched: format!("{POSTGRES_LIB_DIR}/*/bin/{{initdb,postgres}}"),
    };
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(POSTGRES_LIB_DIR)
        .map_err(|_| missing())?
        .filter_map(|e| {
            let e = e.ok()?;
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").is_file() && bin.join("postgres").is_file())
                .then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, b)| b).ok_or_else(missing)
}

/// The uid and gid of [`SERVER_USER`] from /etc/passwd.
fn server_user() -> Result<(u32, u32), TestkitError> {
    let passwd = std::fs::read_to_string("/etc/passwd")
        .map_err(|e| TestkitError::io("reading /etc/passwd", e))?;
    passwd
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.first() == Some(&SERVER_USER))
                .then(|| Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?)))?
        })
        .ok_or_else(|| TestkitError::PostgresStart {
            port: 0,
            reason: format!(
                "running as root, and PostgreSQL refuses root: no user {SERVER_USER:?} to run it as"
            ),
            log: String::new(),
        })
}

fn chown_all(path: &Path, uid: u32, gid: u32) -> Result<(), TestkitError> {
    let owner = |p: &Path| {
        rustix::fs::chown(
            p,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
        )
        .map_err(|e| TestkitError::io(format!("chown {}", p.display()), e.into()))
    };
    owner(path)?;
    if path.is_dir() {
        let entries =
            std::fs::read_dir(path).map_err(|e| TestkitError::io("reading a dir to chown", e))?;
        for e in entries.flatten() {
            chown_all(&e.path(), uid, gid)?;
        }
    }
    Ok(())
}

/// The processes whose parent is `parent` (from `/proc`).
fn children_of(parent: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // "pid (comm) state ppid ...": comm may hold anything, up to the last ')'
            let rest = &stat[stat.rfind(')')? + 1..];
            let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
            (ppid == parent).then_some(pid)
        })
        .collect()
}

impl PostgresServer {
    /// Runs `initdb` in a fresh temp dir (trust auth, superuser `postgres`) and starts the
    /// server on a free port of 127.0.0.1, waiting until it accepts connections.
    pub fn start() -> Result<PostgresServer, TestkitError> {
        let bin = find_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("spendgate-pg-")
            .tempdir()
            .map_err(|e| TestkitError::io("creating temp dir for postgres", e))?;
        let user = if rustix::process::geteuid().is_root() {
            let u = server_user()?;
            chown_all(dir.path(), u.0, u.1)?;
            Some(u)
        } else {
            None
        };
        let mut server = PostgresServer {
            child: None,
            port: 0,
            bin,
            user,
            dir,
        };
        server.initdb()?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            server.port = free_port();
            match server.launch() {
                Ok(()) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(TestkitError::NotRunning("postgres".into())))
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.user {
            cmd.uid(uid).gid(gid);
        }
        cmd.current_dir(self.dir.path()).stdin(Stdio::null());
        cmd
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn initdb(&self) -> Result<(), TestkitError> {
        let log = self.dir.path().join("initdb.log");
        let out = File::create(&log).map_err(|e| TestkitError::io("creating initdb.log", e))?;
        let err = out
            .try_clone()
            .map_err(|e| TestkitError::io("duplicating initdb.log", e))?;
        if let Some((uid, gid)) = self.user {
            chown_all(&log, uid, gid)?;
        }
        let mut child = self
            .command("initdb")
            .arg("-D")
            .arg(self.data())
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|e| TestkitError::io("spawning initdb", e))?;
        let deadline = Instant::now() + INITDB_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => {
                    return Err(TestkitError::PostgresStart {
                        port: 0,
                        reason: format!("initdb exited with {status}"),
                        log: read_lossy(&log),
                    })
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(TestkitError::Timeout {
                        what: "initdb".into(),
                        elapsed_ms: INITDB_TIMEOUT.as_millis(),
                    });
                }
            }
        }
    }

    fn launch(&mut self) -> Result<(), TestkitError> {
        let log_path = self.dir.path().join(LOG_FILE);
        let out =
            File::create(&log_path).map_err(|e| TestkitError::io("creating postgres.log", e))?;
        let err = out
            .try_clone()
            .map_err(|e| TestkitError::io("duplicating postgres.log", e))?;
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("-k")
            .arg(self.dir.path())
            .args(["-c", "fsync=off", "-c", "max_connections=50"])
            // (its own process group: a kill takes its backends with it)
            .process_group(0)
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|e| TestkitError::io("spawning postgres", e))?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(TestkitError::PostgresStart {
                        port: self.port,
                        reason: format!("postgres exited with {status}"),
                        log: read_lossy(&log_path),
                    });
                }
            }
            let log = read_lossy(&log_path);
            if log.contains("ready to accept connections")
                && TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(TestkitError::PostgresStart {
                    port: self.port,
                    reason: "did not accept connections in time".into(),
                    log,
                });
            }
            std::thread::sleep(POLL);
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// SIGKILL, as a crash (the cluster stays; [`PostgresServer::restart`] recovers it).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // (each backend calls setsid(): neither the postmaster's death nor a kill of its
            // process group stops one at once, and a connection's backend would go on
            // answering; they are killed one by one, as a machine that dies kills them)
            for pid in children_of(child.id()) {
                if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
            if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // (the server's own children go with the postmaster; wait until the port is free)
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        let _ = std::fs::remove_file(self.data().join("postmaster.pid"));
    }

    /// Starts the killed server again on the same port and data.
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.kill();
        self.launch()
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.kill();
    }
}
