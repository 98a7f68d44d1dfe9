//! Fair capacity: every request is put in a class of caller as soon as its head is read, from
//! its path and the presence of a valid token alone, and holds a slot of that class's own
//! bound for as long as it is in flight (until its answer's body has been sent or dropped):
//!
//! - **health**: `/healthz`, `/readyz`, `/metrics` (`server.health_requests_max`);
//! - **admin**: a path under `/admin/` with a valid admin token (`admin_requests_max`);
//! - **service**: any other path with a valid service token, the operator's backend
//!   (`service_requests_max`);
//! - **public**: everything else: guests (`POST /v1/sessions`, `GET /v1/usage` with the
//!   cookie, browser-direct chat), the demo and dashboard pages, and every request whose token
//!   is missing or wrong (`public_requests_max`).
//!
//! One class at its bound never takes a slot from another: a flood of guests leaves the
//! operator's backend, the admin API and the health checks their own room. Requests without a
//! valid token (public and health) are bounded per client address prefix too
//! (`address_requests_max`, each wider IPv6 prefix at that times its factor; the client's
//! address as the ledger sees it: the socket peer, or `X-Forwarded-For` through trusted
//! proxies), so one address never takes the public class from the others. Past a bound the
//! request is answered at once, before its body is read: 429 `rate_limited` (scope `global`
//! for a class, `ip` for an address), `Retry-After: 1`, `x-should-retry: false` (OpenAI
//! clients would otherwise add their retries to a flood) and `connection: close`.
//!
//! A request body must keep arriving: after `body_grace_ms` its average rate since the head
//! must stay at `body_min_bytes_per_s` at least ([`RateBody`]); a body that falls behind is
//! answered 408 `request_timeout` and its connection closed. A large body sent at any
//! honest speed is never cut; one byte and then silence holds its slot for the grace only.
//!
//! Connections are bounded per socket peer in the listener (`spendgate_listener::Bounded`), before
//! anything is read: the class of a connection is not known until its first head arrives.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use spendgate_core::ScopeKind;
use spendgate_wire::error::ApiError;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// `Retry-After` of a request refused for capacity.
pub const CAPACITY_RETRY_AFTER_S: u64 = 1;

/// Who is calling, as far as capacity is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Public,
    Service,
    Admin,
    Health,
}

impl Class {
    pub fn name(self) -> &'static str {
        match self {
            Class::Public => "public",
            Class::Service => "service",
            Class::Admin => "admin",
            Class::Health => "health",
        }
    }

    /// Requests of this class are bounded per client address too (they carry no token that
    /// says whose they are).
    pub fn per_address(self) -> bool {
        matches!(self, Class::Public | Class::Health)
    }
}

/// The in-flight bounds of one process.
pub struct Capacity {
    public: Arc<Semaphore>,
    service: Arc<Semaphore>,
    admin: Arc<Semaphore>,
    health: Arc<Semaphore>,
    address_max: usize,
    /// Requests in flight per client address prefix (only prefixes with one at least: the
    /// map holds at most (public + health bound) × prefixes per address entries).
    addresses: Arc<Mutex<HashMap<String, usize>>>,
    pub(crate) body_min_bytes_per_s: u64,
    pub(crate) body_grace: Duration,
}

impl std::fmt::Debug for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capacity")
            .field("address_max", &self.address_max)
            .finish()
    }
}

/// Why a request was refused a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    Class(Class),
    Address,
    /// A public request on a connection slot reserved for the others
    /// (`spendgate_listener::Bounded`).
    Connections,
}

/// What a request in flight holds; released when dropped.
pub struct Held {
    _class: OwnedSemaphorePermit,
    _address: Option<AddressHold>,
}

struct AddressHold {
    addresses: Arc<Mutex<HashMap<String, usize>>>,
    prefixes: Vec<String>,
}

impl Drop for AddressHold {
    fn drop(&mut self) {
        let mut map = self
            .addresses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for p in &self.prefixes {
            if let Some(n) = map.get_mut(p) {
                debug_assert!(*n > 0, "an address count held is positive");
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(p);
                }
            }
        }
    }
}

impl Capacity {
    pub fn new(c: &spendgate_config::CapacityConfig) -> Capacity {
        assert!(
            c.public_requests_max > 0
                && c.service_requests_max > 0
                && c.admin_requests_max > 0
                && c.health_requests_max > 0
                && c.address_requests_max > 0,
            "every class and address serves one request at least"
        );
        assert!(c.body_min_bytes_per_s > 0, "a body rate is positive");
        Capacity {
            public: Arc::new(Semaphore::new(c.public_requests_max)),
            service: Arc::new(Semaphore::new(c.service_requests_max)),
            admin: Arc::new(Semaphore::new(c.admin_requests_max)),
            health: Arc::new(Semaphore::new(c.health_requests_max)),
            address_max: c.address_requests_max,
            addresses: Arc::new(Mutex::new(HashMap::new())),
            body_min_bytes_per_s: c.body_min_bytes_per_s,
            body_grace: c.body_grace,
        }
    }

    fn semaphore(&self, class: Class) -> &Arc<Semaphore> {
        match class {
            Class::Public => &self.public,
            Class::Service => &self.service,
            Class::Admin => &self.admin,
            Class::Health => &self.health,
        }
    }

    /// A slot of `class`, and one of each address prefix (`(prefix, factor)`: bound
    /// `address_requests_max × factor`), or why not. Takes nothing when it refuses.
    pub fn hold(&self, class: Class, prefixes: &[(String, u64)]) -> Result<Held, Full> {
        let permit = self
            .semaphore(class)
            .clone()
            .try_acquire_owned()
            .map_err(|_| Full::Class(class))?;
        let address = if prefixes.is_empty() {
            None
        } else {
            let mut map = self
                .addresses
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let over = prefixes.iter().any(|(p, factor)| {
                let max = self.address_max.saturating_mul(*factor as usize);
                map.get(p).copied().unwrap_or(0) >= max
            });
            if over {
                return Err(Full::Address);
            }
            for (p, _) in prefixes {
                *map.entry(p.clone()).or_insert(0) += 1;
            }
            Some(AddressHold {
                addresses: self.addresses.clone(),
                prefixes: prefixes.iter().map(|(p, _)| p.clone()).collect(),
            })
        };
        Ok(Held {
            _class: permit,
            _address: address,
        })
    }

    /// Requests in flight now from the prefix `p` (for tests and diagnostics).
    pub fn address_in_flight(&self, p: &str) -> usize {
        self.addresses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(p)
            .copied()
            .unwrap_or(0)
    }
}

/// The answer to a request refused for capacity (see the module docs).
pub fn refusal(full: Full) -> Response {
    let (scope, message) = match full {
        Full::Class(class) => (
            ScopeKind::Global,
            format!(
                "the gateway is at its bound of {} requests in flight; retry later",
                class.name()
            ),
        ),
        Full::Address => (
            ScopeKind::Ip,
            "too many requests in flight from this address; retry later".to_string(),
        ),
        Full::Connections => (
            ScopeKind::Global,
            "the gateway is at its bound of connections; retry later".to_string(),
        ),
    };
    let mut res = ApiError {
        retry_after_s: Some(CAPACITY_RETRY_AFTER_S),
        ..ApiError::new(spendgate_wire::error::ErrorCode::RateLimited, message)
    }
    .with_scope(scope)
    .into_response();
    let h = res.headers_mut();
    h.insert("x-should-retry", HeaderValue::from_static("false"));
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

/// A request body that fell behind the minimum rate.
#[derive(Debug, thiserror::Error)]
#[error("the request body arrived slower than {min_bytes_per_s} bytes a second")]
pub struct BodyTooSlow {
    pub min_bytes_per_s: u64,
}

/// Whether `e` (or an error it wraps) is a [`BodyTooSlow`].
pub fn is_too_slow(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    // (a chain of wrappers is short; bounded all the same)
    for _ in 0..16 {
        let Some(e) = next else { return false };
        if e.is::<BodyTooSlow>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// A request body that must keep arriving: once `grace` has passed since the head, the bytes
/// received must stay at `min_bytes_per_s` × (time since the head − `grace`) at least. The
/// moment they fall behind (`head + grace + received / rate`) the body fails with
/// [`BodyTooSlow`] and `tripped` is set.
pub struct RateBody {
    inner: axum::body::Body,
    started: Instant,
    grace: Duration,
    min_bytes_per_s: u64,
    received: u64,
    /// Armed only while the body waits for bytes.
    timer: Option<Pin<Box<Sleep>>>,
    tripped: Arc<AtomicBool>,
}

impl RateBody {
    pub fn new(
        inner: axum::body::Body,
        min_bytes_per_s: u64,
        grace: Duration,
        tripped: Arc<AtomicBool>,
    ) -> RateBody {
        assert!(min_bytes_per_s > 0, "a body rate is positive");
        RateBody {
            inner,
            started: Instant::now(),
            grace,
            min_bytes_per_s,
            received: 0,
            timer: None,
            tripped,
        }
    }

    /// When the bytes received so far stop being enough.
    fn due(&self) -> Instant {
        let nanos = u128::from(self.received) * 1_000_000_000 / u128::from(self.min_bytes_per_s);
        let earned = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
        self.started + self.grace + earned
    }

    fn too_slow(&mut self) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.tripped.store(true, Ordering::Relaxed);
        self.timer = None;
        Poll::Ready(Some(Err(axum::Error::new(BodyTooSlow {
            min_bytes_per_s: self.min_bytes_per_s,
        }))))
    }
}

impl HttpBody for RateBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received = this.received.saturating_add(data.len() as u64);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => Poll::Ready(other),
            Poll::Pending => {
                let due = this.due();
                if Instant::now() >= due {
                    return this.too_slow();
                }
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
                if timer.deadline() != due {
                    timer.as_mut().reset(due);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return this.too_slow();
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_config::CapacityConfig;

    fn capacity(public: usize, address: usize) -> Capacity {
        Capacity::new(&CapacityConfig {
            public_requests_max: public,
            service_requests_max: 2,
            admin_requests_max: 1,
            health_requests_max: 1,
            address_requests_max: address,
            ..CapacityConfig::default()
        })
    }

    fn p(s: &str, factor: u64) -> (String, u64) {
        (s.to_string(), factor)
    }

    /// A class at its bound refuses only its own; an address at its bound refuses only
    /// itself; a refusal takes nothing; everything is given back when dropped.
    #[test]
    fn classes_and_addresses_are_bounded_apart() {
        let c = capacity(3, 2);
        let a = [p("10.0.0.1/32", 1)];
        let b = [p("10.0.0.2/32", 1)];
        let a1 = c.hold(Class::Public, &a).expect("a1");
        let _a2 = c.hold(Class::Public, &a).expect("a2");
        assert_eq!(c.hold(Class::Public, &a).err(), Some(Full::Address));
        assert_eq!(c.address_in_flight("10.0.0.1/32"), 2);
        let _b1 = c.hold(Class::Public, &b).expect("another address");
        assert_eq!(
            c.hold(Class::Public, &[p("10.0.0.3/32", 1)]).err(),
            Some(Full::Class(Class::Public))
        );
        // The other classes keep their room.
        let _s1 = c.hold(Class::Service, &[]).expect("service");
        let _s2 = c.hold(Class::Service, &[]).expect("service");
        assert_eq!(
            c.hold(Class::Service, &[]).err(),
            Some(Full::Class(Class::Service))
        );
        // Health has its own class, and shares the address's count (no token either).
        assert_eq!(c.hold(Class::Health, &a).err(), Some(Full::Address));
        let h = c.hold(Class::Health, &b).expect("health, own class");
        assert_eq!(c.address_in_flight("10.0.0.2/32"), 2);
        let _ad = c.hold(Class::Admin, &[]).expect("admin");
        drop(a1);
        assert_eq!(c.address_in_flight("10.0.0.1/32"), 1);
        let _a3 = c.hold(Class::Public, &a).expect("room again");
        drop((_a2, _a3, _b1, h));
        assert!(
            c.addresses.lock().expect("lock").is_empty(),
            "no empty entry kept"
        );
    }

    /// A wider IPv6 prefix is bounded at the address bound times its factor.
    #[test]
    fn wider_prefixes_have_their_factor() {
        let c = capacity(100, 1);
        let one = |host: &str| [p(host, 1), p("2001:db8::/48", 4)];
        let mut held = Vec::new();
        for i in 0..4 {
            let host = format!("2001:db8:0:{i}::/64");
            held.push(
                c.hold(Class::Public, &one(&host))
                    .expect("under the /48's bound"),
            );
            assert_eq!(
                c.hold(Class::Public, &one(&host)).err(),
                Some(Full::Address),
                "the /64's own bound"
            );
        }
        assert_eq!(
            c.hold(Class::Public, &one("2001:db8:0:9::/64")).err(),
            Some(Full::Address),
            "the /48 is full"
        );
    }

    async fn read_all(body: RateBody) -> Result<usize, axum::Error> {
        let mut stream = axum::body::Body::new(body).into_data_stream();
        let mut n = 0;
        while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
            n += chunk?.len();
        }
        Ok(n)
    }

    /// A body sent at the rate passes however long it takes; one that stops is cut at
    /// `grace + received / rate` after its head; one byte and silence at the grace.
    #[tokio::test(start_paused = true)]
    async fn a_body_must_keep_its_rate_after_the_grace() {
        let grace = Duration::from_secs(2);
        let rate = 1_000u64;
        // 100 s at 1,000 bytes a second (sent as 500 bytes every half second).
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let sender = tokio::spawn(async move {
            for _ in 0..200 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if tx.send(Ok(Bytes::from(vec![b' '; 500]))).await.is_err() {
                    break;
                }
            }
        });
        let body = axum::body::Body::from_stream(tokio_stream(rx));
        let tripped = Arc::new(AtomicBool::new(false));
        let n = read_all(RateBody::new(body, rate, grace, tripped.clone()))
            .await
            .expect("a body at the rate passes");
        assert_eq!(n, 100_000);
        assert!(!tripped.load(Ordering::Relaxed));
        sender.await.expect("sender");

        // 5,000 bytes at once, then silence: cut at 2 s + 5 s.
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        tx.send(Ok(Bytes::from(vec![b' '; 5_000])))
            .await
            .expect("send");
        let body = axum::body::Body::from_stream(tokio_stream(rx));
        let started = Instant::now();
        let tripped = Arc::new(AtomicBool::new(false));
        let e = read_all(RateBody::new(body, rate, grace, tripped.clone()))
            .await
            .expect_err("a stalled body fails");
        assert!(is_too_slow(&e), "{e}");
        assert_eq!(started.elapsed(), Duration::from_secs(7));
        assert!(tripped.load(Ordering::Relaxed));
        drop(tx);

        // One byte, then silence: cut right after the grace (1 ms of credit).
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        tx.send(Ok(Bytes::from_static(b"{"))).await.expect("send");
        let body = axum::body::Body::from_stream(tokio_stream(rx));
        let started = Instant::now();
        let e = read_all(RateBody::new(body, rate, grace, Arc::default()))
            .await
            .expect_err("a stalled body fails");
        assert!(is_too_slow(&e));
        assert_eq!(started.elapsed(), grace + Duration::from_millis(1));
        drop(tx);
    }

    fn tokio_stream(
        mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
    ) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }
}
