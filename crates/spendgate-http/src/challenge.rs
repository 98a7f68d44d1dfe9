//! Protected session creation: a proof-of-work puzzle, signed, expiring and single-use.
//!
//! A puzzle is `{"nonce", "bits", "expires", "sig"}`; a solution is any string `s` such that
//! SHA-256(`nonce:s`) starts with `bits` zero bits. The signature (HMAC with the first session
//! key) makes puzzles unforgeable; `expires` bounds their life; single use is enforced through
//! the shared store (an idempotency record per nonce), so one solution opens one session on
//! every replica together.

use crate::state::AppState;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use spendgate_config::ChallengeMode;
use spendgate_store::clock::now_unix;
use spendgate_wire::error::ApiError;
use spendgate_wire::error::ApiResult;
use std::net::IpAddr;

/// How long a puzzle may be solved.
pub const CHALLENGE_TTL_S: u64 = 300;

/// What a client sent to pass the challenge: the puzzle it was given and its solution (or,
/// with an external verifier, the verifier's token as the solution).
#[derive(Clone, Copy, Debug, Default)]
pub struct Answer<'a> {
    pub challenge: Option<&'a Value>,
    pub solution: Option<&'a str>,
}

/// Marks a single-use token as used, in the shared store; true for the first use only.
async fn consume_nonce(state: &AppState, nonce: &str) -> ApiResult<bool> {
    let ttl = CHALLENGE_TTL_S * 1000 * 2;
    Ok(state
        .store
        .consume_once(format!("pow:{nonce}"), ttl)
        .await?
        .value)
}

fn sign(state: &AppState, payload: &str) -> String {
    sign_with(state.keys.signing_key(), payload)
}

/// Whether `sig` is `payload` signed by any configured key: during a key rotation, replicas
/// whose first keys differ accept each other's challenges (as they do session tokens).
fn signed_by_any(state: &AppState, payload: &str, sig: &str) -> bool {
    state.keys.keys().fold(false, |ok, key| {
        let expect = sign_with(key, payload);
        ok | bool::from(subtle::ConstantTimeEq::ct_eq(
            expect.as_bytes(),
            sig.as_bytes(),
        ))
    })
}

fn sign_with(key: &[u8], payload: &str) -> String {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(key).unwrap_or_else(|_| {
        <Hmac<Sha256> as KeyInit>::new_from_slice(&[0u8; 32]).expect("32-byte HMAC key")
    });
    m.update(payload.as_bytes());
    B64.encode(m.finalize().into_bytes())
}

pub fn issue(state: &AppState) -> Value {
    let nonce = hex::encode(rand::random::<[u8; 16]>());
    let bits = state.config.sessions.challenge_bits;
    let expires = now_unix() + CHALLENGE_TTL_S;
    let sig = sign(state, &format!("pow.{nonce}.{bits}.{expires}"));
    json!({"kind": "pow", "nonce": nonce, "bits": bits, "expires": expires, "sig": sig,
           "algorithm": "find s such that sha256(nonce + \":\" + s) has `bits` leading zero bits"})
}

pub fn leading_zero_bits(d: &[u8]) -> u32 {
    let mut n = 0;
    for b in d {
        if *b == 0 {
            n += 8;
        } else {
            n += b.leading_zeros();
            break;
        }
    }
    n
}

/// Whether `solution` solves the puzzle `nonce` at `bits`.
pub fn solves(nonce: &str, bits: u8, solution: &str) -> bool {
    leading_zero_bits(&Sha256::digest(format!("{nonce}:{solution}"))) >= u32::from(bits)
}

/// Solves a puzzle (for tests, demos and clients written in Rust).
pub fn solve(nonce: &str, bits: u8) -> String {
    (0u64..)
        .map(|i| i.to_string())
        .find(|s| solves(nonce, bits, s))
        .unwrap_or_default()
}

/// Longest token accepted for the external verifier.
pub const VERIFIER_TOKEN_BYTES_MAX: usize = 4096;
/// Time the external verifier may take.
pub const VERIFIER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn external_required(message: &str) -> ApiError {
    let mut e = ApiError::new(
        spendgate_wire::error::ErrorCode::ChallengeRequired,
        message.to_string(),
    );
    e.challenge =
        Some(json!({"kind": "external", "solution": "the verifier's token for this visitor"}));
    e
}

/// The external (siteverify-style) check: the visitor's token is POSTed, form-encoded, with the
/// configured secret and the client address; `{"success": true}` admits, anything else, an
/// error or a timeout refuses (fail closed). A token opens one session, across replicas.
async fn check_external(
    state: &AppState,
    url: &str,
    client: IpAddr,
    answer: Answer<'_>,
) -> Result<(), ApiError> {
    let Some(token) = answer
        .solution
        .filter(|t| !t.is_empty() && t.len() <= VERIFIER_TOKEN_BYTES_MAX)
    else {
        return Err(external_required(
            "pass the verifier's token as \"solution\"",
        ));
    };
    let secret = state
        .config
        .sessions
        .verifier_secret
        .as_ref()
        .map(|s| s.expose().to_string())
        .unwrap_or_default();
    // The visitor's own address (not its prefix's network address), as verifiers expect.
    let remoteip = client.to_string();
    let form = [
        ("secret", secret.as_str()),
        ("response", token),
        ("remoteip", remoteip.as_str()),
    ];
    let answer = state
        .http
        .post(url)
        .timeout(VERIFIER_TIMEOUT)
        .form(&form)
        .send()
        .await;
    let ok = match answer {
        Ok(r) if r.status().is_success() => match r.json::<Value>().await {
            Ok(v) => v.get("success").and_then(Value::as_bool) == Some(true),
            Err(_) => false,
        },
        Ok(r) => {
            tracing::warn!(status = %r.status(), "challenge verifier answered an error; refusing");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "challenge verifier unreachable; refusing");
            false
        }
    };
    if !ok {
        return Err(external_required("the challenge was not verified"));
    }
    let key = hex::encode(&Sha256::digest(token.as_bytes())[..16]);
    if !consume_nonce(state, &format!("ext:{key}")).await? {
        return Err(external_required("this token was already used"));
    }
    Ok(())
}

fn required(code_msg: &str, state: &AppState) -> ApiError {
    let mut e = ApiError::new(
        spendgate_wire::error::ErrorCode::ChallengeRequired,
        code_msg.to_string(),
    );
    e.challenge = Some(issue(state));
    e
}

/// Whether a creation must solve a challenge, given whether the store said it would be
/// under pressure (more than half a creation burst in use, for this client's address
/// prefixes or globally: the shared state of every replica, asked for this request).
pub fn needed(mode: ChallengeMode, pressure: bool) -> bool {
    match mode {
        ChallengeMode::Off => false,
        ChallengeMode::Always => true,
        ChallengeMode::Adaptive => pressure,
    }
}

/// Checks (and uses up) the challenge when `needed`. `Ok` means session creation may go on.
pub async fn check(
    state: &AppState,
    client: IpAddr,
    answer: Answer<'_>,
    needed: bool,
) -> Result<(), ApiError> {
    if !needed {
        return Ok(());
    }
    if let Some(url) = &state.config.sessions.verifier_url {
        return check_external(state, url, client, answer).await;
    }
    let (Some(ch), Some(solution)) = (answer.challenge, answer.solution) else {
        return Err(required(
            "solve the challenge and post it back with its solution",
            state,
        ));
    };
    let nonce = ch.get("nonce").and_then(Value::as_str).unwrap_or("");
    let bits = ch.get("bits").and_then(Value::as_u64).unwrap_or(0);
    let expires = ch.get("expires").and_then(Value::as_u64).unwrap_or(0);
    let sig = ch.get("sig").and_then(Value::as_str).unwrap_or("");
    let sig_ok = signed_by_any(state, &format!("pow.{nonce}.{bits}.{expires}"), sig);
    if !sig_ok || nonce.len() != 32 || solution.len() > 64 {
        return Err(required("challenge is not one of ours", state));
    }
    if expires <= now_unix() {
        return Err(required("challenge expired", state));
    }
    if bits < u64::from(state.config.sessions.challenge_bits)
        || u64::from(leading_zero_bits(&Sha256::digest(format!(
            "{nonce}:{solution}"
        )))) < bits
    {
        return Err(required("wrong solution", state));
    }
    // Single use: the first to present this nonce wins, across replicas.
    if !consume_nonce(state, nonce).await? {
        return Err(required("challenge already used", state));
    }
    Ok(())
}
