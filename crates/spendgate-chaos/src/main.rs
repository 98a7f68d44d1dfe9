//! `spendgate-chaos`: the chaos run from the command line (`scripts/chaos.sh` builds and runs
//! it). Exits 0 when every check held, 1 on any violation, 2 when the run could not be made.

use clap::Parser;
use spendgate_chaos::schedule::FaultSet;
use spendgate_chaos::{run, Options};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "spendgate-chaos",
    about = "Replicas, Redis and the mock upstream under scheduled faults; the books checked \
             against what the upstream served"
)]
struct Cli {
    /// Seconds of load (the run takes up to about a minute more).
    #[arg(long)]
    seconds: u64,
    /// The seed of the fault schedule and of the guests' choices.
    #[arg(long)]
    seed: u64,
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Simulated guests.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Fault kinds: all, none, or a list of kill, pause, restart, flood, slow, drop, 5xx,
    /// nousage, overbound, disconnect, vanish.
    #[arg(long, default_value = "all")]
    faults: String,
    /// The spendgate binary (default: next to this one).
    #[arg(long)]
    spendgate: Option<PathBuf>,
    /// The redis-server binary (default: /usr/bin/redis-server, else on PATH).
    #[arg(long, env = "SPENDGATE_CHAOS_REDIS")]
    redis_server: Option<PathBuf>,
    /// Connections of each flood.
    #[arg(long, default_value_t = 8_300)]
    flood_connections: usize,
    /// Switch on a planted bug in the replicas (see docs/chaos.md); the run should fail.
    #[arg(long)]
    plant: Option<String>,
    /// Write the replicas' and Redis's logs and the table here.
    #[arg(long)]
    logs: Option<PathBuf>,
    /// Faults of each scheduled kind (default: one per 120 s of load, at least one).
    #[arg(long)]
    per_kind: Option<usize>,
    /// Chance that a run's backend vanishes after one of its decision steps.
    #[arg(long, default_value_t = 0.05)]
    vanish: f64,
    /// Chance that a guest leaves a proxied stream after its first chunk.
    #[arg(long, default_value_t = 0.1)]
    disconnect: f64,
    /// Chance that the upstream generates beyond the bound it was given.
    #[arg(long, default_value_t = 0.05)]
    overbound: f64,
    /// Serve every call as reserved (one-byte messages, answers as long as their bound), so
    /// budgets are spent to within one step.
    #[arg(long)]
    tight: bool,
    /// When the operator books spend so that the global budget runs out, as a share of the
    /// load's time; `none` for never.
    #[arg(long, default_value = "0.8")]
    squeeze_at: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let faults = match FaultSet::parse(&cli.faults) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("spendgate-chaos: --faults: {e}");
            return ExitCode::from(2);
        }
    };
    let spendgate = cli.spendgate.unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("spendgate")))
            .unwrap_or_else(|| PathBuf::from("spendgate"))
    });
    let mut opts = Options::new(cli.seconds, cli.seed, spendgate);
    opts.replicas = cli.replicas;
    opts.clients = cli.clients;
    opts.faults = faults;
    opts.redis_server = cli.redis_server;
    opts.flood_connections = cli.flood_connections;
    opts.plant = cli.plant;
    opts.logs = cli.logs;
    opts.per_kind = cli.per_kind;
    for (name, p) in [
        ("vanish", cli.vanish),
        ("disconnect", cli.disconnect),
        ("overbound", cli.overbound),
    ] {
        if !(0.0..=1.0).contains(&p) {
            eprintln!("spendgate-chaos: --{name} is a chance, 0 to 1");
            return ExitCode::from(2);
        }
    }
    opts.knobs.vanish = cli.vanish;
    opts.knobs.disconnect = cli.disconnect;
    opts.knobs.overbound = cli.overbound;
    opts.knobs.tight = cli.tight;
    match cli.squeeze_at.as_str() {
        "none" => opts.squeeze = false,
        s => {
            match s.parse::<f64>() {
                Ok(at) if (0.0..=1.0).contains(&at) => opts.squeeze_at = at,
                _ => {
                    eprintln!("spendgate-chaos: --squeeze-at is a share of the load's time (0 to 1), or none");
                    return ExitCode::from(2);
                }
            }
        }
    }
    let mut out = std::io::stdout();
    match run(opts, &mut out).await {
        Ok(o) if o.totals.violations == 0 => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("spendgate-chaos: {e}");
            ExitCode::from(2)
        }
    }
}
