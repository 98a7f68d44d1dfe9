//! Test support for spendgate integration tests.
//!
//! * [`free_port`] / [`wait_for_port`]: loopback port helpers.
//! * [`RedisServer`]: a private `redis-server` child process (own port, own temp
//!   dir) that can be paused, crashed, shut down and restarted. Tests must never
//!   touch the shared Redis on `127.0.0.1:6379`; this launcher never uses it.
//! * [`PostgresServer`]: a private PostgreSQL server (Debian's `initdb` and `postgres`, own
//!   port, own temp dir, trust auth on 127.0.0.1), killable and restartable. Never the shared
//!   server on 5432.
//! * [`ChildGuard`]: any child process, killed and reaped on `Drop`.
//! * [`workspace_bin`]: locate a binary of this workspace built by cargo.
//!
//! Everything here is synchronous `std` code (no tokio runtime needed) and
//! cleans up on `Drop`, including while a test unwinds from a panic.
//!
//! Limitation: if the test process itself is killed with SIGKILL (or aborts),
//! `Drop` cannot run and children are left behind; Ctrl-C in a terminal still
//! reaches them because they stay in the test's process group.

mod bin;
mod child;
mod error;
mod net;
mod postgres;
mod redis;
mod signal;

pub use bin::workspace_bin;
pub use child::ChildGuard;
pub use error::TestkitError;
pub use net::{free_port, wait_for_port};
pub use postgres::{PostgresServer, POSTGRES_LIB_DIR};
pub use redis::{RedisOptions, RedisServer, RespValue, REDIS_SERVER_PATH};
