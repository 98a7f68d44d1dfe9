//! The client libraries' own suites (clients/python, clients/typescript), run against this
//! build of the binary: each starts its servers from `SPENDGATE_BIN`, including the killed
//! agent whose held step expires and is charged in full.
//!
//! What they need (httpx, pytest, setuptools and wheel in `SPENDGATE_TEST_PYTHON`; Node 20 with
//! `npm ci` done in clients/typescript) is installed by scripts/test.sh. A missing one fails
//! with the command that installs it; nothing is skipped.

use crate::harness::{test_python, workspace_root};
use spendgate_testkit::ChildGuard;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// How long one client's whole suite may take (each test starts servers, and the killed-agent
/// and heartbeat cases wait out leases, on a machine that may be busy with the rest of the
/// workspace's tests).
const SUITE_TIME_MAX: Duration = Duration::from_secs(15 * 60);

/// Runs `cmd` in a process group of its own, to its end or for at most [`SUITE_TIME_MAX`];
/// then kills whatever of the group is left (the servers and agents it started): whether
/// it succeeded, and what it printed.
fn run_suite(mut cmd: Command) -> (bool, String) {
    cmd.process_group(0);
    let mut child = ChildGuard::spawn(cmd).expect("spawn the suite");
    let group = child.pid();
    let deadline = Instant::now() + SUITE_TIME_MAX;
    while child.is_running() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    // The group is ours: the suite and every process it started and did not reap.
    let _ = Command::new("sh")
        .args(["-c", &format!("kill -KILL -- -{group} 2>/dev/null")])
        .status();
    let status = child.exit_status();
    let timed_out = if status.is_none() {
        let _ = child.kill();
        format!("\n(killed after {SUITE_TIME_MAX:?})")
    } else {
        String::new()
    };
    let ok = status.is_some_and(|s| s.success());
    (ok, format!("{}{timed_out}", child.output()))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("dir entry");
        let name = entry.file_name();
        if name == "build" || name == "__pycache__" || name.to_string_lossy().ends_with(".egg-info")
        {
            continue;
        }
        let path = entry.path();
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&path, &to.join(&name));
        } else {
            std::fs::copy(&path, to.join(&name)).expect("copy");
        }
    }
}

pub(crate) fn python_has(python: &Path, modules: &str) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .status()
        .is_ok_and(|s| s.success())
}

/// `pip install ./clients/python` into a fresh directory, from a copy of the source (so the
/// build leaves nothing in the tree): the package as a user gets it, `py.typed` included.
pub(crate) fn install_python_client(python: &Path, into: &Path) -> PathBuf {
    let source = into.join("source");
    copy_dir(&workspace_root().join("clients/python"), &source);
    let target = into.join("site");
    let out = Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
        ])
        .arg("--target")
        .arg(&target)
        .arg(&source)
        .output()
        .expect("run pip");
    assert!(
        out.status.success(),
        "pip install clients/python failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        target.join("spendgate/py.typed").is_file(),
        "the installed package has no py.typed"
    );
    target
}

#[test]
fn python_client_suite_passes_against_the_binary() {
    let python = test_python();
    assert!(
        python_has(&python, "httpx, pytest, setuptools, wheel"),
        "{} lacks httpx, pytest, setuptools or wheel (the Python client's tests need them): \
         scripts/test.sh installs them, or run: {} -m pip install 'httpx>=0.24,<1' 'pytest>=7' \
         'setuptools>=61' wheel",
        python.display(),
        python.display()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let site = install_python_client(&python, dir.path());
    let mut cmd = Command::new(&python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
        .arg(dir.path().join("source/tests"))
        .current_dir(dir.path().join("source"))
        .env("PYTHONPATH", &site)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("SPENDGATE_REPO", workspace_root())
        .env("SPENDGATE_BIN", env!("CARGO_BIN_EXE_spendgate"));
    let (ok, out) = run_suite(cmd);
    assert!(ok, "the Python client's suite failed:\n{out}");
    assert!(
        !out.contains("skipped") && out.contains(" passed"),
        "the Python client's suite skipped tests or ran none:\n{out}"
    );
    eprintln!("{}", out.lines().last().unwrap_or(""));
}

/// Fails unless `node` on PATH is Node 20 or later (`who` needs it).
pub(crate) fn require_node(who: &str) {
    let version = Command::new("node")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| {
            panic!("no `node` on PATH: {who} need Node 20 or later and npm (apt-get install nodejs npm)")
        });
    let major: u32 = version
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    assert!(major >= 20, "node {version}: {who} need Node 20 or later");
}

#[test]
fn typescript_client_suite_passes_against_the_binary() {
    let ts = workspace_root().join("clients/typescript");
    require_node("the TypeScript client's tests");
    assert!(
        ts.join("node_modules/typescript").is_dir(),
        "clients/typescript has no node_modules: scripts/test.sh runs it, or run: \
         (cd clients/typescript && npm ci)"
    );
    let mut cmd = Command::new("npm");
    cmd.args(["test", "--silent"])
        .current_dir(&ts)
        .env("SPENDGATE_BIN", env!("CARGO_BIN_EXE_spendgate"));
    let (ok, out) = run_suite(cmd);
    assert!(ok, "the TypeScript client's suite failed:\n{out}");
    assert!(
        out.contains("# fail 0") && out.contains("# skipped 0") && out.contains("# todo 0"),
        "the TypeScript client's suite skipped tests or ran none:\n{out}"
    );
    assert!(
        !out.contains("# pass 0\n"),
        "the TypeScript client's suite ran no test:\n{out}"
    );
    eprintln!(
        "{}",
        out.lines()
            .filter(|l| l.starts_with("# "))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
