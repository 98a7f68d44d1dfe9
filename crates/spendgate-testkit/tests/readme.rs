//! README.md's demo and walkthrough, run as written, so that they cannot rot.
//!
//! README marks what is run with HTML comments (invisible on the rendered page):
//!
//! - `<!-- walkthrough:start NAME -->` … `<!-- walkthrough:end -->` is a walkthrough. Its
//!   fenced ```` ```sh ```` blocks are run in order, verbatim, in one `bash -euo pipefail` in a
//!   fresh empty directory (variables set by one block are seen by the next), and its
//!   ```` ```python ```` blocks with the Python that has the official `openai` client. Fenced
//!   `text` and `json` blocks are shown, not run; any other language inside a walkthrough is
//!   an error (so that a block is never skipped by accident).
//! - `<!-- walkthrough:expect TEXT -->` after a block: the block's output (stdout and stderr)
//!   must contain TEXT. Every block that is run has at least one.
//! - `<!-- walkthrough:server -->` before a `sh` block: the block starts a server and keeps
//!   running; it is started in the background (its expectations are checked on its output),
//!   and the next block runs once the server answers `/healthz`, as a reader would switch to
//!   a second terminal.
//! - `<!-- walkthrough:demo-output -->` before a `text` block: what `spendgate demo` prints,
//!   compared line by line with what it really prints (tokens, numbers and the ledger's path
//!   aside).
//!
//! The `serve` walkthrough starts its own server (its server block). The `demo` walkthrough
//! runs against `spendgate demo --listen 127.0.0.1:PORT` started by this test (README's
//! `spendgate demo` on a free port); the service token the demo printed is given to its blocks
//! as `SPENDGATE_TOKEN`, as README tells the reader to. Blocks read the port from `PORT`
//! (`${PORT:-8080}`), which the test sets to a free port.
//!
//! The `spendgate` binary must be built (`cargo build --bin spendgate`; `cargo test
//! --workspace` builds it); its directory comes first on `PATH`, so the blocks' `spendgate` is
//! the one of this workspace. Every process a walkthrough starts is in one process group,
//! killed when the test ends, whatever its outcome. Needs `bash`, `curl`, `jq` and `openssl`
//! (scripts/test.sh installs them).

#![allow(clippy::too_many_lines)] // test code: the 100-line bound is for production code

use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{kill_process_group, test_kill_process_group, Pid, Signal};
use spendgate_testkit::{free_port, wait_for_port, workspace_bin, ChildGuard};

const README: &str = include_str!("../../../README.md");
const README_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");

/// The longest a whole walkthrough may take (its blocks are a few seconds; a debug build and a
/// busy machine are slower).
const WALKTHROUGH_TIME_MAX: Duration = Duration::from_secs(300);
/// The longest a server block may take to answer `/healthz` (tenths of a second).
const SERVER_START_TENTHS_MAX: u32 = 900;
/// How long the demo may take to print where it is.
const DEMO_START_MAX: Duration = Duration::from_secs(90);
/// Between SIGTERM and SIGKILL of a walkthrough's process group.
const TERMINATE_GRACE: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Lang {
    Sh,
    Python,
}

#[derive(Debug)]
struct Block {
    lang: Lang,
    text: String,
    /// Starts a server that keeps running.
    server: bool,
    expects: Vec<String>,
    /// README line of the opening fence, for messages.
    line: usize,
}

#[derive(Debug)]
struct Walkthrough {
    name: String,
    blocks: Vec<Block>,
}

#[derive(Debug, Default)]
struct Marked {
    walkthroughs: Vec<Walkthrough>,
    demo_output: Option<Vec<String>>,
}

impl Marked {
    fn walkthrough(&self, name: &str) -> &Walkthrough {
        self.walkthroughs
            .iter()
            .find(|w| w.name == name)
            .unwrap_or_else(|| panic!("README.md has no `<!-- walkthrough:start {name} -->`"))
    }
}

/// What a line of README is to the parser.
enum Directive<'a> {
    Start(&'a str),
    End,
    Server,
    Expect(&'a str),
    DemoOutput,
}

fn directive(line: &str) -> Result<Option<Directive<'_>>, String> {
    let Some(rest) = line.trim().strip_prefix("<!-- walkthrough:") else {
        return Ok(None);
    };
    let body = rest
        .strip_suffix("-->")
        .ok_or_else(|| format!("a walkthrough comment must end on its line: {line:?}"))?
        .trim();
    let (word, arg) = body.split_once(' ').unwrap_or((body, ""));
    let arg = arg.trim();
    match (word, arg.is_empty()) {
        ("start", false) => Ok(Some(Directive::Start(arg))),
        ("end", true) => Ok(Some(Directive::End)),
        ("server", true) => Ok(Some(Directive::Server)),
        ("expect", false) => Ok(Some(Directive::Expect(arg))),
        ("demo-output", true) => Ok(Some(Directive::DemoOutput)),
        _ => Err(format!(
            "unknown or malformed walkthrough comment: {line:?}"
        )),
    }
}

/// Reads the marks and blocks of a README. Errors name the line.
fn parse(text: &str) -> Result<Marked, String> {
    let mut marked = Marked::default();
    let mut open: Option<Walkthrough> = None;
    let mut server_next = false;
    let mut demo_output_next = false;
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    while let Some((n, line)) = lines.next() {
        let at = |e: String| format!("README.md:{n}: {e}");
        if let Some(fence) = line.strip_prefix("```") {
            let lang = fence.trim();
            let mut body = String::new();
            let mut closed = false;
            for (_, l) in lines.by_ref() {
                if l.trim_end() == "```" {
                    closed = true;
                    break;
                }
                body.push_str(l);
                body.push('\n');
            }
            if !closed {
                return Err(at(format!("the ```{lang} block is never closed")));
            }
            if std::mem::take(&mut demo_output_next) {
                if lang != "text" {
                    return Err(at(
                        "walkthrough:demo-output must precede a ```text block".into()
                    ));
                }
                marked.demo_output = Some(body.lines().map(str::to_string).collect());
            }
            let server = std::mem::take(&mut server_next);
            let Some(w) = open.as_mut() else {
                if server {
                    return Err(at("walkthrough:server outside a walkthrough".into()));
                }
                continue;
            };
            let lang = match lang {
                "sh" => Lang::Sh,
                "python" => Lang::Python,
                "text" | "json" if !server => continue,
                other => {
                    return Err(at(format!(
                        "a walkthrough runs ```sh and ```python blocks and shows ```text and \
                         ```json ones; ```{other} here would be neither run nor meant to be shown"
                    )))
                }
            };
            if server && lang != Lang::Sh {
                return Err(at("a server block must be ```sh".into()));
            }
            w.blocks.push(Block {
                lang,
                text: body,
                server,
                expects: Vec::new(),
                line: n,
            });
            continue;
        }
        let Some(d) = directive(line).map_err(at)? else {
            continue;
        };
        match d {
            Directive::Start(name) => {
                if let Some(w) = &open {
                    return Err(at(format!("walkthrough {} is not ended", w.name)));
                }
                if marked.walkthroughs.iter().any(|w| w.name == name) {
                    return Err(at(format!("a second walkthrough named {name}")));
                }
                open = Some(Walkthrough {
                    name: name.to_string(),
                    blocks: Vec::new(),
                });
            }
            Directive::End => {
                let w = open
                    .take()
                    .ok_or_else(|| at("walkthrough:end without a start".into()))?;
                if let Some(b) = w.blocks.iter().find(|b| b.expects.is_empty()) {
                    return Err(format!(
                        "README.md:{}: a walkthrough block without a walkthrough:expect after it",
                        b.line
                    ));
                }
                marked.walkthroughs.push(w);
            }
            Directive::Server => server_next = true,
            Directive::DemoOutput => demo_output_next = true,
            Directive::Expect(text) => {
                let block = open
                    .as_mut()
                    .and_then(|w| w.blocks.last_mut())
                    .ok_or_else(|| {
                        at("walkthrough:expect before any block of a walkthrough".into())
                    })?;
                block.expects.push(text.to_string());
            }
        }
    }
    if let Some(w) = open {
        return Err(format!("walkthrough {} is never ended", w.name));
    }
    if server_next || demo_output_next {
        return Err("a walkthrough:server or demo-output mark with no block after it".into());
    }
    Ok(marked)
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The one script that runs a walkthrough's blocks in order, each one's output in
/// `meta/N.out`, the number of the block under way in `meta/at`.
fn script(w: &Walkthrough, meta: &Path, python: Option<&Path>) -> Result<String, String> {
    let m = |name: String| sh_quote(&meta.join(name).to_string_lossy());
    let mut s = String::from("set -euo pipefail\nshopt -s inherit_errexit\n");
    for (i, b) in w.blocks.iter().enumerate() {
        let _ = writeln!(s, "echo {i} > {}", m("at".into()));
        let out = m(format!("{i}.out"));
        match (b.lang, b.server) {
            (Lang::Sh, false) => {
                let _ = write!(s, "{{\n{}\n}} > {out} 2>&1\n", b.text);
            }
            (Lang::Sh, true) => {
                // In the background, as in a terminal of its own; the next block waits until
                // it answers (or stops at once if it exits).
                let _ = write!(
                    s,
                    "(\n{}\n) > {out} 2>&1 &\nserver=$!\n\
                     for _ in $(seq {SERVER_START_TENTHS_MAX}); do\n\
                     \x20 curl -s -o /dev/null \"http://127.0.0.1:$PORT/healthz\" && break\n\
                     \x20 kill -0 \"$server\" 2>/dev/null || {{ echo 'the server block exited' >&2; exit 97; }}\n\
                     \x20 sleep 0.1\n\
                     done\n\
                     curl -s -o /dev/null \"http://127.0.0.1:$PORT/healthz\" \
                     || {{ echo 'the server never answered /healthz' >&2; exit 98; }}\n",
                    b.text
                );
            }
            (Lang::Python, _) => {
                let python = python.ok_or("a python block needs a Python with `openai`")?;
                let file = meta.join(format!("{i}.py"));
                std::fs::write(&file, &b.text).map_err(|e| format!("{}: {e}", file.display()))?;
                let _ = writeln!(
                    s,
                    "{} {} > {out} 2>&1",
                    sh_quote(&python.to_string_lossy()),
                    sh_quote(&file.to_string_lossy())
                );
            }
        }
    }
    let _ = writeln!(s, "echo done > {}", m("at".into()));
    Ok(s)
}

/// A walkthrough's `bash` and everything it started, in its own process group: SIGTERM to the
/// group, then SIGKILL, on drop.
struct Group {
    child: Child,
    pgid: Pid,
}

impl Group {
    fn spawn(mut cmd: Command) -> Group {
        cmd.process_group(0);
        let child = cmd.spawn().expect("spawning bash");
        let pgid = Pid::from_raw(i32::try_from(child.id()).expect("a pid fits i32"))
            .expect("a child's pid is positive");
        Group { child, pgid }
    }

    /// Waits for `bash` itself, at most `limit`: its exit status, or None if it timed out.
    fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let until = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = kill_process_group(self.pgid, Signal::TERM);
        let until = Instant::now() + TERMINATE_GRACE;
        // (signal 0: is any process of the group left)
        while test_kill_process_group(self.pgid).is_ok() && Instant::now() < until {
            let _ = self.child.try_wait();
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = kill_process_group(self.pgid, Signal::KILL);
        let _ = self.child.wait();
    }
}

fn read(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Runs a walkthrough in a fresh directory; Err says which block failed or missed what.
fn run(w: &Walkthrough, env: &[(&str, String)], python: Option<&Path>) -> Result<(), String> {
    let work = tempfile::Builder::new()
        .prefix("spendgate-readme-")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let meta = tempfile::Builder::new()
        .prefix("spendgate-readme-meta-")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let text = script(w, meta.path(), python)?;
    let script_path = meta.path().join("walkthrough.sh");
    std::fs::File::create(&script_path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| e.to_string())?;
    let log = std::fs::File::create(meta.path().join("bash.out")).map_err(|e| e.to_string())?;
    let mut cmd = Command::new("bash");
    cmd.arg(&script_path)
        .current_dir(work.path())
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut group = Group::spawn(cmd);
    let status = group.wait(WALKTHROUGH_TIME_MAX);
    let at = read(&meta.path().join("at")).trim().to_string();
    let output = |i: usize| read(&meta.path().join(format!("{i}.out")));
    let server_output = || {
        w.blocks
            .iter()
            .position(|b| b.server)
            .map(|i| format!("\n--- the server's output ---\n{}", output(i)))
            .unwrap_or_default()
    };
    if !status.is_some_and(|s| s.success()) || at != "done" {
        let failed = at
            .parse::<usize>()
            .ok()
            .and_then(|i| w.blocks.get(i).map(|b| (i, b)));
        let what = match status {
            None => format!("did not end within {WALKTHROUGH_TIME_MAX:?}"),
            Some(s) => format!("failed ({s})"),
        };
        return Err(match failed {
            Some((i, b)) => format!(
                "walkthrough {}: the block at README.md:{} {what}:\n{}\n--- its output ---\n{}\
                 --- bash ---\n{}{}",
                w.name,
                b.line,
                b.text,
                output(i),
                read(&meta.path().join("bash.out")),
                server_output()
            ),
            None => format!(
                "walkthrough {} {what} before its first block:\n{}",
                w.name,
                read(&meta.path().join("bash.out"))
            ),
        });
    }
    let mut missing = String::new();
    for (i, b) in w.blocks.iter().enumerate() {
        let out = output(i);
        for e in b.expects.iter().filter(|e| !out.contains(e.as_str())) {
            let _ = writeln!(
                missing,
                "README.md:{}: the block's output lacks {e:?}:\n{}--- its output ---\n{out}",
                b.line, b.text
            );
        }
    }
    drop(group);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("walkthrough {}:\n{missing}", w.name))
    }
}

fn spendgate_dir() -> PathBuf {
    let bin = workspace_bin("spendgate").unwrap_or_else(|e| {
        panic!("{e}\n(`cargo build --bin spendgate` builds it; `cargo test --workspace` does too)")
    });
    bin.parent()
        .expect("a binary has a directory")
        .to_path_buf()
}

/// `PATH` with the workspace's `spendgate` first, after checking the tools the blocks use.
fn path_with_spendgate() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    for tool in ["bash", "curl", "jq", "openssl"] {
        let found = std::env::split_paths(&path).any(|d| d.join(tool).is_file());
        assert!(
            found,
            "`{tool}` is not on PATH; README's walkthrough uses it: apt-get install -y {tool} \
             (scripts/test.sh installs it)"
        );
    }
    format!("{}:{path}", spendgate_dir().display())
}

/// The Python that has the official `openai` package: `SPENDGATE_TEST_PYTHON`, else the
/// workspace's `.venv` (both made by `scripts/test.sh`).
fn test_python() -> PathBuf {
    let p = std::env::var_os("SPENDGATE_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"));
    assert!(
        p.exists(),
        "no Python with the `openai` package at {}: set SPENDGATE_TEST_PYTHON, or at the \
         workspace root run: python3 -m venv .venv && .venv/bin/pip install openai",
        p.display()
    );
    p
}

fn base_env(port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("PATH", path_with_spendgate()),
        ("PORT", port.to_string()),
        // (curl and the Python clients must not send loopback calls to a proxy)
        ("NO_PROXY", "127.0.0.1,localhost".to_string()),
        ("no_proxy", "127.0.0.1,localhost".to_string()),
        ("RUST_LOG", "info".to_string()),
    ]
}

/// A line of the demo's output with what changes from run to run replaced: the tokens, the
/// ledger's path, every number.
fn shape(line: &str) -> String {
    let mut line = line.trim_end().to_string();
    if let Some(i) = line.find("token: ") {
        let from = i + "token: ".len();
        let to = line[from..].find(')').map_or(line.len(), |j| from + j);
        line.replace_range(from..to, "TOKEN");
    }
    if let Some(i) = line.find("ledger: ") {
        line.replace_range(i + "ledger: ".len().., "PATH");
    }
    let mut out = String::new();
    let mut in_number = false;
    for c in line.chars() {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            out.push(c);
            in_number = false;
        }
    }
    out
}

fn readme() -> Marked {
    parse(README).unwrap_or_else(|e| panic!("{e} ({README_PATH})"))
}

#[test]
fn readme_walkthrough_runs_as_written() {
    let marked = readme();
    let w = marked.walkthrough("serve");
    assert_eq!(
        w.blocks.iter().filter(|b| b.server).count(),
        1,
        "the serve walkthrough starts its server in one block marked walkthrough:server"
    );
    let env = base_env(free_port());
    if let Err(e) = run(w, &env, None) {
        panic!("{e}");
    }
}

#[test]
fn readme_demo_runs_as_written() {
    let marked = readme();
    let w = marked.walkthrough("demo");
    assert!(
        w.blocks.iter().all(|b| !b.server),
        "the demo walkthrough runs against the demo this test starts"
    );
    let shown = marked
        .demo_output
        .as_ref()
        .expect("README.md shows what `spendgate demo` prints (walkthrough:demo-output)");
    let python = test_python();
    let port = free_port();
    let mut env = base_env(port);
    let ledger = tempfile::tempdir().expect("temp dir");
    let mut demo = Command::new(spendgate_dir().join("spendgate"));
    demo.args(["demo", "--listen", &format!("127.0.0.1:{port}"), "--db"])
        .arg(ledger.path().join("demo.db"));
    let demo = ChildGuard::spawn(demo).expect("starting spendgate demo");
    wait_for_port(port, DEMO_START_MAX)
        .unwrap_or_else(|e| panic!("{e}\n--- the demo's output ---\n{}", demo.output()));

    // What it printed: its lines from the first one README shows, as many as README shows.
    let first = shown.first().map(|l| shape(l)).unwrap_or_default();
    let until = Instant::now() + DEMO_START_MAX;
    let printed: Vec<String> = loop {
        let out = demo.output();
        let lines: Vec<String> = out
            .lines()
            .skip_while(|l| shape(l) != first)
            .take(shown.len())
            .map(str::to_string)
            .collect();
        if lines.len() == shown.len() || Instant::now() > until {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let want: Vec<String> = shown.iter().map(|l| shape(l)).collect();
    let got: Vec<String> = printed.iter().map(|l| shape(l)).collect();
    assert_eq!(
        got,
        want,
        "README.md shows other lines than `spendgate demo` prints (numbers, tokens and the \
         ledger's path aside)\n--- the demo's output ---\n{}",
        demo.output()
    );
    let token = printed
        .iter()
        .find_map(|l| {
            let from = l.find("service token: ")? + "service token: ".len();
            let to = l[from..].find(')')? + from;
            Some(l[from..to].to_string())
        })
        .expect("the demo prints its service token");
    env.push(("SPENDGATE_TOKEN", token));

    let result = run(w, &env, Some(&python));
    if let Err(e) = result {
        panic!("{e}\n--- the demo's output ---\n{}", demo.output());
    }
}

/// The runner itself fails a walkthrough whose block fails or misses its expected output,
/// and the parser refuses marks it cannot run unambiguously.
#[test]
fn a_walkthrough_that_does_not_print_what_readme_says_fails() {
    let env = vec![("PORT", "1".to_string())];
    let ok = parse(
        "<!-- walkthrough:start t -->\n```sh\nX=hi\n```\n<!-- walkthrough:expect x -->\n\
         ```sh\necho \"$X there\"\n```\n<!-- walkthrough:expect hi there -->\n\
         <!-- walkthrough:end -->\n",
    )
    .expect("parses");
    assert_eq!(ok.walkthroughs[0].blocks.len(), 2);
    // The first block prints nothing, so its "x" is missing: that alone must fail the run.
    let e = run(&ok.walkthroughs[0], &env, None).expect_err("an expectation is missing");
    assert!(e.contains("lacks \"x\""), "{e}");
    assert!(
        !e.contains("hi there"),
        "the second block's expectation holds: {e}"
    );

    let failing = parse(
        "<!-- walkthrough:start t -->\n```sh\necho before\nfalse\necho after\n```\n\
         <!-- walkthrough:expect after -->\n<!-- walkthrough:end -->\n",
    )
    .expect("parses");
    let e = run(&failing.walkthroughs[0], &env, None).expect_err("a command fails");
    assert!(e.contains("failed") && e.contains("before"), "{e}");

    for (bad, why) in [
        (
            "<!-- walkthrough:start t -->\n```sh\ntrue\n```\n<!-- walkthrough:end -->\n",
            "expect",
        ),
        (
            "<!-- walkthrough:start t -->\n```bash\ntrue\n```\n",
            "```bash",
        ),
        (
            "<!-- walkthrough:start t -->\n```sh\ntrue\n```\n<!-- walkthrough:expect x -->\n",
            "never ended",
        ),
        ("<!-- walkthrough:expect x -->\n", "before any block"),
        ("<!-- walkthrough:begin t -->\n", "unknown"),
        ("<!-- walkthrough:server -->\n```sh\ntrue\n```\n", "outside"),
    ] {
        let e = parse(bad).expect_err(bad);
        assert!(e.contains(why), "{bad:?}: {e}");
    }
    assert_eq!(shape("  ledger: /tmp/x-12.db"), "  ledger: PATH");
    assert_eq!(
        shape("  a: http://127.0.0.1:8080/v1  (service token: demo-service-ab12)"),
        "  a: http://N.N.N.N:N/vN  (service token: TOKEN)"
    );
}
