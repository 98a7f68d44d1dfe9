//! How a [`Command`] becomes script arguments and how the script's answer becomes a [`Reply`].
//!
//! The script answers with arrays of strings: `["OK", seq, changed, ...]` for a write,
//! `["OK", seq, ...]` for a read, `["E", seq, changed, kind, ...]` for a ledger error and
//! `["X", kind, ...]` when the store itself refuses (epoch missing or changed, rollback).
//! Outcomes of admissions are flat string lists so that idempotency records can store them
//! verbatim and a retry decodes to the very same answer.

use spendgate_core::{
    budget_message, Adjustment, Applied, Command, Counter, CounterKey, Heartbeat, IdempotencyKey,
    IpScope, LedgerError, Micros, ModelPrice, RateLeft, Refusal, RefusalCode, ReplicaSeen, Reply,
    Reservation, ReservationId, ReservationKind, ReservationState, Resolution, Resolved,
    RunAdmitted, RunBounds, RunEnded, RunId, RunRequest, RunState, ScopeKey, ScopeKind,
    SessionGrant, Settlement, StepKind, StepRequest, StepReserved, Summary, ToolPrice, UnixMs,
    UsageLine, Window, WindowId, HELD_RETRY_AFTER_S, LEDGER_RECORDS_MAX, LIFETIME_RETRY_AFTER_S,
    MICROS_MAX, REPLICAS_MAX,
};
use spendgate_store::StoreError;
use std::collections::HashMap;

/// Largest `limit`/`top` passed to a listing (the core lists everything; a Redis script must
/// stay bounded).
pub const LISTING_MAX: usize = 100_000;

/// One script call: which script (read-only or not), the operation and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub read: bool,
    pub op: &'static str,
    pub args: Vec<String>,
}

fn bad(what: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("redis store: unexpected script answer: {what}"))
}

fn b01(b: bool) -> String {
    if b { "1" } else { "0" }.to_string()
}

fn push_idem(args: &mut Vec<String>, idem: &Option<IdempotencyKey>) {
    match idem {
        Some(k) => {
            args.push("1".into());
            args.push(k.key.clone());
            args.push(k.fingerprint.clone());
        }
        None => {
            args.push("0".into());
            args.push(String::new());
            args.push(String::new());
        }
    }
}

fn push_ips(args: &mut Vec<String>, ips: &[IpScope]) {
    args.push(ips.len().to_string());
    for ip in ips {
        args.push(ip.prefix.clone());
        args.push(ip.factor.to_string());
    }
}

/// The script call for a command: a read-only call for a command that only reads
/// ([`Command::is_read`]), run by the script's `no-writes` entry.
pub fn encode(cmd: &Command) -> Call {
    let (op, args) = match cmd {
        Command::AdmitRun { req, idem } => ("admit_run", admit_run_args(req, idem)),
        Command::ReserveStep { req, idem } => ("reserve_step", reserve_step_args(req, idem)),
        Command::Resolve { step, how } => ("resolve", resolve_args(step, *how)),
        Command::Heartbeat { run } => ("heartbeat", vec![run.0.clone()]),
        Command::Finish { run } => ("finish", vec![run.0.clone()]),
        Command::CreateSession { ips, dry } => {
            let mut a = Vec::new();
            push_ips(&mut a, ips);
            a.push(b01(*dry));
            ("create_session", a)
        }
        Command::Usage { scopes } => {
            let mut a = vec![scopes.len().to_string()];
            for (s, f) in scopes {
                a.extend([s.kind.name().to_string(), s.id.clone(), f.to_string()]);
            }
            ("usage", a)
        }
        Command::SetCutoff { engaged, reason } => {
            ("set_cutoff", vec![b01(*engaged), reason.clone()])
        }
        Command::Adjust {
            scope,
            factor,
            amount,
            once,
        } => (
            "adjust",
            vec![
                scope.kind.name().to_string(),
                scope.id.clone(),
                amount.to_string(),
                factor.to_string(),
                once.clone().unwrap_or_default(),
            ],
        ),
        Command::Summary => ("summary", vec![]),
        Command::Reservations { state, limit } => (
            "reservations",
            vec![
                state.map(|s| s.name().to_string()).unwrap_or_default(),
                (*limit).min(LISTING_MAX).to_string(),
            ],
        ),
        Command::TopCounters { kind, top } => (
            "top",
            vec![
                kind.map(|k| k.name().to_string()).unwrap_or_default(),
                (*top).min(LISTING_MAX).to_string(),
            ],
        ),
        Command::Sweep => ("sweep", vec![]),
        Command::ConsumeOnce { key, ttl_ms } => {
            ("consume_once", vec![key.clone(), ttl_ms.to_string()])
        }
        Command::Announce {
            replica,
            fingerprint,
        } => ("announce", vec![replica.clone(), fingerprint.clone()]),
        Command::Replicas => ("replicas", vec![]),
    };
    Call {
        read: cmd.is_read(),
        op,
        args,
    }
}

fn admit_run_args(req: &RunRequest, idem: &Option<IdempotencyKey>) -> Vec<String> {
    let mut a = vec![
        req.run_id.0.clone(),
        req.session.clone(),
        req.conversation.clone(),
        req.input_bytes.to_string(),
    ];
    push_idem(&mut a, idem);
    push_ips(&mut a, &req.ips);
    a
}

fn reserve_step_args(req: &StepRequest, idem: &Option<IdempotencyKey>) -> Vec<String> {
    let mut a = vec![req.run_id.0.clone(), req.step_id.0.clone()];
    push_idem(&mut a, idem);
    match &req.kind {
        StepKind::Model {
            model,
            price,
            prompt_tokens,
            max_output_tokens,
            retry,
        } => a.extend([
            "model".to_string(),
            model.clone(),
            price.input_per_million.0.to_string(),
            price.cached_input_per_million.0.to_string(),
            price.output_per_million.0.to_string(),
            prompt_tokens.to_string(),
            max_output_tokens.map(|m| m.to_string()).unwrap_or_default(),
            b01(*retry),
        ]),
        StepKind::Tool { tool, price, units } => a.extend([
            "tool".to_string(),
            tool.clone(),
            price.per_call.0.to_string(),
            price.per_unit.0.to_string(),
            units.to_string(),
        ]),
    }
    a
}

fn resolve_args(step: &ReservationId, how: Resolution) -> Vec<String> {
    let mut a = vec![step.0.clone()];
    match how {
        Resolution::Commit(Settlement::Tokens(u)) => {
            let cached = u.cached_tokens.min(u.prompt_tokens);
            a.extend([
                "tokens".to_string(),
                (u.prompt_tokens - cached).to_string(),
                cached.to_string(),
                u.completion_tokens.to_string(),
            ]);
        }
        Resolution::Commit(Settlement::Units(n)) => a.extend(["units".to_string(), n.to_string()]),
        Resolution::Commit(Settlement::ResultBytes(n)) => {
            a.extend(["bytes".to_string(), n.to_string()])
        }
        Resolution::Release => a.push("release".into()),
        Resolution::Unknown => a.push("unknown".into()),
    }
    a
}

/// A script answer as nested lists of strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Str(String),
    List(Vec<Item>),
}

impl Item {
    pub fn from_value(v: redis::Value) -> Result<Item, StoreError> {
        Ok(match v {
            redis::Value::BulkString(b) => {
                Item::Str(String::from_utf8(b).map_err(|_| bad("a string is not UTF-8"))?)
            }
            redis::Value::SimpleString(s) => Item::Str(s),
            redis::Value::Okay => Item::Str("OK".into()),
            redis::Value::Int(i) => Item::Str(i.to_string()),
            redis::Value::Array(items) => Item::List(
                items
                    .into_iter()
                    .map(Item::from_value)
                    .collect::<Result<_, _>>()?,
            ),
            other => return Err(bad(format!("{other:?}"))),
        })
    }
    pub fn str(&self) -> Result<&str, StoreError> {
        match self {
            Item::Str(s) => Ok(s),
            Item::List(_) => Err(bad("a list where a string was expected")),
        }
    }
    pub fn list(&self) -> Result<&[Item], StoreError> {
        match self {
            Item::List(l) => Ok(l),
            Item::Str(_) => Err(bad("a string where a list was expected")),
        }
    }
}

/// Reads fields one after another.
pub struct Fields<'a> {
    items: &'a [Item],
    at: usize,
}

impl<'a> Fields<'a> {
    pub fn new(items: &'a [Item]) -> Fields<'a> {
        Fields { items, at: 0 }
    }
    fn next(&mut self) -> Result<&'a Item, StoreError> {
        let it = self
            .items
            .get(self.at)
            .ok_or_else(|| bad("answer too short"))?;
        self.at += 1;
        Ok(it)
    }
    pub fn s(&mut self) -> Result<String, StoreError> {
        Ok(self.next()?.str()?.to_string())
    }
    pub fn u(&mut self) -> Result<u64, StoreError> {
        let s = self.next()?.str()?;
        s.parse().map_err(|_| bad(format!("{s:?} is not a number")))
    }
    pub fn i(&mut self) -> Result<i64, StoreError> {
        let s = self.next()?.str()?;
        s.parse().map_err(|_| bad(format!("{s:?} is not a number")))
    }
    pub fn b(&mut self) -> Result<bool, StoreError> {
        Ok(self.next()?.str()? == "1")
    }
    pub fn opt_u(&mut self) -> Result<Option<u64>, StoreError> {
        let s = self.next()?.str()?;
        if s.is_empty() {
            return Ok(None);
        }
        s.parse()
            .map(Some)
            .map_err(|_| bad(format!("{s:?} is not a number")))
    }
    pub fn list(&mut self) -> Result<&'a [Item], StoreError> {
        self.next()?.list()
    }
    pub fn rest(&mut self) -> &'a [Item] {
        let r = self.items.get(self.at..).unwrap_or(&[]);
        self.at = self.items.len();
        r
    }
}

fn kind_of(s: &str) -> Result<ScopeKind, StoreError> {
    ScopeKind::parse(s).ok_or_else(|| bad(format!("scope kind {s:?}")))
}

fn window_of(s: &str) -> Result<Window, StoreError> {
    Window::parse(s).ok_or_else(|| bad(format!("window {s:?}")))
}

fn res_state(s: &str) -> Result<ReservationState, StoreError> {
    ReservationState::parse(s).ok_or_else(|| bad(format!("reservation state {s:?}")))
}

fn run_state(s: &str) -> Result<RunState, StoreError> {
    match s {
        "active" => Ok(RunState::Active),
        "finished" => Ok(RunState::Finished),
        "expired" => Ok(RunState::Expired),
        _ => Err(bad(format!("run state {s:?}"))),
    }
}

fn code_of(s: &str) -> Result<RefusalCode, StoreError> {
    Ok(match s {
        "rate_limited" => RefusalCode::RateLimited,
        "concurrency_limited" => RefusalCode::ConcurrencyLimited,
        "budget_exhausted" => RefusalCode::BudgetExhausted,
        "run_bound_exceeded" => RefusalCode::RunBoundExceeded,
        "payload_too_large" => RefusalCode::PayloadTooLarge,
        "context_too_large" => RefusalCode::ContextTooLarge,
        "cutoff_engaged" => RefusalCode::CutoffEngaged,
        "budget_held" => RefusalCode::BudgetHeld,
        _ => return Err(bad(format!("refusal code {s:?}"))),
    })
}

/// "window|index|kind|id" → CounterKey
pub fn counter_key(enc: &str) -> Result<CounterKey, StoreError> {
    let mut parts = enc.splitn(4, '|');
    let (Some(w), Some(idx), Some(kind), Some(id)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad(format!("counter key {enc:?}")));
    };
    Ok(CounterKey {
        scope: ScopeKey::new(kind_of(kind)?, id),
        window: WindowId {
            window: window_of(w)?,
            index: idx
                .parse()
                .map_err(|_| bad(format!("counter key {enc:?}")))?,
        },
    })
}

/// Decodes a netstring list ("3:abc0:").
pub fn netstrings(s: &str) -> Result<Vec<String>, StoreError> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (len, tail) = rest.split_once(':').ok_or_else(|| bad("malformed list"))?;
        let len: usize = len.parse().map_err(|_| bad("malformed list"))?;
        let item = tail.get(..len).ok_or_else(|| bad("malformed list"))?;
        out.push(item.to_string());
        rest = tail.get(len..).ok_or_else(|| bad("malformed list"))?;
    }
    Ok(out)
}

fn refusal(f: &mut Fields<'_>) -> Result<Refusal, StoreError> {
    let code = code_of(&f.s()?)?;
    let scope = match f.s()?.as_str() {
        "" => None,
        k => Some(kind_of(k)?),
    };
    let retry = f.opt_u()?.map(|s| s.max(1));
    let kind = f.s()?;
    let (message, retry) = match kind.as_str() {
        "text" => (f.s()?, retry),
        // A spent budget ("budget") waits for its window's reset; one its holds refuse
        // ("held") for HELD_RETRY_AFTER_S at most (as `admission::decide`).
        held @ ("budget" | "held") => {
            let window = WindowId {
                window: window_of(&f.s()?)?,
                index: f.u()?,
            };
            let c = Counter {
                used: Micros(f.u()?),
                reserved: Micros(f.u()?),
                limit: Micros(f.u()?),
                ..Counter::default()
            };
            let now = UnixMs(f.u()?);
            let to_reset = window
                .resets_at()
                .map(|r| now.secs_until(r))
                .unwrap_or(LIFETIME_RETRY_AFTER_S)
                .max(1);
            let (state, retry) = if held == "held" {
                (
                    "is held by calls in flight",
                    to_reset.min(HELD_RETRY_AFTER_S),
                )
            } else {
                ("is spent", to_reset)
            };
            let kind = scope.unwrap_or(ScopeKind::Global);
            (budget_message(kind, &window, state, &c), Some(retry))
        }
        "runcost" => (
            format!("run cost bound of {} reached", Micros(f.u()?)),
            retry,
        ),
        other => return Err(bad(format!("refusal message kind {other:?}"))),
    };
    Ok(Refusal {
        code,
        scope,
        retry_after_s: retry,
        message,
    })
}

fn run_outcome(f: &mut Fields<'_>) -> Result<Result<RunAdmitted, Refusal>, StoreError> {
    match f.s()?.as_str() {
        "refused" => Ok(Err(refusal(f)?)),
        "run_ok" => Ok(Ok(RunAdmitted {
            run_id: RunId(f.s()?),
            deadline: UnixMs(f.u()?),
            reserved: Micros(f.u()?),
            bounds: RunBounds {
                max_input_bytes: f.u()?,
                max_context_tokens: f.u()?,
                max_output_tokens: f.u()?,
                max_tool_result_bytes: f.u()?,
                max_model_rounds: u32_of(f.u()?)?,
                max_tool_calls: u32_of(f.u()?)?,
                max_retries: u32_of(f.u()?)?,
                max_seconds: f.u()?,
                max_cost: Micros(f.u()?),
                shrink_to_fit: f.b()?,
                min_output_tokens: f.u()?,
            },
            rate_left: rate_left(f)?,
            dry_run: dry_run(f)?,
        })),
        other => Err(bad(format!("run outcome {other:?}"))),
    }
}

/// `0`, or `1` and the refusal a limit in dry-run would have given (a refusal's fields).
fn dry_run(f: &mut Fields<'_>) -> Result<Option<Refusal>, StoreError> {
    if f.b()? {
        Ok(Some(refusal(f)?))
    } else {
        Ok(None)
    }
}

/// `scope remaining reset_s`, the scope `""` when no scope of the run has a rate.
fn rate_left(f: &mut Fields<'_>) -> Result<Option<RateLeft>, StoreError> {
    let scope = f.s()?;
    let remaining = f.u()?;
    let reset_s = f.u()?;
    if scope.is_empty() {
        return Ok(None);
    }
    Ok(Some(RateLeft {
        scope: kind_of(&scope)?,
        remaining,
        reset_s,
    }))
}

fn u32_of(v: u64) -> Result<u32, StoreError> {
    u32::try_from(v).map_err(|_| bad(format!("{v} does not fit u32")))
}

fn step_outcome(f: &mut Fields<'_>) -> Result<Result<StepReserved, Refusal>, StoreError> {
    match f.s()?.as_str() {
        "refused" => Ok(Err(refusal(f)?)),
        "step_ok" => Ok(Ok(StepReserved {
            step_id: ReservationId(f.s()?),
            reserved: Micros(f.u()?),
            max_output_tokens: f.opt_u()?,
            shrunk: f.b()?,
            dry_run: dry_run(f)?,
        })),
        other => Err(bad(format!("step outcome {other:?}"))),
    }
}

fn session_outcome(f: &mut Fields<'_>) -> Result<Result<SessionGrant, Refusal>, StoreError> {
    match f.s()?.as_str() {
        "refused" => Ok(Err(refusal(f)?)),
        "session_ok" => Ok(Ok(SessionGrant { pressure: f.b()? })),
        other => Err(bad(format!("session outcome {other:?}"))),
    }
}

fn usage_lines(rows: &[Item]) -> Result<Vec<UsageLine>, StoreError> {
    rows.iter()
        .map(|row| {
            let mut f = Fields::new(row.list()?);
            let scope = ScopeKey::new(kind_of(&f.s()?)?, f.s()?);
            let window = WindowId {
                window: window_of(&f.s()?)?,
                index: f.u()?,
            };
            Ok(UsageLine {
                scope,
                window,
                limit: Micros(f.u()?),
                used: Micros(f.u()?),
                reserved: Micros(f.u()?),
                overrun: f.b()?,
                resets_at: window.resets_at(),
            })
        })
        .collect()
}

fn ledger_error(f: &mut Fields<'_>) -> Result<LedgerError, StoreError> {
    Ok(match f.s()?.as_str() {
        "notfound" => LedgerError::NotFound(f.s()?),
        "closed" => LedgerError::Closed {
            state: res_state(&f.s()?)?,
            charged: Micros(f.u()?),
        },
        "runclosed" => LedgerError::RunClosed(run_state(&f.s()?)?),
        "conflict" => LedgerError::IdempotencyConflict,
        "invalid" => LedgerError::Invalid(f.s()?),
        "full" => LedgerError::Full(LEDGER_RECORDS_MAX),
        other => return Err(bad(format!("error kind {other:?}"))),
    })
}

fn reservation(row: &[Item]) -> Result<Reservation, StoreError> {
    let mut f = Fields::new(row);
    let id = ReservationId(f.s()?);
    let run_id = RunId(f.s()?);
    let kind = f.s()?;
    let name = f.s()?;
    let (p1, p2, p3) = (f.u()?, f.u()?, f.u()?);
    let retry = f.b()?;
    let units = f.u()?;
    let kind = match kind.as_str() {
        "model" => ReservationKind::Model {
            model: name,
            price: ModelPrice {
                input_per_million: Micros(p1),
                cached_input_per_million: Micros(p2),
                output_per_million: Micros(p3),
            },
            retry,
        },
        "tool" => ReservationKind::Tool {
            tool: name,
            price: ToolPrice {
                per_call: Micros(p1),
                per_unit: Micros(p2),
            },
            units,
        },
        "hold" => ReservationKind::RunHold,
        other => return Err(bad(format!("reservation kind {other:?}"))),
    };
    let amount = Micros(f.u()?);
    let counters = netstrings(&f.s()?)?
        .iter()
        .map(|e| counter_key(e))
        .collect::<Result<_, _>>()?;
    Ok(Reservation {
        id,
        run_id,
        kind,
        amount,
        counters,
        state: res_state(&f.s()?)?,
        charged: Micros(f.u()?),
        created: UnixMs(f.u()?),
        resolved_at: f.opt_u()?.map(UnixMs),
        max_output_tokens: f.opt_u()?,
        overrun: f.b()?,
        result_too_large: f.b()?,
    })
}

/// The answer of a script that did not refuse at the store level (`OK` or `E`).
pub fn decode(cmd: &Command, items: &[Item]) -> Result<Reply, StoreError> {
    let mut f = Fields::new(items);
    let tag = f.s()?;
    let seq = f.u()?;
    if tag == "E" {
        let changed = f.b()?;
        return Err(StoreError::Ledger(
            ledger_error(&mut f)?,
            changed.then_some(seq),
        ));
    }
    if tag != "OK" {
        return Err(bad(format!("tag {tag:?}")));
    }
    let changed = if has_changed_flag(cmd) { f.b()? } else { false };
    let stamp = Stamp { seq, changed };
    let f = &mut f;
    Ok(match cmd {
        Command::AdmitRun { .. } => Reply::Run(stamp.on(run_outcome(f)?)),
        Command::ReserveStep { .. } => Reply::Step(stamp.on(step_outcome(f)?)),
        Command::CreateSession { .. } => Reply::Session(stamp.on(session_outcome(f)?)),
        Command::Resolve { .. } => Reply::Resolved(stamp.on(resolved(f)?)),
        Command::Heartbeat { .. } => Reply::Heartbeat(stamp.on(Heartbeat {
            lease_until: UnixMs(f.u()?),
            deadline: UnixMs(f.u()?),
        })),
        Command::Finish { .. } => Reply::Finished(stamp.on(run_ended(f)?)),
        Command::SetCutoff { .. } => Reply::Cutoff(stamp.on(f.b()?)),
        Command::Adjust { .. } => {
            let repeated = f.b()?;
            let lines = usage_lines(f.rest())?;
            Reply::Adjusted(stamp.on(Adjustment { lines, repeated }))
        }
        Command::Sweep => Reply::Swept(stamp.on(usize::try_from(f.u()?).unwrap_or(usize::MAX))),
        Command::ConsumeOnce { .. } => Reply::Consumed(stamp.on(f.b()?)),
        Command::Announce { .. } | Command::Replicas => Reply::Replicas(replicas(f)?),
        Command::Usage { .. } => Reply::Usage(usage_lines(f.list()?)?),
        Command::Summary => Reply::Summary(summary(f, seq)?),
        Command::Reservations { limit, .. } => Reply::Reservations(reservations(f, *limit)?),
        Command::TopCounters { top, .. } => Reply::TopCounters(top_counters(f, *top)?),
    })
}

/// The sequence number and change flag an answer carries.
#[derive(Clone, Copy)]
struct Stamp {
    seq: u64,
    changed: bool,
}

impl Stamp {
    fn on<T>(self, value: T) -> Applied<T> {
        Applied {
            value,
            seq: self.seq,
            changed: self.changed,
        }
    }
}

fn resolved(f: &mut Fields<'_>) -> Result<Resolved, StoreError> {
    Ok(Resolved {
        state: res_state(&f.s()?)?,
        charged: Micros(f.u()?),
        reserved: Micros(f.u()?),
        overrun: f.b()?,
        repeated: f.b()?,
        result_too_large: f.b()?,
    })
}

fn run_ended(f: &mut Fields<'_>) -> Result<RunEnded, StoreError> {
    let state = run_state(&f.s()?)?;
    let charged = Micros(f.u()?);
    Ok(RunEnded {
        state,
        charged,
        steps: u32_of(f.u()?)?,
        repeated: f.b()?,
        // What the budgets were charged: the whole-run hold's charge (ledger.lua's finish).
        budgets_charged: Micros(f.u()?),
    })
}

fn replicas(f: &mut Fields<'_>) -> Result<Vec<ReplicaSeen>, StoreError> {
    let mut v = f
        .list()?
        .iter()
        .map(|row| {
            let mut r = Fields::new(row.list()?);
            Ok(ReplicaSeen {
                replica: r.s()?,
                fingerprint: r.s()?,
                seen: UnixMs(r.u()?),
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    // (by id, as the core answers; sorted here, not by the script, whose string order
    // follows the server's locale)
    v.sort_by(|a, b| a.replica.cmp(&b.replica));
    v.truncate(REPLICAS_MAX);
    Ok(v)
}

fn summary(f: &mut Fields<'_>, seq: u64) -> Result<Summary, StoreError> {
    let engaged = f.b()?;
    let reason = f.s()?;
    let runs_active = f.u()?;
    let mut reservations = HashMap::new();
    for state in ["held", "committed", "released", "unknown", "expired"] {
        let n = f.u()?;
        if n > 0 {
            reservations.insert(state.to_string(), n);
        }
    }
    let cap = |v: i64| Micros(u64::try_from(v.max(0)).unwrap_or(0).min(MICROS_MAX.0));
    Ok(Summary {
        seq,
        cutoff: engaged.then_some(reason),
        runs_active,
        reservations,
        held_micros: cap(f.i()?),
        charged_micros: cap(f.i()?),
        overruns: f.u()?,
    })
}

/// The newest `limit` reservations, newest first (as the core lists them).
fn reservations(f: &mut Fields<'_>, limit: usize) -> Result<Vec<Reservation>, StoreError> {
    let mut v = f
        .list()?
        .iter()
        .map(|row| reservation(row.list()?))
        .collect::<Result<Vec<_>, _>>()?;
    v.sort_by(|a, b| b.created.cmp(&a.created).then_with(|| a.id.cmp(&b.id)));
    v.truncate(limit);
    Ok(v)
}

/// The `top` counters with the most used and held, most first (as the core lists them).
fn top_counters(f: &mut Fields<'_>, top: usize) -> Result<Vec<(CounterKey, Counter)>, StoreError> {
    let mut v = f
        .list()?
        .iter()
        .map(|row| {
            let mut r = Fields::new(row.list()?);
            let key = counter_key(&r.s()?)?;
            Ok((
                key,
                Counter {
                    limit: Micros(r.u()?),
                    used: Micros(r.u()?),
                    reserved: Micros(r.u()?),
                    overrun: r.b()?,
                    adjusted: r.i()?,
                },
            ))
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    v.sort_by(|a, b| {
        (b.1.used.add_capped(b.1.reserved))
            .cmp(&a.1.used.add_capped(a.1.reserved))
            .then_with(|| a.0.cmp(&b.0))
    });
    v.truncate(top);
    Ok(v)
}

/// Whether the command's answer carries a `changed` flag (every write does, but an
/// announcement, which changes no ledger record).
fn has_changed_flag(cmd: &Command) -> bool {
    !matches!(
        cmd,
        Command::Usage { .. }
            | Command::Summary
            | Command::Reservations { .. }
            | Command::TopCounters { .. }
            | Command::Announce { .. }
            | Command::Replicas
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_core::{FINGERPRINT_BYTES_MAX, REPLICA_ID_BYTES_MAX, REPLICA_STALE_MS};

    /// `ledger.lua` bounds the replicas it remembers as the core does.
    #[test]
    fn the_script_holds_the_cores_replica_bounds() {
        let script = include_str!("ledger.lua");
        for needle in [
            format!("local REPLICAS_MAX, REPLICA_STALE_MS = {REPLICAS_MAX}, {REPLICA_STALE_MS}"),
            format!("#id > {REPLICA_ID_BYTES_MAX}"),
            format!("#fp > {FINGERPRINT_BYTES_MAX}"),
        ] {
            assert!(script.contains(&needle), "ledger.lua lacks {needle:?}");
        }
    }

    #[test]
    fn netstrings_roundtrip() {
        assert_eq!(
            netstrings("3:abc0:2:x|").expect("valid"),
            vec!["abc".to_string(), String::new(), "x|".to_string()]
        );
        assert!(netstrings("3:ab").is_err());
        assert!(netstrings("x:ab").is_err());
    }

    #[test]
    fn counter_keys_keep_ids_with_separators() {
        let k = counter_key("day|20000|session|a|b").expect("valid");
        assert_eq!(k.scope, ScopeKey::new(ScopeKind::Session, "a|b"));
        assert_eq!(k.window.index, 20000);
        let g = counter_key("month|24322|global|").expect("valid");
        assert_eq!(g.scope, ScopeKey::global());
    }
}
