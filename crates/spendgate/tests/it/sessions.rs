//! Guest session creation: limited per address prefix and globally, and protected by a
//! signed, expiring, single-use proof-of-work challenge when configured.

use crate::harness::*;
use serde_json::{json, Value};

async fn create(server: &Server, xff: &str, body: Option<Value>) -> (u16, Option<String>, Value) {
    let mut req = server
        .http
        .post(server.url("/v1/sessions"))
        .header("x-forwarded-for", xff)
        // (a guest's session route always takes JSON, with a body or without)
        .header("content-type", "application/json");
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.expect("send");
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (status, retry, r.json().await.unwrap_or(Value::Null))
}

/// Solves the challenge of a `challenge_required` answer (8 bits) and posts it back.
async fn create_solved(
    server: &Server,
    xff: &str,
    refused: &Value,
) -> (u16, Option<String>, Value) {
    let nonce = refused["challenge"]["nonce"].as_str().expect("nonce");
    let solution = spendgate_http::challenge::solve(nonce, 8);
    create(
        server,
        xff,
        Some(json!({"challenge": refused["challenge"], "solution": solution})),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_creation_is_rate_limited_per_ip_prefix_and_globally() {
    let server = Server::start_with_sessions(
        "create_rate_per_ip = \"2/hour\"\ncreate_rate_global = \"5/hour\"",
        "[identity]\nipv4_prefix = 24\n",
    );
    // Two from one /24 (the client address comes from X-Forwarded-For via the trusted proxy).
    for host in [1, 2] {
        let (status, _, v) = create(&server, &format!("198.51.100.{host}"), None).await;
        assert_eq!(status, 201, "{v}");
    }
    let (status, retry, v) = create(&server, "198.51.100.3", None).await;
    assert_eq!((status, code(&v)), (429, "rate_limited"), "same /24: {v}");
    assert_eq!(v["error"]["scope"], "ip");
    assert!(retry
        .and_then(|r| r.parse::<u64>().ok())
        .is_some_and(|r| r > 0));
    // Other prefixes go on until the global allowance (5) is spent.
    for net in [1, 2, 3] {
        let (status, _, v) = create(&server, &format!("203.0.{net}.9"), None).await;
        assert_eq!(status, 201, "{v}");
    }
    let (status, _, v) = create(&server, "192.0.2.1", None).await;
    assert_eq!((status, code(&v)), (429, "rate_limited"), "{v}");
    assert_eq!(v["error"]["scope"], "global");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn challenge_is_signed_expiring_and_single_use() {
    let server = Server::start_with_sessions(
        "create_rate_per_ip = \"1000/second\"\ncreate_rate_global = \"1000/second\"\nchallenge = \"always\"\nchallenge_bits = 8",
        "",
    );
    let (status, _, v) = create(&server, "198.51.100.1", None).await;
    assert_eq!((status, code(&v)), (403, "challenge_required"), "{v}");
    let challenge = v["challenge"].clone();
    let nonce = challenge["nonce"].as_str().expect("nonce");
    let bits = challenge["bits"].as_u64().expect("bits") as u8;
    assert_eq!(bits, 8);

    // A wrong solution and a forged challenge are refused.
    let wrong = (0u64..)
        .map(|i| i.to_string())
        .find(|s| !spendgate_http::challenge::solves(nonce, bits, s))
        .expect("some string fails");
    let (status, _, v) = create(
        &server,
        "198.51.100.1",
        Some(json!({"challenge": challenge, "solution": wrong})),
    )
    .await;
    assert_eq!((status, code(&v)), (403, "challenge_required"), "{v}");
    let mut forged = challenge.clone();
    forged["bits"] = json!(1);
    let easy = spendgate_http::challenge::solve(nonce, 1);
    let (status, _, v) = create(
        &server,
        "198.51.100.1",
        Some(json!({"challenge": forged, "solution": easy})),
    )
    .await;
    assert_eq!(
        (status, code(&v)),
        (403, "challenge_required"),
        "forged: {v}"
    );

    let solution = spendgate_http::challenge::solve(nonce, bits);
    let body = json!({"challenge": challenge, "solution": solution});
    let (status, _, v) = create(&server, "198.51.100.1", Some(body.clone())).await;
    assert_eq!(status, 201, "{v}");
    assert!(v["session"].as_str().is_some());
    let (status, _, v) = create(&server, "198.51.100.1", Some(body)).await;
    assert_eq!(
        (status, code(&v)),
        (403, "challenge_required"),
        "a solution opens one session only: {v}"
    );
}

/// An external siteverify-style verifier: a token it accepts opens one session; a token it
/// refuses, a repeat, or a verifier that is down refuse (fail closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_verifier_checks_tokens_once_and_fails_closed() {
    use axum::routing::post;
    use axum::{Form, Json, Router};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    let seen: Arc<Mutex<Vec<HashMap<String, String>>>> = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    // The address the verifier was last given.
    let last_remoteip = || {
        let seen = seen.lock().expect("lock");
        let last = seen.last().expect("the verifier was called");
        last.get("remoteip").cloned()
    };
    let app = Router::new().route(
        "/siteverify",
        post(move |Form(f): Form<HashMap<String, String>>| {
            let sink = sink.clone();
            async move {
                sink.lock().expect("lock").push(f.clone());
                let ok = f.get("secret").map(String::as_str) == Some("verifier-secret")
                    && f.get("response").is_some_and(|r| r.starts_with("good"));
                Json(json!({"success": ok}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let server = Server::start_with_sessions(
        &format!(
            "challenge = \"always\"\nverifier_url = \"http://{addr}/siteverify\"\nverifier_secret = \"verifier-secret\""
        ),
        "",
    );
    let (status, _, v) = create(&server, "198.51.100.7", None).await;
    assert_eq!((status, code(&v)), (403, "challenge_required"), "{v}");
    assert_eq!(v["challenge"]["kind"], "external");
    let (status, _, v) = create(
        &server,
        "198.51.100.7",
        Some(json!({"solution": "bad-token"})),
    )
    .await;
    assert_eq!((status, code(&v)), (403, "challenge_required"), "{v}");
    let (status, _, v) = create(
        &server,
        "198.51.100.7",
        Some(json!({"solution": "good-token-1"})),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    let (status, _, v) = create(
        &server,
        "198.51.100.7",
        Some(json!({"solution": "good-token-1"})),
    )
    .await;
    assert_eq!(
        (status, code(&v)),
        (403, "challenge_required"),
        "a token opens one session: {v}"
    );
    assert_eq!(last_remoteip().as_deref(), Some("198.51.100.7"));
    // The verifier gets the visitor's own address, not its /64's network address.
    let (status, _, v) = create(
        &server,
        "2001:db8:1:2::77",
        Some(json!({"solution": "good-token-2"})),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(last_remoteip().as_deref(), Some("2001:db8:1:2::77"));
    task.abort();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (status, _, v) = create(
        &server,
        "198.51.100.7",
        Some(json!({"solution": "good-token-2"})),
    )
    .await;
    assert_eq!(
        (status, code(&v)),
        (403, "challenge_required"),
        "verifier down: refused: {v}"
    );
}

/// `challenge = "adaptive"`: no challenge while session creation is quiet; once creation
/// uses more than half its global allowance, a challenge is required.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_challenge_starts_under_pressure() {
    let server = Server::start_with_sessions(
        "create_rate_per_ip = \"1000/second\"\ncreate_rate_global = \"10/hour\"\nchallenge = \"adaptive\"\nchallenge_bits = 8",
        "",
    );
    let mut free = 0;
    let mut challenged = None;
    for i in 0..10 {
        let (status, _, v) = create(&server, &format!("203.0.113.{i}"), None).await;
        match status {
            201 => free += 1,
            403 => {
                assert_eq!(code(&v), "challenge_required", "{v}");
                challenged = Some(v);
                break;
            }
            other => panic!("unexpected {other}: {v}"),
        }
    }
    assert!(
        (3..=7).contains(&free),
        "quiet creation needs no challenge at first: {free}"
    );
    let v = challenged.expect("pressure turns the challenge on");
    let (status, _, v) = create_solved(&server, "203.0.113.99", &v).await;
    assert_eq!(status, 201, "{v}");
}

/// `challenge = "adaptive"` per address: one prefix busy past half its allowance is
/// challenged; another prefix is not (and its creations do not lift the first one's
/// challenge); a prefix its rate refuses gets 429 before any challenge is spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_challenge_follows_each_clients_own_pressure() {
    let server = Server::start_with_sessions(
        "create_rate_per_ip = \"4/hour\"\ncreate_rate_global = \"1000/second\"\nchallenge = \"adaptive\"\nchallenge_bits = 8",
        "",
    );
    let busy = "203.0.113.10";
    for _ in 0..2 {
        let (status, _, v) = create(&server, busy, None).await;
        assert_eq!(status, 201, "quiet: {v}");
    }
    let (status, _, v) = create(&server, busy, None).await;
    assert_eq!((status, code(&v)), (403, "challenge_required"), "{v}");
    for i in 0..2 {
        let (status, _, v) = create(&server, &format!("198.51.100.{i}"), None).await;
        assert_eq!(status, 201, "another address is not challenged: {v}");
    }
    let (status, _, v) = create(&server, busy, None).await;
    assert_eq!(
        (status, code(&v)),
        (403, "challenge_required"),
        "still challenged after other addresses' creations: {v}"
    );
    // Solve two challenges: the busy address's allowance of 4 is then used.
    for _ in 0..2 {
        let (_, _, v) = create(&server, busy, None).await;
        let (status, _, v) = create_solved(&server, busy, &v).await;
        assert_eq!(status, 201, "{v}");
    }
    // Past its rate the address is refused 429 before any challenge is looked at (a
    // verifier is not called, a solution not used up).
    let (status, retry, v) = create(
        &server,
        busy,
        Some(json!({"challenge": {"nonce": "x"}, "solution": "y"})),
    )
    .await;
    assert_eq!((status, code(&v)), (429, "rate_limited"), "{v}");
    assert!(retry.is_some());
}

/// During a key rotation replicas may sign with different first keys: a challenge issued by
/// one is accepted by another that has the issuer's key among its keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_challenge_from_a_replica_with_another_first_key_is_accepted() {
    const OTHER_KEY: &str = "test-session-key-rotated-0123456789";
    let start = |keys: String| {
        let (dir, store) = sqlite_dir();
        Server::start_config(
            dir,
            move |port| {
                config_text_with_sessions(
                    port,
                    &store,
                    "challenge = \"always\"\nchallenge_bits = 8",
                    "",
                )
                .replace(&format!("keys = [\"{SESSION_KEY}\"]"), &keys)
            },
            Vec::new(),
        )
    };
    let old_first = start(format!("keys = [\"{SESSION_KEY}\", \"{OTHER_KEY}\"]"));
    let new_first = start(format!("keys = [\"{OTHER_KEY}\", \"{SESSION_KEY}\"]"));
    let (status, _, v) = create(&old_first, "198.51.100.20", None).await;
    assert_eq!((status, code(&v)), (403, "challenge_required"), "{v}");
    let (status, _, v) = create_solved(&new_first, "198.51.100.20", &v).await;
    assert_eq!(status, 201, "{v}");
}

/// A proxy may add its own `X-Forwarded-For` line after one the client wrote: the lines are
/// one list, walked from the right, so the client's line cannot choose the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_written_forwarded_for_line_does_not_choose_the_address() {
    let server = Server::start_with_sessions(
        "create_rate_per_ip = \"2/hour\"\ncreate_rate_global = \"1000/hour\"",
        "",
    );
    for attempt in 1..=3 {
        let r = server
            .http
            .post(server.url("/v1/sessions"))
            .header("x-forwarded-for", format!("192.0.2.{attempt}"))
            .header("x-forwarded-for", "198.51.100.7")
            .json(&json!({}))
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        if attempt <= 2 {
            assert_eq!(status, 201, "{v}");
        } else {
            assert_eq!((status, code(&v)), (429, "rate_limited"), "{v}");
            assert_eq!(v["error"]["scope"], "ip", "{v}");
        }
    }
}

/// A trusted proxy that writes `X-Forwarded-For` entries with a port (`addr:port`,
/// `[v6]:port`): the address without the port is the client's, so guests behind it are not
/// all counted under the proxy's own address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_entries_with_a_port_name_the_client() {
    let server = Server::start_with_sessions(
        "create_rate_per_ip = \"2/hour\"\ncreate_rate_global = \"1000/hour\"",
        "",
    );
    // Three guests: one address each (under the proxy's address the third would be refused).
    for xff in ["198.51.100.7:1234", "[2001:db8::1]:443", "203.0.113.9:80"] {
        let (status, _, v) = create(&server, xff, None).await;
        assert_eq!(status, 201, "{xff}: {v}");
    }
    // The same address with another port, or none, is the same guest.
    let (status, _, v) = create(&server, "198.51.100.7:9", None).await;
    assert_eq!(status, 201, "{v}");
    let (status, _, v) = create(&server, "198.51.100.7", None).await;
    assert_eq!((status, code(&v)), (429, "rate_limited"), "{v}");
    assert_eq!(v["error"]["scope"], "ip", "{v}");
    let (status, _, v) = create(&server, "[2001:db8::1]:8443", None).await;
    assert_eq!(status, 201, "{v}");
    let (status, _, v) = create(&server, "2001:db8::1", None).await;
    assert_eq!((status, code(&v)), (429, "rate_limited"), "{v}");
    // An entry the trusted proxy wrote that is no address: the proxy's own address counts,
    // and the operator is told in the log.
    let (status, _, v) = create(&server, "not-an-address:80", None).await;
    assert_eq!(status, 201, "{v}");
    let mut logged = String::new();
    for _ in 0..50 {
        logged = server
            .child
            .as_ref()
            .map(|c| c.output())
            .unwrap_or_default();
        if logged.contains("X-Forwarded-For") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        logged.contains("is not an address") && logged.contains("not-an-address:80"),
        "{logged}"
    );
}

/// `trusted_proxies` written as IPv4-mapped IPv6 (`::ffff:127.0.0.1`) trusts the IPv4 proxy:
/// peers are compared as IPv4, and so are the configured prefixes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_trusted_proxy_is_its_ipv4_form() {
    for proxies in ["\"::ffff:127.0.0.1\"", "\"::ffff:127.0.0.0/104\""] {
        let (dir, store) = sqlite_dir();
        let server = Server::start_config(
            dir,
            |port| {
                config_text_with_sessions(
                    port,
                    &store,
                    "create_rate_per_ip = \"1/hour\"\ncreate_rate_global = \"1000/hour\"",
                    "",
                )
                .replace(
                    "trusted_proxies = [\"127.0.0.1/32\"]",
                    &format!("trusted_proxies = [{proxies}]"),
                )
            },
            Vec::new(),
        );
        // One session per address: each forwarded address is its own guest.
        for xff in ["198.51.100.7", "198.51.100.8", "198.51.100.9"] {
            let (status, _, v) = create(&server, xff, None).await;
            assert_eq!(status, 201, "{proxies} {xff}: {v}");
        }
    }
    let no_env = |_: &str| None;
    let c = spendgate_config::load(
        "[server]\ntrusted_proxies = [\"::ffff:10.0.0.0/104\", \"::ffff:192.0.2.7\", \"2001:db8::/32\"]\n",
        &no_env,
    )
    .expect("config");
    let nets: Vec<String> = c
        .server
        .trusted_proxies
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(nets, ["10.0.0.0/8", "192.0.2.7/32", "2001:db8::/32"]);
    // A mapped prefix shorter than /96 has no IPv4 form: refused, naming the key.
    let Err(e) = spendgate_config::load(
        "[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"::ffff:0.0.0.0/80\"]\n",
        &no_env,
    ) else {
        panic!("a mapped prefix shorter than /96 is refused");
    };
    assert_eq!(e.key(), "server.trusted_proxies[1]", "{e}");
    assert!(e.to_string().contains("IPv4"), "{e}");
}

/// The operator's backend creating sessions for its guests passes each guest's address
/// (`client_ip`, with its service token): each guest is counted under its own address, not
/// the backend's. A guest cannot choose its address this way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_caller_passes_the_guests_address_when_creating_a_session() {
    let server = Server::start_with_sessions(
        "create_rate_per_ip = \"1/hour\"\ncreate_rate_global = \"1000/hour\"",
        "",
    );
    let send = |token: Option<&'static str>, body: Value| {
        let mut req = server.http.post(server.url("/v1/sessions")).json(&body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        async move {
            let r = req.send().await.expect("send");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    for ip in ["198.51.100.7", "198.51.100.8", "2001:db8::7"] {
        let (status, v) = send(Some(SERVICE), json!({"client_ip": ip})).await;
        assert_eq!(status, 201, "{ip}: {v}");
        assert!(v["session"].as_str().is_some(), "{v}");
    }
    let (status, v) = send(Some(SERVICE), json!({"client_ip": "198.51.100.7"})).await;
    assert_eq!((status, code(&v)), (429, "rate_limited"), "{v}");
    assert_eq!(v["error"]["scope"], "ip", "{v}");
    // A guest (no token, or not a service token) may not name an address.
    let (status, v) = send(None, json!({"client_ip": "192.0.2.99"})).await;
    assert_eq!((status, code(&v)), (400, "invalid_request"), "{v}");
    let (status, v) = send(Some(ADMIN), json!({"client_ip": "192.0.2.99"})).await;
    assert_eq!((status, code(&v)), (401, "unauthorized"), "{v}");
    let (status, v) = send(Some(SERVICE), json!({"client_ip": "not an address"})).await;
    assert_eq!((status, code(&v)), (400, "invalid_request"), "{v}");
    // Without client_ip the connection's address counts, as for a guest.
    let (status, v) = send(None, json!({})).await;
    assert_eq!(status, 201, "{v}");
}
