//! Throughput of reserve + commit pairs (one model step reserved, then committed with its
//! observed usage) on the memory and sqlite stores, from many concurrent tasks.
//!
//! On sqlite every reservation is fsynced before it is answered; concurrent callers share
//! group commits. Each task is one guest (its own ip, session and conversation, each with a
//! day budget, plus the global day and month budgets and the run's own counter), so each
//! reservation touches six counters. Runs are admitted before the timed part, and finished
//! and purged after it (the store's clock runs in real time and is moved past the record
//! retention between samples), so every sample measures a ledger of steady size.
//!
//! `cargo bench -p spendgate-store --bench store -- --warm-up-time 1 --measurement-time 5`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use spendgate_core::{
    Budget, IpScope, Micros, ModelPrice, Policy, ReservationId, ReservationMode, Resolution,
    RunBounds, RunId, RunRequest, ScopePolicy, Settlement, StepKind, StepRequest, TokenUsage,
    UnixMs, Window, RECORD_RETENTION_MS,
};
use spendgate_store::{Clock, MemoryStore, SqliteOptions, SqliteStore, Store};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Steps per run (the run's `max_model_rounds`).
const STEPS_PER_RUN: u64 = 16;
const T0: UnixMs = UnixMs(1_800_000_000_000);

fn policy() -> Policy {
    let day = |amount: u64| ScopePolicy {
        budgets: vec![Budget::new(Micros(amount), Window::Day)],
        rate: None,
        concurrency: None,
        dry_run: false,
        rate_dry_run: false,
        concurrency_dry_run: false,
    };
    let mut global = day(1_000_000_000_000);
    global
        .budgets
        .push(Budget::new(Micros(4_000_000_000_000), Window::Month));
    Policy {
        global,
        ip: day(100_000_000_000),
        session: day(100_000_000_000),
        conversation: day(100_000_000_000),
        run: RunBounds {
            max_model_rounds: STEPS_PER_RUN as u32,
            max_seconds: 3600,
            max_cost: Micros(1_000_000_000),
            ..RunBounds::default()
        },
        mode: ReservationMode::PerStep,
        lease_ttl_ms: 600_000,
        session_create_per_ip: None,
        session_create_global: None,
    }
}

fn run_request(task: u64, run: &str) -> RunRequest {
    RunRequest {
        run_id: RunId(run.to_string()),
        session: format!("session-{task}"),
        ips: vec![IpScope {
            prefix: format!("10.0.{task}.0/24"),
            factor: 1,
        }],
        conversation: format!("conversation-{task}"),
        input_bytes: 1000,
    }
}

fn step_request(run: &str, step: String) -> StepRequest {
    StepRequest {
        run_id: RunId(run.to_string()),
        step_id: ReservationId(step),
        kind: StepKind::Model {
            model: "mock-small".into(),
            price: ModelPrice {
                input_per_million: Micros(150_000),
                cached_input_per_million: Micros(75_000),
                output_per_million: Micros(600_000),
            },
            prompt_tokens: 1200,
            max_output_tokens: Some(512),
            retry: false,
        },
    }
}

/// Real time from `T0`, plus whatever the bench skips between samples.
#[derive(Clone)]
struct BenchClock(Arc<(Instant, AtomicU64)>);

impl BenchClock {
    fn skip_ms(&self, ms: u64) {
        self.0 .1.fetch_add(ms, Ordering::Relaxed);
    }
}

impl Clock for BenchClock {
    fn now(&self) -> UnixMs {
        let real = u64::try_from(self.0 .0.elapsed().as_millis()).unwrap_or(u64::MAX);
        T0.plus_ms(real).plus_ms(self.0 .1.load(Ordering::Relaxed))
    }
}

struct Fixture {
    rt: tokio::runtime::Runtime,
    store: Arc<dyn Store>,
    clock: BenchClock,
    /// Concurrent callers (tokio tasks).
    tasks: u64,
    /// Numbers the runs of each sample apart.
    sample: AtomicU64,
}

impl Fixture {
    fn new(tasks: u64, make: impl FnOnce(BenchClock) -> Arc<dyn Store>) -> Fixture {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let clock = BenchClock(Arc::new((Instant::now(), AtomicU64::new(0))));
        let store = make(clock.clone());
        Fixture {
            rt,
            store,
            clock,
            tasks,
            sample: AtomicU64::new(0),
        }
    }

    /// Runs `pairs` reserve + commit pairs spread over `self.tasks` tasks; returns the wall
    /// time of the pairs alone.
    fn pairs(&self, pairs: u64) -> Duration {
        let sample = self.sample.fetch_add(1, Ordering::Relaxed);
        self.rt.block_on(async {
            // Untimed: admit every run the sample needs.
            let mut plans = Vec::new();
            for task in 0..self.tasks {
                let steps = pairs / self.tasks + u64::from(task < pairs % self.tasks);
                let runs: Vec<String> = (0..steps.div_ceil(STEPS_PER_RUN))
                    .map(|r| format!("r{sample}-{task}-{r}"))
                    .collect();
                plans.push((task, steps, runs));
            }
            let mut admits = Vec::new();
            for (task, _, runs) in &plans {
                let (store, task, runs) = (self.store.clone(), *task, runs.clone());
                admits.push(tokio::spawn(async move {
                    for run in &runs {
                        let a = store
                            .admit_run(run_request(task, run), None)
                            .await
                            .expect("admit");
                        a.value.expect("admitted");
                    }
                }));
            }
            for a in admits {
                a.await.expect("admit task");
            }

            let start = Instant::now();
            let mut workers = Vec::new();
            for (_, steps, runs) in &plans {
                let (store, steps, runs) = (self.store.clone(), *steps, runs.clone());
                workers.push(tokio::spawn(async move {
                    for i in 0..steps {
                        let run = &runs[(i / STEPS_PER_RUN) as usize];
                        let step = format!("{run}.{}", i % STEPS_PER_RUN);
                        let r = store
                            .reserve_step(step_request(run, step), None)
                            .await
                            .expect("reserve");
                        let r = r.value.expect("reserved");
                        let usage = TokenUsage {
                            prompt_tokens: 1200,
                            completion_tokens: 300,
                            cached_tokens: 400,
                        };
                        store
                            .resolve(r.step_id, Resolution::Commit(Settlement::Tokens(usage)))
                            .await
                            .expect("commit");
                    }
                }));
            }
            for w in workers {
                w.await.expect("worker task");
            }
            let elapsed = start.elapsed();

            // Untimed: finish the runs and purge them, so the ledger does not grow.
            let mut finishes = Vec::new();
            for (_, _, runs) in plans {
                let store = self.store.clone();
                finishes.push(tokio::spawn(async move {
                    for run in runs {
                        store.finish(RunId(run)).await.expect("finish");
                    }
                }));
            }
            for f in finishes {
                f.await.expect("finish task");
            }
            self.clock.skip_ms(RECORD_RETENTION_MS + 1);
            self.store.sweep().await.expect("sweep");
            elapsed
        })
    }
}

fn reserve_commit(c: &mut Criterion) {
    let mut group = c.benchmark_group("reserve_commit");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);

    let memory = Fixture::new(64, |clock| {
        Arc::new(MemoryStore::new(policy(), Arc::new(clock)))
    });
    group.bench_function("memory/64_tasks", |b| b.iter_custom(|n| memory.pairs(n)));
    drop(memory);

    for tasks in [64, 256] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bench.sqlite");
        let sqlite = Fixture::new(tasks, |clock| {
            let store = SqliteStore::open(SqliteOptions::new(&path), policy(), Arc::new(clock))
                .expect("open sqlite");
            Arc::new(store)
        });
        group.bench_function(format!("sqlite/{tasks}_tasks"), |b| {
            b.iter_custom(|n| sqlite.pairs(n))
        });
    }
    group.finish();
}

criterion_group!(benches, reserve_commit);
criterion_main!(benches);
