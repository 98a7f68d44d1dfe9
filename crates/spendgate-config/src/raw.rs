//! Stage one: the file as written. Each struct mirrors one table of the file; the doc comment,
//! type ([`Ty`]) and default of every key stand beside its field, and the reference, the
//! example and check-config's output are generated from them (see [`crate::schema`]).

use crate::schema::{table, Ty};
use crate::text::amount_text;
use crate::{
    ADDRESS_REQUESTS_MAX_DEFAULT, ADMIN_REQUESTS_MAX_DEFAULT, BODY_GRACE_MS_DEFAULT,
    BODY_GRACE_MS_MAX, BODY_GRACE_MS_MIN, BODY_MIN_BYTES_PER_S_DEFAULT, BODY_MIN_BYTES_PER_S_FLOOR,
    BODY_MIN_BYTES_PER_S_MAX, BURN_WINDOW_S_MAX, BURST_MAX, CHALLENGE_BITS_MAX, CLASS_REQUESTS_MAX,
    CONCURRENCY_MAX, CONNECTIONS_MAX, HEALTH_REQUESTS_MAX_DEFAULT,
    HISTORY_DRAIN_LAG_ALERT_S_DEFAULT, HISTORY_DRAIN_LAG_ALERT_S_MAX,
    HISTORY_RETENTION_DAYS_DEFAULT, HISTORY_RETENTION_DAYS_MAX, HISTORY_ROWS_MAX_DEFAULT,
    HISTORY_ROWS_MAX_MAX, HISTORY_STREAM_MAX_LEN_DEFAULT, HISTORY_STREAM_MAX_LEN_MAX,
    IPV6_WIDER_MAX, LEASE_TTL_S_MAX, LIST_LEN_MAX, PUBLIC_REQUESTS_MAX_DEFAULT, RUN_BYTES_MAX,
    RUN_COUNT_MAX, RUN_SECONDS_MAX, RUN_TOKENS_MAX, SERVICE_REQUESTS_MAX_DEFAULT,
    SESSION_TTL_S_MAX, SLOW_GRACE_MS_DEFAULT, SLOW_GRACE_MS_MAX, STORE_TIMEOUT_MS_MAX,
    TRUSTED_PROXIES_MAX, UPSTREAM_TIMEOUT_S_MAX,
};
use serde::de::{self, Visitor};
use serde::{Deserialize, Serialize};
use spendgate_core::RunBounds;
use std::collections::BTreeMap;
use std::fmt;

table! {
    /// The whole file.
    struct RawConfig {
        /// The HTTP listener: where it listens, which proxies it believes, who may call, and
        /// how much of the process each kind of caller may hold.
        #[key(Ty::Table(&RawServer::TABLE))]
        server: RawServer = RawServer::default(),
        /// Where the ledger lives: `memory`, one `sqlite` file, or a `redis` shared by replicas.
        #[key(Ty::Table(&RawStore::TABLE))]
        store: RawStore = RawStore::default(),
        /// Guest sessions: signing keys, lifetime, cookie, and how their creation is limited.
        #[key(Ty::Table(&RawSessions::TABLE))]
        sessions: RawSessions = RawSessions::default(),
        /// How client addresses are grouped into the prefixes that `[limits.ip]` counts.
        #[key(Ty::Table(&RawIdentity::TABLE))]
        identity: RawIdentity = RawIdentity::default(),
        /// Limits per scope: `[limits.global]` (the whole service), `[limits.ip]` (one client
        /// address prefix), `[limits.session]` (one guest session) and `[limits.conversation]`.
        /// Each takes the same keys; a key left out keeps that scope's default.
        #[key(Ty::Table(&RawLimits::TABLE))]
        limits: RawLimits = RawLimits::default(),
        /// Bounds on one run: one accepted user message and every model call, tool call and
        /// retry it causes. Always enforced, dry-run or not.
        #[key(Ty::Table(&RawRun::TABLE))]
        run: RawRun = RawRun::default(),
        /// Models that may be called, by the name clients use, with their prices per million
        /// tokens. No price, no call: a model not listed here is refused (`model_not_allowed`).
        #[key(Ty::Map(&Ty::Table(&RawModel::TABLE)))]
        models: BTreeMap<String, RawModel> = BTreeMap::new(),
        /// Paid tools, by name, with their prices. A tool not listed here is refused.
        #[key(Ty::Map(&Ty::Table(&RawTool::TABLE)))]
        tools: BTreeMap<String, RawTool> = BTreeMap::new(),
        /// Upstream APIs (OpenAI-compatible) that models name. `"mock"` is reserved for the
        /// built-in mock upstream of `spendgate demo`.
        #[key(Ty::Map(&Ty::Table(&RawUpstream::TABLE)))]
        upstreams: BTreeMap<String, RawUpstream> = BTreeMap::new(),
        /// Spending alerts: a webhook and the log, once per threshold per budget window across
        /// every replica, and once per window when a global budget's burn rate would spend it
        /// before the window resets; also on overruns, expiries and store outages.
        #[key(Ty::Table(&RawAlerts::TABLE))]
        alerts: RawAlerts = RawAlerts::default(),
        /// The usage history: one record per reservation and per run, refusals per minute.
        /// sqlite keeps it in its file; Redis in a capped stream, drained by the replicas into
        /// PostgreSQL when `url` is set.
        #[key(Ty::Table(&RawHistory::TABLE))]
        history: RawHistory = RawHistory::default(),
    }
}

table! {
    /// `[history]`.
    struct RawHistory {
        /// The PostgreSQL database the replicas of a redis store drain the history into
        /// (`postgres://user:password@host:port/db`); `""`: none (the history is then kept in
        /// Redis only, up to `stream_max_len` records). A secret: it may hold a password.
        #[key(Ty::Secret("a postgres:// URL, or \"\""))]
        url: String = String::new(),
        /// Records older than this many days are deleted (sqlite and PostgreSQL).
        #[key(Ty::Int { min: 1, max: HISTORY_RETENTION_DAYS_MAX })]
        retention_days: u64 = HISTORY_RETENTION_DAYS_DEFAULT,
        /// Reservation records kept at most (sqlite and PostgreSQL; runs, adjustments and
        /// refusal minutes each as many): the oldest beyond it are deleted.
        #[key(Ty::Int { min: 1, max: HISTORY_ROWS_MAX_MAX })]
        rows_max: u64 = HISTORY_ROWS_MAX_DEFAULT,
        /// Redis: the history stream's cap (approximate, trimmed as Redis trims `MAXLEN ~`).
        /// Records not drained before the cap evicts them are lost to PostgreSQL: size it for
        /// the longest drain outage at the peak record rate. About 1 KB of Redis memory each.
        #[key(Ty::Int { min: 1, max: HISTORY_STREAM_MAX_LEN_MAX })]
        stream_max_len: u64 = HISTORY_STREAM_MAX_LEN_DEFAULT,
        /// Redis with PostgreSQL: when the oldest record not yet drained is older than this many
        /// seconds, an alert is raised (and `spendgate_history_drain_lag_seconds` says it).
        #[key(Ty::Int { min: 1, max: HISTORY_DRAIN_LAG_ALERT_S_MAX })]
        drain_lag_alert_s: u64 = HISTORY_DRAIN_LAG_ALERT_S_DEFAULT,
    }
}

table! {
    /// `[server]`.
    struct RawServer {
        /// The address and port to listen on (`"[::]:8080"`: every address).
        #[key(Ty::Str("an address and port such as \"127.0.0.1:8080\" or \"[::]:8080\""))]
        listen: String = "127.0.0.1:8080".to_string(),
        /// A second address and port that serves `/metrics` (and `/healthz`, `/readyz`)
        /// without a token, for a scraper on a private network; `""`: none, and `/metrics` is
        /// served on `listen` to the admin token only. It tells how much budget is left: never
        /// expose it where guests reach.
        #[key(Ty::Str("\"\" or an address and port such as \"127.0.0.1:9090\""))]
        metrics_listen: String = String::new(),
        /// Reverse proxies whose `X-Forwarded-For` is believed: the client is then the
        /// rightmost address that is not a trusted proxy. Never list a range your guests
        /// connect from: whoever connects from a trusted address picks their own address.
        #[key(Ty::List {
            of: &Ty::Str("a CIDR such as \"10.0.0.0/8\" or an address"),
            max: TRUSTED_PROXIES_MAX,
        })]
        trusted_proxies: Vec<String> = Vec::new(),
        /// Bearer tokens of your backend (the decision API, the proxy, usage of any session).
        /// An `env:` entry whose variable is unset or empty is dropped; with none left the
        /// service API is closed. Tokens under 16 bytes draw a warning.
        #[key(Ty::List { of: &Ty::Secret("a token"), max: LIST_LEN_MAX })]
        service_tokens: Vec<String> = vec!["env:SPENDGATE_SERVICE_TOKEN".to_string()],
        /// Bearer tokens of the admin API (`/admin/v1/`, the dashboard), each different from
        /// every service token. Unset `env:` entries are dropped; with none left the admin API
        /// is closed.
        #[key(Ty::List { of: &Ty::Secret("a token"), max: LIST_LEN_MAX })]
        admin_tokens: Vec<String> = vec!["env:SPENDGATE_ADMIN_TOKEN".to_string()],
        /// Guests may call the proxy (`/v1/chat/completions`) with their session cookie alone,
        /// without a service token.
        #[key(Ty::Bool)]
        browser_direct: bool = false,
        /// Every `[limits.X]` in dry-run: rates, concurrency caps and budgets are computed,
        /// logged and counted but not enforced. Run bounds, the cutoff, prices and session
        /// creation limits stay enforced.
        #[key(Ty::Bool)]
        dry_run: bool = false,
        /// Requests in flight from guests and anyone without a valid service or admin token.
        #[key(Ty::Int { min: 1, max: CLASS_REQUESTS_MAX })]
        public_requests_max: u64 = PUBLIC_REQUESTS_MAX_DEFAULT,
        /// Requests in flight with a valid service token.
        #[key(Ty::Int { min: 1, max: CLASS_REQUESTS_MAX })]
        service_requests_max: u64 = SERVICE_REQUESTS_MAX_DEFAULT,
        /// Requests in flight with a valid admin token.
        #[key(Ty::Int { min: 1, max: CLASS_REQUESTS_MAX })]
        admin_requests_max: u64 = ADMIN_REQUESTS_MAX_DEFAULT,
        /// Requests in flight to `/healthz`, `/readyz` and `/metrics`.
        #[key(Ty::Int { min: 1, max: CLASS_REQUESTS_MAX })]
        health_requests_max: u64 = HEALTH_REQUESTS_MAX_DEFAULT,
        /// Requests in flight without a valid token, per client address prefix (each wider
        /// IPv6 prefix allows this times its factor).
        #[key(Ty::Int { min: 1, max: CLASS_REQUESTS_MAX })]
        address_requests_max: u64 = ADDRESS_REQUESTS_MAX_DEFAULT,
        /// Connections per socket peer prefix; a trusted proxy is exempt. At most
        /// `connections_max`; absent: 256, or `connections_max` when that is smaller.
        #[key(Ty::Int { min: 1, max: CONNECTIONS_MAX as u64 })]
        address_connections_max: Option<u64> = None,
        /// Connections served at once (the open files limit is raised for this many).
        #[key(Ty::Int { min: 2, max: CONNECTIONS_MAX as u64 })]
        connections_max: u64 = CONNECTIONS_MAX as u64,
        /// Connections kept for callers that are not public (a valid service or admin token,
        /// or a health route) once the others are all taken. At most half of
        /// `connections_max`; absent: 1024, or a sixteenth of `connections_max` when smaller.
        #[key(Ty::Int { min: 0, max: CONNECTIONS_MAX as u64 / 2 })]
        connections_reserved: Option<u64> = None,
        /// After `body_grace_ms`, a request body must have arrived at this average rate at
        /// least (bytes a second), or the request is answered 408.
        #[key(Ty::Int { min: BODY_MIN_BYTES_PER_S_FLOOR, max: BODY_MIN_BYTES_PER_S_MAX })]
        body_min_bytes_per_s: u64 = BODY_MIN_BYTES_PER_S_DEFAULT,
        /// How long a request body may take before its rate is checked (milliseconds).
        #[key(Ty::Int { min: BODY_GRACE_MS_MIN, max: BODY_GRACE_MS_MAX })]
        body_grace_ms: u64 = BODY_GRACE_MS_DEFAULT,
    }
}

table! {
    /// `[store]`.
    struct RawStore {
        /// `memory`: in the process, lost at exit (tests, throwaway runs); `sqlite`: one file,
        /// one node; `redis`: shared by any number of replicas (Redis 7 or Valkey).
        #[key(Ty::Choice(&["memory", "sqlite", "redis"]))]
        kind: String = "sqlite".to_string(),
        /// The sqlite file (kind `sqlite`), relative to the working directory.
        #[key(Ty::Str("a file path"))]
        path: String = "spendgate.db".to_string(),
        /// The Redis URL (kind `redis`): `redis://`, `rediss://`, `redis+unix://`, `unix://`,
        /// `valkey://` or `valkeys://`. A secret: it may hold a password.
        #[key(Ty::Secret("a Redis URL"))]
        url: String = "redis://127.0.0.1:6379/0".to_string(),
        /// The prefix of every Redis key: one deployment per prefix. 1 to 64 letters, digits,
        /// `_`, `-`, `.` or `:` (no braces: keys carry their own hash tag).
        #[key(Ty::Str("a key prefix"))]
        prefix: String = "spendgate".to_string(),
        /// The Redis ledger's id, as `spendgate store init` printed it (`lg-` and 32 hex
        /// digits). `spendgate serve` refuses a redis store without it, and a Redis holding
        /// another ledger; empty: not pinned (only `store init` runs).
        #[key(Ty::Str("a ledger id such as \"lg-8d7f6f04c3622caf038125313873dc9b\", or \"\""))]
        ledger_id: String = String::new(),
        /// Redis: the file of the ledger's high-water mark on this replica's disk, which
        /// detects a Redis rolled back to an older state; relative to the working directory.
        /// `"off"`: no witness (a warning says what then goes unseen).
        #[key(Ty::Str("a file path, or \"off\""))]
        witness_path: String = "spendgate.witness".to_string(),
        /// Once the store is known to be failing, a store call that has no answer after this
        /// long is refused (503 `store_unavailable`); also bounds `/readyz`'s check.
        #[key(Ty::Int { min: 1, max: STORE_TIMEOUT_MS_MAX })]
        timeout_ms: u64 = 100,
        /// While the store is not known to be failing, how much longer than `timeout_ms` a
        /// call may wait (0: none).
        #[key(Ty::Int { min: 0, max: SLOW_GRACE_MS_MAX })]
        slow_grace_ms: u64 = SLOW_GRACE_MS_DEFAULT,
        /// The lease of concurrency slots and reservations, renewed by heartbeat and by every
        /// call on the run: a crashed holder's slots free, and its reservations are charged in
        /// full, this long after its last call. An idempotency key is kept at least as long.
        #[key(Ty::Int { min: 1, max: LEASE_TTL_S_MAX })]
        lease_ttl_s: u64 = 30,
    }
}

table! {
    /// `[sessions]`.
    struct RawSessions {
        /// HMAC keys of session tokens, at least 16 bytes each: the first signs, every one
        /// verifies (rotation). With none set (an unset `env:` entry is dropped), an ephemeral
        /// key is generated at start: sessions then end at restart and are not shared between
        /// replicas, which a redis store refuses.
        #[key(Ty::List { of: &Ty::Secret("a key of at least 16 bytes"), max: LIST_LEN_MAX })]
        keys: Vec<String> = vec!["env:SPENDGATE_SESSION_KEY".to_string()],
        /// How long a session lasts, in seconds (also the cookie's `Max-Age`; at most 400
        /// days).
        #[key(Ty::Int { min: 1, max: SESSION_TTL_S_MAX })]
        ttl_s: u64 = 86_400,
        /// The cookie is `__Host-spendgate_session`, `Secure`; `false` (plain-HTTP local use):
        /// `spendgate_session` without `Secure`.
        #[key(Ty::Bool)]
        secure_cookie: bool = true,
        /// When creating a session asks for a challenge: `off` never, `always` every time,
        /// `adaptive` when more than half the creation burst is in use (for the client's
        /// prefixes or globally).
        #[key(Ty::Choice(&["off", "always", "adaptive"]))]
        challenge: String = "off".to_string(),
        /// Difficulty of the built-in proof-of-work challenge: leading zero bits.
        #[key(Ty::Int { min: 1, max: CHALLENGE_BITS_MAX })]
        challenge_bits: u64 = 18,
        /// Sessions created per client address prefix (wider IPv6 prefixes get their factor).
        /// Its burst is its count, at most 1000.
        #[key(Ty::Rate)]
        create_rate_per_ip: String = "10/hour".to_string(),
        /// Sessions created in all. Its burst is its count, at most 1000.
        #[key(Ty::Rate)]
        create_rate_global: String = "600/minute".to_string(),
        /// An external siteverify-style checker used instead of the built-in proof of work
        /// (http or https). A verifier that is down or slow refuses the session.
        #[key(
            Ty::Str("an http:// or https:// URL"),
            example: Some("\"https://challenges.example.com/siteverify\"")
        )]
        verifier_url: Option<String> = None,
        /// The secret sent to `verifier_url`: required with it, refused without it.
        #[key(Ty::Secret("a secret"), example: Some("\"env:SPENDGATE_VERIFIER_SECRET\""))]
        verifier_secret: Option<String> = None,
    }
}

table! {
    /// `[identity]`.
    struct RawIdentity {
        /// IPv4 clients are counted by this prefix length (32: each address).
        #[key(Ty::Int { min: 1, max: 32 })]
        ipv4_prefix: u64 = 32,
        /// IPv6 clients are counted by this prefix length. IPv4-mapped IPv6 counts as IPv4.
        #[key(Ty::Int { min: 1, max: 128 })]
        ipv6_prefix: u64 = 64,
        /// Wider IPv6 prefixes limited too, narrowest first, each shorter than `ipv6_prefix`:
        /// the k-th at the `[limits.ip]` limits times 4^k (one attacker easily holds a /48).
        /// Absent: `[56, 48]`, without those not shorter than `ipv6_prefix`.
        #[key(Ty::List { of: &Ty::Int { min: 1, max: 127 }, max: IPV6_WIDER_MAX })]
        ipv6_wider_prefixes: Option<Vec<u64>> = None,
    }
}

table! {
    /// `[limits]`: a `[limits.X]` table per scope.
    struct RawLimits {
        /// The whole service.
        #[key(Ty::Table(&RawScope::TABLE))]
        global: RawScope = RawScope::default(),
        /// One client address prefix (`[identity]`).
        #[key(Ty::Table(&RawScope::TABLE))]
        ip: RawScope = RawScope::default(),
        /// One guest session. A session is not a person: anyone can create another one.
        #[key(Ty::Table(&RawScope::TABLE))]
        session: RawScope = RawScope::default(),
        /// One conversation (its concurrency of 1: one generation at a time).
        #[key(Ty::Table(&RawScope::TABLE))]
        conversation: RawScope = RawScope::default(),
    }
}

table! {
    /// One `[limits.X]` table; a key left out keeps the scope's default.
    struct RawScope {
        /// Runs admitted per period (GCRA), or `"off"`. Given without `burst`, the scope's
        /// default burst stays (at most the new count); a scope with no default rate takes
        /// the count as its burst, at most 1000.
        #[key(Ty::Rate)]
        rate: Option<String> = None,
        /// How many runs may start at once above the rate. Needs a rate.
        #[key(Ty::Int { min: 1, max: BURST_MAX })]
        burst: Option<u64> = None,
        /// The rate alone in dry-run: a run past it is admitted, reported (`dry_run` in the
        /// answer, `spendgate_dry_run_refusals_total`) and logged; the scope's budgets and
        /// concurrency cap stay enforced. Needs a rate.
        #[key(Ty::Bool)]
        rate_dry_run: Option<bool> = None,
        /// Runs in flight at once, or `"off"`.
        #[key(Ty::CountOrOff { min: 1, max: CONCURRENCY_MAX })]
        concurrency: Option<RawCount> = None,
        /// The concurrency cap alone in dry-run (as `rate_dry_run`). Needs a cap.
        #[key(Ty::Bool)]
        concurrency_dry_run: Option<bool> = None,
        /// Spending caps, at most one per window: inline tables `{ amount = "50", window =
        /// "day" }`. `amount` is in currency units; `window` is `hour`, `day`, `month` (UTC
        /// calendar windows) or `lifetime`; `dry_run = true` puts that budget alone in
        /// dry-run (`{ amount = "5", window = "hour", dry_run = true }`: a new cap watched
        /// before it is enforced). An amount of 0 admits nothing; `[]`: no budget, which
        /// `[limits.global]` accepts only with `unbudgeted = true`.
        #[key(Ty::List { of: &Ty::Table(&RawBudget::TABLE), max: 4 })]
        budgets: Option<Vec<RawBudget>> = None,
        /// Only in `[limits.global]`: `true` says the service runs with no global budget
        /// (`budgets = []`). A global budget is the one limit that bounds what the whole
        /// service spends, whoever calls, so a config without one is refused unless it says
        /// so here: an edit that drops the last global budget must not remove that bound
        /// silently. Not allowed together with a global budget.
        #[key(Ty::Bool)]
        unbudgeted: Option<bool> = None,
        /// This scope's limits in dry-run: computed, logged and counted, not enforced.
        #[key(Ty::Bool)]
        dry_run: Option<bool> = None,
    }
}

table! {
    /// One budget of a `[limits.X]` table.
    struct RawBudget {
        /// The cap, in currency units.
        #[key(Ty::Amount, required: true)]
        amount: Option<RawAmount> = None,
        /// The window it is counted in.
        #[key(Ty::Choice(&["hour", "day", "month", "lifetime"]), required: true)]
        window: Option<String> = None,
        /// This budget alone in dry-run: a call past it is admitted and reported; the
        /// scope's other limits stay enforced.
        #[key(Ty::Bool)]
        dry_run: Option<bool> = None,
    }
}

table! {
    /// `[run]`.
    struct RawRun {
        /// `per_step`: each model or tool call reserves its own bound; `whole_run`: a run
        /// reserves `max_cost` once at admission, its steps draw from it, and finishing frees
        /// the rest.
        #[key(Ty::Choice(&["per_step", "whole_run"]))]
        mode: String = "per_step".to_string(),
        /// Bytes of the user's input (413 `payload_too_large` above).
        #[key(Ty::Int { min: 1, max: RUN_BYTES_MAX })]
        max_input_bytes: u64 = RunBounds::default().max_input_bytes,
        /// Prompt tokens of each model call: refused above, never truncated.
        #[key(Ty::Int { min: 1, max: RUN_TOKENS_MAX })]
        max_context_tokens: u64 = RunBounds::default().max_context_tokens,
        /// Output tokens of each model call: a request's bound is clamped to it, and inserted
        /// when absent.
        #[key(Ty::Int { min: 1, max: RUN_TOKENS_MAX })]
        max_output_tokens: u64 = RunBounds::default().max_output_tokens,
        /// Bytes of one tool result the agent may feed back.
        #[key(Ty::Int { min: 0, max: RUN_BYTES_MAX })]
        max_tool_result_bytes: u64 = RunBounds::default().max_tool_result_bytes,
        /// Model calls per run, retries not counted.
        #[key(Ty::Int { min: 1, max: RUN_COUNT_MAX })]
        max_model_rounds: u64 = u64::from(RunBounds::default().max_model_rounds),
        /// Paid tool calls per run.
        #[key(Ty::Int { min: 0, max: RUN_COUNT_MAX })]
        max_tool_calls: u64 = u64::from(RunBounds::default().max_tool_calls),
        /// Model calls marked as retries, per run.
        #[key(Ty::Int { min: 0, max: RUN_COUNT_MAX })]
        max_retries: u64 = u64::from(RunBounds::default().max_retries),
        /// The run's deadline, in seconds after admission: later steps are refused, and a
        /// proxied call still running then is cut and charged in full.
        #[key(Ty::Int { min: 1, max: RUN_SECONDS_MAX })]
        max_seconds: u64 = RunBounds::default().max_seconds,
        /// What one run may reserve and charge in all (more than 0).
        #[key(Ty::Amount)]
        max_cost: RawAmount = RawAmount(amount_text(RunBounds::default().max_cost)),
        /// A model call whose bound does not fit the budgets left, but would with an output
        /// bound of at least `min_output_tokens`, is admitted with the smaller bound instead
        /// of refused.
        #[key(Ty::Bool)]
        shrink_to_fit: bool = RunBounds::default().shrink_to_fit,
        /// The smallest output bound `shrink_to_fit` shrinks to (at most
        /// `max_output_tokens`).
        #[key(Ty::Int { min: 1, max: RUN_TOKENS_MAX })]
        min_output_tokens: u64 = RunBounds::default().min_output_tokens,
    }
}

table! {
    /// `[models.NAME]`: NAME is the model name clients send.
    struct RawModel {
        /// The upstream that serves it: a `[upstreams.NAME]` name, or `"mock"` (the built-in
        /// mock, served by `spendgate demo` only).
        #[key(Ty::Str("an [upstreams] name or \"mock\""), required: true)]
        upstream: Option<String> = None,
        /// Price of a million prompt tokens.
        #[key(Ty::Amount, required: true)]
        input_per_million: Option<RawAmount> = None,
        /// Price of a million output tokens.
        #[key(Ty::Amount, required: true)]
        output_per_million: Option<RawAmount> = None,
        /// Price of a million cached prompt tokens, at most `input_per_million` (reservations
        /// price every prompt token at the input price). Absent: `input_per_million`.
        #[key(Ty::Amount)]
        cached_input_per_million: Option<RawAmount> = None,
        /// Price of a million prompt tokens written to a prompt cache (Anthropic's
        /// `cache_creation_input_tokens`), at least `input_per_million`. Absent: twice
        /// `input_per_million` (the most Anthropic charges for a cache write).
        #[key(Ty::Amount)]
        cache_write_per_million: Option<RawAmount> = None,
        /// How prompts and relayed output are counted. `bytes`: one token per byte, a hard
        /// upper bound for any byte-level tokenizer; `o200k_base` and `cl100k_base`: OpenAI's,
        /// exact for the models that use them.
        #[key(Ty::Choice(&["o200k_base", "cl100k_base", "bytes"]))]
        tokenizer: String = "bytes".to_string(),
        /// The model name sent upstream. Absent: NAME.
        #[key(Ty::Str("a model name"), example: Some("\"gpt-4o-mini-2024-07-18\""))]
        upstream_model: Option<String> = None,
        /// The one output-bound field the forwarded request carries, whichever the client
        /// sent: the field the upstream honours (OpenAI's reasoning models need
        /// `max_completion_tokens`).
        #[key(Ty::Choice(&["max_tokens", "max_completion_tokens"]))]
        output_bound_field: String = "max_tokens".to_string(),
    }
}

table! {
    /// `[tools.NAME]`: at least one of the two prices.
    struct RawTool {
        /// Price of one call. Absent: 0.
        #[key(Ty::Amount)]
        per_call: Option<RawAmount> = None,
        /// Price of one unit (the units a call reports). Absent: 0.
        #[key(Ty::Amount)]
        per_unit: Option<RawAmount> = None,
    }
}

table! {
    /// `[upstreams.NAME]`.
    struct RawUpstream {
        /// The API's base URL, e.g. `https://api.openai.com/v1`; paths such as
        /// `/chat/completions` are appended. No user info, query or fragment.
        #[key(Ty::Str("an http:// or https:// URL"), required: true)]
        base_url: Option<String> = None,
        /// Sent as `Authorization: Bearer`. Absent, or its variable unset: no header.
        #[key(Ty::Secret("an API key"), example: Some("\"env:OPENAI_API_KEY\""))]
        api_key: Option<String> = None,
        /// The API the upstream speaks: `openai` (OpenAI-compatible: `/chat/completions`, key
        /// as `Authorization: Bearer`) or `anthropic` (Anthropic's Messages API:
        /// `/messages`, key as `x-api-key`). Its models are served on that API's route only.
        #[key(Ty::Choice(&["openai", "anthropic"]))]
        api: String = "openai".to_string(),
        /// How long one upstream call may take, in seconds.
        #[key(Ty::Int { min: 1, max: UPSTREAM_TIMEOUT_S_MAX })]
        timeout_s: u64 = 60,
        /// An upstream error status that shows no work was done (such as 400, 401, 429)
        /// releases the reservation instead of charging it.
        #[key(Ty::Bool)]
        release_on_error: bool = true,
    }
}

table! {
    /// `[alerts]`.
    struct RawAlerts {
        /// Where alerts are POSTed as JSON with a Slack-compatible `text` field; `""`: the log
        /// only. A secret (webhook URLs carry their credential): an `env:` variable that is
        /// unset is an error.
        #[key(Ty::Secret("an http:// or https:// URL, or \"\""))]
        webhook_url: String = String::new(),
        /// Fractions of a budget at which to alert, ascending, each in (0, 10] with at most 3
        /// decimals (1.0: the budget is spent).
        #[key(Ty::List { of: &Ty::Fraction, max: 32 })]
        thresholds: Vec<f64> = vec![0.5, 0.8, 1.0],
        /// Kinds of scope whose budgets are watched: `global`, and `ip`, `session`,
        /// `conversation` (their top spenders). Distinct.
        #[key(Ty::List { of: &Ty::Choice(&["global", "ip", "session", "conversation"]), max: 4 })]
        scopes: Vec<String> = vec!["global".to_string()],
        /// The burn-rate alert's short window (seconds): the global budgets' spend rate over
        /// it, and over `burn_long_s`, must both exhaust the budget before its window resets.
        #[key(Ty::Int { min: 1, max: BURN_WINDOW_S_MAX })]
        burn_short_s: u64 = 300,
        /// The burn-rate alert's long window (seconds), longer than `burn_short_s`. Rates and
        /// forecasts over both are in `/admin/v1/summary` and `/metrics`.
        #[key(Ty::Int { min: 2, max: BURN_WINDOW_S_MAX })]
        burn_long_s: u64 = 3600,
    }
}

/// An amount as written: a decimal string (or an integer, which is exact). A float is refused:
/// `0.1` as a float is not 0.1.
#[derive(Debug)]
pub(crate) struct RawAmount(pub(crate) String);

impl<'de> Deserialize<'de> for RawAmount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawAmount;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an amount as a decimal string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawAmount, E> {
                Ok(RawAmount(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawAmount, E> {
                Ok(RawAmount(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawAmount, E> {
                Ok(RawAmount(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for RawAmount {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// A count or `"off"`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RawCount {
    Off,
    N(u64),
}

impl<'de> Deserialize<'de> for RawCount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawCount;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a positive integer or \"off\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawCount, E> {
                if v == "off" {
                    Ok(RawCount::Off)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawCount, E> {
                Ok(RawCount::N(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawCount, E> {
                u64::try_from(v)
                    .map(RawCount::N)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for RawCount {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            RawCount::Off => s.serialize_str("off"),
            RawCount::N(n) => s.serialize_u64(*n),
        }
    }
}
