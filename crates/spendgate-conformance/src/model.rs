//! The model-based property test: random sequences of operations run against the store and
//! against a small reference model written here from the SPEC (plain vectors and loops, not
//! `spendgate_core::Ledger`). Every answer is compared, and the ledger-wide invariants are
//! checked after every operation.
//!
//! The model is deliberately small: per-step mode, one policy with a global and a session day
//! budget, one active run per conversation, run bounds on rounds, retries, tool calls, cost and
//! seconds; three sessions with two conversations each; clock moves that stay well inside one
//! day and inside the retention of ended runs (`RECORD_RETENTION_MS`; longer advances are skipped). Every amount is a multiple of 1_000 micros and
//! the limits are small, so that budgets are often filled exactly, overruns often cross
//! limits, and runs often live until their deadline caps the lease. Expiry happens, in both, at the start of the
//! next operation that writes (reads never expire anything), so the model expires due leases
//! before each operation it applies.

use crate::support::{day, lines_hold, policy, Who, LIST_MAX, MODEL_PRICE, START};
use crate::Backend;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use spendgate_core::{
    IpScope, LedgerError, Micros, Policy, Refusal, RefusalCode, ReservationId, ReservationMode,
    ReservationState, Resolution, RunBounds, RunId, RunRequest, RunState, ScopeKind, Settlement,
    StepKind, StepRequest, Summary, TokenUsage, ToolPrice, RECORD_RETENTION_MS,
};
use spendgate_store::{Store, StoreError};
use std::sync::Arc;

const TTL_MS: u64 = 10_000;
const RUN_SECONDS: u64 = 15;
const GLOBAL_DAY: u64 = 60_000;
const SESSION_DAY: u64 = 40_000;
/// The session budget when it is in dry-run: small, so that cases often go past it.
const SESSION_DAY_DRY: u64 = 15_000;
const RUN_COST: u64 = 20_000;
const CONTEXT: u64 = 8_000;
const OUTPUT: u64 = 4_000;
const ROUNDS: u32 = 3;
const TOOLS: u32 = 3;
const RETRIES: u32 = 1;
const INPUT_BYTES: u64 = 1_000;
const SESSIONS: usize = 3;
const CONVERSATIONS: usize = 2;
const TOOL_CALL: u64 = 2_000;
const TOOL_UNIT: u64 = 2_000;
const IP: &str = "203.0.113.9/32";
const DAY_MS: u64 = 86_400_000;
/// Cases and operations per case.
const CASES: u32 = 64;
const OPS_MAX: usize = 40;

fn session_day(session_dry: bool) -> u64 {
    if session_dry {
        SESSION_DAY_DRY
    } else {
        SESSION_DAY
    }
}

/// `session_dry`: the session budget in dry-run (reported, not enforced).
fn model_policy(session_dry: bool) -> Policy {
    let mut p = policy();
    p.global.budgets = vec![day(GLOBAL_DAY)];
    p.session.budgets = vec![day(session_day(session_dry))];
    p.session.dry_run = session_dry;
    p.conversation.concurrency = Some(1);
    p.run = RunBounds {
        max_input_bytes: INPUT_BYTES,
        max_context_tokens: CONTEXT,
        max_output_tokens: OUTPUT,
        max_tool_result_bytes: 1_000,
        max_model_rounds: ROUNDS,
        max_tool_calls: TOOLS,
        max_retries: RETRIES,
        max_seconds: RUN_SECONDS,
        max_cost: Micros(RUN_COST),
        shrink_to_fit: false,
        min_output_tokens: 1,
    };
    p.mode = ReservationMode::PerStep;
    p.lease_ttl_ms = TTL_MS;
    p
}

const TOOL: ToolPrice = ToolPrice {
    per_call: Micros(TOOL_CALL),
    per_unit: Micros(TOOL_UNIT),
};

/// One operation. Runs and steps are picked among those the model granted so far.
#[derive(Clone, Debug)]
enum Op {
    Admit {
        session: usize,
        conversation: usize,
        oversized: bool,
    },
    Model {
        run: Index,
        prompt: u64,
        out: Option<u64>,
        retry: bool,
    },
    Tool {
        run: Index,
        units: u64,
    },
    /// Commits a step: a model step with `pct`% of its output bound, a tool step with `units`.
    Commit {
        step: Index,
        pct: u64,
        units: u64,
    },
    Release {
        step: Index,
    },
    Unknown {
        step: Index,
    },
    Heartbeat {
        run: Index,
    },
    Finish {
        run: Index,
    },
    Advance {
        ms: u64,
    },
    Sweep,
    /// Reopens a durable store (then sweeps); nothing for others.
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    use proptest::sample::select;
    prop_oneof![
        4 => (0..SESSIONS, 0..CONVERSATIONS, prop::bool::weighted(0.1)).prop_map(
            |(session, conversation, oversized)| Op::Admit { session, conversation, oversized }
        ),
        4 => (
            any::<Index>(),
            select(vec![2_000u64, 6_000, 9_000]),
            select(vec![None, Some(1_000u64), Some(20_000)]),
            prop::bool::weighted(0.25),
        )
            .prop_map(|(run, prompt, out, retry)| Op::Model { run, prompt, out, retry }),
        3 => (any::<Index>(), 0u64..4).prop_map(|(run, units)| Op::Tool { run, units }),
        4 => (any::<Index>(), select(vec![0u64, 50, 100, 150, 1000]), 0u64..6)
            .prop_map(|(step, pct, units)| Op::Commit { step, pct, units }),
        2 => any::<Index>().prop_map(|step| Op::Release { step }),
        2 => any::<Index>().prop_map(|step| Op::Unknown { step }),
        2 => any::<Index>().prop_map(|run| Op::Heartbeat { run }),
        2 => any::<Index>().prop_map(|run| Op::Finish { run }),
        3 => select(vec![700u64, 3_000, 5_000, 9_999, 10_000, 10_001, 25_000])
            .prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Sweep),
        1 => Just(Op::Reopen),
    ]
}

/// A budget counter of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Global(u64),
    Session(usize, u64),
    Run(usize),
}

#[derive(Clone, Debug)]
struct MCounter {
    key: Key,
    limit: u64,
    used: u64,
    reserved: u64,
    /// Used went above the limit: nothing more is admitted in the window.
    overrun: bool,
    /// A charge above its hold was made here (I1's one exception).
    overran: bool,
}

#[derive(Clone, Debug)]
struct MRun {
    id: String,
    session: usize,
    conversation: usize,
    deadline: u64,
    lease: u64,
    state: RunState,
    rounds: u32,
    retries: u32,
    tools: u32,
    steps: Vec<usize>,
}

#[derive(Clone, Debug)]
struct MStep {
    id: String,
    run: usize,
    /// `(prompt, output bound)` of a model step; `None` for a tool step.
    model: Option<(u64, u64)>,
    amount: u64,
    keys: Vec<Key>,
    state: ReservationState,
    charged: u64,
}

/// A refusal a limit in dry-run reported: `(code, scope, retry_after_s)`.
type DryRun = Option<(RefusalCode, Option<ScopeKind>, Option<u64>)>;

/// A normalized answer, compared between store and model.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ans {
    Admitted {
        deadline: u64,
        reserved: u64,
        dry: DryRun,
    },
    Reserved {
        amount: u64,
        max_out: Option<u64>,
        dry: DryRun,
    },
    Refused {
        code: RefusalCode,
        scope: Option<ScopeKind>,
        retry_after_s: Option<u64>,
    },
    Resolved {
        state: ReservationState,
        charged: u64,
        reserved: u64,
        overrun: bool,
        repeated: bool,
    },
    Closed {
        state: ReservationState,
        charged: u64,
    },
    Heartbeat {
        lease_until: u64,
        deadline: u64,
    },
    Finished {
        state: RunState,
        charged: u64,
        steps: u32,
        repeated: bool,
    },
    RunClosed(RunState),
    Swept,
}

#[derive(Default, Debug)]
struct Model {
    /// The session budget is in dry-run.
    session_dry: bool,
    now: u64,
    counters: Vec<MCounter>,
    runs: Vec<MRun>,
    steps: Vec<MStep>,
}

fn day_of(now: u64) -> u64 {
    now / DAY_MS
}

fn refused(code: RefusalCode, scope: ScopeKind, retry_after_s: Option<u64>) -> Ans {
    Ans::Refused {
        code,
        scope: Some(scope),
        retry_after_s,
    }
}

impl Model {
    fn limit(&self, key: Key) -> u64 {
        match key {
            Key::Global(_) => GLOBAL_DAY,
            Key::Session(..) => session_day(self.session_dry),
            Key::Run(_) => RUN_COST,
        }
    }

    fn counter(&mut self, key: Key) -> &mut MCounter {
        let i = match self.counters.iter().position(|c| c.key == key) {
            Some(i) => i,
            None => {
                self.counters.push(MCounter {
                    key,
                    limit: self.limit(key),
                    used: 0,
                    reserved: 0,
                    overrun: false,
                    overran: false,
                });
                self.counters.len() - 1
            }
        };
        &mut self.counters[i]
    }

    /// `(used, reserved, overrun)` of a counter.
    fn view(&self, key: Key) -> (u64, u64, bool) {
        self.counters
            .iter()
            .find(|c| c.key == key)
            .map(|c| (c.used, c.reserved, c.overrun))
            .unwrap_or((0, 0, false))
    }

    fn fits(&self, key: Key, amount: u64) -> bool {
        let (used, reserved, overrun) = self.view(key);
        !overrun && used + reserved + amount <= self.limit(key)
    }

    /// Whether used spend alone would admit `amount` on this counter (the holds of calls in
    /// flight refuse it: a wait, not a spent budget).
    fn held(&self, key: Key, amount: u64) -> bool {
        let (used, _, overrun) = self.view(key);
        !overrun && used + amount <= self.limit(key)
    }

    fn budget_refusal(&self, key: Key, amount: u64) -> Ans {
        if self.held(key, amount) {
            // Held: retry within a second (the lease bounds every hold).
            let scope = match key {
                Key::Global(_) => ScopeKind::Global,
                Key::Session(..) => ScopeKind::Session,
                Key::Run(_) => ScopeKind::Run,
            };
            return refused(RefusalCode::BudgetHeld, scope, Some(1));
        }
        let to_midnight = (day_of(self.now) + 1) * DAY_MS - self.now;
        match key {
            Key::Global(_) => refused(
                RefusalCode::BudgetExhausted,
                ScopeKind::Global,
                Some(to_midnight.div_ceil(1000)),
            ),
            Key::Session(..) => refused(
                RefusalCode::BudgetExhausted,
                ScopeKind::Session,
                Some(to_midnight.div_ceil(1000)),
            ),
            Key::Run(_) => refused(RefusalCode::RunBoundExceeded, ScopeKind::Run, None),
        }
    }

    fn settle(&mut self, step: usize, state: ReservationState, charged: u64) {
        let (amount, keys) = (self.steps[step].amount, self.steps[step].keys.clone());
        self.steps[step].state = state;
        self.steps[step].charged = charged;
        for k in keys {
            let c = self.counter(k);
            c.reserved -= amount;
            c.used += charged;
            c.overran |= charged > amount;
            if c.used > c.limit {
                c.overrun = true;
            }
        }
    }

    fn end(&mut self, run: usize, state: RunState) {
        let step_state = match state {
            RunState::Expired => ReservationState::Expired,
            _ => ReservationState::Unknown,
        };
        for st in self.runs[run].steps.clone() {
            if self.steps[st].state == ReservationState::Held {
                let amount = self.steps[st].amount;
                self.settle(st, step_state, amount);
            }
        }
        self.runs[run].state = state;
    }

    /// Expires every active run whose lease ended; returns how many.
    fn expire(&mut self) -> usize {
        let due: Vec<usize> = (0..self.runs.len())
            .filter(|&r| self.runs[r].state == RunState::Active && self.runs[r].lease <= self.now)
            .collect();
        for &r in &due {
            self.end(r, RunState::Expired);
        }
        due.len()
    }

    /// Renews a run's lease to one TTL from now, never past its deadline and never back.
    /// Returns whether it moved.
    fn renew(&mut self, run: usize) -> bool {
        let r = &mut self.runs[run];
        let new = (self.now + TTL_MS).min(r.deadline).max(r.lease);
        let moved = new != r.lease;
        r.lease = new;
        moved
    }

    fn admit(&mut self, id: String, session: usize, conversation: usize, bytes: u64) -> Ans {
        if bytes > INPUT_BYTES {
            return refused(RefusalCode::PayloadTooLarge, ScopeKind::Run, None);
        }
        let conv = session * CONVERSATIONS + conversation;
        let busy = self
            .runs
            .iter()
            .any(|r| r.state == RunState::Active && r.conversation == conv);
        if busy {
            return refused(
                RefusalCode::ConcurrencyLimited,
                ScopeKind::Conversation,
                Some(1),
            );
        }
        let d = day_of(self.now);
        let dry = match self.check(&[Key::Global(d), Key::Session(session, d)], 1) {
            Ok(dry) => dry,
            Err(refusal) => return refusal,
        };
        let deadline = self.now + RUN_SECONDS * 1000;
        self.runs.push(MRun {
            id,
            session,
            conversation: conv,
            deadline,
            lease: (self.now + TTL_MS).min(deadline),
            state: RunState::Active,
            rounds: 0,
            retries: 0,
            tools: 0,
            steps: Vec::new(),
        });
        Ans::Admitted {
            deadline,
            reserved: 0,
            dry,
        }
    }

    fn dry(&self, key: Key) -> bool {
        matches!(key, Key::Session(..)) && self.session_dry
    }

    /// The refusal of the enforced keys `amount` does not fit, else the one of the keys in
    /// dry-run (as reported). Among the keys that refuse, a spent one before a held one (the
    /// first spent: the run's lifetime bound, listed first, frees last, and the day budgets
    /// reset together); else the first held one.
    fn check(&self, keys: &[Key], amount: u64) -> Result<DryRun, Ans> {
        let pick = |dry: bool| {
            let refusing: Vec<Key> = keys
                .iter()
                .copied()
                .filter(|&k| self.dry(k) == dry && !self.fits(k, amount))
                .collect();
            refusing
                .iter()
                .find(|&&k| !self.held(k, amount))
                .or(refusing.first())
                .map(|&k| self.budget_refusal(k, amount))
        };
        if let Some(refusal) = pick(false) {
            return Err(refusal);
        }
        match pick(true) {
            Some(Ans::Refused {
                code,
                scope,
                retry_after_s,
            }) => Ok(Some((code, scope, retry_after_s))),
            _ => Ok(None),
        }
    }

    /// A model step (`Some((prompt, out, retry))`) or a tool step (`None`, `units`).
    fn reserve(
        &mut self,
        id: String,
        run: usize,
        model: Option<(u64, Option<u64>, bool)>,
        units: u64,
    ) -> Ans {
        let bound = || refused(RefusalCode::RunBoundExceeded, ScopeKind::Run, None);
        let r = &self.runs[run];
        if r.state != RunState::Active || self.now >= r.deadline {
            return bound();
        }
        let (amount, step_model) = match model {
            Some((prompt, out, retry)) => {
                if (retry && r.retries >= RETRIES) || (!retry && r.rounds >= ROUNDS) {
                    return bound();
                }
                if prompt > CONTEXT {
                    return refused(RefusalCode::ContextTooLarge, ScopeKind::Run, None);
                }
                let out = out.unwrap_or(OUTPUT).min(OUTPUT);
                (prompt + 2 * out, Some((prompt, out)))
            }
            None => {
                if r.tools >= TOOLS {
                    return bound();
                }
                (TOOL_CALL + TOOL_UNIT * units, None)
            }
        };
        let d = day_of(self.now);
        // The run's own bound is checked first (a step it can never fit is over the run's
        // bound, not a spent budget).
        let keys = vec![Key::Run(run), Key::Global(d), Key::Session(r.session, d)];
        let dry = match self.check(&keys, amount) {
            Ok(dry) => dry,
            Err(refusal) => return refusal,
        };
        for &key in &keys {
            let in_dry_run = self.dry(key);
            let c = self.counter(key);
            c.reserved += amount;
            // Only a limit in dry-run is held past itself; it is then overrun.
            if in_dry_run && c.used + c.reserved > c.limit {
                c.overrun = true;
            }
        }
        let r = &mut self.runs[run];
        match model {
            Some((_, _, true)) => r.retries += 1,
            Some((_, _, false)) => r.rounds += 1,
            None => r.tools += 1,
        }
        r.steps.push(self.steps.len());
        self.steps.push(MStep {
            id,
            run,
            model: step_model,
            amount,
            keys,
            state: ReservationState::Held,
            charged: 0,
        });
        self.renew(run);
        Ans::Reserved {
            amount,
            max_out: step_model.map(|(_, out)| out),
            dry,
        }
    }

    /// Returns the answer and whether the ledger changed.
    fn resolve(&mut self, step: usize, how: &Resolution) -> (Ans, bool) {
        let st = &self.steps[step];
        let target = match how {
            Resolution::Commit(_) => ReservationState::Committed,
            Resolution::Release => ReservationState::Released,
            Resolution::Unknown => ReservationState::Unknown,
        };
        if st.state != ReservationState::Held {
            // A late overrun: a commit above what an unknown or expired step was charged
            // charges the difference; the state stays.
            let late = match (st.state, how, st.model) {
                (
                    ReservationState::Unknown | ReservationState::Expired,
                    Resolution::Commit(Settlement::Tokens(u)),
                    Some(_),
                ) => u.prompt_tokens + 2 * u.completion_tokens,
                (
                    ReservationState::Unknown | ReservationState::Expired,
                    Resolution::Commit(Settlement::Units(n)),
                    None,
                ) => TOOL_CALL + TOOL_UNIT * n,
                _ => 0,
            };
            if late > st.charged {
                let (state, amount, delta) = (st.state, st.amount, late - st.charged);
                for key in st.keys.clone() {
                    let c = self.counter(key);
                    c.used += delta;
                    c.overran |= late > amount;
                    if c.used > c.limit {
                        c.overrun = true;
                    }
                }
                self.steps[step].charged = late;
                let ans = Ans::Resolved {
                    state,
                    charged: late,
                    reserved: amount,
                    overrun: late > amount,
                    repeated: false,
                };
                return (ans, true);
            }
            if st.state != target {
                return (
                    Ans::Closed {
                        state: st.state,
                        charged: st.charged,
                    },
                    false,
                );
            }
            let ans = Ans::Resolved {
                state: st.state,
                charged: st.charged,
                reserved: st.amount,
                overrun: st.charged > st.amount,
                repeated: true,
            };
            return (ans, false);
        }
        let charged = match how {
            Resolution::Commit(Settlement::Tokens(u)) => u.prompt_tokens + 2 * u.completion_tokens,
            Resolution::Commit(Settlement::Units(n)) => TOOL_CALL + TOOL_UNIT * n,
            Resolution::Commit(Settlement::ResultBytes(_)) => st.amount,
            Resolution::Release => 0,
            Resolution::Unknown => st.amount,
        };
        let (amount, run) = (st.amount, st.run);
        self.settle(step, target, charged);
        self.renew(run);
        let ans = Ans::Resolved {
            state: target,
            charged,
            reserved: amount,
            overrun: charged > amount,
            repeated: false,
        };
        (ans, true)
    }

    fn heartbeat(&mut self, run: usize) -> (Ans, bool) {
        if self.runs[run].state != RunState::Active {
            return (Ans::RunClosed(self.runs[run].state), false);
        }
        let moved = self.renew(run);
        let r = &self.runs[run];
        let ans = Ans::Heartbeat {
            lease_until: r.lease,
            deadline: r.deadline,
        };
        (ans, moved)
    }

    fn finish(&mut self, run: usize) -> (Ans, bool) {
        // (an expired run is answered as it ended: a repeat)
        let fresh = self.runs[run].state == RunState::Active;
        if fresh {
            self.end(run, RunState::Finished);
        }
        let r = &self.runs[run];
        let charged = r.steps.iter().map(|&s| self.steps[s].charged).sum();
        let ans = Ans::Finished {
            state: r.state,
            charged,
            steps: r.steps.len() as u32,
            repeated: !fresh,
        };
        (ans, fresh)
    }

    /// The usage lines the store must report for a session (global, then session).
    fn lines(&self, session: usize) -> Vec<(ScopeKind, u64, u64, u64, bool)> {
        let d = day_of(self.now);
        [
            (ScopeKind::Global, Key::Global(d)),
            (ScopeKind::Session, Key::Session(session, d)),
        ]
        .into_iter()
        .map(|(kind, key)| {
            let (used, reserved, overrun) = self.view(key);
            (kind, self.limit(key), used, reserved, overrun)
        })
        .collect()
    }
}

fn from_refusal(r: &Refusal) -> Ans {
    let retry_after_s = match r.code {
        // Any wait of a second or more: the exact figure is the store's to choose.
        RefusalCode::ConcurrencyLimited => r.retry_after_s.map(|s| s.min(1)),
        _ => r.retry_after_s,
    };
    Ans::Refused {
        code: r.code,
        scope: r.scope,
        retry_after_s,
    }
}

fn dry_of(r: Option<&Refusal>) -> DryRun {
    r.map(|r| (r.code, r.scope, r.retry_after_s))
}

fn from_error(e: StoreError) -> Result<Ans, TestCaseError> {
    match e {
        StoreError::Ledger(LedgerError::Closed { state, charged }, _) => Ok(Ans::Closed {
            state,
            charged: charged.0,
        }),
        StoreError::Ledger(LedgerError::RunClosed(state), _) => Ok(Ans::RunClosed(state)),
        e => Err(TestCaseError::fail(format!("store error: {e}"))),
    }
}

fn step_name(kind: &Option<(u64, u64)>) -> &'static str {
    if kind.is_some() {
        "model"
    } else {
        "tool"
    }
}

/// One case: opens a store, applies `ops` to it and to the model, compares.
async fn run_case(b: &dyn Backend, ops: &[Op], session_dry: bool) -> Result<(), TestCaseError> {
    // Whether the backend is durable decides what `Reopen` does; ask it on an empty store.
    drop(b.open(model_policy(session_dry), START).await);
    let (store, durable) = match b.reopen().await {
        Some(s) => (s, true),
        None => (b.open(model_policy(session_dry), START).await, false),
    };
    let mut case = Case {
        b,
        store,
        durable,
        m: Model {
            session_dry,
            now: START.0,
            ..Model::default()
        },
        admitted: 0,
        reserved: 0,
    };
    let mut last_seq = summary_of(&case.store).await?.seq;
    for (i, op) in ops.iter().enumerate() {
        if matches!(op, Op::Reopen) && case.durable {
            case = case.reopened().await?;
        }
        let Some(Outcome {
            got,
            want,
            seq,
            changed,
        }) = case.apply(i, op).await?
        else {
            continue;
        };
        prop_assert_eq!(&got, &want, "op {} {:?}", i, op);
        let sum = summary_of(&case.store).await?;
        if changed {
            prop_assert!(
                sum.seq > last_seq,
                "op {i} {op:?} changed the ledger but seq stayed at {last_seq}"
            );
        } else {
            prop_assert_eq!(
                sum.seq,
                last_seq,
                "op {} {:?} changed nothing but seq moved",
                i,
                op
            );
        }
        if let Some(seq) = seq {
            prop_assert_eq!(seq, sum.seq, "op {} {:?}: the answer's seq", i, op);
        }
        last_seq = sum.seq;
        check_case(&case.store, &case.m, &sum)
            .await
            .map_err(|e| TestCaseError::fail(format!("after op {i} {op:?}: {e}")))?;
    }
    Ok(())
}

/// What one operation found.
struct Outcome {
    /// The store's answer.
    got: Ans,
    /// The model's.
    want: Ans,
    /// The sequence number the store's answer carries (`None`: an error, which carries none).
    seq: Option<u64>,
    /// Whether the model changed.
    changed: bool,
}

/// One case in progress: the store under test, the model, and the ids handed out so far.
struct Case<'b> {
    b: &'b dyn Backend,
    store: Arc<dyn Store>,
    /// The backend reopens (`Op::Reopen` reopens it).
    durable: bool,
    m: Model,
    admitted: usize,
    reserved: usize,
}

impl Case<'_> {
    /// Applies `op` to the store and to the model. `None`: `op` applies to nothing (no run or
    /// step to pick yet, or a clock move past the retention of ended runs), or only moves the
    /// clock.
    async fn apply(&mut self, i: usize, op: &Op) -> Result<Option<Outcome>, TestCaseError> {
        let pick = |idx: &Index, len: usize| (len > 0).then(|| idx.index(len));
        let (runs, steps) = (self.m.runs.len(), self.m.steps.len());
        Ok(Some(match op {
            Op::Advance { ms } => {
                // The model does not purge ended runs: keep the whole case inside their
                // retention (a case spans at most RECORD_RETENTION_MS of clock).
                if self.m.now + ms < START.0 + RECORD_RETENTION_MS {
                    self.b.advance(*ms);
                    self.m.now += ms;
                }
                return Ok(None);
            }
            Op::Admit {
                session,
                conversation,
                oversized,
            } => self.admit(*session, *conversation, *oversized).await?,
            Op::Model {
                run,
                prompt,
                out,
                retry,
            } => {
                let Some(r) = pick(run, runs) else {
                    return Ok(None);
                };
                let kind = StepKind::Model {
                    model: "m".into(),
                    price: MODEL_PRICE,
                    prompt_tokens: *prompt,
                    max_output_tokens: *out,
                    retry: *retry,
                };
                self.reserve(r, kind, Some((*prompt, *out, *retry)), 0)
                    .await?
            }
            Op::Tool { run, units } => {
                let Some(r) = pick(run, runs) else {
                    return Ok(None);
                };
                let kind = StepKind::Tool {
                    tool: "t".into(),
                    price: TOOL,
                    units: *units,
                };
                self.reserve(r, kind, None, *units).await?
            }
            Op::Commit { step, .. } | Op::Release { step } | Op::Unknown { step } => {
                let Some(st) = pick(step, steps) else {
                    return Ok(None);
                };
                self.resolve(st, op).await?
            }
            Op::Heartbeat { run } => {
                let Some(r) = pick(run, runs) else {
                    return Ok(None);
                };
                self.heartbeat(r).await?
            }
            Op::Finish { run } => {
                let Some(r) = pick(run, runs) else {
                    return Ok(None);
                };
                self.finish(r).await?
            }
            Op::Sweep | Op::Reopen => self.sweep(i, op).await?,
        }))
    }

    async fn admit(
        &mut self,
        session: usize,
        conversation: usize,
        oversized: bool,
    ) -> Result<Outcome, TestCaseError> {
        let id = format!("run{}", self.admitted);
        self.admitted += 1;
        let bytes = if oversized { INPUT_BYTES + 1 } else { 100 };
        let req = RunRequest {
            run_id: RunId(id.clone()),
            session: format!("session{session}"),
            ips: vec![IpScope {
                prefix: IP.into(),
                factor: 1,
            }],
            conversation: format!("conversation{session}.{conversation}"),
            input_bytes: bytes,
        };
        let expired = self.m.expire();
        let want = self.m.admit(id, session, conversation, bytes);
        let a = self.store.admit_run(req, None).await.map_err(fail)?;
        let got = match &a.value {
            Ok(v) => Ans::Admitted {
                deadline: v.deadline.0,
                reserved: v.reserved.0,
                dry: dry_of(v.dry_run.as_ref()),
            },
            Err(r) => from_refusal(r),
        };
        let granted = matches!(want, Ans::Admitted { .. });
        Ok(Outcome {
            got,
            want,
            seq: Some(a.seq),
            changed: expired > 0 || granted,
        })
    }

    /// A step of run `r`: a model step (`model`: prompt, output bound, retry) or a tool step
    /// of `units`.
    async fn reserve(
        &mut self,
        r: usize,
        kind: StepKind,
        model: Option<(u64, Option<u64>, bool)>,
        units: u64,
    ) -> Result<Outcome, TestCaseError> {
        let id = format!("step{}", self.reserved);
        self.reserved += 1;
        let req = StepRequest {
            run_id: RunId(self.m.runs[r].id.clone()),
            step_id: ReservationId(id.clone()),
            kind,
        };
        let expired = self.m.expire();
        let want = self.m.reserve(id, r, model, units);
        let (got, seq) = reserve_ans(&self.store, req).await?;
        let granted = matches!(want, Ans::Reserved { .. });
        Ok(Outcome {
            got,
            want,
            seq: Some(seq),
            changed: expired > 0 || granted,
        })
    }

    /// Resolves step `st` as `op` says (commit, release or unknown).
    async fn resolve(&mut self, st: usize, op: &Op) -> Result<Outcome, TestCaseError> {
        let how = match op {
            Op::Commit { pct, units, .. } => match self.m.steps[st].model {
                Some((prompt, out)) => Resolution::Commit(Settlement::Tokens(TokenUsage {
                    prompt_tokens: prompt,
                    completion_tokens: out * pct / 100,
                    cached_tokens: 0,
                })),
                None => Resolution::Commit(Settlement::Units(*units)),
            },
            Op::Release { .. } => Resolution::Release,
            _ => Resolution::Unknown,
        };
        let expired = self.m.expire();
        let (want, fresh) = self.m.resolve(st, &how);
        let id = ReservationId(self.m.steps[st].id.clone());
        let (got, seq) = match self.store.resolve(id, how).await {
            Ok(a) => (
                Ans::Resolved {
                    state: a.value.state,
                    charged: a.value.charged.0,
                    reserved: a.value.reserved.0,
                    overrun: a.value.overrun,
                    repeated: a.value.repeated,
                },
                Some(a.seq),
            ),
            Err(e) => (from_error(e)?, None),
        };
        Ok(Outcome {
            got,
            want,
            seq,
            changed: expired > 0 || fresh,
        })
    }

    async fn heartbeat(&mut self, r: usize) -> Result<Outcome, TestCaseError> {
        let expired = self.m.expire();
        let (want, moved) = self.m.heartbeat(r);
        let run = RunId(self.m.runs[r].id.clone());
        let (got, seq) = match self.store.heartbeat(run).await {
            Ok(a) => (
                Ans::Heartbeat {
                    lease_until: a.value.lease_until.0,
                    deadline: a.value.deadline.0,
                },
                Some(a.seq),
            ),
            Err(e) => (from_error(e)?, None),
        };
        Ok(Outcome {
            got,
            want,
            seq,
            changed: expired > 0 || moved,
        })
    }

    async fn finish(&mut self, r: usize) -> Result<Outcome, TestCaseError> {
        let expired = self.m.expire();
        let (want, fresh) = self.m.finish(r);
        let run = RunId(self.m.runs[r].id.clone());
        let (got, seq) = match self.store.finish(run).await {
            Ok(a) => (
                Ans::Finished {
                    state: a.value.state,
                    charged: a.value.charged.0,
                    steps: a.value.steps,
                    repeated: a.value.repeated,
                },
                Some(a.seq),
            ),
            Err(e) => (from_error(e)?, None),
        };
        Ok(Outcome {
            got,
            want,
            seq,
            changed: expired > 0 || fresh,
        })
    }

    /// The case with its store closed and reopened (`Op::Reopen` on a durable backend).
    async fn reopened(self) -> Result<Self, TestCaseError> {
        let Case { b, store, .. } = self;
        // Closed before it is reopened.
        drop(store);
        let Some(store) = b.reopen().await else {
            return Err(TestCaseError::fail("a durable backend did not reopen"));
        };
        Ok(Case { store, ..self })
    }

    /// A sweep (after `Op::Reopen`, the case was [reopened](Case::reopened) first).
    async fn sweep(&mut self, i: usize, op: &Op) -> Result<Outcome, TestCaseError> {
        let expired = self.m.expire();
        let a = self.store.sweep().await.map_err(fail)?;
        if expired > 0 {
            prop_assert!(
                a.value >= expired || matches!(op, Op::Reopen),
                "op {i} {op:?}: sweep reported {} of {expired} expiries",
                a.value
            );
        }
        Ok(Outcome {
            got: Ans::Swept,
            want: Ans::Swept,
            seq: Some(a.seq),
            changed: expired > 0,
        })
    }
}

fn fail(e: StoreError) -> TestCaseError {
    TestCaseError::fail(format!("store error: {e}"))
}

async fn summary_of(s: &Arc<dyn Store>) -> Result<Summary, TestCaseError> {
    s.summary().await.map_err(fail)
}

async fn reserve_ans(s: &Arc<dyn Store>, req: StepRequest) -> Result<(Ans, u64), TestCaseError> {
    let a = s.reserve_step(req, None).await.map_err(fail)?;
    let ans = match &a.value {
        Ok(g) => Ans::Reserved {
            amount: g.reserved.0,
            max_out: g.max_output_tokens,
            dry: dry_of(g.dry_run.as_ref()),
        },
        Err(r) => from_refusal(r),
    };
    Ok((ans, a.seq))
}

/// Compares the store's ledger with the model's and checks the invariants.
async fn check_case(s: &Arc<dyn Store>, m: &Model, sum: &Summary) -> Result<(), String> {
    let all = s
        .reservations(None, LIST_MAX)
        .await
        .map_err(|e| e.to_string())?;
    if all.len() != m.steps.len() {
        return Err(format!(
            "{} reservations listed, {} expected",
            all.len(),
            m.steps.len()
        ));
    }
    for st in &m.steps {
        let r = all
            .iter()
            .find(|r| r.id.0 == st.id)
            .ok_or_else(|| format!("reservation {} not listed", st.id))?;
        let got = (r.state, r.amount.0, r.charged.0, &r.run_id.0);
        let want = (st.state, st.amount, st.charged, &m.runs[st.run].id);
        if got != want {
            return Err(format!(
                "{} step {}: (state, amount, charged, run) is {got:?}, model says {want:?}",
                step_name(&st.model),
                st.id
            ));
        }
    }
    for session in 0..SESSIONS {
        let scopes = Who::new(
            &format!("session{session}"),
            &format!("conversation{session}.0"),
            IP,
        )
        .scopes();
        let lines = s.usage(scopes).await.map_err(|e| e.to_string())?;
        lines_hold(&lines, &all)?;
        let got: Vec<_> = lines
            .iter()
            .map(|l| (l.scope.kind, l.limit.0, l.used.0, l.reserved.0, l.overrun))
            .collect();
        let want = m.lines(session);
        if got != want {
            return Err(format!(
                "usage of session{session}: {got:?}, model says {want:?}"
            ));
        }
    }
    let held: u64 = m
        .steps
        .iter()
        .filter(|s| s.state == ReservationState::Held)
        .map(|s| s.amount)
        .sum();
    let charged: u64 = m.steps.iter().map(|s| s.charged).sum();
    let overruns = m
        .steps
        .iter()
        .filter(|s| s.state != ReservationState::Held && s.charged > s.amount)
        .count() as u64;
    let active = m
        .runs
        .iter()
        .filter(|r| r.state == RunState::Active)
        .count() as u64;
    let got = (
        sum.held_micros.0,
        sum.charged_micros.0,
        sum.overruns,
        sum.runs_active,
    );
    let want = (held, charged, overruns, active);
    if got != want {
        return Err(format!(
            "summary (held, charged, overruns, runs active) is {got:?}, model says {want:?}"
        ));
    }
    for c in &m.counters {
        if !c.overrun && !c.overran && c.used + c.reserved > c.limit {
            return Err(format!("model broke I1 on {c:?}"));
        }
    }
    Ok(())
}

/// Random sequences of admit / reserve (model and tool) / commit / release / unknown /
/// heartbeat / finish / clock moves / sweep / reopen against the store and the reference
/// model: every answer, the usage of every session, every reservation and the summary agree
/// after every operation, and I1 and I2 hold throughout. `PROPTEST_CASES` overrides the
/// number of cases.
pub async fn model_based(b: &dyn Backend) {
    model_based_with(b, false).await;
}

/// [`model_based`] with the session budget in dry-run: steps past it are granted and reported,
/// the counter is marked overrun, and conservation holds as before.
pub async fn model_based_dry_run(b: &dyn Backend) {
    model_based_with(b, true).await;
}

async fn model_based_with(b: &dyn Backend, session_dry: bool) {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES);
    let config = Config {
        cases,
        source_file: Some(file!()),
        ..Config::default()
    };
    let handle = tokio::runtime::Handle::current();
    let strategy = proptest::collection::vec(op(), 1..=OPS_MAX);
    let result = tokio::task::block_in_place(|| {
        let mut runner = TestRunner::new(config);
        runner.run(&strategy, |ops| {
            handle.block_on(run_case(b, &ops, session_dry))
        })
    });
    if let Err(e) = result {
        panic!("model-based test failed: {e}");
    }
}
