//! The listening socket with limits: at most [`CONNECTIONS_MAX`] connections at once (past
//! it, new ones wait in the kernel's backlog rather than take a file descriptor each until
//! the process runs out), and a connection on which nothing is read or written for its idle
//! time is closed (a client that opens connections and sends nothing holds none for long).
//! The idle time is at least [`CONNECTION_IDLE_MIN`] and always longer than the longest
//! upstream timeout, so that a call waiting on a slow upstream (streamed or not) is never cut
//! by it. [`serve`] runs HTTP/1 on it with a bound on the time a request's head may take
//! ([`HEADER_READ_TIMEOUT`]: a client that trickles its headers a byte at a time, or keeps a
//! connection open between requests, holds its slot for no longer), and drains in-flight
//! requests on shutdown for at most a bounded time.

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

/// Longest time from the moment a connection waits for a request (its first, or the next one
/// on a kept-alive connection) until that request's whole head has arrived. Past it the
/// connection is closed. (axum's own `serve` sets no timer, so hyper's default of the same
/// length never runs there.)
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

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

/// Serves `app` over HTTP/1 on `listener` (each connection's peer address as axum's
/// `ConnectInfo<SocketAddr>`, Nagle off so relayed chunks are not held back, a request's head
/// bounded by `header_read` — [`HEADER_READ_TIMEOUT`] outside tests) until `shutdown`
/// completes; then stops accepting and lets in-flight requests finish for at most `drain`,
/// after which the remaining connections are dropped (a call cut this way leaves its
/// reservation held: it expires and is charged in full).
pub async fn serve(
    mut listener: Bounded,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    header_read: Duration,
    drain: Duration,
) -> io::Result<()> {
    use axum::extract::ConnectInfo;
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_read);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (io, peer) = tokio::select! {
            accepted = axum::serve::Listener::accept(&mut listener) => accepted,
            () = shutdown.as_mut() => break,
        };
        let _ = io.set_nodelay(true);
        let service = tower::ServiceExt::map_request(
            app.clone(),
            move |mut req: axum::http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req
            },
        );
        let conn = http.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::trace!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            drain_s = drain.as_secs(),
            "shutdown: connections still open after the drain time are dropped"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Starts `serve` with a route that answers the peer address it was given, and one that
    /// takes `slow` to answer; the returned sender begins shutdown.
    async fn start(
        header_read: Duration,
        drain: Duration,
        slow: Duration,
    ) -> (
        SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<io::Result<()>>,
    ) {
        use axum::extract::ConnectInfo;
        use axum::routing::get;
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let app = axum::Router::new()
            .route(
                "/peer",
                get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
            )
            .route(
                "/slow",
                get(move || async move {
                    tokio::time::sleep(slow).await;
                    "done"
                }),
            );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            Bounded::new(tcp, 16, Duration::from_secs(60)),
            app,
            async move {
                let _ = stopped.await;
            },
            header_read,
            drain,
        ));
        (addr, stop, server)
    }

    /// Reads what the server sends until it closes the connection (or `within` passes).
    async fn read_to_close(tcp: &mut TcpStream, within: Duration) -> Option<String> {
        let mut out = Vec::new();
        tokio::time::timeout(within, tcp.read_to_end(&mut out))
            .await
            .ok()
            .map(|_| String::from_utf8_lossy(&out).into_owned())
    }

    /// A client that trickles its request head, or says nothing more on a kept-alive
    /// connection, is closed once the head's time is up; a whole request is served with the
    /// peer's address.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_head_has_a_deadline() {
        let header_read = Duration::from_millis(400);
        let (addr, stop, server) = start(header_read, Duration::from_secs(5), Duration::ZERO).await;

        let mut client = TcpStream::connect(addr).await.expect("connect");
        let local = client.local_addr().expect("local addr");
        client
            .write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        // The answer, then (kept alive, silent) the close once the next head is overdue.
        let started = std::time::Instant::now();
        let text = read_to_close(&mut client, Duration::from_secs(5))
            .await
            .expect("a silent kept-alive connection is closed");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.ends_with(&local.to_string()), "peer address: {text}");
        assert!(started.elapsed() >= header_read, "closed too early");

        // A head trickled a header line every 100 ms never completes: closed after ~400 ms.
        let mut trickler = TcpStream::connect(addr).await.expect("connect");
        let started = std::time::Instant::now();
        trickler
            .write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        let mut closed = false;
        for i in 0..30 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let line = format!("X-Drip-{i}: y\r\n");
            if trickler.write_all(line.as_bytes()).await.is_err() {
                closed = true;
                break;
            }
            let mut buf = [0u8; 256];
            match tokio::time::timeout(Duration::from_millis(1), trickler.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    closed = true;
                    break;
                }
                Ok(Ok(n)) => {
                    // hyper may answer 408 before it closes.
                    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                    assert!(
                        !text.contains(" 200 "),
                        "a trickled head was served: {text}"
                    );
                }
                Err(_) => {}
            }
        }
        let took = started.elapsed();
        assert!(closed, "a trickling client kept its connection for 3 s");
        assert!(
            took >= header_read && took < Duration::from_millis(1500),
            "closed after {took:?}"
        );
        let _ = stop.send(());
        server.await.expect("join").expect("serve");
    }

    /// On shutdown an in-flight request still gets its answer; one that outlasts the drain
    /// time is cut; the listener stops accepting.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_drains_for_a_bounded_time() {
        let get_slow = b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        // Drains: the 300 ms answer arrives after shutdown began.
        let (addr, stop, server) = start(
            HEADER_READ_TIMEOUT,
            Duration::from_secs(5),
            Duration::from_millis(300),
        )
        .await;
        let mut client = TcpStream::connect(addr).await.expect("connect");
        client.write_all(get_slow).await.expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = stop.send(());
        let text = read_to_close(&mut client, Duration::from_secs(5))
            .await
            .expect("answered");
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("done"),
            "{text}"
        );
        server.await.expect("join").expect("serve");
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "still accepting after shutdown"
        );

        // Cut: a 10 s answer with a 300 ms drain; serve returns in time.
        let (addr, stop, server) = start(
            HEADER_READ_TIMEOUT,
            Duration::from_millis(300),
            Duration::from_secs(10),
        )
        .await;
        let mut client = TcpStream::connect(addr).await.expect("connect");
        client.write_all(get_slow).await.expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = std::time::Instant::now();
        let _ = stop.send(());
        server.await.expect("join").expect("serve");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "drain took {:?}",
            started.elapsed()
        );
    }

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
