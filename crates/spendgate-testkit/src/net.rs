use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::TestkitError;

/// The shared developer Redis port; never handed out.
const SHARED_REDIS_PORT: u16 = 6379;

/// Ports handed out by [`free_port`] come from this range, below the usual
/// Linux ephemeral range (32768–60999): outgoing connections take their source
/// ports from the ephemeral range, so a port picked there can be taken by some
/// client socket between `free_port` and the server's bind (a real CI failure).
const PORT_RANGE: std::ops::Range<u16> = 20_000..32_000;

/// Next candidate in [`PORT_RANGE`]; starts at an offset derived from the pid so
/// concurrent test processes walk different parts of the range, and advances
/// atomically so two threads of one process never get the same port.
static NEXT_PORT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(u32::MAX);

/// A free TCP port on 127.0.0.1, outside the ephemeral range (see [`PORT_RANGE`]).
///
/// Each call probes candidates by binding them; a port is handed out at most
/// once per process. Another process may still grab it before the caller binds
/// it, so callers that spawn servers should retry on "address in use".
///
/// # Panics
/// If no port in the range can be bound (the machine has no usable loopback).
pub fn free_port() -> u16 {
    use std::sync::atomic::Ordering;
    let span = u32::from(PORT_RANGE.end - PORT_RANGE.start);
    let _ = NEXT_PORT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7919) % span,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..span {
        let offset = NEXT_PORT.fetch_add(1, Ordering::SeqCst) % span;
        let port = PORT_RANGE.start + u16::try_from(offset).unwrap_or(0);
        if port == SHARED_REDIS_PORT {
            continue;
        }
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on 127.0.0.1 in {PORT_RANGE:?}");
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
