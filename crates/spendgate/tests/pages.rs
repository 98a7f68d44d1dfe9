//! The two web pages in a real browser: `spendgate demo`'s chat page (`/demo/`) and the
//! operator dashboard (`/admin/`), driven by `tests/python/test_pages.py` with Selenium in a
//! headless Chromium (installed by `scripts/test.sh`).
//!
//! A test binary of its own: cargo runs test binaries one after the other, so the browser's
//! load never overlaps the timing-sensitive tests of `tests/it` (store pauses, alerts).

#[allow(dead_code, unused_macros)]
#[path = "it/harness.rs"]
mod harness;

use harness::{run_to_end, start_demo, test_python, workspace_root};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// A browser binary and its driver: `SPENDGATE_CHROMIUM` / `SPENDGATE_CHROMEDRIVER`, else
/// Debian's packages `chromium` and `chromium-driver`.
fn browser() -> (PathBuf, PathBuf) {
    let find = |var: &str, default: &str| {
        let p = std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from);
        assert!(
            p.exists(),
            "{} not found: install the browser for the page test with \
             `apt-get install chromium chromium-driver` (scripts/test.sh does), or set {var}",
            p.display()
        );
        p
    };
    (
        find("SPENDGATE_CHROMIUM", "/usr/bin/chromium"),
        find("SPENDGATE_CHROMEDRIVER", "/usr/bin/chromedriver"),
    )
}

/// The value after `marker` on the line of `output` that has it, up to `end`.
fn printed(output: &str, marker: &str, end: char) -> Option<String> {
    let line = output.lines().find(|l| l.contains(marker))?;
    let rest = &line[line.find(marker)? + marker.len()..];
    Some(rest.split(end).next()?.trim().to_string())
}

/// Acceptance of the pages: the demo chat page works with the cookie alone (answers shown
/// with what they were charged, streamed or not), the dashboard shows the spend and engages
/// and releases the kill switch, and chat is refused under it with nothing forwarded.
#[test]
fn demo_page_and_dashboard_work_in_a_browser() {
    let python = test_python();
    let (chromium, driver) = browser();
    let dir = tempfile::tempdir().expect("tempdir");
    let (demo, port) = start_demo(dir.path());
    // The banner is printed once the gateway listens.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (admin, mock) = loop {
        let out = demo.output();
        if let (Some(a), Some(m)) = (
            printed(&out, "(admin token: ", ')'),
            printed(&out, "built-in mock upstream: ", ' '),
        ) {
            break (a, m);
        }
        assert!(Instant::now() < deadline, "no demo banner:\n{out}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mock = mock.trim_end_matches("/v1").to_string();
    assert!(mock.starts_with("http://127.0.0.1:"), "{mock}");

    let mut cmd = Command::new(&python);
    cmd.arg(workspace_root().join("tests/python/test_pages.py"))
        .env("SPENDGATE_BASE", format!("http://127.0.0.1:{port}"))
        .env("SPENDGATE_ADMIN", &admin)
        .env("SPENDGATE_MOCK", &mock)
        .env(
            "SPENDGATE_ARTIFACTS",
            workspace_root().join("target/test-artifacts"),
        )
        .env("SPENDGATE_CHROMIUM", &chromium)
        .env("SPENDGATE_CHROMEDRIVER", &driver)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // The browser's profile and whatever else goes into the test's own temp dir.
        .env("TMPDIR", dir.path())
        .env("HOME", dir.path());
    let (ok, output) = run_to_end(cmd, Duration::from_secs(180));
    assert!(
        ok,
        "the page test failed (or ran past 180 s):\n{output}\n--- spendgate demo:\n{}",
        demo.output()
    );
    assert!(output.contains("11 passed, 0 failed"), "{output}");
}

#[test]
fn banner_values_are_read_from_the_right_line() {
    let out = "spendgate demo: open http://127.0.0.1:9/demo/\n  operator dashboard: http://127.0.0.1:9/admin/  (admin token: demo-admin-ab12)\n  built-in mock upstream: http://127.0.0.1:7/v1  (stats: /mock/stats)\n";
    assert_eq!(
        printed(out, "(admin token: ", ')').as_deref(),
        Some("demo-admin-ab12")
    );
    assert_eq!(
        printed(out, "built-in mock upstream: ", ' ').as_deref(),
        Some("http://127.0.0.1:7/v1")
    );
    assert_eq!(printed(out, "nothing like this", ' '), None);
}
