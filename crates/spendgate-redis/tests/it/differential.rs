//! The redis scripts against the reference semantics: the same random command sequences go
//! to a `MemoryStore` (a plain `Ledger`) and to a `RedisStore` on one hand-driven clock, and
//! every answer must be identical (values, refusals with messages, errors, `ledger_seq`,
//! `changed`).

use crate::support::*;
use spendgate_core::*;
use spendgate_store::{ManualClock, MemoryStore, Store};

use std::sync::Arc;

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
}

fn budget(amount: u64, window: Window) -> Budget {
    Budget::new(Micros(amount), window)
}

fn rate(count: u64, period_ms: u64, burst: u64) -> Option<Rate> {
    Some(Rate {
        count,
        period_ms,
        burst,
    })
}

fn bounds(shrink: bool) -> RunBounds {
    RunBounds {
        max_input_bytes: 1000,
        max_context_tokens: 400,
        max_output_tokens: 50,
        max_tool_result_bytes: 1000,
        max_model_rounds: 3,
        max_tool_calls: 2,
        max_retries: 1,
        max_seconds: 60,
        max_cost: Micros(1500),
        shrink_to_fit: shrink,
        min_output_tokens: 5,
    }
}

fn policy(variant: u8) -> Policy {
    let mut p = Policy {
        global: ScopePolicy {
            budgets: vec![budget(8000, Window::Day), budget(20_000, Window::Month)],
            rate: rate(20, 1000, 10),
            concurrency: Some(6),
            dry_run: false,
            rate_dry_run: false,
            concurrency_dry_run: false,
        },
        ip: ScopePolicy {
            budgets: vec![budget(4000, Window::Day)],
            rate: rate(2, 1000, 2),
            concurrency: Some(3),
            dry_run: false,
            rate_dry_run: false,
            concurrency_dry_run: false,
        },
        session: ScopePolicy {
            budgets: vec![budget(3000, Window::Day)],
            rate: rate(10, 60_000, 4),
            concurrency: Some(2),
            dry_run: false,
            rate_dry_run: false,
            concurrency_dry_run: false,
        },
        conversation: ScopePolicy {
            budgets: vec![budget(2000, Window::Day)],
            rate: None,
            concurrency: Some(1),
            dry_run: false,
            rate_dry_run: false,
            concurrency_dry_run: false,
        },
        run: bounds(true),
        mode: ReservationMode::PerStep,
        lease_ttl_ms: 5000,
        session_create_per_ip: rate(3, 10_000, 3),
        session_create_global: rate(10, 10_000, 6),
    };
    match variant {
        1 => {
            p.mode = ReservationMode::WholeRun;
            p.run.shrink_to_fit = false;
        }
        2 => {
            p.global.budgets = vec![
                budget(6000, Window::Hour),
                budget(9000, Window::Lifetime),
                budget(7000, Window::Month),
            ];
            p.global.rate = None;
            p.ip.rate = None;
            p.session.rate = None;
            p.conversation.concurrency = Some(2);
            p.session_create_per_ip = None;
        }
        3 => {
            // Dry-run: the ip, session and conversation limits report instead of refusing;
            // the global ones stay enforced.
            p.ip.dry_run = true;
            p.session.dry_run = true;
            p.conversation.dry_run = true;
        }
        4 => {
            // Dry-run on single limits: the address's rate, the session's cap, the global
            // month budget and the session's day budget (its hour budget enforced); every
            // other limit enforced.
            p.ip.rate_dry_run = true;
            p.session.concurrency_dry_run = true;
            p.global.budgets[1].dry_run = true;
            p.session.budgets = vec![
                Budget {
                    dry_run: true,
                    ..budget(1500, Window::Day)
                },
                budget(2500, Window::Hour),
            ];
        }
        _ => {}
    }
    p
}

const SESSIONS: &[&str] = &["s0", "s1", "s2", "s|3"];
const CONVS: &[&str] = &["c0", "c1", "c2", "c3", "c4"];
const PREFIXES: &[&str] = &[
    "10.0.0.1/32",
    "10.0.0.2/32",
    "2001:db8::/64",
    "2001:db8::/48",
];

fn ips(r: &mut Rng) -> Vec<IpScope> {
    let n = if r.chance(5) {
        r.below(6)
    } else {
        1 + r.below(2)
    };
    (0..n)
        .map(|_| IpScope {
            prefix: r.pick(PREFIXES).to_string(),
            factor: r.pick(&[0u64, 1, 1, 1, 4]),
        })
        .collect()
}

fn idem(r: &mut Rng, pct: u64, ns: &str) -> Option<IdempotencyKey> {
    r.chance(pct).then(|| IdempotencyKey {
        key: if r.chance(2) {
            String::new()
        } else {
            format!("{ns}:k{}", r.below(8))
        },
        fingerprint: {
            let n = if r.chance(90) { 1 } else { 2 };
            format!("f{}", r.below(n))
        },
    })
}

fn scope(r: &mut Rng) -> ScopeKey {
    match r.below(6) {
        0 => ScopeKey::global(),
        1 => ScopeKey::new(ScopeKind::Ip, r.pick(PREFIXES)),
        2 => ScopeKey::new(ScopeKind::Session, r.pick(SESSIONS)),
        3 => ScopeKey::new(ScopeKind::Conversation, r.pick(CONVS)),
        4 => ScopeKey::new(ScopeKind::Run, "r1"),
        _ => ScopeKey::new(ScopeKind::Session, "nobody"),
    }
}

struct Gen {
    r: Rng,
    runs: u64,
    steps: u64,
    /// Runs admitted and steps reserved lately (learnt from the reference answers).
    admitted: Vec<RunId>,
    reserved: Vec<ReservationId>,
}

impl Gen {
    fn observe(&mut self, reply: &Result<Reply, spendgate_store::StoreError>) {
        match reply {
            Ok(Reply::Run(a)) => {
                if let Ok(r) = &a.value {
                    self.admitted.push(r.run_id.clone());
                }
            }
            Ok(Reply::Step(a)) => {
                if let Ok(s) = &a.value {
                    self.reserved.push(s.step_id.clone());
                }
            }
            _ => {}
        }
        if self.admitted.len() > 6 {
            self.admitted.remove(0);
        }
        if self.reserved.len() > 10 {
            self.reserved.remove(0);
        }
    }
    fn run(&mut self) -> RunId {
        if !self.admitted.is_empty() && self.r.chance(85) {
            let i = self.r.below(self.admitted.len() as u64) as usize;
            return self.admitted[i].clone();
        }
        if self.runs == 0 || self.r.chance(3) {
            return RunId(format!("r{}", self.runs + 5));
        }
        RunId(format!("r{}", self.r.below(self.runs)))
    }
    fn step(&mut self) -> ReservationId {
        if !self.reserved.is_empty() && self.r.chance(75) {
            let i = self.r.below(self.reserved.len() as u64) as usize;
            return self.reserved[i].clone();
        }
        if self.r.chance(3) {
            return ReservationId(format!("r{}.hold", self.r.below(self.runs.max(1))));
        }
        if self.steps == 0 || self.r.chance(3) {
            return ReservationId(format!("x{}", self.steps + 7));
        }
        ReservationId(format!("x{}", self.r.below(self.steps)))
    }

    fn admit_run(&mut self) -> Command {
        let run_id = if self.r.chance(90) {
            self.runs += 1;
            RunId(format!("r{}", self.runs - 1))
        } else {
            RunId(format!("r{}", self.r.below(self.runs.max(1))))
        };
        let r = &mut self.r;
        Command::AdmitRun {
            req: RunRequest {
                run_id,
                session: r.pick(SESSIONS).to_string(),
                ips: ips(r),
                conversation: r.pick(CONVS).to_string(),
                input_bytes: if r.chance(5) { 5000 } else { r.below(900) },
            },
            idem: idem(r, 30, "run"),
        }
    }

    fn reserve_step(&mut self) -> Command {
        let run_id = self.run();
        let step_id = if self.r.chance(92) {
            self.steps += 1;
            ReservationId(format!("x{}", self.steps - 1))
        } else {
            self.step()
        };
        let r = &mut self.r;
        let kind = if r.chance(65) {
            StepKind::Model {
                model: "m".into(),
                price: ModelPrice {
                    input_per_million: Micros(r.pick(&[0, 1_500_000, 2_000_000, 333_333])),
                    cached_input_per_million: Micros(1_000_000),
                    output_per_million: Micros(r.pick(&[0, 4_000_000, 7_500_001])),
                },
                prompt_tokens: if r.chance(5) { 1000 } else { r.below(300) },
                max_output_tokens: if r.chance(40) {
                    None
                } else {
                    Some(r.below(80))
                },
                retry: r.chance(20),
            }
        } else {
            StepKind::Tool {
                tool: "t".into(),
                price: ToolPrice {
                    per_call: Micros(r.below(300)),
                    per_unit: Micros(r.below(60)),
                },
                units: r.below(6),
            }
        };
        Command::ReserveStep {
            req: StepRequest {
                run_id,
                step_id,
                kind,
            },
            idem: idem(r, 15, "step"),
        }
    }

    fn resolve(&mut self) -> Command {
        let step = self.step();
        let r = &mut self.r;
        let how = match r.below(6) {
            0 | 1 => Resolution::Commit(Settlement::Tokens(TokenUsage {
                prompt_tokens: r.below(320),
                completion_tokens: {
                    let n = if r.chance(10) { 400 } else { 60 };
                    r.below(n)
                },
                cached_tokens: r.below(200),
            })),
            2 => Resolution::Commit(if r.chance(50) {
                Settlement::Units(r.below(10))
            } else {
                Settlement::ResultBytes(r.below(2000))
            }),
            3 => Resolution::Release,
            _ => Resolution::Unknown,
        };
        Command::Resolve { step, how }
    }

    fn command(&mut self) -> Command {
        let r = &mut self.r;
        match r.below(100) {
            0..=14 => self.admit_run(),
            15..=44 => self.reserve_step(),
            45..=64 => self.resolve(),
            65..=69 => Command::Heartbeat { run: self.run() },
            70..=74 => Command::Finish { run: self.run() },
            75..=78 => Command::CreateSession {
                ips: ips(r),
                dry: r.below(2) == 0,
            },
            79..=81 => {
                let n = r.below(4);
                Command::Usage {
                    scopes: (0..n).map(|_| (scope(r), 1 + r.below(2) * 3)).collect(),
                }
            }
            82..=83 => Command::SetCutoff {
                engaged: r.chance(15),
                reason: format!("reason {}", r.below(2)),
            },
            84..=86 => Command::Adjust {
                scope: scope(r),
                factor: [1, 1, 4, 16][r.below(4) as usize],
                amount: r.below(6000) as i64 - 3000,
                // (a few keys: repeats and conflicts)
                once: r.chance(30).then(|| format!("adj{}", r.below(4))),
            },
            87 => Command::Summary,
            88..=89 => Command::Reservations {
                state: if r.chance(50) {
                    None
                } else {
                    ReservationState::parse(r.pick(&[
                        "held",
                        "committed",
                        "released",
                        "unknown",
                        "expired",
                    ]))
                },
                limit: r.below(15) as usize,
            },
            90..=91 => Command::TopCounters {
                kind: if r.chance(50) {
                    None
                } else {
                    ScopeKind::parse(r.pick(&["global", "ip", "session", "conversation", "run"]))
                },
                top: r.below(12) as usize,
            },
            92..=95 => Command::Sweep,
            _ => Command::ConsumeOnce {
                key: format!("c{}", r.below(5)),
                ttl_ms: r.below(20_000),
            },
        }
    }

    fn advance(&mut self) -> u64 {
        let r = &mut self.r;
        match r.below(100) {
            0..=69 => 0,
            70..=94 => r.below(1500),
            95..=97 => 5000 + r.below(60_000),
            _ => r.pick(&[3_600_000, 86_400_000, 31 * 86_400_000, 2_000_000]),
        }
    }
}

type Seen = std::collections::BTreeMap<String, usize>;

/// `batched`: the commands go to redis in batches of 1 to 6 (`execute_many`, one script
/// call), the clock still between batches, while the core executes them one by one.
async fn differential(variant: u8, seed: u64, ops: usize, batched: bool, seen: &mut Seen) {
    let server = server(false);
    // 2026-11-30T23:40:00Z: month, day and hour windows turn over during the run.
    let clock = ManualClock::new(UnixMs(1_796_082_000_000));
    let policy = policy(variant);
    let memory = MemoryStore::new(policy.clone(), Arc::new(clock.clone()));
    let redis = open(
        options(
            &server,
            &fresh_prefix("diff"),
            Some(Arc::new(clock.clone())),
        ),
        policy,
    )
    .await;
    let mut g = Gen {
        r: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
        runs: 0,
        steps: 0,
        admitted: Vec::new(),
        reserved: Vec::new(),
    };
    let mut log = Vec::new();
    let mut i = 0;
    while i < ops {
        let size = if batched {
            1 + g.r.below(6) as usize
        } else {
            1
        };
        let (mut cmds, mut wants) = (Vec::new(), Vec::new());
        for _ in 0..size {
            let cmd = g.command();
            let want = memory.execute(cmd.clone()).await;
            log.push(format!("{}: {cmd:?}", i + cmds.len()));
            *seen.entry(outcome(&want)).or_default() += 1;
            g.observe(&want);
            cmds.push(cmd);
            wants.push(want);
        }
        let gots = if batched {
            redis.execute_many(cmds.clone()).await
        } else {
            let mut v = Vec::new();
            for cmd in &cmds {
                v.push(redis.execute(cmd.clone()).await);
            }
            v
        };
        assert_eq!(gots.len(), wants.len(), "one answer per command");
        for (j, (want, got)) in wants.iter().zip(&gots).enumerate() {
            if want != got {
                let tail = log[log.len().saturating_sub(12)..].join("\n");
                panic!(
                    "variant {variant} seed {seed}: answers differ at op {}\n--- last commands:\n{tail}\n--- memory:\n{want:#?}\n--- redis:\n{got:#?}",
                    i + j
                );
            }
        }
        i += cmds.len();
        let ms = g.advance();
        if ms > 0 {
            clock.advance_ms(ms);
            log.push(format!("   advance {ms} ms"));
        }
    }
    // The final state must agree in full, too.
    for cmd in [
        Command::Summary,
        Command::Reservations {
            state: None,
            limit: 100_000,
        },
        Command::TopCounters {
            kind: None,
            top: 100_000,
        },
    ] {
        assert_eq!(
            memory.execute(cmd.clone()).await,
            redis.execute(cmd.clone()).await,
            "final {cmd:?}"
        );
    }
}

/// A coarse label of an answer, to check what a random sequence covered.
fn outcome(r: &Result<Reply, spendgate_store::StoreError>) -> String {
    let refused = |r: &Refusal| format!("refused {}", r.code.name());
    match r {
        Err(e) => format!("error {}", e.to_string().split(' ').next().unwrap_or("")),
        Ok(Reply::Run(a)) => a.value.as_ref().map_or_else(refused, |r| match &r.dry_run {
            None => "run ok".into(),
            Some(d) => format!("run ok, dry-run {}", d.code.name()),
        }),
        Ok(Reply::Step(a)) => a.value.as_ref().map_or_else(refused, |s| match &s.dry_run {
            None => if s.shrunk { "step shrunk" } else { "step ok" }.into(),
            Some(d) => format!("step ok, dry-run {}", d.code.name()),
        }),
        Ok(Reply::Session(a)) => a
            .value
            .as_ref()
            .map_or_else(refused, |_| "session ok".into()),
        Ok(Reply::Resolved(a)) => format!("resolved {}", a.value.state.name()),
        Ok(Reply::Finished(_)) => "finished".into(),
        Ok(Reply::Swept(a)) if a.value > 0 => "swept".into(),
        Ok(other) => format!("{other:?}")
            .split('(')
            .next()
            .unwrap_or("")
            .to_string(),
    }
}

/// Runs a variant over several seeds and checks that together they reached the interesting
/// paths (not only errors).
async fn variant(variant: u8, seeds: std::ops::RangeInclusive<u64>, extra: &[&str]) {
    variant_run(variant, seeds, false, extra).await;
}

async fn variant_run(
    variant: u8,
    seeds: std::ops::RangeInclusive<u64>,
    batched: bool,
    extra: &[&str],
) {
    let mut seen = Seen::new();
    for seed in seeds {
        differential(variant, seed, 3000, batched, &mut seen).await;
    }
    println!("variant {variant}: {seen:?}");
    let common = [
        "run ok",
        "step ok",
        "session ok",
        "refused budget_exhausted",
        "refused concurrency_limited",
        "refused run_bound_exceeded",
        "refused context_too_large",
        "refused payload_too_large",
        "refused cutoff_engaged",
        "resolved committed",
        "resolved released",
        "resolved unknown",
        "finished",
        "swept",
        "error idempotency",
        "error invalid",
    ];
    for must in common.iter().chain(extra) {
        assert!(
            seen.contains_key(*must),
            "variant {variant} never saw {must:?}: {seen:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_answers_as_the_core_per_step_with_shrink() {
    variant(0, 1..=3, &["step shrunk", "refused rate_limited"]).await;
}

/// `execute_many` as one script call answers each command as the core does one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_answer_as_the_core_one_by_one() {
    variant_run(0, 31..=32, true, &["step shrunk"]).await;
    variant_run(1, 47..=47, true, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_answers_as_the_core_whole_run() {
    variant(1, 11..=13, &["refused rate_limited"]).await;
}

/// Limits in dry-run (ip, session, conversation) report what they would refuse, the same way
/// on both, while the global limits still refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_answers_as_the_core_with_limits_in_dry_run() {
    variant(
        3,
        51..=53,
        &[
            "run ok, dry-run rate_limited",
            "run ok, dry-run concurrency_limited",
            "step ok, dry-run budget_exhausted",
            "step shrunk",
        ],
    )
    .await;
}

/// Single limits in dry-run (a rate, a cap, one budget of a scope whose other budget is
/// enforced) report the same way on both, and every other limit refuses the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_answers_as_the_core_with_single_limits_in_dry_run() {
    variant(
        4,
        61..=63,
        &[
            "run ok, dry-run rate_limited",
            "run ok, dry-run concurrency_limited",
            "step ok, dry-run budget_exhausted",
            "refused rate_limited",
            "refused concurrency_limited",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_answers_as_the_core_hour_month_lifetime() {
    variant(2, 21..=23, &["step shrunk"]).await;
}

/// A value of a random magnitude: 0, small, around 10^6, 2^32, 2^53 or anything up to u64::MAX.
fn magnitude(r: &mut Rng, cap: u64) -> u64 {
    let v = match r.below(9) {
        0 => 0,
        1 => 1 + r.below(9),
        2 => r.below(1000),
        3 => r.below(2_000_000),
        4 => 999_999 + r.below(3),
        5 => r.below(1 << 32),
        6 => r.below(MICROS_MAX.0) + 1,
        7 => r.next(),
        _ => u64::MAX - r.below(2),
    };
    v.min(cap)
}

async fn money_case(shrink: bool, seed: u64) {
    let server = server(false);
    let clock = ManualClock::new(UnixMs(1_800_000_000_000));
    let mut r = Rng(seed | 1);
    let policy = money_policy(shrink);
    let memory = MemoryStore::new(policy.clone(), Arc::new(clock.clone()));
    let redis = open(
        options(
            &server,
            &fresh_prefix("money"),
            Some(Arc::new(clock.clone())),
        ),
        policy,
    )
    .await;
    let mut seen = Seen::new();
    for i in 0..400 {
        for cmd in money_run(&mut r, i, shrink) {
            let want = memory.execute(cmd.clone()).await;
            let got = redis.execute(cmd.clone()).await;
            assert_eq!(want, got, "seed {seed}, {cmd:?}");
            *seen.entry(outcome(&want)).or_default() += 1;
        }
    }
    println!("money (shrink {shrink}): {seen:?}");
    if shrink {
        assert!(seen.contains_key("step shrunk"), "{seen:?}");
    }
}

/// No scope limits, run bounds at the largest amounts (or, with `shrink`, a cost bound that
/// output bounds are shrunk to fit).
fn money_policy(shrink: bool) -> Policy {
    Policy {
        global: ScopePolicy::default(),
        ip: ScopePolicy::default(),
        session: ScopePolicy::default(),
        conversation: ScopePolicy::default(),
        run: RunBounds {
            max_input_bytes: MICROS_MAX.0,
            max_context_tokens: MICROS_MAX.0,
            max_output_tokens: if shrink {
                1_000_000_000_000_000
            } else {
                MICROS_MAX.0
            },
            max_tool_result_bytes: 1000,
            max_model_rounds: 1_000_000,
            max_tool_calls: 1_000_000,
            max_retries: 1_000_000,
            max_seconds: 1_000_000,
            max_cost: if shrink {
                Micros(123_456_789_012)
            } else {
                MICROS_MAX
            },
            shrink_to_fit: shrink,
            min_output_tokens: 0,
        },
        mode: ReservationMode::PerStep,
        lease_ttl_ms: 1_000_000_000,
        session_create_per_ip: None,
        session_create_global: None,
    }
}

/// One run of [`money_case`]: admitted, its steps of random magnitudes reserved and committed
/// (with `shrink`, three, only the last committed), finished.
fn money_run(r: &mut Rng, i: usize, shrink: bool) -> Vec<Command> {
    let run = format!("run{i}");
    let mut cmds = vec![Command::AdmitRun {
        req: RunRequest {
            run_id: RunId(run.clone()),
            session: "s".into(),
            ips: vec![IpScope {
                prefix: "p".into(),
                factor: 1,
            }],
            conversation: "c".into(),
            input_bytes: 1,
        },
        idem: None,
    }];
    let model = r.chance(75);
    let steps = if shrink { 3 } else { 1 };
    for j in 0..steps {
        let kind = if model {
            StepKind::Model {
                model: "m".into(),
                price: ModelPrice {
                    input_per_million: Micros(magnitude(r, MICROS_MAX.0)),
                    cached_input_per_million: Micros(magnitude(r, MICROS_MAX.0)),
                    output_per_million: Micros(magnitude(r, MICROS_MAX.0)),
                },
                prompt_tokens: magnitude(r, u64::MAX),
                max_output_tokens: r.chance(70).then(|| magnitude(r, u64::MAX)),
                retry: false,
            }
        } else {
            StepKind::Tool {
                tool: "t".into(),
                price: ToolPrice {
                    per_call: Micros(magnitude(r, MICROS_MAX.0)),
                    per_unit: Micros(magnitude(r, MICROS_MAX.0)),
                },
                units: magnitude(r, u64::MAX),
            }
        };
        let step = ReservationId(format!("{run}.{j}"));
        cmds.push(Command::ReserveStep {
            req: StepRequest {
                run_id: RunId(run.clone()),
                step_id: step.clone(),
                kind,
            },
            idem: None,
        });
        let how = if model {
            Settlement::Tokens(TokenUsage {
                prompt_tokens: magnitude(r, u64::MAX),
                completion_tokens: magnitude(r, u64::MAX),
                cached_tokens: magnitude(r, u64::MAX),
            })
        } else {
            Settlement::Units(magnitude(r, u64::MAX))
        };
        if !shrink || j == steps - 1 {
            cmds.push(Command::Resolve {
                step,
                how: Resolution::Commit(how),
            });
        }
    }
    cmds.push(Command::Finish {
        run: RunId(run.clone()),
    });
    cmds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn money_math_is_exact_at_every_magnitude() {
    money_case(false, 7).await;
    money_case(false, 8).await;
    money_case(true, 9).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_windows_match_the_core_across_centuries() {
    let server = server(false);
    let clock = ManualClock::new(UnixMs(0));
    let mut p = policy(2);
    p.global.budgets = vec![
        budget(1000, Window::Hour),
        budget(1000, Window::Day),
        budget(1000, Window::Month),
    ];
    p.session.budgets = p.global.budgets.clone();
    let memory = MemoryStore::new(p.clone(), Arc::new(clock.clone()));
    let redis = open(
        options(&server, &fresh_prefix("cal"), Some(Arc::new(clock.clone()))),
        p,
    )
    .await;
    let mut r = Rng(99);
    // Sorted random instants from 1970 to about 2400, plus month and year edges.
    let mut times: Vec<u64> = (0..1500).map(|_| r.below(13_600_000_000_000)).collect();
    for y in [1970i64, 1999, 2000, 2024, 2100, 2399] {
        for m in 1..=12u32 {
            let edge = spendgate_core::window::days_from_civil(y, m, 1) as u64 * 86_400_000;
            times.extend([edge.saturating_sub(1), edge, edge + 1]);
        }
    }
    times.sort_unstable();
    let scopes = vec![
        (ScopeKey::global(), 1),
        (ScopeKey::new(ScopeKind::Session, "s"), 1),
    ];
    for (i, t) in times.into_iter().enumerate() {
        clock.set(UnixMs(t));
        let mut cmds = vec![Command::Usage {
            scopes: scopes.clone(),
        }];
        if i % 3 == 0 {
            cmds.push(Command::Adjust {
                scope: ScopeKey::new(ScopeKind::Session, "s"),
                factor: 1,
                amount: 5,
                once: None,
            });
        }
        if i % 7 == 0 {
            cmds.push(Command::Sweep);
        }
        for cmd in cmds {
            assert_eq!(
                memory.execute(cmd.clone()).await,
                redis.execute(cmd.clone()).await,
                "at {t} ms: {cmd:?}"
            );
        }
    }
}
