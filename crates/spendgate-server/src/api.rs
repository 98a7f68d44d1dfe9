//! The decision API (SPEC §6): thin handlers that parse, call the core through the store,
//! and map answers and errors.

use crate::config::{Config, Tokenizer};
use crate::error::{ApiError, ApiResult};
use crate::identity::{self, SessionKeys};
use crate::metrics::Metrics;
use axum::extract::{ConnectInfo, FromRequest, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use spendgate_core::*;
use spendgate_store::Store;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Largest decision-API request body.
pub const API_BODY_BYTES_MAX: usize = 256 * 1024;
/// Largest `Idempotency-Key`.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 100;
/// Longest conversation id.
pub const CONVERSATION_ID_BYTES_MAX: usize = 100;

pub struct AppState {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    pub keys: SessionKeys,
    pub service_tokens: Vec<String>,
    pub admin_tokens: Vec<String>,
    pub metrics: Metrics,
    pub http: reqwest::Client,
    /// Upstreams by name, resolved at start (the demo adds its built-in mock).
    pub upstreams: std::collections::BTreeMap<String, crate::proxy::Upstream>,
    pub alerts: crate::alerts::Alerts,
    /// The in-flight bounds per class of caller and per address (`crate::capacity`).
    pub capacity: crate::capacity::Capacity,
    /// This process as the store knows it: its id and its policy's fingerprint.
    pub replica: crate::drift::Replica,
}

impl AppState {
    /// Marks a single-use token as used, in the shared store; true for the first use only.
    pub async fn consume_nonce(&self, nonce: &str) -> ApiResult<bool> {
        let ttl = crate::challenge::CHALLENGE_TTL_S * 1000 * 2;
        Ok(self
            .store
            .consume_once(format!("pow:{nonce}"), ttl)
            .await?
            .value)
    }
}

pub type Shared = Arc<AppState>;

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A JSON body parsed strictly; its rejections are `ApiError`s. Keeps the raw bytes, whose
/// digest fingerprints the request when it carries an `Idempotency-Key`.
pub struct Body<T> {
    pub value: T,
    pub raw: Bytes,
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // A body sent slowly holds a request slot: it must keep the minimum rate that the
        // capacity layer puts on every request body (`capacity::RateBody`), else 408.
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if crate::capacity::is_too_slow(&e) {
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    "the request body arrived too slowly: after a short grace a body must \
                     keep arriving at the gateway's minimum rate",
                )
            } else if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large("request body is too large")
            } else {
                ApiError::invalid(format!("could not read the request body: {e}"))
            }
        })?;
        let value = if bytes.is_empty() {
            serde_json::from_slice(b"{}")
        } else {
            serde_json::from_slice(&bytes)
        }
        .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
        Ok(Body { value, raw: bytes })
    }
}

pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    v.strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .map(str::trim)
}

pub fn require_service(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    match bearer(headers) {
        Some(t) if identity::token_matches(t, &state.service_tokens) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("invalid service token")),
        None => Err(ApiError::unauthorized(
            "missing service token (Authorization: Bearer ...)",
        )),
    }
}

pub fn require_admin(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    match bearer(headers) {
        Some(t) if identity::token_matches(t, &state.admin_tokens) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("invalid admin token")),
        None => Err(ApiError::unauthorized(
            "missing admin token (Authorization: Bearer ...)",
        )),
    }
}

pub fn cookie_name(config: &Config) -> &'static str {
    if config.sessions.secure_cookie {
        "__Host-spendgate_session"
    } else {
        "spendgate_session"
    }
}

pub fn session_from_cookie(state: &AppState, headers: &HeaderMap) -> Option<String> {
    let name = cookie_name(&state.config);
    for v in headers.get_all(header::COOKIE) {
        let Ok(s) = v.to_str() else { continue };
        for part in s.split(';') {
            if let Some((k, val)) = part.trim().split_once('=') {
                if k == name {
                    return Some(val.to_string());
                }
            }
        }
    }
    None
}

pub fn client_ip_of(state: &AppState, peer: SocketAddr, headers: &HeaderMap) -> IpAddr {
    let xff = forwarded_for(headers);
    identity::client_addr(peer, xff.as_deref(), &state.config.server.trusted_proxies)
}

/// Every `X-Forwarded-For` line, in order, as one list (RFC 9110 §5.3): a proxy may add a
/// line of its own instead of appending to the one the client sent, and the client's line
/// must not be read as the proxy's. An entry that is not text counts as one unreadable hop
/// (only that entry: a proxy that appends to the client's line puts the client's bytes and
/// the address it saw on one line, and that address must still be read).
fn forwarded_for(headers: &HeaderMap) -> Option<String> {
    let mut lines = headers.get_all("x-forwarded-for").iter().peekable();
    lines.peek()?;
    Some(
        lines
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(|entry| match std::str::from_utf8(entry) {
                Ok(text) if !text.contains(|c: char| c.is_control()) => text,
                _ => "?",
            })
            .collect::<Vec<_>>()
            .join(","),
    )
}

pub fn ip_scopes(state: &AppState, ip: IpAddr) -> Vec<IpScope> {
    let id = &state.config.identity;
    identity::ip_scopes(ip, id.ipv4_prefix, id.ipv6_prefix, &id.ipv6_wider)
}

pub fn parse_ip(s: &str) -> ApiResult<IpAddr> {
    s.trim()
        .parse::<IpAddr>()
        .map_err(|_| ApiError::invalid(format!("client_ip {s:?} is not an IP address")))
}

/// The conversation scope of a conversation a guest names itself (browser-direct, or usage
/// read with its cookie): its own, never another guest's. The id it sends is namespaced by
/// its session (the id hashed to a fixed length), so guests who pick the same id (`chat-1`)
/// neither share a conversation's budget nor take its one generation slot from each other.
/// Ids the operator's backend sends with a service token are its own namespace, as given.
pub fn guest_conversation(session_id: &str, conversation: &str) -> String {
    let digest = Sha256::digest(conversation.as_bytes());
    format!("{session_id}:{}", hex::encode(&digest[..12]))
}

pub fn check_conversation(c: &str) -> ApiResult<()> {
    if c.is_empty() || c.len() > CONVERSATION_ID_BYTES_MAX || c.chars().any(char::is_control) {
        return Err(ApiError::invalid(format!(
            "conversation must be 1 to {CONVERSATION_ID_BYTES_MAX} bytes without control characters"
        )));
    }
    Ok(())
}

pub fn idempotency(
    headers: &HeaderMap,
    namespace: &str,
    body: &Bytes,
) -> ApiResult<Option<IdempotencyKey>> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let k = v
        .to_str()
        .map_err(|_| ApiError::invalid("Idempotency-Key must be visible ASCII"))?;
    if k.is_empty() || k.len() > IDEMPOTENCY_KEY_BYTES_MAX {
        return Err(ApiError::invalid(format!(
            "Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_BYTES_MAX} characters"
        )));
    }
    // Hash the key so that the stored key length is fixed whatever the client sends.
    let h = hex::encode(&Sha256::digest(format!("{namespace}\n{k}"))[..16]);
    // The body as data, not as bytes: the same request serialised again (other spacing, other
    // key order) is the same request. Digested only when a key is given: most carry none.
    let canonical = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| serde_json::to_vec(&v).ok());
    Ok(Some(IdempotencyKey {
        key: format!("{namespace}:{h}"),
        fingerprint: hex::encode(Sha256::digest(canonical.as_deref().unwrap_or(body))),
    }))
}

/// A new run or step id: the prefix, the wall clock in milliseconds (12 hex digits, fixed
/// width), then 128 random bits (what makes it unguessable). Ids made later sort later, so
/// the sqlite store's rows of new runs and steps are appended near the end of its B-tree
/// instead of landing on a random page each: a page written per new row was most of the
/// bytes the disk took per step (see BENCHMARKS.md, eleventh session).
pub fn new_id(prefix: &str) -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let random: [u8; 16] = rand::random();
    format!(
        "{prefix}_{:012x}{}",
        ms & 0xffff_ffff_ffff,
        hex::encode(random)
    )
}

/// A 200 answer that changed (or read) the ledger at `seq`: the body carries `ledger_seq`, and
/// so does a header.
fn ledger_answer(mut body: Value, seq: u64) -> Response {
    body["ledger_seq"] = json!(seq);
    let mut resp = (StatusCode::OK, Json(body)).into_response();
    seq_header(&mut resp, seq);
    resp
}

fn seq_header(resp: &mut Response, seq: u64) {
    if let Ok(v) = HeaderValue::from_str(&seq.to_string()) {
        resp.headers_mut().insert("spendgate-ledger-seq", v);
    }
}

/// Maps an admission outcome to a response: a grant with `status`, or the refusal.
/// `replayed`: the answer repeats an earlier one (same `Idempotency-Key`), which was counted
/// then: not counted again.
fn grant(
    metrics: &Metrics,
    what: &'static str,
    out: Result<Value, Refusal>,
    status: StatusCode,
    (seq, replayed): (u64, bool),
) -> Response {
    match out {
        Ok(mut body) => {
            if !replayed {
                metrics.admitted(what);
            }
            body["ledger_seq"] = json!(seq);
            let mut resp = (status, Json(body)).into_response();
            seq_header(&mut resp, seq);
            resp
        }
        Err(r) => {
            if !replayed {
                metrics.refused(what, r.code.name(), r.scope);
            }
            ApiError::from(&r).with_ledger_seq(seq).into_response()
        }
    }
}

fn bounds_json(b: &RunBounds) -> Value {
    json!({
        "max_input_bytes": b.max_input_bytes,
        "max_context_tokens": b.max_context_tokens,
        "max_output_tokens": b.max_output_tokens,
        "max_tool_result_bytes": b.max_tool_result_bytes,
        "max_model_rounds": b.max_model_rounds,
        "max_tool_calls": b.max_tool_calls,
        "max_retries": b.max_retries,
        "max_seconds": b.max_seconds,
        "max_cost_micros": b.max_cost.0,
    })
}

// ---------------------------------------------------------------------------------------
// Sessions

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionBody {
    pub challenge: Option<Value>,
    pub solution: Option<String>,
    /// The guest's address, from the operator's backend (service token) only: a guest must
    /// not choose the address its creations are counted under.
    pub client_ip: Option<String>,
}

pub async fn create_session(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body<CreateSessionBody>,
) -> ApiResult<Response> {
    let ip = match &body.value.client_ip {
        None => client_ip_of(&state, peer, &headers),
        Some(given) => {
            if bearer(&headers).is_none() {
                return Err(ApiError::invalid(
                    "client_ip is taken only from the operator's backend (with a service \
                     token); a guest's address is the connection's",
                ));
            }
            require_service(&state, &headers)?;
            parse_ip(given)?
        }
    };
    let ips = ip_scopes(&state, ip);
    let refused = |r: &Refusal, seq: u64| {
        state.metrics.refused("session", r.code.name(), r.scope);
        ApiError::from(r).with_ledger_seq(seq)
    };
    let mode = state.config.sessions.challenge;
    if mode != crate::config::ChallengeMode::Off {
        // Ask first, applying nothing: a creation that its rate would refuse is refused
        // before a challenge is checked (no verifier call, no solution used up), and whether
        // one is needed follows this client's own prefixes and the global bucket.
        let started = Instant::now();
        let asked = state.store.create_session(ips.clone(), true).await;
        state.metrics.store_call(started.elapsed());
        let asked = asked?;
        let pressure = match &asked.value {
            Ok(g) => g.pressure,
            Err(r) => return Err(refused(r, asked.seq)),
        };
        let needed = crate::challenge::needed(mode, pressure);
        crate::challenge::check(&state, ip, &body.value, needed).await?;
    }
    let started = Instant::now();
    let applied = state.store.create_session(ips, false).await;
    state.metrics.store_call(started.elapsed());
    let applied = applied?;
    if let Err(r) = &applied.value {
        return Err(refused(r, applied.seq));
    }
    let ttl = state.config.sessions.ttl.as_secs();
    let (token, session) = state.keys.issue(now_unix(), ttl);
    state.metrics.admitted("session");
    let expires_at = rfc3339(UnixMs(session.expires_unix * 1000));
    let cookie = format!(
        "{}={token}; {}HttpOnly; SameSite=Lax; Path=/; Max-Age={ttl}",
        cookie_name(&state.config),
        if state.config.sessions.secure_cookie {
            "Secure; "
        } else {
            ""
        },
    );
    let mut resp = (
        StatusCode::CREATED,
        Json(json!({"session": token, "expires_at": expires_at, "ledger_seq": applied.seq})),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    Ok(resp)
}

// ---------------------------------------------------------------------------------------
// Runs and steps

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRunBody {
    pub session: String,
    pub client_ip: String,
    pub conversation: String,
    pub input_text: Option<String>,
    pub input_bytes: Option<u64>,
}

pub async fn create_run(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Body<CreateRunBody>,
) -> ApiResult<Response> {
    require_service(&state, &headers)?;
    let b = &body.value;
    let session = state.keys.verify(&b.session, now_unix())?;
    let ip = parse_ip(&b.client_ip)?;
    check_conversation(&b.conversation)?;
    let input_bytes = match (&b.input_text, b.input_bytes) {
        (Some(t), None) => t.len() as u64,
        (None, Some(n)) => n,
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of input_text and input_bytes",
            ))
        }
    };
    let req = RunRequest {
        run_id: RunId(new_id("run")),
        session: session.id,
        ips: ip_scopes(&state, ip),
        conversation: b.conversation.clone(),
        input_bytes,
    };
    // Keys are the guest session's own: two sessions (or two backends) that happen to pick
    // the same key do not meet.
    let idem = idempotency(&headers, &format!("run:{}", req.session), &body.raw)?;
    // (a first answer under a key always changes the ledger: it is remembered)
    let keyed = idem.is_some();
    let started = Instant::now();
    let applied = state.store.admit_run(req, idem).await;
    state.metrics.store_call(started.elapsed());
    let applied = applied?;
    let rate_left = applied.value.as_ref().ok().and_then(|a| a.rate_left);
    let changed = applied.changed;
    let dry_run = applied.value.as_ref().ok().and_then(|a| a.dry_run.clone());
    let out = applied.value.map(|a| {
        json!({
            "run_id": a.run_id.0,
            "deadline": rfc3339(a.deadline),
            "bounds": bounds_json(&a.bounds),
            "reserved_micros": a.reserved.0,
        })
    });
    let mut resp = grant(
        &state.metrics,
        "run",
        out,
        StatusCode::CREATED,
        (applied.seq, keyed && !changed),
    );
    if resp.status() == StatusCode::CREATED {
        rate_limit_headers(&state, rate_left, resp.headers_mut());
        note_dry_run(&state, "run", dry_run.as_ref(), changed, resp.headers_mut());
    }
    Ok(resp)
}

/// A limit in dry-run would have refused this admitted request (SPEC §8: computed, logged and
/// counted, not enforced): logs it, counts it in `spendgate_dry_run_refusals_total` and tells
/// the caller in `Spendgate-Dry-Run: <code>; scope=<scope>`. `decided`: this call made the
/// decision; an idempotent replay of an earlier answer (which changed nothing) repeats the
/// header but is not logged or counted again.
pub fn note_dry_run(
    state: &AppState,
    what: &'static str,
    refusal: Option<&Refusal>,
    decided: bool,
    headers: &mut HeaderMap,
) {
    let Some(r) = refusal else { return };
    let scope = r.scope.map(|s| s.name()).unwrap_or("");
    if decided {
        state.metrics.dry_run_refused(what, r.code.name(), r.scope);
        tracing::warn!(
            what,
            code = r.code.name(),
            scope,
            message = %r.message,
            "dry-run: a limit would have refused this request; admitted"
        );
    }
    if let Ok(v) = HeaderValue::from_str(&format!("{}; scope={scope}", r.code.name())) {
        headers.insert("spendgate-dry-run", v);
    }
}

/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers, 08 and later): one list member, the
/// rate policy with the least quota left after this admission, e.g.
/// `RateLimit: "session";r=2;t=20`. The name is one of those in `RateLimit-Policy`.
///
/// For GCRA: `r` is how many more runs that policy would admit right now (the burst left);
/// `t` is the seconds until it regains one more unit of quota, rounded up (at least 1). With
/// `r=0`, `t` is the `Retry-After` an admission at this moment would be refused with.
/// The values come from the rate state the admission itself wrote (an idempotent replay
/// repeats the first answer's values).
fn rate_limit(left: RateLeft, headers: &mut HeaderMap) {
    let value = format!(
        "\"{}\";r={};t={}",
        left.scope.name(),
        left.remaining,
        left.reset_s
    );
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert("ratelimit", v);
    }
}

/// The rate-limit headers of a successful admission (a run through the decision API, or the
/// one-step run of a proxied call): `RateLimit-Policy`, and `RateLimit` when a rate applies.
pub fn rate_limit_headers(state: &AppState, left: Option<RateLeft>, headers: &mut HeaderMap) {
    rate_limit_policy(state, headers);
    if let Some(left) = left {
        rate_limit(left, headers);
    }
}

/// `RateLimit-Policy` (IETF httpapi draft) naming the request-rate policies that apply.
fn rate_limit_policy(state: &AppState, headers: &mut HeaderMap) {
    let p = &state.config.policy;
    let mut parts = Vec::new();
    for (name, sp) in [
        ("session", &p.session),
        ("ip", &p.ip),
        ("global", &p.global),
        // Only when configured (SPEC §4 names no conversation rate); `RateLimit` may name it.
        ("conversation", &p.conversation),
    ] {
        if let Some(r) = sp.rate {
            parts.push(format!(
                "\"{name}\";q={};w={}",
                r.count,
                r.period_ms.div_ceil(1000)
            ));
        }
    }
    if let Ok(v) = HeaderValue::from_str(&parts.join(", ")) {
        if !parts.is_empty() {
            headers.insert("ratelimit-policy", v);
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum StepBody {
    Model {
        model: String,
        prompt_tokens: Option<u64>,
        prompt_text: Option<String>,
        max_output_tokens: Option<u64>,
        #[serde(default)]
        retry: bool,
    },
    Tool {
        tool: String,
        units: Option<u64>,
    },
}

/// Builds the core step from a request, with the configured price: no price, no call. A
/// long `prompt_text` is counted on the blocking pool (`tokens::count_all`), never on the
/// worker that serves other requests.
pub async fn step_kind(config: &Config, body: &StepBody) -> ApiResult<StepKind> {
    match body {
        StepBody::Model {
            model,
            prompt_tokens,
            prompt_text,
            max_output_tokens,
            retry,
        } => {
            let m = config.models.get(model).ok_or_else(|| {
                ApiError::model_not_allowed(format!("model {model:?} is not configured"))
            })?;
            // 0 is refused: some upstreams (Ollama's) read an output bound of 0 as no limit.
            if *max_output_tokens == Some(0) {
                return Err(ApiError::invalid("max_output_tokens must be at least 1"));
            }
            let prompt_tokens = match (prompt_tokens, prompt_text) {
                (Some(n), None) => *n,
                (None, Some(t)) => {
                    let overhead =
                        crate::tokens::TOKENS_PER_MESSAGE + crate::tokens::TOKENS_PER_REQUEST;
                    // More text than the context bound can hold is not counted: the ledger
                    // refuses it as over the bound (`context_too_large`) all the same.
                    let max = config.policy.run.max_context_tokens;
                    if crate::tokens::over_countable(t.len() as u64, max) {
                        (t.len() as u64).saturating_add(overhead)
                    } else {
                        crate::tokens::count_all(m.tokenizer, vec![t.clone()])
                            .await
                            .saturating_add(overhead)
                    }
                }
                _ => {
                    return Err(ApiError::invalid(
                        "give exactly one of prompt_tokens and prompt_text",
                    ))
                }
            };
            Ok(StepKind::Model {
                model: model.clone(),
                price: m.price,
                prompt_tokens,
                max_output_tokens: *max_output_tokens,
                retry: *retry,
            })
        }
        StepBody::Tool { tool, units } => {
            let price = config.tools.get(tool).ok_or_else(|| {
                ApiError::model_not_allowed(format!("tool {tool:?} has no configured price"))
            })?;
            if *units == Some(0) && price.per_unit > Micros::ZERO {
                // It would hold nothing (admitted even on a spent budget), and its commit
                // would then be an overrun.
                return Err(ApiError::invalid(format!(
                    "units must be at least 1 for tool {tool:?}, which is priced per unit"
                )));
            }
            Ok(StepKind::Tool {
                tool: tool.clone(),
                price: *price,
                units: units.unwrap_or(1),
            })
        }
    }
}

pub fn check_id_path(what: &str, id: &str) -> ApiResult<()> {
    if id.is_empty()
        || id.len() > ID_BYTES_MAX
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
    {
        return Err(ApiError::not_found(format!("{what} {id:?} not found")));
    }
    Ok(())
}

pub async fn create_step(
    State(state): State<Shared>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
    body: Body<StepBody>,
) -> ApiResult<Response> {
    require_service(&state, &headers)?;
    check_id_path("run", &run_id)?;
    let kind = step_kind(&state.config, &body.value).await?;
    let req = StepRequest {
        run_id: RunId(run_id.clone()),
        step_id: ReservationId(new_id("stp")),
        kind,
    };
    let idem = idempotency(&headers, &format!("step:{run_id}"), &body.raw)?;
    let keyed = idem.is_some();
    let started = Instant::now();
    let applied = state.store.reserve_step(req, idem).await;
    state.metrics.store_call(started.elapsed());
    let applied = applied?;
    let shrunk = matches!(&applied.value, Ok(s) if s.shrunk);
    let changed = applied.changed;
    let dry_run = applied.value.as_ref().ok().and_then(|s| s.dry_run.clone());
    let out = applied.value.map(|s| {
        json!({
            "step_id": s.step_id.0,
            "reserved_micros": s.reserved.0,
            "max_output_tokens": s.max_output_tokens,
            "output_shrunk": s.shrunk,
        })
    });
    let mut resp = grant(
        &state.metrics,
        "step",
        out,
        StatusCode::CREATED,
        (applied.seq, keyed && !changed),
    );
    if shrunk {
        resp.headers_mut()
            .insert("spendgate-output-shrunk", HeaderValue::from_static("true"));
    }
    if resp.status() == StatusCode::CREATED {
        note_dry_run(
            &state,
            "step",
            dry_run.as_ref(),
            changed,
            resp.headers_mut(),
        );
    }
    Ok(resp)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageBody {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitBody {
    pub usage: Option<UsageBody>,
    pub units: Option<u64>,
    pub result_bytes: Option<u64>,
}

fn resolved_response(state: &AppState, step: &str, applied: Applied<Resolved>) -> Response {
    let r = applied.value;
    if r.overrun && !r.repeated {
        state.metrics.overrun();
        state.alerts.overrun(step, r.reserved.0, r.charged.0);
        tracing::warn!(
            charged = r.charged.0,
            reserved = r.reserved.0,
            "overrun: observed usage above the reservation, charged in full"
        );
    }
    let mut body = json!({
        "state": r.state.name(),
        "charged_micros": r.charged.0,
        "reserved_micros": r.reserved.0,
        "overrun": r.overrun,
        "repeated": r.repeated,
    });
    if r.result_too_large {
        body["result_too_large"] = json!(true);
        body["message"] = json!("tool result is over max_tool_result_bytes: charged, but it must not be fed back to the model");
    }
    ledger_answer(body, applied.seq)
}

pub async fn commit_step(
    State(state): State<Shared>,
    Path(step_id): Path<String>,
    headers: HeaderMap,
    body: Body<CommitBody>,
) -> ApiResult<Response> {
    require_service(&state, &headers)?;
    check_id_path("step", &step_id)?;
    let b = &body.value;
    let settlement = match (&b.usage, b.units, b.result_bytes) {
        (Some(u), None, None) => Settlement::Tokens(TokenUsage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens,
        }),
        (None, Some(n), None) => Settlement::Units(n),
        (None, None, Some(n)) => Settlement::ResultBytes(n),
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of usage, units and result_bytes",
            ))
        }
    };
    resolve(&state, step_id, Resolution::Commit(settlement)).await
}

async fn resolve(state: &AppState, step_id: String, how: Resolution) -> ApiResult<Response> {
    let started = Instant::now();
    let applied = state
        .store
        .resolve(ReservationId(step_id.clone()), how)
        .await;
    state.metrics.store_call(started.elapsed());
    Ok(resolved_response(state, &step_id, applied?))
}

pub async fn release_step(
    state: State<Shared>,
    step: Path<String>,
    headers: HeaderMap,
    _b: Body<Empty>,
) -> ApiResult<Response> {
    resolve_route(state, step, headers, Resolution::Release).await
}

pub async fn unknown_step(
    state: State<Shared>,
    step: Path<String>,
    headers: HeaderMap,
    _b: Body<Empty>,
) -> ApiResult<Response> {
    resolve_route(state, step, headers, Resolution::Unknown).await
}

async fn resolve_route(
    State(state): State<Shared>,
    Path(step_id): Path<String>,
    headers: HeaderMap,
    how: Resolution,
) -> ApiResult<Response> {
    require_service(&state, &headers)?;
    check_id_path("step", &step_id)?;
    resolve(&state, step_id, how).await
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Empty {}

pub async fn heartbeat(
    State(state): State<Shared>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
    _b: Body<Empty>,
) -> ApiResult<Response> {
    require_service(&state, &headers)?;
    check_id_path("run", &run_id)?;
    let applied = state.store.heartbeat(RunId(run_id)).await?;
    let h = applied.value;
    let body = json!({"lease_until": rfc3339(h.lease_until), "deadline": rfc3339(h.deadline)});
    Ok(ledger_answer(body, applied.seq))
}

pub async fn finish(
    State(state): State<Shared>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
    _b: Body<Empty>,
) -> ApiResult<Response> {
    require_service(&state, &headers)?;
    check_id_path("run", &run_id)?;
    let applied = state.store.finish(RunId(run_id)).await?;
    let f = applied.value;
    let body = json!({
        "state": format!("{:?}", f.state).to_lowercase(),
        "charged_micros": f.charged.0,
        "steps": f.steps,
        "repeated": f.repeated,
    });
    Ok(ledger_answer(body, applied.seq))
}

// ---------------------------------------------------------------------------------------
// Usage

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    pub session: Option<String>,
    pub client_ip: Option<String>,
    pub conversation: Option<String>,
}

pub fn usage_json(lines: &[UsageLine]) -> Value {
    let scopes: Vec<Value> = lines
        .iter()
        .map(|l| {
            json!({
                "kind": l.scope.kind.name(),
                "id": if l.scope.kind == ScopeKind::Global { None } else { Some(&l.scope.id) },
                "window": l.window.window.name(),
                "window_id": l.window.to_string(),
                "limit_micros": l.limit.0,
                "used_micros": l.used.0,
                "reserved_micros": l.reserved.0,
                "remaining_micros": l.limit.saturating_sub(l.used).saturating_sub(l.reserved).0,
                "overrun": l.overrun,
                "resets_at": l.resets_at.map(rfc3339),
            })
        })
        .collect();
    json!({ "scopes": scopes })
}

pub async fn usage(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Query(q): Query<UsageQuery>,
) -> ApiResult<Response> {
    let service = bearer(&headers).is_some();
    let (token, ip) = if service {
        require_service(&state, &headers)?;
        let token = q
            .session
            .clone()
            .ok_or_else(|| ApiError::invalid("?session= is required with a service token"))?;
        let ip = q.client_ip.as_deref().map(parse_ip).transpose()?;
        (token, ip)
    } else {
        let token = session_from_cookie(&state, &headers)
            .ok_or_else(|| ApiError::unauthorized("no session cookie and no service token"))?;
        (token, Some(client_ip_of(&state, peer, &headers)))
    };
    if let Some(c) = &q.conversation {
        check_conversation(c)?;
    }
    let session = state.keys.verify(&token, now_unix())?;
    // A guest's conversations are named as the proxy names them (`proxy::caller`): its own
    // namespace, and without one named, the session itself (the conversation a
    // browser-direct call without `Spendgate-Conversation` is billed to).
    let conversation = match &q.conversation {
        Some(c) if !service => Some(guest_conversation(&session.id, c)),
        None if !service => Some(session.id.clone()),
        other => other.clone(),
    };
    let ips = ip.map(|ip| ip_scopes(&state, ip)).unwrap_or_default();
    let scopes = Ledger::request_scopes(&session.id, &ips, conversation.as_deref());
    let lines = state.store.usage(scopes).await?;
    Ok(Json(usage_json(&lines)).into_response())
}

// ---------------------------------------------------------------------------------------
// Operations

pub async fn healthz() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

pub async fn readyz(State(state): State<Shared>) -> Response {
    match state.store.ready().await {
        Ok(()) => Json(json!({"status": "ready", "store": state.store.kind()})).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "not ready");
            let mut resp = ApiError::store_unavailable().into_response();
            *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            resp
        }
    }
}

pub async fn metrics(State(state): State<Shared>) -> Response {
    let summary = state.store.summary().await.ok();
    let global = state
        .store
        .usage(vec![(ScopeKey::global(), 1)])
        .await
        .unwrap_or_default();
    let mut text = state.metrics.render(summary.as_ref(), &global);
    if let Ok(live) = state.store.replicas().await {
        let view = crate::drift::PolicyView::of(&state.replica, live);
        let me = (
            state.replica.id.as_str(),
            state.replica.fingerprint.as_str(),
        );
        crate::metrics::render_policy(&mut text, &view.fingerprints, me);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Any route that does not exist: an OpenAI-shaped 404.
pub async fn fallback() -> ApiError {
    ApiError::not_found("no such route")
}

/// A method a route does not take, on any route: an OpenAI-shaped 405 (the router adds the
/// `Allow` header).
pub async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request",
        format!("this path does not take {method}"),
    )
}

pub fn tokenizer_of(config: &Config, model: &str) -> Option<Tokenizer> {
    config.models.get(model).map(|m| m.tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new id is the prefix, 12 hex digits of milliseconds and 32 random hex digits: ids
    /// made later sort later (a millisecond apart at least), and no two are alike.
    #[test]
    fn new_ids_sort_by_time_and_stay_unguessable() {
        let a = new_id("stp");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = new_id("stp");
        for id in [&a, &b] {
            let hex = id.strip_prefix("stp_").expect("prefix");
            assert_eq!(hex.len(), 12 + 32, "{id}");
            assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
            assert!(id.len() <= spendgate_core::ID_BYTES_MAX);
        }
        assert!(a < b, "{a} then {b}");
        assert_ne!(a[16..], b[16..], "the random part differs");
        let same_ms: std::collections::HashSet<String> = (0..1000).map(|_| new_id("run")).collect();
        assert_eq!(same_ms.len(), 1000);
    }

    /// An entry that is not text is one unreadable hop; the entries around it (on the same
    /// line, as a proxy that appends writes them) are still read.
    #[test]
    fn forwarded_for_reads_each_entry() {
        let mut h = HeaderMap::new();
        let line = HeaderValue::from_bytes(b"\xff, 9.9.9.9").expect("obs-text is a header value");
        h.append("x-forwarded-for", line);
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        assert_eq!(forwarded_for(&h).as_deref(), Some("?, 9.9.9.9,10.0.0.1"));
        let trusted: Vec<ipnet::IpNet> = vec!["127.0.0.0/8".parse().expect("net")];
        let peer: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let addr = identity::client_addr(peer, forwarded_for(&h).as_deref(), &trusted);
        assert_eq!(addr.to_string(), "10.0.0.1");
        let trusted: Vec<ipnet::IpNet> = vec![
            "127.0.0.0/8".parse().expect("net"),
            "10.0.0.0/8".parse().expect("net"),
        ];
        let addr = identity::client_addr(peer, forwarded_for(&h).as_deref(), &trusted);
        assert_eq!(
            addr.to_string(),
            "9.9.9.9",
            "the proxy-appended address is read"
        );
        assert_eq!(forwarded_for(&HeaderMap::new()), None);
    }
}
