//! The listening socket with limits: at most [`CONNECTIONS_MAX`] connections at once (past
//! it, new ones wait in the kernel's backlog rather than take a file descriptor each until
//! the process runs out), and a connection on which nothing is read or written for its idle
//! time is closed (a client that opens connections and sends nothing holds none for long).
//! The idle time is at least [`CONNECTION_IDLE_MIN`] and always longer than the longest
//! upstream timeout, so that a call waiting on a slow upstream (streamed or not) is never cut
//! by it.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Connections served at once by one process.
pub const CONNECTIONS_MAX: usize = 16_384;
/// Shortest idle time of a connection.
pub const CONNECTION_IDLE_MIN: Duration = Duration::from_secs(120);
/// How much longer than the longest upstream timeout a connection may stay idle.
pub const CONNECTION_IDLE_MARGIN: Duration = Duration::from_secs(30);

/// The idle time of connections, given the longest upstream timeout.
pub fn idle_time(longest_upstream: Duration) -> Duration {
    CONNECTION_IDLE_MIN.max(longest_upstream + CONNECTION_IDLE_MARGIN)
}

/// A TCP listener whose connections are counted and closed when idle.
pub struct Bounded {
    inner: TcpListener,
    slots: Arc<Semaphore>,
    idle: Duration,
}

impl Bounded {
    pub fn new(inner: TcpListener, max: usize, idle: Duration) -> Bounded {
        assert!(max > 0, "a listener serves at least one connection");
        Bounded {
            inner,
            slots: Arc::new(Semaphore::new(max)),
            idle,
        }
    }
}

impl axum::serve::Listener for Bounded {
    type Io = IdleIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (IdleIo, SocketAddr) {
        // (the semaphore is never closed)
        let slot = match self.slots.clone().acquire_owned().await {
            Ok(slot) => slot,
            Err(_) => std::future::pending().await,
        };
        let (tcp, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        (IdleIo::new(tcp, slot, self.idle), addr)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection that fails once nothing was read or written on it for its idle time, and
/// holds its listener's slot until dropped.
pub struct IdleIo {
    tcp: TcpStream,
    idle: Duration,
    /// The last time bytes moved.
    last: Instant,
    /// Fires at `last + idle` at the earliest (moved forward lazily when it fires early).
    timer: Pin<Box<Sleep>>,
    _slot: OwnedSemaphorePermit,
}

impl IdleIo {
    fn new(tcp: TcpStream, slot: OwnedSemaphorePermit, idle: Duration) -> IdleIo {
        let now = Instant::now();
        IdleIo {
            tcp,
            idle,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + idle)),
            _slot: slot,
        }
    }

    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nodelay(on)
    }

    /// The outcome of a write: bytes written are activity; a pending write may have idled.
    fn wrote(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match r {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    self.last = Instant::now();
                }
                Poll::Ready(r)
            }
            Poll::Pending => self.idle_check(cx).map(Err),
        }
    }

    /// After an operation that is pending: an error once the connection has been idle for
    /// its idle time, else pending (with the timer's wake-up registered).
    fn idle_check(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let due = self.last + self.idle;
            if Instant::now() >= due {
                return Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection idle for too long",
                ));
            }
            self.timer.as_mut().reset(due);
        }
    }
}

impl AsyncRead for IdleIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.tcp).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    this.last = Instant::now();
                }
                Poll::Ready(r)
            }
            Poll::Pending => this.idle_check(cx).map(Err),
        }
    }
}

impl AsyncWrite for IdleIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.tcp).poll_write(cx, buf);
        this.wrote(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs);
        this.wrote(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn idle_time_outlasts_every_upstream() {
        assert_eq!(idle_time(Duration::from_secs(10)), CONNECTION_IDLE_MIN);
        assert_eq!(
            idle_time(Duration::from_secs(600)),
            Duration::from_secs(630)
        );
    }

    /// An idle connection is closed after its idle time; one that keeps talking is not; past
    /// the cap, a new connection waits until a slot frees.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_close_and_the_cap_holds() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let mut listener = Bounded::new(tcp, 1, Duration::from_millis(300));
        let server = tokio::spawn(async move {
            loop {
                let (mut io, _) = listener.accept().await;
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    // Echo until the connection ends or idles out.
                    while let Ok(n) = io.read(&mut buf).await {
                        if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let mut talker = TcpStream::connect(addr).await.expect("connect");
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            talker.write_all(b"hi").await.expect("write");
            let mut buf = [0u8; 2];
            talker
                .read_exact(&mut buf)
                .await
                .expect("echo while talking");
        }
        // A second connection waits for the one slot (connect completes in the backlog,
        // but nothing is served).
        let mut waiting = TcpStream::connect(addr).await.expect("connect");
        waiting.write_all(b"x").await.expect("write");
        let mut buf = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(200), waiting.read(&mut buf)).await;
        assert!(early.is_err(), "served past the cap: {early:?}");
        // The talker goes quiet: its connection is closed after the idle time, and the
        // waiting one is served.
        let n = tokio::time::timeout(Duration::from_secs(2), talker.read(&mut buf))
            .await
            .expect("closed in time")
            .unwrap_or(0);
        assert_eq!(n, 0, "the idle connection was closed");
        let n = tokio::time::timeout(Duration::from_secs(2), waiting.read(&mut buf))
            .await
            .expect("served once a slot freed")
            .expect("read");
        assert_eq!((n, buf[0]), (1, b'x'));
        server.abort();
    }
}
