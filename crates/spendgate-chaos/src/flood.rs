//! The slow-body flood (issue 18, finding 4): one address keeps many connections to a
//! replica's public `POST /v1/sessions` open, each sending its headers and one byte of its
//! body, and opens a new one whenever the server ends one. Meanwhile the operator's backend calls the same replica (service-token
//! session creation, `/healthz`) and another address creates a session: none of them may
//! be refused for capacity.

use crate::cluster::lock;
use crate::cluster::SERVICE_TOKEN;
use crate::record::Record;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The flooding address (loopback: every 127/8 address reaches the replica).
pub const FLOOD_FROM: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 66));
/// Another guest's address, creating a session during the flood.
pub const OTHER_FROM: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 77));
/// Connections being opened at once (the rest wait their turn).
const OPENING_AT_ONCE: usize = 512;
/// A flood connection is opened again at most this often (the server's body deadline).
const REOPEN_EVERY: Duration = Duration::from_secs(10);
/// A probe's bound: past it, the call counts as not served.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Time between two rounds of probes.
const PROBE_EVERY: Duration = Duration::from_millis(250);

/// Keeps `n` slow-body requests open from [`FLOOD_FROM`] to `target` for `hold`: each of `n`
/// connections sends a session creation's head and one byte of a longer body and waits; when
/// the server answers or closes it, another takes its place, [`REOPEN_EVERY`] after the one
/// before, as an attacker repeating the flood every body deadline does. Returns (connections opened, connects that failed).
pub async fn flood(target: SocketAddr, n: usize, hold: Duration) -> (u64, u64) {
    let until = tokio::time::Instant::now() + hold;
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(OPENING_AT_ONCE));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let gate = gate.clone();
        tasks.spawn(async move {
            let (mut opened, mut failed) = (0u64, 0u64);
            while tokio::time::Instant::now() < until {
                let started = tokio::time::Instant::now();
                match slow_body(target, until, &gate).await {
                    Some(()) => opened += 1,
                    None => failed += 1,
                }
                tokio::time::sleep_until((started + REOPEN_EVERY).min(until)).await;
            }
            (opened, failed)
        });
    }
    let (mut opened, mut failed) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        if let Ok((o, f)) = r {
            opened += o;
            failed += f;
        }
    }
    (opened, failed)
}

/// One slow-body request, held until `until` or until the server answers or closes it;
/// `None` when the connection could not be made.
async fn slow_body(
    target: SocketAddr,
    until: tokio::time::Instant,
    gate: &tokio::sync::Semaphore,
) -> Option<()> {
    let mut stream = {
        let _permit = gate.acquire().await.ok()?;
        let socket = tokio::net::TcpSocket::new_v4().ok()?;
        // Closed with a reset: thousands of flood sockets leave no TIME_WAIT behind.
        socket.set_zero_linger().ok()?;
        socket.bind(SocketAddr::new(FLOOD_FROM, 0)).ok()?;
        tokio::time::timeout_at(until, socket.connect(target))
            .await
            .ok()?
            .ok()?
    };
    let head = "POST /v1/sessions HTTP/1.1\r\nhost: spendgate\r\n\
                content-type: application/json\r\ncontent-length: 64\r\n\r\n{";
    if stream.write_all(head.as_bytes()).await.is_ok() {
        // Held until the deadline, or until the server answers (anything) or closes.
        let mut buf = [0u8; 1024];
        let _ = tokio::time::timeout_at(until, stream.read(&mut buf)).await;
    }
    Some(())
}

/// What a probe's answer says about capacity: `None` when served (or refused for a reason
/// that is not capacity), else why it was not served.
fn capacity_refusal(status: u16, body: &serde_json::Value) -> Option<String> {
    let code = body
        .pointer("/error/code")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("");
    match (status, code) {
        (200..=299, _) => None,
        // The store is out (a fault of its own), not the replica's capacity.
        (503, "store_unavailable") => None,
        (s, c) => Some(format!("{s} {c}")),
    }
}

/// The operator's backend and another address call replica `base` every [`PROBE_EVERY`]
/// until `until`; each call not served for capacity is counted in `record`.
pub async fn probe(base: String, until: Instant, record: &Mutex<Record>) {
    let Ok(operator) = reqwest::Client::builder()
        .local_address(IpAddr::V4(Ipv4Addr::LOCALHOST))
        .timeout(PROBE_TIMEOUT)
        .build()
    else {
        return;
    };
    let Ok(other) = reqwest::Client::builder()
        .local_address(OTHER_FROM)
        .timeout(PROBE_TIMEOUT)
        .build()
    else {
        return;
    };
    let mut i = 0u64;
    while Instant::now() < until {
        i += 1;
        let calls = [
            (
                "operator GET /healthz",
                operator.get(format!("{base}/healthz")),
                false,
            ),
            (
                "operator POST /v1/sessions",
                operator
                    .post(format!("{base}/v1/sessions"))
                    .bearer_auth(SERVICE_TOKEN)
                    .json(&serde_json::json!({"client_ip": format!("198.51.100.{}", i % 250)})),
                false,
            ),
            (
                "another address POST /v1/sessions",
                other
                    .post(format!("{base}/v1/sessions"))
                    .json(&serde_json::json!({})),
                true,
            ),
        ];
        for (what, req, is_other) in calls {
            let started = Instant::now();
            let verdict = match req.send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let body = r.json::<serde_json::Value>().await.unwrap_or_default();
                    capacity_refusal(status, &body)
                }
                Err(e) if e.is_timeout() => Some(format!("no answer within {PROBE_TIMEOUT:?}")),
                Err(_) => Some("connection refused or dropped".to_string()),
            };
            let mut rec = lock(record);
            Record::latency(&mut rec.probes.latency, started.elapsed());
            if is_other {
                rec.probes.other_sent += 1;
            } else {
                rec.probes.sent += 1;
            }
            if let Some(why) = verdict {
                if is_other {
                    rec.probes.other_refused += 1;
                } else {
                    rec.probes.refused += 1;
                }
                if rec.probes.examples.len() < crate::record::EXAMPLES_MAX {
                    rec.probes.examples.push(format!("{what}: {why}"));
                }
            }
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_capacity_refusals_count() {
        assert_eq!(capacity_refusal(201, &json!({})), None);
        let store = json!({"error": {"code": "store_unavailable"}});
        assert_eq!(capacity_refusal(503, &store), None);
        let shed = json!({"error": {"code": "rate_limited", "scope": "global"}});
        assert_eq!(
            capacity_refusal(429, &shed),
            Some("429 rate_limited".into())
        );
        assert!(capacity_refusal(431, &json!(null)).is_some());
    }
}
