//! The chaos run in the test command: a short run with every fault kind (its table printed,
//! every check held), and each check shown to catch a planted bug (`plants`).
//!
//! The runs use the `spendgate` binary of this build (`target/<profile>/spendgate`, which a
//! workspace build compiles with the `planted-bugs` feature this crate turns on) and a
//! private `redis-server` each. The short run runs alone; the small targeted runs two at a
//! time (they mostly wait: on leases, on the upstream).

mod plants;

use spendgate_chaos::{run, Options, Outcome};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Chaos runs at once in this process: a targeted run takes one permit, the short run all.
pub const PERMITS: u32 = 2;
pub static RUNS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(PERMITS as usize);

/// The sources the `spendgate` binary is built from.
const SOURCES: [&str; 14] = [
    "spendgate/src",
    "spendgate-ops/src",
    "spendgate-http/src",
    "spendgate-wire/src",
    "spendgate-listener/src",
    "spendgate-telemetry/src",
    "spendgate-proxy/src",
    "spendgate-config/src",
    "spendgate-tokens/src",
    "spendgate-core/src",
    "spendgate-store/src",
    "spendgate-redis/src",
    "spendgate-mock-upstream/src",
    "spendgate/Cargo.toml",
];

fn newest(path: &Path) -> Option<SystemTime> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_file() {
        return meta.modified().ok();
    }
    std::fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| newest(&e.path()))
        .max()
}

/// How to build the binary these tests need.
const BUILD: &str = "build it with `cargo build -p spendgate -p spendgate-chaos` (the \
    workspace's tests build it; `cargo build -p spendgate` or `cargo test -p spendgate` alone builds \
    it without the planted bugs)";

/// The `spendgate` binary next to this test's, refused when it is older than its sources
/// (`cargo test -p spendgate-chaos` alone does not build it; `cargo test --workspace` does)
/// or built without the planted-bug switches.
pub fn spendgate() -> PathBuf {
    let bin =
        spendgate_testkit::workspace_bin("spendgate").unwrap_or_else(|e| panic!("{e}: {BUILD}"));
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .expect("the binary's time");
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for s in SOURCES {
        if let Some(t) = newest(&crates.join(s)) {
            assert!(
                t <= built,
                "{} is older than crates/{s}: {BUILD}",
                bin.display()
            );
        }
    }
    let image = std::fs::read(&bin).expect("the binary");
    let banner = b"PLANTED BUG ACTIVE";
    assert!(
        image.windows(banner.len()).any(|w| w == banner),
        "{} has no planted-bug switches: {BUILD}",
        bin.display()
    );
    bin
}

/// Runs `opts`, its output into a buffer; returns the outcome and the output.
pub async fn run_quiet(opts: Options) -> (Outcome, String) {
    let mut out: Vec<u8> = Vec::new();
    let mut w = std::io::Cursor::new(&mut out);
    let outcome = run(opts, &mut w).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    match outcome {
        Ok(o) => (o, text),
        Err(e) => panic!("the chaos run could not be made: {e}\n{text}"),
    }
}

/// Writes to the terminal even under the test harness's capture (which takes only the
/// `print!` family): the acceptance asks the test command to show the table.
pub fn show(text: &str) {
    let mut err = std::io::stderr();
    let _ = err.write_all(text.as_bytes());
    let _ = err.flush();
}

/// The acceptance run of the test command: 90 s of load (about 2 minutes in all), fixed
/// seed, 3 replicas, every fault kind; its table printed; every check holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_chaos_run_holds_every_check() {
    let _all = RUNS.acquire_many(PERMITS).await.expect("permits");
    let opts = Options::new(90, 18, spendgate());
    let mut out: Vec<u8> = Vec::new();
    let outcome = {
        let mut w = std::io::Cursor::new(&mut out);
        run(opts, &mut w).await
    };
    let text = String::from_utf8_lossy(&out).into_owned();
    show(&format!("\n{text}"));
    let outcome = outcome.unwrap_or_else(|e| panic!("the chaos run could not be made: {e}"));
    assert!(
        outcome.table.ends_with("overspend=0 lost=0 violations=0\n"),
        "the short chaos run found violations:\n{}",
        outcome.table
    );
}
