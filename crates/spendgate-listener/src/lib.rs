//! spendgate-listener: the listening socket with limits, below the HTTP surface
//! (`spendgate-http` builds its router on it and `spendgate_http::serve` sets it from the
//! config). It depends on the error shape (`spendgate-wire`, for its protocol refusals) and the
//! config, never on the handlers; the process's open files limit ([`rlimit`]) and the body
//! that holds a guard until sent ([`holding`]) are here because the bounds need them.
//!
//! The listener: at most [`CONNECTIONS_MAX`] connections at once (past it, new ones wait in the
//! kernel's backlog rather than take a file descriptor each until the process runs out), at most
//! `server.address_connections_max` from one socket peer (its address prefix after [`canonical`],
//! as spendgate-http's identity groups addresses; past it a new connection is closed at once,
//! before anything is read; a peer in `server.trusted_proxies` is exempt, since every client behind
//! it comes through its connections), and a connection on which nothing is read or written for its
//! idle time is closed (a client that opens connections and sends nothing holds none for long). The
//! idle time is at least [`CONNECTION_IDLE_MIN`] and always longer than the longest upstream
//! timeout, so that a call waiting on a slow upstream (streamed or not) is never cut by it.
//! [`serve`] runs HTTP/1 on it with a bound on the time a request's head may take
//! ([`HEADER_READ_TIMEOUT`]: a client that trickles its headers a byte at a time, or keeps a
//! connection open between requests, holds its slot for no longer) and on its size
//! ([`HEAD_BYTES_MAX`]), answers the requests hyper itself refuses (a head it cannot parse, too
//! many or too long header lines: hyper writes an empty 400, 414 or 431) in the error shape like
//! every other refusal ([`ShapedIo`]), and drains in-flight requests on shutdown for at most a
//! bounded time.

use spendgate_wire::error::ErrorCode;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

pub mod holding;
pub mod rlimit;

/// Connections served at once by one process (see [`spendgate_config::CONNECTIONS_MAX`]).
pub use spendgate_config::CONNECTIONS_MAX;

/// Total bytes of request headers accepted (names and values).
pub const HEADER_BYTES_MAX: usize = 16 * 1024;

/// Longest time from accepting a connection on a reserved slot until its request's head
/// has arrived (and, kept alive, between its requests): a reserved slot is for the
/// operator's backend, which sends at once, and a silent connection holds one no longer.
pub const RESERVED_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Marks a request that came on a reserved connection slot (see [`Bounded`]): it is served
/// only if it is not public (`capacity::admit`).
#[derive(Clone, Copy, Debug)]
pub struct Reserved;
/// Shortest idle time of a connection.
pub const CONNECTION_IDLE_MIN: Duration = Duration::from_secs(120);
/// How much longer than the longest upstream timeout a connection may stay idle.
pub const CONNECTION_IDLE_MARGIN: Duration = Duration::from_secs(30);

/// Longest time from the moment a connection waits for a request (its first, or the next one
/// on a kept-alive connection) until that request's whole head has arrived. Past it the
/// connection is closed. (axum's own `serve` sets no timer, so hyper's default of the same
/// length never runs there.)
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest request head (request line and header lines, as sent): past it hyper answers 431.
/// Room for [`HEADER_BYTES_MAX`] of names and values (checked again, exactly, by the
/// router) with their separators, and a long request line.
pub const HEAD_BYTES_MAX: usize = 2 * HEADER_BYTES_MAX + 8 * 1024;

/// How long, and for how many bytes, a connection whose refusal [`ShapedIo`] wrote is still
/// read after it was shut down, so that the client receives the answer instead of a reset
/// (closing a socket with unread bytes sends one, which may destroy the answer in flight).
pub const LINGER: Duration = Duration::from_secs(2);
pub const LINGER_BYTES_MAX: usize = 256 * 1024;

/// Connection attempts the kernel queues for `accept` (capped by `net.core.somaxconn`,
/// 4,096 on current Linux). std's and mio's 128 overflows in a burst of connection attempts:
/// past the queue the kernel drops a SYN and the client tries again a second later (then 3,
/// 7 s…), the operator's backend as much as a flood; a deeper queue lets the accept loop,
/// which closes a flooding peer's excess connections at once, catch up.
pub const LISTEN_BACKLOG: u32 = 4_096;

/// A listening socket on `addr` with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR`, as std and mio
/// set it).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Least time between two warnings about a peer at its connection bound.
pub const PEER_WARN_EVERY_S: u64 = 60;

/// The idle time of connections, given the longest upstream timeout.
pub fn idle_time(longest_upstream: Duration) -> Duration {
    CONNECTION_IDLE_MIN.max(longest_upstream + CONNECTION_IDLE_MARGIN)
}

/// The bound on connections per socket peer.
#[derive(Clone, Debug)]
pub struct PeerBound {
    /// Connections per peer prefix.
    pub max: usize,
    /// Peers exempt from it (`server.trusted_proxies`).
    pub trusted: Vec<ipnet::IpNet>,
    /// The prefix lengths peers are grouped by (`identity.ipv4_prefix`, `ipv6_prefix`).
    pub v4: u8,
    pub v6: u8,
}

/// An address as the gateway groups it: IPv4-mapped IPv6 addresses count as IPv4 (the
/// listener's peer bound and the identity's address prefixes both start from it).
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

impl PeerBound {
    pub fn of(config: &spendgate_config::Config) -> PeerBound {
        if spendgate_wire::plant::on(spendgate_wire::plant::Plant::SharedCapacity) {
            return PeerBound::none();
        }
        PeerBound {
            max: config.server.capacity.address_connections_max,
            trusted: config.server.trusted_proxies.clone(),
            v4: config.identity.ipv4_prefix,
            v6: config.identity.ipv6_prefix,
        }
    }

    /// No bound per peer (tests of the other bounds).
    pub fn none() -> PeerBound {
        PeerBound {
            max: usize::MAX,
            trusted: Vec::new(),
            v4: 32,
            v6: 128,
        }
    }

    /// The prefix a peer's connections are counted under; `None` for an exempt peer.
    fn key(&self, peer: SocketAddr) -> Option<ipnet::IpNet> {
        let ip = canonical(peer.ip());
        if self.max == usize::MAX || self.trusted.iter().any(|n| n.contains(&ip)) {
            return None;
        }
        let bits = if ip.is_ipv4() { self.v4 } else { self.v6 };
        Some(
            ipnet::IpNet::new(ip, bits)
                .map(|n| n.trunc())
                .unwrap_or_else(|_| ipnet::IpNet::from(ip)),
        )
    }
}

type PeerCounts = Arc<Mutex<HashMap<ipnet::IpNet, usize>>>;

/// One connection counted under its peer's prefix, until dropped.
struct PeerHold {
    counts: PeerCounts,
    key: ipnet::IpNet,
}

impl Drop for PeerHold {
    fn drop(&mut self) {
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = counts.get_mut(&self.key) {
            debug_assert!(*n > 0, "a peer count held is positive");
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

/// A TCP listener whose connections are counted (in all and per peer) and closed when idle.
/// Of its slots, `reserved` are taken only once the others are all taken: a request on such
/// a connection is served only when it is not public (a valid service or admin token, or a
/// health route; spendgate-http's `admit` refuses the others), and its head must come within
/// [`RESERVED_HEADER_READ_TIMEOUT`]. So guests holding every ordinary slot (silent
/// connections hold one for `HEADER_READ_TIMEOUT`) still leave the operator's backend room
/// to connect.
pub struct Bounded {
    inner: TcpListener,
    slots: Arc<Semaphore>,
    reserved: Arc<Semaphore>,
    idle: Duration,
    peers: PeerBound,
    /// Connections open per peer prefix (only prefixes with one at least: at most
    /// `CONNECTIONS_MAX` entries).
    counts: PeerCounts,
    /// Connections closed at once for their peer's bound.
    refused: AtomicU64,
    last_warned_s: AtomicU64,
}

impl Bounded {
    pub fn new(
        inner: TcpListener,
        max: usize,
        reserved: usize,
        idle: Duration,
        peers: PeerBound,
    ) -> Bounded {
        assert!(
            reserved < max,
            "a listener serves at least one connection besides the reserved ones"
        );
        assert!(peers.max > 0, "a peer may open one connection at least");
        Bounded {
            inner,
            slots: Arc::new(Semaphore::new(max - reserved)),
            reserved: Arc::new(Semaphore::new(reserved)),
            idle,
            peers,
            counts: Arc::default(),
            refused: AtomicU64::new(0),
            last_warned_s: AtomicU64::new(0),
        }
    }

    /// An ordinary slot, else a reserved one (`true`), else the first to free.
    async fn slot(&self) -> (OwnedSemaphorePermit, bool) {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return (slot, false);
        }
        if let Ok(slot) = self.reserved.clone().try_acquire_owned() {
            return (slot, true);
        }
        // (the semaphores are never closed)
        tokio::select! {
            Ok(slot) = self.slots.clone().acquire_owned() => (slot, false),
            Ok(slot) = self.reserved.clone().acquire_owned() => (slot, true),
            else => std::future::pending().await,
        }
    }

    /// Counts a new connection from `peer`; `None` when its prefix is at its bound.
    fn admit(&self, peer: SocketAddr) -> Option<Option<PeerHold>> {
        let Some(key) = self.peers.key(peer) else {
            return Some(None);
        };
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = counts.get(&key).copied().unwrap_or(0);
        if n >= self.peers.max {
            return None;
        }
        counts.insert(key, n + 1);
        Some(Some(PeerHold {
            counts: self.counts.clone(),
            key,
        }))
    }

    /// Logs (at most once per [`PEER_WARN_EVERY_S`]) that a peer's connections are refused.
    fn warn_refused(&self, peer: SocketAddr) {
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let now = spendgate_store::clock::now_unix();
        let last = self.last_warned_s.load(Ordering::Relaxed);
        if now >= last.saturating_add(PEER_WARN_EVERY_S)
            && self
                .last_warned_s
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                peer = %peer.ip(),
                max = self.peers.max,
                refused_in_all = refused,
                "a peer is at server.address_connections_max: its new connections are closed"
            );
        }
    }
}

impl axum::serve::Listener for Bounded {
    type Io = IdleIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (IdleIo, SocketAddr) {
        loop {
            let (slot, reserved) = self.slot().await;
            let (tcp, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            match self.admit(addr) {
                Some(peer) => {
                    let mut io = IdleIo::new(tcp, slot, self.idle, peer);
                    io.reserved = reserved;
                    return (io, addr);
                }
                None => {
                    // Closed at once, unread: the slot is free again.
                    drop(tcp);
                    self.warn_refused(addr);
                }
            }
        }
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
    _peer: Option<PeerHold>,
    /// On a reserved slot (see [`Bounded`]).
    reserved: bool,
}

impl IdleIo {
    fn new(
        tcp: TcpStream,
        slot: OwnedSemaphorePermit,
        idle: Duration,
        peer: Option<PeerHold>,
    ) -> IdleIo {
        let now = Instant::now();
        IdleIo {
            tcp,
            idle,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + idle)),
            _slot: slot,
            _peer: peer,
            reserved: false,
        }
    }

    /// Whether the connection holds a reserved slot.
    pub fn reserved(&self) -> bool {
        self.reserved
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

// ---------------------------------------------------------------------------------------
// Protocol refusals in the error shape

/// Longest write that can be hyper's automatic refusal (a status line, `content-length: 0`,
/// `connection: close` and `date`: under 130 bytes).
const AUTOMATIC_HEAD_BYTES_MAX: usize = 256;

/// Answers in flight on one connection (requests the router is serving, until their
/// answer's body has been sent or dropped).
#[derive(Clone, Default)]
pub struct Busy(Arc<AtomicUsize>);

/// One answer in flight, until dropped.
pub struct BusyGuard(Arc<AtomicUsize>);

impl Busy {
    pub fn enter(&self) -> BusyGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        BusyGuard(self.0.clone())
    }

    fn idle(&self) -> bool {
        self.0.load(Ordering::Relaxed) == 0
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The status of hyper's automatic refusal when `head` is one, written whole: hyper answers a
/// request head it cannot take (hyper-1.12 `proto/h1/role.rs` `on_error`, `conn.rs`
/// `on_parse_error`) with a bare head `HTTP/1.1 400|414|431 <reason>`, `content-length: 0`,
/// `date` (and `connection: close`), nothing else, and closes. Nothing the router answers
/// looks like it (every answer of ours carries a content type), and it is only looked for
/// while no answer of the router is in flight on the connection.
fn automatic_refusal(head: &[u8]) -> Option<(&str, u16, &str)> {
    if head.len() > AUTOMATIC_HEAD_BYTES_MAX {
        return None;
    }
    let text = std::str::from_utf8(head).ok()?.strip_suffix("\r\n\r\n")?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next()?;
    let (version, rest) = status_line.split_once(' ')?;
    if !matches!(version, "HTTP/1.1" | "HTTP/1.0") {
        return None;
    }
    let (code, reason) = rest.split_once(' ')?;
    let code: u16 = code.parse().ok()?;
    let status = axum::http::StatusCode::from_u16(code).ok()?;
    if !matches!(code, 400 | 414 | 431) || status.canonical_reason() != Some(reason) {
        return None;
    }
    let mut date = None;
    let mut empty = false;
    for line in lines {
        match line {
            "content-length: 0" => empty = true,
            "connection: close" => {}
            l if l.len() == "date: ".len() + 29 && l.starts_with("date: ") => date = Some(&l[6..]),
            _ => return None,
        }
    }
    if !empty {
        return None;
    }
    Some((version, code, date?))
}

/// The message of a protocol refusal.
fn refusal_message(code: u16) -> &'static str {
    match code {
        414 => "the request target is too long",
        431 => "the request head is too large: too many header lines, or too long ones",
        _ => "the request could not be read as HTTP/1.1",
    }
}

/// The error body of a protocol refusal: what `ApiError::new(status, "invalid_request", …)`
/// renders (a unit test holds them equal).
fn refusal_body(code: u16) -> Vec<u8> {
    let body = serde_json::json!({
        "error": {
            "type": ErrorCode::InvalidRequest.kind(),
            "code": ErrorCode::InvalidRequest.as_str(),
            "message": refusal_message(code),
            "param": null,
            "scope": null,
            "retry_after_s": null,
        }
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The whole answer that replaces hyper's automatic refusal.
fn shaped_refusal(version: &str, code: u16, date: &str) -> Vec<u8> {
    let reason = axum::http::StatusCode::from_u16(code)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Bad Request");
    let body = refusal_body(code);
    let mut out = format!(
        "{version} {code} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nx-should-retry: false\r\ndate: {date}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// A connection whose protocol refusals leave in the error shape: when hyper writes its
/// automatic refusal (`automatic_refusal`), the write is taken whole and the connection
/// sends, instead, the same status with the OpenAI-shaped JSON body and `connection: close`,
/// then takes no more writes, reads nothing more for hyper, and on shutdown reads (and drops)
/// what the client still sends for at most [`LINGER`] and [`LINGER_BYTES_MAX`], so that the
/// answer is not lost to a reset.
pub struct ShapedIo<T> {
    inner: T,
    busy: Busy,
    /// The replacement answer and how much of it is written; `Some` once replaced.
    answer: Option<(Vec<u8>, usize)>,
    linger: Option<(Pin<Box<Sleep>>, usize)>,
}

impl<T: AsyncRead + AsyncWrite + Unpin> ShapedIo<T> {
    pub fn new(inner: T, busy: Busy) -> ShapedIo<T> {
        ShapedIo {
            inner,
            busy,
            answer: None,
            linger: None,
        }
    }

    /// Writes what is left of the replacement answer.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some((answer, written)) = &mut self.answer else {
            return Poll::Ready(Ok(()));
        };
        while *written < answer.len() {
            let n =
                std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, &answer[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        Poll::Ready(Ok(()))
    }

    /// Takes `head` in place of hyper's automatic refusal when it is one.
    fn replace(&mut self, head: &[u8]) -> bool {
        if self.answer.is_some() || !self.busy.idle() {
            return false;
        }
        let Some((version, code, date)) = automatic_refusal(head) else {
            return false;
        };
        tracing::debug!(code, "a protocol refusal answered in the error shape");
        self.answer = Some((shaped_refusal(version, code, date), 0));
        true
    }

    /// Reads and drops what the client still sends, for a bounded time and size.
    fn poll_linger(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let (timer, drained) = self
            .linger
            .get_or_insert_with(|| (Box::pin(tokio::time::sleep(LINGER)), 0));
        let mut scratch = [0u8; 4096];
        while *drained < LINGER_BYTES_MAX {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.inner).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => *drained += buf.filled().len(),
                // End of stream, an error or a reset: nothing more to wait for.
                Poll::Ready(_) => return Poll::Ready(()),
                Poll::Pending => {
                    return if timer.as_mut().poll(cx).is_ready() {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    };
                }
            }
        }
        Poll::Ready(())
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for ShapedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.answer.is_some() {
            // Refused: hyper reads no further request from this connection.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for ShapedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.answer.is_none() && !this.replace(buf) {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        // Taken whole (hyper's refusal, or anything after it, which is not sent).
        match this.poll_answer(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(buf.len())),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        if this.answer.is_none() {
            let candidate = len <= AUTOMATIC_HEAD_BYTES_MAX && this.busy.idle() && {
                let head: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
                this.replace(&head)
            };
            if !candidate {
                return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
            }
        }
        match this.poll_answer(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(len)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_answer(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_answer(cx))?;
        let replaced = this.answer.is_some();
        if this.linger.is_none() {
            std::task::ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
        }
        if replaced {
            std::task::ready!(this.poll_linger(cx));
        }
        Poll::Ready(Ok(()))
    }
}

/// Serves `app` over HTTP/1 on `listener` (each connection's peer address as axum's
/// `ConnectInfo<SocketAddr>`, Nagle off so relayed chunks are not held back, a request's head
/// bounded by `header_read` — [`HEADER_READ_TIMEOUT`] outside tests — and [`HEAD_BYTES_MAX`],
/// hyper's own refusals in the error shape) until `shutdown` completes; then stops accepting
/// and lets in-flight requests finish for at most `drain`, after which the remaining
/// connections are dropped (a call cut this way leaves its reservation held: it expires and
/// is charged in full).
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
        .header_read_timeout(header_read)
        .max_header_size(HEAD_BYTES_MAX);
    let mut reserved_http = http.clone();
    reserved_http.header_read_timeout(header_read.min(RESERVED_HEADER_READ_TIMEOUT));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (io, peer) = tokio::select! {
            accepted = axum::serve::Listener::accept(&mut listener) => accepted,
            () = shutdown.as_mut() => break,
        };
        let _ = io.set_nodelay(true);
        let reserved = io.reserved();
        let busy = Busy::default();
        let io = ShapedIo::new(io, busy.clone());
        let app = app.clone();
        let service =
            tower::service_fn(move |mut req: axum::http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                if reserved {
                    req.extensions_mut().insert(Reserved);
                }
                // In flight from here until its answer's body is sent or dropped.
                let guard = busy.enter();
                let answer = tower::ServiceExt::oneshot(app.clone(), req);
                async move {
                    let res = answer.await?;
                    Ok::<_, std::convert::Infallible>(res.map(|body| {
                        axum::body::Body::new(crate::holding::Holding::new(body, guard))
                    }))
                }
            });
        let builder = if reserved { &reserved_http } else { &http };
        let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
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
        start_with(header_read, drain, slow, PeerBound::none()).await
    }

    async fn start_with(
        header_read: Duration,
        drain: Duration,
        slow: Duration,
        peers: PeerBound,
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
            Bounded::new(tcp, 16, 0, Duration::from_secs(60), peers),
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
        let mut listener = Bounded::new(tcp, 1, 0, Duration::from_millis(300), PeerBound::none());
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

    /// A connection from `from` (a loopback address: all of 127/8 is local on Linux).
    async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(format!("{from}:0").parse().expect("addr"))
            .expect("bind the client side");
        socket.connect(to).await.expect("connect")
    }

    /// Whether the server closed `tcp` without a byte (within `within`).
    async fn closed_unanswered(tcp: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(within, tcp.read(&mut buf)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    /// A peer past its bound has its new connections closed at once, unread; a trusted proxy
    /// is not bounded; a closed connection gives its room back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_are_bounded_per_peer_but_for_trusted_proxies() {
        let peers = PeerBound {
            max: 2,
            trusted: vec!["127.0.0.1/32".parse().expect("net")],
            v4: 32,
            v6: 64,
        };
        let (addr, stop, server) = start_with(
            HEADER_READ_TIMEOUT,
            Duration::from_secs(5),
            Duration::ZERO,
            peers,
        )
        .await;
        let get = b"GET /peer HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut kept = Vec::new();
        for _ in 0..2 {
            let mut tcp = connect_from("127.0.0.2", addr).await;
            tcp.write_all(get).await.expect("write");
            let mut buf = [0u8; 256];
            let n = tcp.read(&mut buf).await.expect("answered");
            assert!(
                buf[..n].starts_with(b"HTTP/1.1 200"),
                "served within the bound"
            );
            kept.push(tcp);
        }
        let mut third = connect_from("127.0.0.2", addr).await;
        let _ = third.write_all(get).await;
        assert!(
            closed_unanswered(&mut third, Duration::from_secs(2)).await,
            "the third connection of a peer bounded at 2 is closed unanswered"
        );
        // Another peer has its own bound; a trusted proxy has none.
        let mut other = connect_from("127.0.0.3", addr).await;
        other.write_all(get).await.expect("write");
        let mut buf = [0u8; 256];
        let n = other.read(&mut buf).await.expect("answered");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        let mut proxied = Vec::new();
        for _ in 0..5 {
            let mut tcp = connect_from("127.0.0.1", addr).await;
            tcp.write_all(get).await.expect("write");
            let n = tcp.read(&mut buf).await.expect("answered");
            assert!(
                buf[..n].starts_with(b"HTTP/1.1 200"),
                "a trusted proxy is exempt"
            );
            proxied.push(tcp);
        }
        // One closed: room for one more.
        drop(kept.pop());
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut again = connect_from("127.0.0.2", addr).await;
        again.write_all(get).await.expect("write");
        let n = again.read(&mut buf).await.expect("answered");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "room again");
        let _ = stop.send(());
        drop((kept, proxied, again, other));
        server.await.expect("join").expect("serve");
    }

    /// The status, the lower-cased head and the JSON body of an answer.
    fn answer_of(text: &str) -> (u16, String, serde_json::Value) {
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
        (status, head.to_ascii_lowercase(), body)
    }

    /// What hyper refuses itself (too many header lines, an oversize head, a head it cannot
    /// parse) is answered in the error shape, whole, and the connection closed; the router's
    /// own answers are untouched.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn protocol_refusals_have_the_error_shape() {
        let (addr, stop, server) =
            start(HEADER_READ_TIMEOUT, Duration::from_secs(5), Duration::ZERO).await;
        let many: String = (0..2_000).map(|i| format!("X-Line-{i}: v\r\n")).collect();
        let big = "a".repeat(HEAD_BYTES_MAX + 1024);
        let cases = [
            (format!("GET /peer HTTP/1.1\r\nHost: x\r\n{many}\r\n"), 431),
            (
                format!("GET /peer HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n"),
                431,
            ),
            ("NOT HTTP AT ALL\r\n\r\n".to_string(), 400),
            (
                "GET /peer HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n".to_string(),
                400,
            ),
        ];
        for (req, want) in cases {
            let mut tcp = TcpStream::connect(addr).await.expect("connect");
            // (the server may answer before it has read all of it)
            let _ = tcp.write_all(req.as_bytes()).await;
            let text = read_to_close(&mut tcp, Duration::from_secs(5))
                .await
                .expect("answered and closed");
            let (status, head, v) = answer_of(&text);
            let what = &req[..req.len().min(40)];
            assert_eq!(status, want, "{what:?}: {text}");
            assert!(
                head.contains("\r\ncontent-type: application/json\r\n"),
                "{head}"
            );
            assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
            assert!(head.contains("\r\ndate: "), "{head}");
            assert_eq!(v["error"]["code"], "invalid_request", "{text}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
            assert!(v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
        }
        let mut tcp = TcpStream::connect(addr).await.expect("connect");
        tcp.write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let text = read_to_close(&mut tcp, Duration::from_secs(5))
            .await
            .expect("answered");
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        let _ = stop.send(());
        server.await.expect("join").expect("serve");
    }

    #[test]
    fn only_hyper_s_bare_refusal_is_recognised() {
        let date = "date: Sun, 06 Nov 1994 08:49:37 GMT";
        let ok = format!(
            "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n{date}\r\n\r\n"
        );
        assert_eq!(
            automatic_refusal(ok.as_bytes()),
            Some(("HTTP/1.1", 431, "Sun, 06 Nov 1994 08:49:37 GMT"))
        );
        let closing = format!(
            "HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n{date}\r\n\r\n"
        );
        assert!(automatic_refusal(closing.as_bytes()).is_some());
        for not in [
            // an answer with a body or a type is the router's
            format!("HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 0\r\n{date}\r\n\r\n"),
            format!("HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n{date}\r\n\r\n"),
            format!("HTTP/1.1 400 Bad Request\r\n{date}\r\n\r\n"),
            // another status, another reason, not the end of a head
            format!("HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n{date}\r\n\r\n"),
            format!("HTTP/1.1 400 Nope\r\ncontent-length: 0\r\n{date}\r\n\r\n"),
            format!("HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n{date}\r\n"),
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: x\r\n\r\n".to_string(),
        ] {
            assert_eq!(automatic_refusal(not.as_bytes()), None, "{not:?}");
        }
        let answer = String::from_utf8(shaped_refusal(
            "HTTP/1.1",
            431,
            "Sun, 06 Nov 1994 08:49:37 GMT",
        ))
        .expect("text");
        let (status, head, v) = answer_of(&answer);
        assert_eq!(status, 431);
        let len = refusal_body(431).len();
        assert!(
            head.contains(&format!("\r\ncontent-length: {len}\r\n")),
            "{head}"
        );
        assert_eq!(v["error"]["code"], "invalid_request");
    }

    /// The body written in place of hyper's refusal is the one `ApiError` renders.
    #[tokio::test]
    async fn protocol_refusal_bodies_are_api_errors() {
        use axum::response::IntoResponse;
        for code in [400u16, 414, 431] {
            let status = axum::http::StatusCode::from_u16(code).expect("status");
            let r = spendgate_wire::error::ApiError::invalid(refusal_message(code))
                .with_status(status)
                .into_response();
            let want = axum::body::to_bytes(r.into_body(), 4096)
                .await
                .expect("body");
            let want: serde_json::Value = serde_json::from_slice(&want).expect("json");
            let got: serde_json::Value = serde_json::from_slice(&refusal_body(code)).expect("json");
            assert_eq!(got, want, "{code}");
        }
    }

    /// Once the ordinary slots are taken, a connection gets a reserved one (its requests are
    /// marked [`Reserved`]); past both, it waits for the first to free.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reserved_slots_are_taken_last_and_marked() {
        use axum::routing::get;
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let app = axum::Router::new().route(
            "/slot",
            get(|req: axum::extract::Request| async move {
                if req.extensions().get::<Reserved>().is_some() {
                    "reserved"
                } else {
                    "ordinary"
                }
            }),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            Bounded::new(tcp, 2, 1, Duration::from_secs(60), PeerBound::none()),
            app,
            async move {
                let _ = stopped.await;
            },
            HEADER_READ_TIMEOUT,
            Duration::from_secs(1),
        ));
        let ask = |mut tcp: TcpStream| async move {
            tcp.write_all(b"GET /slot HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .expect("write");
            let mut buf = [0u8; 512];
            let n = tcp.read(&mut buf).await.expect("read");
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            (tcp, text)
        };
        let (first, text) = ask(TcpStream::connect(addr).await.expect("connect")).await;
        assert!(text.ends_with("ordinary"), "{text}");
        let (second, text) = ask(TcpStream::connect(addr).await.expect("connect")).await;
        assert!(text.ends_with("reserved"), "{text}");
        // Both taken: a third waits, and gets the slot the first frees.
        let mut third = TcpStream::connect(addr).await.expect("connect");
        third
            .write_all(b"GET /slot HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 512];
        let early = tokio::time::timeout(Duration::from_millis(200), third.read(&mut buf)).await;
        assert!(early.is_err(), "served past both bounds: {early:?}");
        drop(first);
        let n = tokio::time::timeout(Duration::from_secs(2), third.read(&mut buf))
            .await
            .expect("served once a slot freed")
            .expect("read");
        assert!(String::from_utf8_lossy(&buf[..n]).ends_with("ordinary"));
        let _ = stop.send(());
        drop((second, third));
        server.await.expect("join").expect("serve");
    }
}
