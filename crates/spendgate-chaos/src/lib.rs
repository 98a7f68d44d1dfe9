//! The chaos run (issue 18, point 8): R replicas of the real `spendgate serve` on a private
//! `redis-server` (AOF, `appendfsync always`), the mock upstream, and M simulated guests
//! running multi-step agent runs through the proxy and the decision API, while faults
//! scheduled from a seed hit the replicas, Redis, the upstream and the listener. At the end
//! the load stops, the leases are left to expire, and the books are checked against the
//! upstream's own record of what it served (see `docs/chaos.md` for each check).
//!
//! Bounded in count and time: the load runs `seconds`, the end waits a bounded time for the
//! leases, every call has a timeout, every flood a count. Loopback only.

pub mod checks;
pub mod cluster;
mod flood;
pub mod guest;
mod observe;
pub mod record;
pub mod report;
pub mod schedule;

use crate::checks::{Check, End, Inputs, Usage};
use crate::cluster::{lock, Budgets, Cluster, ADMIN_TOKEN, LEASE_TTL};
use crate::guest::{Ctx, Knobs};
use crate::observe::{admin_get, Observed};
use crate::record::Record;
use crate::report::Totals;
use crate::schedule::{Event, FaultKind, FaultSet};
use serde_json::{json, Value};
use spendgate_core::{parse_amount, Micros, ModelPrice};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What stops a run before it can check anything.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error("setting up the run: {0}")]
    Setup(String),
    #[error("injecting a fault: {0}")]
    Fault(String),
    #[error("writing the report: {0}")]
    Io(#[from] std::io::Error),
}

/// Most seconds of load a run takes.
pub const SECONDS_MAX: u64 = 24 * 3600;
/// Most guests.
pub const CLIENTS_MAX: usize = 1000;
/// Most replicas.
pub const REPLICAS_MAX: usize = 16;
/// Most connections a flood opens.
pub const FLOOD_CONNECTIONS_MAX: usize = 16_000;
/// How long the end waits for the guests' last runs, the last faults and the leases, at most.
const GUESTS_END_MAX: Duration = Duration::from_secs(60);
const FAULTS_END_MAX: Duration = Duration::from_secs(60);
/// The end waits the lease TTL, then until nothing is held, by default at most this long
/// past the TTL.
pub const LEASES_WAIT_MAX: Duration = Duration::from_secs(30);
/// The operator books spend against the global budget at this share of the run, leaving
/// about `SQUEEZE_LEFT` of spending, so the global budget runs out before the load stops.
pub const SQUEEZE_AT: f64 = 0.8;
const SQUEEZE_LEFT: Duration = Duration::from_secs(4);
/// The least the squeeze leaves (a few steps' worth).
const SQUEEZE_LEFT_MIN: u64 = 20_000;
/// Time between two polls of the reservations.
const OBSERVE_EVERY: Duration = Duration::from_millis(500);
/// Time between two progress lines.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// A run's options.
#[derive(Clone, Debug)]
pub struct Options {
    /// Seconds of load (the whole run takes up to about a minute more: start, end, checks).
    pub seconds: u64,
    pub seed: u64,
    pub replicas: usize,
    pub clients: usize,
    pub faults: FaultSet,
    /// The `spendgate` binary.
    pub spendgate: PathBuf,
    /// The `redis-server` binary (`None`: the testkit's default).
    pub redis_server: Option<PathBuf>,
    /// A planted bug (`SPENDGATE_PLANT`) for the replicas.
    pub plant: Option<String>,
    /// Connections a flood opens (the finding: 8,300).
    pub flood_connections: usize,
    pub knobs: Knobs,
    pub budgets: Budgets,
    /// Whether the operator books spend so that the global budget runs out, and when (a
    /// share of the load's time).
    pub squeeze: bool,
    pub squeeze_at: f64,
    /// Where to write the replicas' logs at the end.
    pub logs: Option<PathBuf>,
    /// Faults of each scheduled kind (`None`: one per `schedule::SECONDS_PER_FAULT` s).
    pub per_kind: Option<usize>,
    /// How long the end waits, past the lease TTL, for nothing to be held.
    pub lease_wait: Duration,
}

impl Options {
    /// The defaults of `scripts/chaos.sh` for `seconds` and `seed`.
    pub fn new(seconds: u64, seed: u64, spendgate: PathBuf) -> Options {
        Options {
            seconds,
            seed,
            replicas: 3,
            clients: 16,
            faults: FaultSet::all(),
            spendgate,
            redis_server: None,
            plant: None,
            flood_connections: 8_300,
            knobs: Knobs::default(),
            budgets: Budgets {
                global: Micros(1_000_000_000),
                ip: Micros(150_000),
                session: Micros(40_000),
            },
            squeeze: true,
            squeeze_at: SQUEEZE_AT,
            logs: None,
            per_kind: None,
            lease_wait: LEASES_WAIT_MAX,
        }
    }

    fn validate(&self) -> Result<(), ChaosError> {
        let bad = |m: String| Err(ChaosError::Setup(m));
        if self.seconds == 0 || self.seconds > SECONDS_MAX {
            return bad(format!("--seconds must be 1 to {SECONDS_MAX}"));
        }
        if self.clients == 0 || self.clients > CLIENTS_MAX {
            return bad(format!("--clients must be 1 to {CLIENTS_MAX}"));
        }
        if self.replicas == 0 || self.replicas > REPLICAS_MAX {
            return bad(format!("--replicas must be 1 to {REPLICAS_MAX}"));
        }
        if self.flood_connections > FLOOD_CONNECTIONS_MAX {
            return bad(format!(
                "--flood-connections is at most {FLOOD_CONNECTIONS_MAX}"
            ));
        }
        if !self.spendgate.is_file() {
            return bad(format!(
                "no spendgate binary at {} (build it: cargo build -p spendgate -p \
                 spendgate-chaos)",
                self.spendgate.display()
            ));
        }
        Ok(())
    }
}

/// What a run found.
#[derive(Debug)]
pub struct Outcome {
    pub schedule: Vec<Event>,
    pub checks: Vec<Check>,
    pub totals: Totals,
    /// The table as printed.
    pub table: String,
}

impl Outcome {
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
}

/// The model's price, as the replicas read it.
pub fn price() -> ModelPrice {
    let per_million = |s: &str| parse_amount(s).unwrap_or(Micros(u64::MAX));
    ModelPrice {
        input_per_million: per_million(cluster::INPUT_PER_MILLION),
        cached_input_per_million: per_million(cluster::CACHED_PER_MILLION),
        output_per_million: per_million(cluster::OUTPUT_PER_MILLION),
    }
}

/// Raises this process's soft limit on open files to its hard limit (a flood holds
/// thousands of connections).
fn raise_open_files() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let now = getrlimit(Resource::Nofile);
    if let (Some(cur), Some(max)) = (now.current, now.maximum) {
        if cur < max {
            let _ = setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(max),
                    maximum: Some(max),
                },
            );
        }
    }
}

/// Runs the chaos run described by `opts`, printing its schedule, progress and table to
/// `out`: start, load under faults, wind down, gather the evidence, check.
pub async fn run(opts: Options, out: &mut (dyn Write + Send)) -> Result<Outcome, ChaosError> {
    opts.validate()?;
    raise_open_files();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let schedule = schedule::schedule(
        opts.seconds,
        opts.seed,
        &opts.faults,
        opts.replicas,
        opts.per_kind,
    );
    writeln!(out, "{}", title(&opts, " of load"))?;
    writeln!(out, "schedule ({} faults):", schedule.len())?;
    for e in &schedule {
        writeln!(out, "  {e}")?;
    }
    out.flush()?;

    let (cluster, ctx) = start(&opts, &schedule).await?;
    let tasks = Tasks::spawn(&ctx, &cluster, &opts);
    load(&ctx, opts.seconds, out).await?;
    let mut notes = Vec::new();
    let (end, mut observed) = wind_down(&ctx, tasks, opts.lease_wait, &mut notes).await;
    last_look(&ctx, &mut observed).await;
    let usage = read_usage(&ctx).await;
    let served = cluster.mock.served();

    let rec = lock(&ctx.record);
    notes.extend(evidence_notes(&observed, &rec));
    let (mut checks, spend) = checks::run_checks(&Inputs {
        served: &served,
        record: &rec,
        observed: &observed,
        usage: &usage,
        end,
        price: price(),
    });
    if let Some(h) = checks.iter_mut().find(|c| c.name == "harness") {
        for e in &rec.fault_errors {
            h.violations += 1;
            h.examples.push(e.clone());
        }
    }
    let table = report::table(&title(&opts, ""), &rec, &spend, &checks, &notes);
    drop(rec);
    write!(out, "{table}")?;
    out.flush()?;
    if let Some(dir) = &opts.logs {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("replicas.log"), cluster.logs())?;
        std::fs::write(dir.join("redis.log"), lock(&cluster.redis).log())?;
        std::fs::write(dir.join("table.txt"), &table)?;
    }
    let totals = report::totals(&checks);
    Ok(Outcome {
        schedule,
        checks,
        totals,
        table,
    })
}

/// The run's title line.
fn title(opts: &Options, of_load: &str) -> String {
    format!(
        "chaos run: seed {}, {} s{of_load}, {} replicas, {} clients, faults {}{}",
        opts.seed,
        opts.seconds,
        opts.replicas,
        opts.clients,
        opts.faults,
        opts.plant
            .as_ref()
            .map(|p| format!(", PLANTED BUG {p}"))
            .unwrap_or_default()
    )
}

/// Redis, the replicas and the mock up; what the guests share.
async fn start(opts: &Options, schedule: &[Event]) -> Result<(Arc<Cluster>, Arc<Ctx>), ChaosError> {
    let cluster = Arc::new(
        Cluster::start(
            &opts.spendgate,
            opts.redis_server.clone(),
            opts.replicas,
            &opts.budgets,
            opts.plant.clone(),
        )
        .await?,
    );
    let client = |total: Option<Duration>| {
        let b = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .connect_timeout(Duration::from_secs(2));
        let b = match total {
            Some(t) => b.timeout(t),
            None => b,
        };
        b.build()
            .map_err(|e| ChaosError::Setup(format!("http client: {e}")))
    };
    let ctx = Arc::new(Ctx {
        bases: cluster.bases(),
        up: (0..opts.replicas).map(|_| AtomicBool::new(true)).collect(),
        mock_base: format!("http://127.0.0.1:{}", cluster.mock_port),
        http: client(None)?,
        upstream_http: client(Some(Duration::from_secs(20)))?,
        schedule: schedule.to_vec(),
        faults: opts.faults.clone(),
        knobs: opts.knobs.clone(),
        start: Instant::now(),
        stop: AtomicBool::new(false),
        record: Mutex::new(Record::default()),
        next_ip: AtomicUsize::new(opts.clients),
    });
    Ok((cluster, ctx))
}

/// The tasks of a run besides the driver's own.
struct Tasks {
    observer: tokio::task::JoinHandle<(Observed, observe::Limits)>,
    observer_stop: Arc<AtomicBool>,
    injector: tokio::task::JoinHandle<()>,
    squeeze: Option<tokio::task::JoinHandle<()>>,
    guests: tokio::task::JoinSet<()>,
}

impl Tasks {
    fn spawn(ctx: &Arc<Ctx>, cluster: &Arc<Cluster>, opts: &Options) -> Tasks {
        let observer_stop = Arc::new(AtomicBool::new(false));
        let mut guests = tokio::task::JoinSet::new();
        for g in 0..opts.clients {
            guests.spawn(guest::guest(ctx.clone(), g, opts.seed));
        }
        Tasks {
            observer: tokio::spawn(observe_loop(ctx.clone(), observer_stop.clone())),
            observer_stop,
            injector: tokio::spawn(inject(ctx.clone(), cluster.clone(), opts.flood_connections)),
            squeeze: opts
                .squeeze
                .then(|| tokio::spawn(squeeze(ctx.clone(), opts.seconds, opts.squeeze_at))),
            guests,
        }
    }
}

/// The load's time, with a progress line every [`PROGRESS_EVERY`].
async fn load(ctx: &Ctx, seconds: u64, out: &mut (dyn Write + Send)) -> Result<(), ChaosError> {
    let load_end = ctx.start + Duration::from_secs(seconds);
    while Instant::now() < load_end {
        let next = (Instant::now() + PROGRESS_EVERY).min(load_end);
        tokio::time::sleep_until(next.into()).await;
        let line = {
            let rec = lock(&ctx.record);
            format!(
                "  t={:>6.1}s  admitted {:?}  refused {}  no answer {}",
                ctx.start.elapsed().as_secs_f64(),
                rec.admitted,
                rec.refused.values().sum::<u64>(),
                rec.no_answer
            )
        };
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    Ok(())
}

/// The end: the guests finish their runs, the last faults end, the leases run out (all
/// bounded); returns the last summary and what the observer saw.
async fn wind_down(
    ctx: &Ctx,
    mut tasks: Tasks,
    lease_wait: Duration,
    notes: &mut Vec<String>,
) -> (End, Observed) {
    ctx.stop.store(true, Ordering::Relaxed);
    let guests_done = tokio::time::timeout(GUESTS_END_MAX, async {
        while tasks.guests.join_next().await.is_some() {}
    })
    .await;
    if guests_done.is_err() {
        notes.push(format!(
            "guests still busy {GUESTS_END_MAX:?} after the load stopped: aborted"
        ));
        tasks.guests.abort_all();
    }
    if let Some(s) = tasks.squeeze {
        let _ = s.await;
    }
    if tokio::time::timeout(FAULTS_END_MAX, tasks.injector)
        .await
        .is_err()
    {
        notes.push("the fault injector did not end in time".into());
    }
    let end = wait_for_leases(ctx, lease_wait).await;
    tasks.observer_stop.store(true, Ordering::Relaxed);
    let (observed, _) = tasks.observer.await.unwrap_or_default();
    (end, observed)
}

/// The last look at the reservations, once nothing moves, at the most rows (a failed
/// listing halves its rows: tried again).
async fn last_look(ctx: &Ctx, observed: &mut Observed) {
    let mut limits = observe::Limits::default().most();
    for _ in 0..4 {
        for base in &ctx.bases {
            if observe::poll(&ctx.http, base, observed, &mut limits).await {
                return;
            }
        }
    }
}

/// What the report should say about how whole the evidence is.
fn evidence_notes(observed: &Observed, rec: &Record) -> Vec<String> {
    let mut notes = Vec::new();
    if observed.gaps > 0 {
        notes.push(format!(
            "{} reservation listings came back full with their oldest row newer than the \
             state's previous listing: rows between may have been missed (books may fail \
             for it)",
            observed.gaps
        ));
    }
    if observed.failed_polls > 0 {
        notes.push(format!(
            "{} of {} reservation polls failed (a replica or Redis down, or a listing past \
             the store's timeout)",
            observed.failed_polls, observed.polls
        ));
    }
    if rec.squeeze_unknown {
        notes.push(
            "the global squeeze's outcome is unknown: the global books were not checked".into(),
        );
    }
    notes
}

/// Polls every reservation listing until told to stop; returns what it saw.
async fn observe_loop(ctx: Arc<Ctx>, stop: Arc<AtomicBool>) -> (Observed, observe::Limits) {
    let mut observed = Observed::default();
    let mut limits = observe::Limits::default();
    let mut next = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        // From a replica believed up; another one if it fails.
        for _ in 0..ctx.bases.len() {
            next = (next + 1) % ctx.bases.len();
            if !ctx.up[next].load(Ordering::Relaxed) {
                continue;
            }
            if observe::poll(&ctx.http, &ctx.bases[next], &mut observed, &mut limits).await {
                break;
            }
        }
        tokio::time::sleep(OBSERVE_EVERY.saturating_sub(started.elapsed())).await;
    }
    (observed, limits)
}

/// Injects the scheduled faults, each at its time.
async fn inject(ctx: Arc<Ctx>, cluster: Arc<Cluster>, flood_connections: usize) {
    for e in ctx.schedule.clone() {
        tokio::time::sleep_until((ctx.start + e.at).into()).await;
        lock(&ctx.record).inject(e.kind);
        if let Err(err) = inject_one(&ctx, &cluster, &e, flood_connections).await {
            lock(&ctx.record).fault_errors.push(format!("{e}: {err}"));
        }
    }
}

async fn inject_one(
    ctx: &Arc<Ctx>,
    cluster: &Arc<Cluster>,
    e: &Event,
    flood_connections: usize,
) -> Result<(), ChaosError> {
    match e.kind {
        FaultKind::Kill => {
            cluster.kill_replica(e.replica);
            ctx.up[e.replica].store(false, Ordering::Relaxed);
            tokio::time::sleep(e.len).await;
            if cluster.start_replica(e.replica).await.is_err() {
                // Once more (a port in use a moment longer); a second failure is reported.
                cluster.kill_replica(e.replica);
                tokio::time::sleep(Duration::from_secs(1)).await;
                cluster.start_replica(e.replica).await?;
            }
            ctx.up[e.replica].store(true, Ordering::Relaxed);
        }
        FaultKind::Pause => {
            cluster.with_redis(|r| r.pause()).await?;
            tokio::time::sleep(e.len).await;
            cluster.with_redis(|r| r.resume()).await?;
        }
        FaultKind::Restart => {
            cluster.with_redis(|r| r.stop()).await?;
            tokio::time::sleep(e.len).await;
            cluster.with_redis(|r| r.restart()).await?;
        }
        FaultKind::Flood => {
            let port = lock(&cluster.replicas[e.replica]).port;
            let target = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let base = ctx.bases[e.replica].clone();
            let until = Instant::now() + e.len;
            let probes = {
                let ctx = ctx.clone();
                tokio::spawn(async move { flood::probe(base, until, &ctx.record).await })
            };
            let (opened, failed) = flood::flood(target, flood_connections, e.len).await;
            let _ = probes.await;
            let mut rec = lock(&ctx.record);
            rec.flood_opened += opened;
            rec.flood_failed += failed;
        }
        // The guests read the upstream windows from the schedule.
        _ => {}
    }
    Ok(())
}

/// The operator books spend against the global budget so that about `SQUEEZE_LEFT` of
/// spending is left: the global budget then runs out under load and faults.
async fn squeeze(ctx: Arc<Ctx>, seconds: u64, share: f64) {
    let at = ctx.start + Duration::from_secs_f64(seconds as f64 * share.clamp(0.0, 1.0));
    tokio::time::sleep_until(at.into()).await;
    let mut global = None;
    for base in ctx.bases.iter().cycle().take(ctx.bases.len() * 3) {
        if let Some(v) = admin_get(&ctx.http, base, "/admin/v1/scopes?kind=global&top=10").await {
            global = v
                .get("scopes")
                .and_then(Value::as_array)
                .and_then(|rows| rows.first().cloned());
            if global.is_some() {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let Some(g) = global else {
        return;
    };
    let field = |k: &str| g.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (limit, used, reserved) = (
        field("limit_micros"),
        field("used_micros"),
        field("reserved_micros"),
    );
    let elapsed = ctx.start.elapsed().as_secs_f64().max(1.0);
    let left = ((used as f64 / elapsed) * SQUEEZE_LEFT.as_secs_f64()) as u64;
    let left = left.max(SQUEEZE_LEFT_MIN);
    let Some(amount) = limit
        .checked_sub(used + reserved + left)
        .and_then(|a| i64::try_from(a).ok())
        .filter(|a| *a > 0)
    else {
        return;
    };
    let body = json!({"scope": "global", "amount_micros": amount,
        "reason": "chaos run: the operator books spend so that the global budget runs out"});
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut i = 0usize;
    let mut tried = false;
    while Instant::now() < deadline {
        let base = &ctx.bases[i % ctx.bases.len()];
        i += 1;
        let r = ctx
            .http
            .post(format!("{base}/admin/v1/adjustments"))
            .bearer_auth(ADMIN_TOKEN)
            .header("idempotency-key", "chaos-squeeze")
            .timeout(Duration::from_secs(5))
            .json(&body)
            .send()
            .await;
        tried = true;
        match r {
            Ok(resp) if resp.status().is_success() => {
                lock(&ctx.record).squeeze = Some(amount);
                return;
            }
            // Refused outright: nothing applied.
            Ok(resp) if resp.status().is_client_error() => return,
            _ => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
    if tried {
        lock(&ctx.record).squeeze_unknown = true;
    }
}

/// Waits the lease TTL, then until nothing is held (bounded); returns the last summary.
async fn wait_for_leases(ctx: &Ctx, wait: Duration) -> End {
    tokio::time::sleep(LEASE_TTL + Duration::from_secs(1)).await;
    let until = Instant::now() + wait;
    let mut end = End::default();
    loop {
        for base in &ctx.bases {
            if let Some(v) = admin_get(&ctx.http, base, "/admin/v1/summary").await {
                end = End {
                    held: v
                        .pointer("/reservations/held")
                        .and_then(Value::as_u64)
                        .unwrap_or(0),
                    runs_active: v.get("runs_active").and_then(Value::as_u64).unwrap_or(0),
                    read: true,
                };
                break;
            }
        }
        if (end.read && end.held == 0 && end.runs_active == 0) || Instant::now() > until {
            return end;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Every session's, address's and the global usage line.
async fn read_usage(ctx: &Ctx) -> Usage {
    let sessions = lock(&ctx.record).sessions.clone();
    let mut usage = Usage::default();
    let mut tasks = tokio::task::JoinSet::new();
    let gate = Arc::new(tokio::sync::Semaphore::new(16));
    for (i, s) in sessions.into_iter().enumerate() {
        let http = ctx.http.clone();
        let bases = ctx.bases.clone();
        let gate = gate.clone();
        tasks.spawn(async move {
            let _permit = gate.acquire().await;
            for base in bases.iter().cycle().skip(i).take(bases.len() * 2) {
                if let Some(lines) = observe::usage(&http, base, &s.token, &s.ip).await {
                    return (i, s.ip, Some(lines));
                }
            }
            (i, s.ip, None)
        });
    }
    while let Some(Ok((i, ip, lines))) = tasks.join_next().await {
        for l in lines.into_iter().flatten() {
            match l.kind.as_str() {
                "global" => usage.global = Some(l),
                "session" => {
                    usage.sessions.insert(i, l);
                }
                "ip" => {
                    usage.ips.insert(ip.clone(), l);
                }
                _ => {}
            }
        }
    }
    usage
}
