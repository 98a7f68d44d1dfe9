use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::signal::Signal;
use tempfile::TempDir;

use crate::child::read_lossy;
use crate::net::{free_port, loopback};
use crate::{signal, TestkitError};

/// Where the `redis-server` binary is expected (Debian/Ubuntu package).
/// If it is missing, `redis-server` is also looked up on `$PATH`.
pub const REDIS_SERVER_PATH: &str = "/usr/bin/redis-server";

/// How long `start`/`restart` wait for the server to answer PING (a restart loads its AOF,
/// which on a loaded 2-core machine has taken more than 5 s; a 20-minute chaos run's Redis
/// then stayed down and voided the run).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Default read/write timeout of [`RedisServer::command`].
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `shutdown` waits after SIGTERM before resorting to SIGKILL.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How many fresh ports `start` tries when the chosen one turns out taken.
const START_ATTEMPTS: usize = 5;
const POLL: Duration = Duration::from_millis(10);
const LOG_FILE: &str = "redis.log";
const STDIO_FILE: &str = "redis.stdio";

/// Options for [`RedisServer::start`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisOptions {
    /// Turn on the append-only file with `appendfsync always`, so every
    /// acknowledged write survives even a SIGKILL.
    pub appendonly: bool,
    /// `maxmemory-policy`, e.g. `"allkeys-lru"`; `None` means `noeviction`.
    pub maxmemory_policy: Option<String>,
    /// Extra command-line arguments appended last (so they override the
    /// defaults), e.g. `["--maxmemory", "10mb"]`.
    pub extra_args: Vec<String>,
    /// The server binary; `None` means `redis-server` (see [`REDIS_SERVER_PATH`]).
    /// Any server that speaks Redis 7's protocol and options, e.g. `valkey-server`.
    pub binary: Option<PathBuf>,
}

/// A private `redis-server` child process on a free loopback port with its
/// own temp dir. Killed (SIGKILL) and its dir removed on `Drop`.
///
/// The `DEBUG` command is enabled for local connections (Redis >= 7).
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    opts: RedisOptions,
    binary: PathBuf,
    paused: AtomicBool,
    // Last, so the directory is removed after the process is gone.
    dir: TempDir,
}

/// A RESP (v2) reply, as returned by [`RedisServer::query`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    /// `+OK`
    Simple(String),
    /// `-ERR ...`
    Error(String),
    /// `:42`
    Integer(i64),
    /// `$n` bulk string; `None` is the null bulk string (`$-1`).
    Bulk(Option<Vec<u8>>),
    /// `*n` array; `None` is the null array (`*-1`).
    Array(Option<Vec<RespValue>>),
}

impl RespValue {
    /// Render as text the way [`RedisServer::command`] does: simple strings,
    /// integers and bulk strings as their text (bulk decoded lossily as
    /// UTF-8), nulls as `(nil)`, errors as `(error) MSG`, arrays as their
    /// elements' renderings joined with `\n`.
    pub fn to_text(&self) -> String {
        match self {
            RespValue::Simple(s) => s.clone(),
            RespValue::Error(e) => format!("(error) {e}"),
            RespValue::Integer(i) => i.to_string(),
            RespValue::Bulk(Some(b)) => String::from_utf8_lossy(b).into_owned(),
            RespValue::Bulk(None) | RespValue::Array(None) => "(nil)".to_string(),
            RespValue::Array(Some(items)) => items
                .iter()
                .map(RespValue::to_text)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

impl fmt::Display for RespValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_text())
    }
}

/// Why one launch attempt failed.
struct LaunchFailure {
    error: TestkitError,
    /// The port was taken by someone else; a retry may help.
    port_conflict: bool,
}

impl RedisServer {
    /// Start a `redis-server` on a free port of 127.0.0.1 with its own temp
    /// dir as `--dir`, no RDB snapshots, the log in that dir, and wait (up to
    /// 5 s) until it answers PING.
    pub fn start(opts: RedisOptions) -> Result<RedisServer, TestkitError> {
        let binary = match &opts.binary {
            Some(b) if b.is_file() => b.clone(),
            Some(b) => {
                return Err(TestkitError::RedisNotInstalled {
                    searched: b.display().to_string(),
                })
            }
            None => find_redis_server()?,
        };
        let dir = tempfile::Builder::new()
            .prefix("spendgate-redis-")
            .tempdir()
            .map_err(|e| TestkitError::io("creating temp dir for redis-server", e))?;
        let mut server = RedisServer {
            child: None,
            port: 0,
            opts,
            binary,
            paused: AtomicBool::new(false),
            dir,
        };
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            server.port = free_port();
            match server.launch() {
                Ok(()) => return Ok(server),
                Err(f) if f.port_conflict => last_error = Some(f.error),
                Err(f) => return Err(f.error),
            }
        }
        Err(last_error.unwrap_or_else(|| TestkitError::RedisStart {
            port: server.port,
            reason: "no start attempt made".into(),
            log: server.log(),
        }))
    }

    /// The TCP port (on 127.0.0.1) the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT/0`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The process id, if the server process is currently owned (started and
    /// not yet stopped).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's working directory (`--dir`: AOF files, log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The options the server was started with.
    pub fn options(&self) -> &RedisOptions {
        &self.opts
    }

    /// The server log so far (plus anything it printed to stdout/stderr),
    /// for failure messages.
    pub fn log(&self) -> String {
        let mut out = read_lossy(&self.dir.path().join(STDIO_FILE));
        out.push_str(&read_lossy(&self.dir.path().join(LOG_FILE)));
        out
    }

    /// Whether the server process is still alive (a paused server counts as
    /// running).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Freeze the server with SIGSTOP: connections are still accepted by the
    /// kernel but nothing is answered until [`resume`](Self::resume).
    pub fn pause(&self) -> Result<(), TestkitError> {
        let pid = self.running_pid("pause")?;
        signal::send(pid, Signal::Stop)?;
        self.paused.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Continue a paused server with SIGCONT.
    pub fn resume(&self) -> Result<(), TestkitError> {
        let pid = self.running_pid("resume")?;
        signal::send(pid, Signal::Cont)?;
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Crash the server: SIGKILL and reap it. Nothing is flushed (with
    /// `appendonly` the AOF, fsynced on every write, still has all
    /// acknowledged writes). A no-op if it is not running.
    pub fn stop(&mut self) -> Result<(), TestkitError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        self.paused.store(false, Ordering::SeqCst);
        let pid = child.id();
        if matches!(child.try_wait(), Ok(Some(_))) {
            return Ok(());
        }
        child
            .kill()
            .map_err(|e| TestkitError::io(format!("killing redis-server pid {pid}"), e))?;
        child
            .wait()
            .map_err(|e| TestkitError::io(format!("waiting for redis-server pid {pid}"), e))?;
        Ok(())
    }

    /// Graceful shutdown: SIGTERM (after SIGCONT if paused) and wait for the
    /// server to exit. If it has not exited after 10 s it is killed and a
    /// timeout error is returned. A no-op if it is not running.
    pub fn shutdown(&mut self) -> Result<(), TestkitError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = child.id();
        if matches!(child.try_wait(), Ok(Some(_))) {
            self.paused.store(false, Ordering::SeqCst);
            return Ok(());
        }
        if self.paused.swap(false, Ordering::SeqCst) {
            let _ = signal::send(pid, Signal::Cont);
        }
        let start = Instant::now();
        if let Err(e) = signal::send(pid, Signal::Term) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        while start.elapsed() < SHUTDOWN_GRACE {
            match child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => std::thread::sleep(POLL),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(TestkitError::io(
                        format!("waiting for redis-server pid {pid}"),
                        e,
                    ));
                }
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        Err(TestkitError::Timeout {
            what: format!("redis-server pid {pid} to exit after SIGTERM (it was then killed)"),
            elapsed_ms: start.elapsed().as_millis(),
        })
    }

    /// Start the server again on the same port and dir with the same options
    /// (so an AOF is reloaded) and wait until it answers PING. If it is still
    /// running it is first shut down gracefully.
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.shutdown()?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.launch() {
                Ok(()) => return Ok(()),
                // The old socket may linger briefly; give it a moment.
                Err(f) if f.port_conflict && attempt < 3 => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(f) => return Err(f.error),
            }
        }
    }

    /// Send one command and return the reply rendered as text (see
    /// [`RespValue::to_text`]; e.g. `OK`, `42`, the bulk string, `(nil)`).
    /// An error reply becomes `Err(TestkitError::Redis(msg))`.
    /// Uses a fresh connection with a 10 s read/write timeout.
    pub fn command(&self, args: &[&str]) -> Result<String, TestkitError> {
        self.command_with_timeout(args, COMMAND_TIMEOUT)
    }

    /// [`command`](Self::command) with a custom connect/read/write timeout.
    pub fn command_with_timeout(
        &self,
        args: &[&str],
        timeout: Duration,
    ) -> Result<String, TestkitError> {
        match self.query_with_timeout(args, timeout)? {
            RespValue::Error(e) => Err(TestkitError::Redis(e)),
            other => Ok(other.to_text()),
        }
    }

    /// Send one command and return the raw reply (error replies are returned
    /// as [`RespValue::Error`], not as `Err`).
    pub fn query(&self, args: &[&str]) -> Result<RespValue, TestkitError> {
        self.query_with_timeout(args, COMMAND_TIMEOUT)
    }

    /// [`query`](Self::query) with a custom connect/read/write timeout.
    pub fn query_with_timeout(
        &self,
        args: &[&str],
        timeout: Duration,
    ) -> Result<RespValue, TestkitError> {
        resp_query(self.port, args, timeout)
    }

    fn running_pid(&self, what: &str) -> Result<u32, TestkitError> {
        self.pid().ok_or_else(|| {
            TestkitError::NotRunning(format!(
                "cannot {what} redis-server on port {}: it is stopped",
                self.port
            ))
        })
    }

    fn args(&self) -> Vec<OsString> {
        let dir = self.dir.path();
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |k: &str, v: &dyn AsRef<std::ffi::OsStr>| {
            args.push(k.into());
            args.push(v.as_ref().to_owned());
        };
        push("--port", &self.port.to_string());
        push("--bind", &"127.0.0.1");
        push("--protected-mode", &"yes");
        push("--dir", &dir);
        push("--save", &"");
        push("--daemonize", &"no");
        push("--logfile", &dir.join(LOG_FILE));
        push(
            "--appendonly",
            &if self.opts.appendonly { "yes" } else { "no" },
        );
        if self.opts.appendonly {
            push("--appendfsync", &"always");
        }
        push(
            "--maxmemory-policy",
            &self
                .opts
                .maxmemory_policy
                .as_deref()
                .unwrap_or("noeviction"),
        );
        if redis_major_version(&self.binary).is_some_and(|v| v >= 7) {
            push("--enable-debug-command", &"local");
        }
        args.extend(self.opts.extra_args.iter().map(OsString::from));
        args
    }

    /// Spawn on `self.port` and wait for PING; on failure nothing is left running.
    fn launch(&mut self) -> Result<(), LaunchFailure> {
        let fail = |error| LaunchFailure {
            error,
            port_conflict: false,
        };
        let stdio_path = self.dir.path().join(STDIO_FILE);
        let out = File::create(&stdio_path).map_err(|e| {
            fail(TestkitError::io(
                format!("creating {}", stdio_path.display()),
                e,
            ))
        })?;
        let err = out
            .try_clone()
            .map_err(|e| fail(TestkitError::io("duplicating redis stdio file", e)))?;
        let mut cmd = Command::new(&self.binary);
        cmd.args(self.args())
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let child = cmd.spawn().map_err(|e| {
            fail(TestkitError::io(
                format!("spawning {}", self.binary.display()),
                e,
            ))
        })?;
        let pid = child.id();
        self.child = Some(child);
        self.paused.store(false, Ordering::SeqCst);

        match self.wait_ready(pid) {
            Ok(()) => Ok(()),
            Err(reason) => {
                if let Some(mut child) = self.child.take() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                let log = self.log();
                let port_conflict =
                    reason.contains("another process") || log.contains("Address already in use");
                Err(LaunchFailure {
                    error: TestkitError::RedisStart {
                        port: self.port,
                        reason,
                        log: tail(&log, 40),
                    },
                    port_conflict,
                })
            }
        }
    }

    /// Wait until *our* process answers PING on the port.
    fn wait_ready(&mut self, pid: u32) -> Result<(), String> {
        let start = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut() {
                match child.try_wait() {
                    Ok(Some(status)) => return Err(format!("redis-server exited: {status}")),
                    Ok(None) => {}
                    Err(e) => return Err(format!("cannot wait for redis-server: {e}")),
                }
            }
            if ping(self.port, Duration::from_millis(200)) {
                // Make sure the PONG came from our process and not from some
                // other server that happened to grab the same port.
                let info = resp_query(self.port, &["INFO", "server"], Duration::from_secs(2))
                    .map(|v| v.to_text())
                    .unwrap_or_default();
                let their_pid = info
                    .lines()
                    .find_map(|l| l.strip_prefix("process_id:"))
                    .and_then(|p| p.trim().parse::<u32>().ok());
                return match their_pid {
                    Some(p) if p == pid => Ok(()),
                    Some(p) => Err(format!(
                        "port {} is served by another process (pid {p}, ours is {pid})",
                        self.port
                    )),
                    None => Err(format!("unexpected INFO reply: {info:?}")),
                };
            }
            if start.elapsed() >= START_TIMEOUT {
                return Err(format!("no +PONG within {} ms", START_TIMEOUT.as_millis()));
            }
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.paused.load(Ordering::SeqCst) {
                let _ = signal::send(child.id(), Signal::Cont);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Locate `redis-server`: [`REDIS_SERVER_PATH`], then `$PATH`.
fn find_redis_server() -> Result<PathBuf, TestkitError> {
    let default = PathBuf::from(REDIS_SERVER_PATH);
    if default.is_file() {
        return Ok(default);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("redis-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(TestkitError::RedisNotInstalled {
        searched: format!("{REDIS_SERVER_PATH} and $PATH"),
    })
}

/// Major version of a server binary (from `--version`), cached per binary.
fn redis_major_version(binary: &Path) -> Option<u32> {
    static VERSIONS: OnceLock<Mutex<HashMap<PathBuf, Option<u32>>>> = OnceLock::new();
    let versions = VERSIONS.get_or_init(Default::default);
    if let Some(v) = versions.lock().ok()?.get(binary) {
        return *v;
    }
    let read = || {
        let out = Command::new(binary)
            .arg("--version")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        // "Redis server v=7.0.15 sha=...", "Valkey server v=8.0.1 sha=..."
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let v = text.split_whitespace().find_map(|w| w.strip_prefix("v="))?;
        v.split('.').next()?.parse().ok()
    };
    let v = read();
    versions.lock().ok()?.insert(binary.to_path_buf(), v);
    v
}

/// One raw inline `PING`; true iff the reply starts with `+PONG`.
fn ping(port: u16, timeout: Duration) -> bool {
    let Ok(stream) = TcpStream::connect_timeout(&loopback(port), timeout) else {
        return false;
    };
    if stream.set_read_timeout(Some(timeout)).is_err()
        || stream.set_write_timeout(Some(timeout)).is_err()
    {
        return false;
    }
    if (&stream).write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut line = Vec::new();
    match BufReader::new(&stream).read_until(b'\n', &mut line) {
        Ok(_) => line.starts_with(b"+PONG"),
        Err(_) => false,
    }
}

fn resp_query(port: u16, args: &[&str], timeout: Duration) -> Result<RespValue, TestkitError> {
    let started = Instant::now();
    let what = || format!("redis command {args:?} on 127.0.0.1:{port}");
    let map_io = |e: std::io::Error| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => TestkitError::Timeout {
            what: what(),
            elapsed_ms: started.elapsed().as_millis(),
        },
        _ => TestkitError::io(what(), e),
    };
    let stream = TcpStream::connect_timeout(&loopback(port), timeout).map_err(map_io)?;
    stream.set_read_timeout(Some(timeout)).map_err(map_io)?;
    stream.set_write_timeout(Some(timeout)).map_err(map_io)?;
    let _ = stream.set_nodelay(true);

    let mut req = Vec::new();
    req.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        req.extend_from_slice(a.as_bytes());
        req.extend_from_slice(b"\r\n");
    }
    (&stream).write_all(&req).map_err(map_io)?;

    let mut reader = BufReader::new(&stream);
    read_value(&mut reader, 0).map_err(|e| match e {
        ReadError::Io(e) => map_io(e),
        ReadError::Protocol(p) => TestkitError::Protocol(p),
    })
}

enum ReadError {
    Io(std::io::Error),
    Protocol(String),
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

fn read_line(r: &mut impl BufRead) -> Result<Vec<u8>, ReadError> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Err(ReadError::Protocol("connection closed before reply".into()));
    }
    if !line.ends_with(b"\r\n") {
        return Err(ReadError::Protocol(format!(
            "line not terminated by CRLF: {:?}",
            String::from_utf8_lossy(&line)
        )));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

fn parse_int(s: &[u8]) -> Result<i64, ReadError> {
    std::str::from_utf8(s)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ReadError::Protocol(format!("bad integer {:?}", String::from_utf8_lossy(s))))
}

fn read_value(r: &mut impl BufRead, depth: usize) -> Result<RespValue, ReadError> {
    if depth > 64 {
        return Err(ReadError::Protocol("reply nested too deeply".into()));
    }
    let line = read_line(r)?;
    let (&kind, rest) = line
        .split_first()
        .ok_or_else(|| ReadError::Protocol("empty reply line".into()))?;
    let text = || String::from_utf8_lossy(rest).into_owned();
    match kind {
        b'+' => Ok(RespValue::Simple(text())),
        b'-' => Ok(RespValue::Error(text())),
        b':' => Ok(RespValue::Integer(parse_int(rest)?)),
        b'$' => {
            let len = parse_int(rest)?;
            if len < 0 {
                return Ok(RespValue::Bulk(None));
            }
            let len = usize::try_from(len)
                .map_err(|_| ReadError::Protocol(format!("bulk length {len} too large")))?;
            let mut buf = vec![0u8; len + 2];
            std::io::Read::read_exact(r, &mut buf)?;
            if !buf.ends_with(b"\r\n") {
                return Err(ReadError::Protocol(
                    "bulk string not terminated by CRLF".into(),
                ));
            }
            buf.truncate(len);
            Ok(RespValue::Bulk(Some(buf)))
        }
        b'*' => {
            let n = parse_int(rest)?;
            if n < 0 {
                return Ok(RespValue::Array(None));
            }
            let mut items = Vec::new();
            for _ in 0..n {
                items.push(read_value(r, depth + 1)?);
            }
            Ok(RespValue::Array(Some(items)))
        }
        other => Err(ReadError::Protocol(format!(
            "unexpected reply type byte {:?} in {:?}",
            other as char,
            String::from_utf8_lossy(&line)
        ))),
    }
}

/// The last `n` lines of `s`.
fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> Result<RespValue, String> {
        read_value(&mut BufReader::new(bytes), 0).map_err(|e| match e {
            ReadError::Io(e) => e.to_string(),
            ReadError::Protocol(p) => p,
        })
    }

    #[test]
    fn parses_and_renders_resp() {
        assert_eq!(parse(b"+OK\r\n"), Ok(RespValue::Simple("OK".into())));
        assert_eq!(parse(b":-7\r\n"), Ok(RespValue::Integer(-7)));
        assert_eq!(parse(b"$-1\r\n"), Ok(RespValue::Bulk(None)));
        assert_eq!(
            parse(b"$4\r\na\r\nb\r\n").map(|v| v.to_text()),
            Ok("a\r\nb".to_string())
        );
        assert_eq!(
            parse(b"*2\r\n$16\r\nmaxmemory-policy\r\n$10\r\nnoeviction\r\n").map(|v| v.to_text()),
            Ok("maxmemory-policy\nnoeviction".to_string())
        );
        assert_eq!(
            parse(b"-ERR nope\r\n"),
            Ok(RespValue::Error("ERR nope".into()))
        );
        assert!(parse(b"").is_err());
        assert!(parse(b"$5\r\nab\r\n").is_err());
        assert!(parse(b"?x\r\n").is_err());
    }

    #[test]
    fn tail_keeps_last_lines() {
        assert_eq!(tail("a\nb\nc", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
