//! Fair capacity (issue 18, findings 4 and 5): classes of callers and addresses bounded apart,
//! connections bounded per peer, a minimum body rate, every refusal in the error shape (the
//! HTTP stack's own included) and JSON routes that take JSON only.
//!
//! Clients bind their side of a connection to chosen loopback addresses (all of 127/8 is
//! local on Linux): the flooding guest at 127.0.0.2, another guest at 127.0.0.3, the
//! operator's backend at 127.0.0.1 (a trusted proxy in the test config). The flood holds
//! 8,300 sockets in this process: `ulimit -Hn` must allow it (20,000 here); the test raises
//! its soft limit itself and fails, never skips, when the hard limit is too low.

use crate::harness::*;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Limits that never bind, so that only the gateway's capacity bounds are tested.
const OPEN: &str = concat!(
    r#"
[limits.global]
rate = "100000/second"
burst = 100000
concurrency = 100000
budgets = [{ amount = "100.00", window = "day" }]
"#,
    open_guest_limits!(),
    r#"
[limits.conversation]
concurrency = 1000
budgets = []
"#
);

/// Connections the flood opens: the attack round's count.
const FLOOD: usize = 8_300;
/// Flood connections opened between two rounds of probes.
const FLOOD_BATCH: usize = 100;
/// Room for the test's other open files (and the other tests of this binary running beside
/// it) beyond the flood.
const FD_MARGIN: u64 = 2_048;

/// Raises this process's soft limit on open files (as the gateway does at start) and fails
/// when the hard limit cannot hold `sockets` more.
fn need_open_files(sockets: usize) {
    if let Some(limit) = spendgate_listener::rlimit::raise_open_files_limit() {
        assert!(
            limit >= sockets as u64 + FD_MARGIN,
            "this test holds {sockets} sockets; the open files limit is {limit} (raise the \
             hard limit: ulimit -Hn {})",
            sockets as u64 + FD_MARGIN
        );
    }
}

/// A connection to the server from the loopback address `from`.
async fn connect_from(from: &str, port: u16) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(format!("{from}:0").parse::<SocketAddr>().expect("addr"))?;
    socket
        .connect(SocketAddr::from(([127, 0, 0, 1], port)))
        .await
}

/// An answer read off a raw connection.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// The head, lower case.
    head: String,
    body: Value,
}

impl Answer {
    fn parse(bytes: &[u8]) -> Option<Answer> {
        let text = String::from_utf8_lossy(bytes);
        let (head, body) = text.split_once("\r\n\r\n")?;
        let status = head.split(' ').nth(1)?.parse().ok()?;
        Some(Answer {
            status,
            head: head.to_ascii_lowercase(),
            body: serde_json::from_str(body).unwrap_or(Value::Null),
        })
    }

    fn has(&self, header_line: &str) -> bool {
        self.head.contains(&format!("\r\n{header_line}\r\n"))
    }

    /// Asserts the OpenAI error shape with `code`.
    fn assert_error(&self, status: u16, code: &str, what: &str) {
        assert_eq!(self.status, status, "{what}: {self:?}");
        assert!(
            self.has("content-type: application/json"),
            "{what}: {self:?}"
        );
        assert_eq!(self.body["error"]["code"], code, "{what}: {self:?}");
        assert!(
            self.body["error"]["type"].is_string()
                && self.body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
            "{what}: {self:?}"
        );
    }
}

/// Reads until the server closes the connection or `within` passes; the answer, if whole.
async fn answer_of(tcp: &mut TcpStream, within: Duration) -> Option<Answer> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(within, tcp.read_to_end(&mut out)).await;
    Answer::parse(&out)
}

/// Sends `request` from `from` and reads the answer (the server closes the connection:
/// requests carry `Connection: close` or are refused).
async fn exchange(from: &str, port: u16, request: &[u8]) -> Option<Answer> {
    let mut tcp = connect_from(from, port).await.ok()?;
    // (the server may answer and close before it has read all of it)
    let _ = tcp.write_all(request).await;
    answer_of(&mut tcp, Duration::from_secs(10)).await
}

/// The head of a `POST` with `Content-Length: 1000` of which only `{` is sent: it holds its
/// request in flight until its body rate gives out.
fn slow_post(path: &str, headers: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}\
         Content-Length: 1000\r\n\r\n{{"
    )
}

/// A request with a JSON body, `Connection: close`.
fn post_json(path: &str, headers: &str, body: &Value) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
         {headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn get(path: &str, headers: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n").into_bytes()
}

fn service() -> String {
    format!("Authorization: Bearer {SERVICE}\r\n")
}

/// One round of what must be served whatever a guest does: the operator's backend (from
/// 127.0.0.1) opens and finishes a run for a guest, `/healthz` answers, and another guest
/// (127.0.0.3) creates a session. The statuses seen, in that order.
async fn probes(port: u16, session: &str, round: usize) -> [u16; 4] {
    let status = |a: Option<Answer>| a.map_or(0, |a| a.status);
    let run = exchange(
        "127.0.0.1",
        port,
        &post_json(
            "/v1/runs",
            &service(),
            &json!({"session": session, "client_ip": "198.51.100.1",
                    "conversation": format!("flood-{round}"), "input_text": "hi"}),
        ),
    )
    .await;
    let run_status = run.as_ref().map_or(0, |a| a.status);
    let finished = match run.as_ref().and_then(|a| a.body["run_id"].as_str()) {
        Some(id) => status(
            exchange(
                "127.0.0.1",
                port,
                &post_json(&format!("/v1/runs/{id}/finish"), &service(), &json!({})),
            )
            .await,
        ),
        None => 0,
    };
    let health = status(exchange("127.0.0.1", port, &get("/healthz", "")).await);
    let guest = status(
        exchange(
            "127.0.0.3",
            port,
            &post_json("/v1/sessions", "", &json!({})),
        )
        .await,
    );
    [run_status, finished, health, guest]
}

/// Finding 4: 8,300 connections from one address, each with its head and one byte of body
/// on the public session route. During the flood every call of the operator's backend and
/// every `/healthz` is served, and another address still creates sessions; the flooding
/// address gets at most its bounds: connections past `address_connections_max` closed
/// unread, requests past `address_requests_max` refused 429 `rate_limited` (scope `ip`) in
/// the error shape, and the ones it holds answered 408 once their body rate gives out. On
/// the code before this, the flood filled the process's one bound of requests in flight and
/// every probe got 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_flood_from_one_address_takes_nothing_from_the_operator_or_other_guests() {
    need_open_files(FLOOD);
    // (the memory store: the probes' latency is the gateway's, not a loaded disk's fsync)
    let (dir, _) = sqlite_dir();
    let server = Server::start_config(
        dir,
        |port| config_text_full(port, "", "kind = \"memory\"", DEFAULT_SESSIONS, OPEN),
        Vec::new(),
    );
    let port = server.port;
    let session = server.session().await;
    let started = Instant::now();
    let opened = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // The flood, as fast as it goes, while the probes run beside it.
    let flooding = {
        let opened = opened.clone();
        tokio::spawn(async move {
            let head = slow_post("/v1/sessions", "");
            let mut flood: Vec<TcpStream> = Vec::with_capacity(FLOOD);
            let mut attempts = 0;
            while attempts < FLOOD {
                let batch = FLOOD_BATCH.min(FLOOD - attempts);
                attempts += batch;
                let batch = futures::future::join_all((0..batch).map(|_| async {
                    let mut tcp = connect_from("127.0.0.2", port).await.ok()?;
                    // (a connection closed at once may refuse the write)
                    let _ = tcp.write_all(head.as_bytes()).await;
                    Some(tcp)
                }))
                .await;
                flood.extend(batch.into_iter().flatten());
                opened.store(flood.len(), std::sync::atomic::Ordering::Relaxed);
                assert!(
                    started.elapsed() < Duration::from_secs(40),
                    "the flood took too long to open ({} connections)",
                    flood.len()
                );
            }
            flood
        })
    };
    let mut served = 0;
    let mut failed = Vec::new();
    let mut round = 0;
    let mut after = 0;
    // Until the flood is open, and for a few rounds more while its last requests are held.
    while after < 3 {
        if flooding.is_finished() {
            after += 1;
        }
        round += 1;
        let seen = probes(port, &session, round).await;
        let at = opened.load(std::sync::atomic::Ordering::Relaxed);
        if seen == [201, 200, 200, 201] {
            served += 1;
        } else {
            failed.push((at, seen));
        }
    }
    let mut flood = flooding.await.expect("the flood task");
    let opened_in = started.elapsed();
    assert!(
        failed.is_empty(),
        "during the flood, probes (run, finish, healthz, other guest) were refused: \
         {failed:?} (as (connections open, statuses); {served} rounds served)"
    );

    // What the flooding address got: never a session, only its bounds.
    let outcomes = futures::future::join_all(flood.iter_mut().map(|tcp| async move {
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(8), tcp.read_to_end(&mut out)).await;
        match (read, Answer::parse(&out)) {
            (_, Some(a)) => Some(a),
            (Ok(_), None) => None,
            (Err(_), None) => Some(Answer {
                status: 0,
                head: "still open".into(),
                body: Value::Null,
            }),
        }
    }))
    .await;
    let mut closed_unread = 0;
    let mut limited = 0;
    let mut timed_out = 0;
    for a in outcomes {
        match a {
            None => closed_unread += 1,
            Some(a) if a.status == 429 => {
                a.assert_error(
                    429,
                    "rate_limited",
                    "a flood request past its address bound",
                );
                assert_eq!(a.body["error"]["scope"], "ip", "{a:?}");
                assert!(
                    a.has("retry-after: 1") && a.has("connection: close"),
                    "{a:?}"
                );
                limited += 1;
            }
            Some(a) if a.status == 408 => {
                a.assert_error(408, "request_timeout", "a stalled flood body");
                assert!(a.has("connection: close"), "{a:?}");
                timed_out += 1;
            }
            Some(a) => panic!("a flood connection got {a:?}"),
        }
    }
    let took = started.elapsed();
    eprintln!(
        "flood of {FLOOD}: {closed_unread} closed unread, {limited} refused 429, {timed_out} \
         answered 408; {served} probe rounds served; opened in {opened_in:?}, all answered in \
         {took:?}"
    );
    // The address held at most `address_requests_max` requests at a time, each for about
    // the grace: a bound on the 408s.
    let grace = spendgate_config::BODY_GRACE_MS_DEFAULT as f64 / 1000.0;
    let held_max =
        spendgate_config::ADDRESS_REQUESTS_MAX_DEFAULT as f64 * (took.as_secs_f64() / grace + 1.0);
    assert!(
        (timed_out as f64) <= held_max,
        "{timed_out} stalled bodies held in {took:?}: more than the address bound allows"
    );
    assert!(limited > 0 && timed_out > 0);
}

/// Config of the class test: small bounds, a long body grace so that slow bodies hold their
/// slots for the whole test.
const SMALL_CLASSES: &str = "public_requests_max = 8\nservice_requests_max = 8\n\
     admin_requests_max = 2\nhealth_requests_max = 4\naddress_requests_max = 4\n\
     body_grace_ms = 10000";

/// One class at its bound takes nothing from another, and one address at its bound takes
/// nothing from other addresses (the address as the ledger sees it: through a trusted
/// proxy, its `X-Forwarded-For`). Refusals for capacity are 429 `rate_limited` with
/// `Retry-After: 1`, `x-should-retry: false` and `connection: close`; scope `global` for a
/// class, `ip` for an address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_class_at_its_bound_takes_nothing_from_another() {
    let (dir, store) = sqlite_dir();
    let server = Server::start_config(
        dir,
        |port| config_text_full(port, SMALL_CLASSES, &store, DEFAULT_SESSIONS, OPEN),
        Vec::new(),
    );
    let port = server.port;
    let session = server.session().await;
    let hold = |from: &'static str, path: &'static str, headers: String| async move {
        let mut tcp = connect_from(from, port).await.expect("connect");
        tcp.write_all(slow_post(path, &headers).as_bytes())
            .await
            .expect("write");
        // (answered only if refused: read what comes within a moment)
        let mut buf = vec![0u8; 2048];
        let n = tokio::time::timeout(Duration::from_millis(300), tcp.read(&mut buf))
            .await
            .map_or(0, |r| r.unwrap_or(0));
        (tcp, Answer::parse(&buf[..n]))
    };
    let new_session = |from: &'static str, xff: &'static str| async move {
        let headers = if xff.is_empty() {
            String::new()
        } else {
            format!("X-Forwarded-For: {xff}\r\n")
        };
        exchange(from, port, &post_json("/v1/sessions", &headers, &json!({})))
            .await
            .expect("answered")
    };

    // One address (behind the trusted proxy) holds its 4; its 5th is refused for the
    // address, another address behind the same proxy is not.
    let mut held = Vec::new();
    for _ in 0..4 {
        let (tcp, refused) = hold(
            "127.0.0.1",
            "/v1/sessions",
            "X-Forwarded-For: 203.0.113.9\r\n".into(),
        )
        .await;
        assert!(refused.is_none(), "within the address bound: {refused:?}");
        held.push(tcp);
    }
    let a = new_session("127.0.0.1", "203.0.113.9").await;
    a.assert_error(429, "rate_limited", "an address past its bound");
    assert_eq!(a.body["error"]["scope"], "ip", "{a:?}");
    for line in [
        "retry-after: 1",
        "x-should-retry: false",
        "connection: close",
    ] {
        assert!(a.has(line), "{line}: {a:?}");
    }
    assert_eq!(new_session("127.0.0.1", "203.0.113.10").await.status, 201);

    // The public class fills (4 more from a second address): a third address is refused
    // for the class, and the operator, the admin API and the health checks are served.
    for _ in 0..4 {
        let (tcp, refused) = hold("127.0.0.4", "/v1/sessions", String::new()).await;
        assert!(refused.is_none(), "within the public bound: {refused:?}");
        held.push(tcp);
    }
    let a = new_session("127.0.0.5", "").await;
    a.assert_error(429, "rate_limited", "the public class at its bound");
    assert_eq!(a.body["error"]["scope"], "global", "{a:?}");
    assert!(
        a.has("connection: close") && a.has("retry-after: 1"),
        "{a:?}"
    );
    let run = exchange(
        "127.0.0.1",
        port,
        &post_json(
            "/v1/runs",
            &service(),
            &json!({"session": session, "client_ip": "198.51.100.2", "conversation": "c1", "input_text": "hi"}),
        ),
    )
    .await
    .expect("answered");
    assert_eq!(
        run.status, 201,
        "the operator's backend, public class full: {run:?}"
    );
    let admin = exchange(
        "127.0.0.1",
        port,
        &get(
            "/admin/v1/summary",
            &format!("Authorization: Bearer {ADMIN}\r\n"),
        ),
    )
    .await
    .expect("answered");
    assert_eq!(admin.status, 200, "admin, public class full: {admin:?}");
    let health = exchange("127.0.0.6", port, &get("/healthz", ""))
        .await
        .expect("answered");
    assert_eq!(health.status, 200, "healthz, public class full: {health:?}");
    // A wrong token is no way into the service class.
    let wrong = exchange(
        "127.0.0.7",
        port,
        &post_json(
            "/v1/sessions",
            "Authorization: Bearer not-a-token\r\n",
            &json!({}),
        ),
    )
    .await
    .expect("answered");
    assert_eq!(wrong.body["error"]["scope"], "global", "{wrong:?}");

    // The service class fills too: the operator is refused for its own class only, and
    // once the guests' requests end, guests are served again while it stays full.
    let mut service_held = Vec::new();
    for _ in 0..8 {
        let (tcp, refused) = hold("127.0.0.1", "/v1/runs", service()).await;
        assert!(refused.is_none(), "within the service bound: {refused:?}");
        service_held.push(tcp);
    }
    let run = exchange(
        "127.0.0.1",
        port,
        &post_json("/v1/runs", &service(), &json!({"session": session, "client_ip": "198.51.100.2", "conversation": "c2", "input_text": "hi"})),
    )
    .await
    .expect("answered");
    run.assert_error(429, "rate_limited", "the service class at its bound");
    assert_eq!(run.body["error"]["scope"], "global", "{run:?}");
    drop(held);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        new_session("127.0.0.5", "").await.status,
        201,
        "public room again"
    );
    let health = exchange("127.0.0.6", port, &get("/healthz", ""))
        .await
        .expect("answered");
    assert_eq!(health.status, 200);
    drop(service_held);
}

/// Connections are accounted by class where they can be: once guests hold every ordinary
/// connection slot, the reserved ones still take the operator's backend, the admin API and
/// the health checks, and refuse a guest's request at once (429, connection closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_connections_keep_room_for_the_operator() {
    let (dir, store) = sqlite_dir();
    let server_keys =
        "connections_max = 24\nconnections_reserved = 4\naddress_connections_max = 10";
    let server = Server::start_config(
        dir,
        |port| config_text_full(port, server_keys, &store, DEFAULT_SESSIONS, OPEN),
        Vec::new(),
    );
    let port = server.port;
    let session = server.session().await;
    // Two guests hold the 20 ordinary slots with silent connections.
    let mut silent = Vec::new();
    for from in ["127.0.0.2", "127.0.0.4"] {
        for _ in 0..10 {
            silent.push(connect_from(from, port).await.expect("connect"));
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let guest = exchange(
        "127.0.0.3",
        port,
        &post_json("/v1/sessions", "", &json!({})),
    )
    .await
    .expect("answered");
    guest.assert_error(429, "rate_limited", "a guest on a reserved slot");
    assert_eq!(guest.body["error"]["scope"], "global", "{guest:?}");
    assert!(guest.has("connection: close"), "{guest:?}");
    for _ in 0..3 {
        let run = exchange(
            "127.0.0.1",
            port,
            &post_json(
                "/v1/runs",
                &service(),
                &json!({"session": session, "client_ip": "198.51.100.5", "conversation": "r", "input_text": "hi"}),
            ),
        )
        .await
        .expect("answered");
        assert_eq!(run.status, 201, "the operator on a reserved slot: {run:?}");
        let id = run.body["run_id"].as_str().expect("run id");
        let finish = exchange(
            "127.0.0.1",
            port,
            &post_json(&format!("/v1/runs/{id}/finish"), &service(), &json!({})),
        )
        .await
        .expect("answered");
        assert_eq!(finish.status, 200, "{finish:?}");
    }
    let health = exchange("127.0.0.6", port, &get("/healthz", ""))
        .await
        .expect("answered");
    assert_eq!(health.status, 200, "{health:?}");
    // The guests let go: a guest is served again (once the server has seen them close).
    drop(silent);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let guest = exchange(
            "127.0.0.3",
            port,
            &post_json("/v1/sessions", "", &json!({})),
        )
        .await
        .expect("answered");
        if guest.status == 201 {
            break;
        }
        assert!(Instant::now() < deadline, "{guest:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Finding 5: what the HTTP stack refuses itself is answered in the error shape too: 2,000
/// small header lines, one header line over the head bound, a request line that is not
/// HTTP; and a head under the stack's bound but over `HEADER_BYTES_MAX` by the router. On
/// the code before this, hyper's answers had an empty body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_refusals_are_answered_in_the_error_shape() {
    let server = Server::start(OPEN);
    let lines: String = (0..2_000).map(|i| format!("X-Line-{i}: v\r\n")).collect();
    let oversize = "a".repeat(spendgate_listener::HEAD_BYTES_MAX + 1);
    let over_router = "b".repeat(spendgate_listener::HEADER_BYTES_MAX + 100);
    let body = "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    let cases = [
        ("2,000 header lines", format!("POST /v1/sessions HTTP/1.1\r\nHost: x\r\n{lines}{body}"), 431),
        ("an oversize header line", format!("POST /v1/sessions HTTP/1.1\r\nHost: x\r\nX-Big: {oversize}\r\n{body}"), 431),
        ("a bad request line", "HELLO THERE\r\n\r\n".to_string(), 400),
        ("a header line without a colon", format!("POST /v1/sessions HTTP/1.1\r\nHost: x\r\nno colon\r\n{body}"), 400),
        ("headers over HEADER_BYTES_MAX", format!("POST /v1/sessions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: {over_router}\r\n{body}"), 431),
    ];
    for (what, request, status) in cases {
        let a = exchange("127.0.0.3", server.port, request.as_bytes())
            .await
            .unwrap_or_else(|| panic!("{what}: no whole answer"));
        a.assert_error(status, "invalid_request", what);
        assert_eq!(
            a.body["error"]["type"], "invalid_request_error",
            "{what}: {a:?}"
        );
        assert!(a.has("connection: close"), "{what}: {a:?}");
    }
}

/// JSON routes take `Content-Type: application/json`, else 415 before anything is read or
/// done: always on the routes a guest's cookie reaches (a cross-site "simple" request can
/// POST there with `text/plain`, a form type or no body at all), and on the service and
/// admin routes whenever a body is sent. A body-less service call needs no type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_routes_take_json_only() {
    let server = Server::start_browser_direct(OPEN);
    let session = server.session().await;
    let cookie = format!("Cookie: spendgate_session={session}\r\n");
    let proxy_service = format!(
        "{}Spendgate-Session: {session}\r\nSpendgate-Client-Ip: 198.51.100.3\r\nSpendgate-Conversation: c1\r\n",
        service()
    );
    let run_body =
        json!({"session": session, "client_ip": "198.51.100.3", "conversation": "c1", "input_text": "hi"})
            .to_string();
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let with = |path: &str, headers: &str, ct: &str, body: &str| {
        let ct = if ct.is_empty() {
            String::new()
        } else {
            format!("Content-Type: {ct}\r\n")
        };
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}{ct}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let cases = [
        (
            "a guest session as text/plain",
            with("/v1/sessions", "", "text/plain", "{}"),
        ),
        (
            "a guest session as a form",
            with(
                "/v1/sessions",
                "",
                "application/x-www-form-urlencoded",
                "a=b",
            ),
        ),
        (
            "a guest session without a body or a type",
            with("/v1/sessions", "", "", ""),
        ),
        (
            "a run as text/plain",
            with("/v1/runs", &service(), "text/plain", &run_body),
        ),
        (
            "a run without a type",
            with("/v1/runs", &service(), "", &run_body),
        ),
        (
            "the proxy with a service token, text/plain",
            with("/v1/chat/completions", &proxy_service, "text/plain", &chat),
        ),
        (
            "the proxy with a guest's cookie, text/plain",
            with("/v1/chat/completions", &cookie, "text/plain", &chat),
        ),
        (
            "the proxy with a guest's cookie, no body",
            with("/v1/chat/completions", &cookie, "", ""),
        ),
        (
            "an admin adjustment as text/plain",
            with(
                "/admin/v1/adjustments",
                &format!("Authorization: Bearer {ADMIN}\r\n"),
                "text/plain",
                "{}",
            ),
        ),
    ];
    let before = server.admin_get("/admin/v1/summary").await;
    for (what, request) in cases {
        let a = exchange("127.0.0.3", server.port, request.as_bytes())
            .await
            .unwrap_or_else(|| panic!("{what}: no whole answer"));
        a.assert_error(415, "invalid_request", what);
        assert!(!a.has("set-cookie"), "{what}: {a:?}");
    }
    let after = server.admin_get("/admin/v1/summary").await;
    assert_eq!(
        before["ledger_seq"], after["ledger_seq"],
        "nothing was done"
    );

    // The accepted forms: the type with parameters or in another case; a body-less service
    // call without one.
    let ok = exchange(
        "127.0.0.3",
        server.port,
        with("/v1/sessions", "", "Application/JSON; charset=utf-8", "").as_bytes(),
    )
    .await
    .expect("answered");
    assert_eq!(ok.status, 201, "{ok:?}");
    let run = exchange(
        "127.0.0.1",
        server.port,
        with("/v1/runs", &service(), "application/json", &run_body).as_bytes(),
    )
    .await
    .expect("answered");
    assert_eq!(run.status, 201, "{run:?}");
    let id = run.body["run_id"].as_str().expect("run id");
    let finish = exchange(
        "127.0.0.1",
        server.port,
        with(&format!("/v1/runs/{id}/finish"), &service(), "", "").as_bytes(),
    )
    .await
    .expect("answered");
    assert_eq!(
        finish.status, 200,
        "a body-less service call needs no type: {finish:?}"
    );
}

/// A body must keep arriving: one byte and silence is answered 408 in the error shape soon
/// after the grace (the connection closed), where a flat deadline held it for 10 s; a large
/// body sent fast passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_must_keep_arriving_and_a_large_fast_one_passes() {
    let server = Server::start(OPEN);
    let session = server.session().await;
    let grace = Duration::from_millis(spendgate_config::BODY_GRACE_MS_DEFAULT);
    let started = Instant::now();
    let mut tcp = connect_from("127.0.0.3", server.port)
        .await
        .expect("connect");
    tcp.write_all(slow_post("/v1/sessions", "").as_bytes())
        .await
        .expect("write");
    let a = answer_of(&mut tcp, Duration::from_secs(8))
        .await
        .expect("answered and closed");
    let took = started.elapsed();
    a.assert_error(408, "request_timeout", "a stalled body");
    assert!(a.has("connection: close"), "{a:?}");
    assert!(
        took >= grace && took < grace + Duration::from_secs(3),
        "answered after {took:?}"
    );

    // 200 KiB of JSON (whitespace inside the object) at loopback speed.
    let padding = " ".repeat(200 * 1024);
    let body = format!(
        "{{\"session\": \"{session}\", \"client_ip\": \"198.51.100.4\",{padding}\"conversation\": \"big\", \"input_bytes\": 10}}"
    );
    let request = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {SERVICE}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let a = exchange("127.0.0.1", server.port, request.as_bytes())
        .await
        .expect("answered");
    assert_eq!(a.status, 201, "{a:?}");
}
