use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::TestkitError;

/// The shared developer Redis port; never handed out.
const SHARED_REDIS_PORT: u16 = 6379;

/// A free TCP port on 127.0.0.1 (bind `:0`, read the port, drop the listener).
///
/// There is an inherent race: another process may grab the port before the
/// caller binds it. Callers that spawn servers should retry on "address in use".
///
/// # Panics
/// If binding a loopback socket fails (the machine has no usable loopback).
pub fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0 to find a free port: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("cannot read local address of 127.0.0.1:0 listener: {e}"))
            .port();
        if port != SHARED_REDIS_PORT {
            return port;
        }
    }
}

pub(crate) fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// Wait until a TCP connect to `127.0.0.1:port` succeeds (bounded by `timeout`).
pub fn wait_for_port(port: u16, timeout: Duration) -> Result<(), TestkitError> {
    let start = Instant::now();
    let addr = loopback(port);
    loop {
        let remaining = timeout.saturating_sub(start.elapsed());
        let attempt = remaining.min(Duration::from_millis(250));
        if !attempt.is_zero() && TcpStream::connect_timeout(&addr, attempt).is_ok() {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(TestkitError::Timeout {
                what: format!("waiting for a TCP listener on 127.0.0.1:{port}"),
                elapsed_ms: start.elapsed().as_millis(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
