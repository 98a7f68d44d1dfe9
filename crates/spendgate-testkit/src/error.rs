use std::path::PathBuf;

/// Errors reported by the testkit.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// An I/O operation failed; `context` says what was being done.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// No `redis-server` binary could be found.
    #[error(
        "redis-server not found (looked at {searched}); install it with `apt-get install -y redis-server`"
    )]
    RedisNotInstalled { searched: String },

    /// No PostgreSQL server binaries could be found.
    #[error(
        "PostgreSQL's initdb and postgres not found (looked for {searched}); install them with `apt-get install -y postgresql`"
    )]
    PostgresNotInstalled { searched: String },

    /// `initdb` or `postgres` failed.
    #[error("postgres on port {port} failed to start: {reason}\n--- log ---\n{log}")]
    PostgresStart {
        port: u16,
        reason: String,
        log: String,
    },

    /// `redis-server` exited or never answered PING.
    #[error("redis-server on port {port} failed to start: {reason}\n--- redis log ---\n{log}")]
    RedisStart {
        port: u16,
        reason: String,
        log: String,
    },

    /// Redis answered a command with an error reply (`-ERR ...`).
    #[error("redis error reply: {0}")]
    Redis(String),

    /// The bytes received from Redis were not valid RESP.
    #[error("RESP protocol error: {0}")]
    Protocol(String),

    /// Something did not happen within the allowed time.
    #[error("timed out after {elapsed_ms} ms: {what}")]
    Timeout { what: String, elapsed_ms: u128 },

    /// Sending a signal failed.
    #[error("sending {signal} to pid {pid} failed: {source}")]
    Signal {
        signal: String,
        pid: u32,
        #[source]
        source: rustix::io::Errno,
    },

    /// The operation needs a running process, but it is not running.
    #[error("process is not running: {0}")]
    NotRunning(String),

    /// A workspace binary was not found.
    #[error(
        "binary `{name}` not found (searched: {searched:?}); build it first, e.g. `cargo build --bin {name}`"
    )]
    BinaryNotFound {
        name: String,
        searched: Vec<PathBuf>,
    },
}

impl TestkitError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        TestkitError::Io {
            context: context.into(),
            source,
        }
    }
}
