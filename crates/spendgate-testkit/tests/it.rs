//! Integration tests of the testkit itself. They start private redis-server
//! processes on free loopback ports (never the shared 127.0.0.1:6379).

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use rustix::process::{test_kill_process, Pid};
use spendgate_testkit::{
    free_port, wait_for_port, workspace_bin, ChildGuard, RedisOptions, RedisServer, RespValue,
    TestkitError,
};

fn pid_exists(pid: u32) -> bool {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .expect("a pid of a child");
    test_kill_process(pid).is_ok()
}

fn start(opts: RedisOptions) -> RedisServer {
    RedisServer::start(opts).unwrap_or_else(|e| panic!("starting redis-server: {e}"))
}

/// Raw inline PING with a read timeout; Ok(reply) or the io error.
fn raw_ping(port: u16, read_timeout: Duration) -> std::io::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(read_timeout))?;
    s.write_all(b"PING\r\n")?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Another process may take a port between `free_port` and the caller's bind (its docs say
/// to retry on "address in use"; a CI run once lost that race here): of three ports in a
/// row, at least one must bind, and none is 0 or the shared Redis port.
#[test]
fn free_port_is_bindable_loopback_and_not_6379() {
    let mut errors = Vec::new();
    for _ in 0..3 {
        let p = free_port();
        assert_ne!(p, 0);
        assert_ne!(p, 6379);
        match TcpListener::bind(("127.0.0.1", p)) {
            Ok(_) => return,
            Err(e) => errors.push((p, e)),
        }
    }
    panic!("no free port could be bound: {errors:?}");
}

#[test]
fn wait_for_port_succeeds_and_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    wait_for_port(port, Duration::from_secs(1)).expect("listener is up");
    drop(listener);

    let closed = free_port();
    let t = Instant::now();
    let err = wait_for_port(closed, Duration::from_millis(300)).expect_err("nothing listens");
    assert!(matches!(err, TestkitError::Timeout { .. }), "{err}");
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert!(t.elapsed() < Duration::from_secs(2));
}

#[test]
fn redis_basic_commands() {
    let redis = start(RedisOptions::default());
    assert_ne!(redis.port(), 6379);
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{}/0", redis.port()));
    assert!(redis.dir().is_dir());

    assert_eq!(redis.command(&["PING"]).expect("ping"), "PONG");
    assert_eq!(redis.command(&["SET", "k", "v 1"]).expect("set"), "OK");
    assert_eq!(redis.command(&["GET", "k"]).expect("get"), "v 1");
    assert_eq!(redis.command(&["GET", "missing"]).expect("get"), "(nil)");
    assert_eq!(redis.command(&["INCR", "n"]).expect("incr"), "1");
    assert_eq!(redis.command(&["INCRBY", "n", "41"]).expect("incrby"), "42");
    assert_eq!(
        redis.query(&["GET", "missing"]).expect("query"),
        RespValue::Bulk(None)
    );

    // Error replies become Err.
    let err = redis.command(&["INCR", "k"]).expect_err("not an integer");
    assert!(
        matches!(&err, TestkitError::Redis(m) if m.starts_with("ERR")),
        "{err}"
    );

    // Default policy and CONFIG SET/GET.
    assert_eq!(
        redis
            .command(&["CONFIG", "GET", "maxmemory-policy"])
            .expect("config get"),
        "maxmemory-policy\nnoeviction"
    );
    assert_eq!(
        redis
            .command(&["CONFIG", "GET", "appendonly"])
            .expect("config get"),
        "appendonly\nno"
    );
    assert_eq!(
        redis
            .command(&["CONFIG", "GET", "save"])
            .expect("config get"),
        "save\n"
    );
    redis
        .command(&["CONFIG", "SET", "maxmemory", "10mb"])
        .expect("config set");
    assert_eq!(
        redis
            .command(&["CONFIG", "GET", "maxmemory"])
            .expect("config get"),
        "maxmemory\n10485760"
    );

    assert!(redis
        .command(&["INFO", "server"])
        .expect("info")
        .contains(&format!("tcp_port:{}", redis.port())));
    assert_eq!(
        redis.command(&["SCRIPT", "FLUSH"]).expect("script flush"),
        "OK"
    );
    assert_eq!(
        redis.command(&["DEBUG", "SLEEP", "0"]).expect("debug"),
        "OK"
    );
    assert_eq!(redis.command(&["FLUSHALL"]).expect("flushall"), "OK");
    assert_eq!(redis.command(&["DBSIZE"]).expect("dbsize"), "0");
}

#[test]
fn redis_options_are_applied() {
    let redis = start(RedisOptions {
        appendonly: true,
        maxmemory_policy: Some("allkeys-lru".into()),
        extra_args: vec!["--maxmemory".into(), "5mb".into()],
        binary: None,
    });
    let get = |k: &str| redis.command(&["CONFIG", "GET", k]).expect("config get");
    assert_eq!(get("maxmemory-policy"), "maxmemory-policy\nallkeys-lru");
    assert_eq!(get("appendonly"), "appendonly\nyes");
    assert_eq!(get("appendfsync"), "appendfsync\nalways");
    assert_eq!(get("maxmemory"), "maxmemory\n5242880");
    assert_eq!(get("bind"), "bind\n127.0.0.1");
}

#[test]
fn a_missing_server_binary_is_named() {
    let err = RedisServer::start(RedisOptions {
        binary: Some("/nonexistent/valkey-server".into()),
        ..RedisOptions::default()
    })
    .expect_err("no such binary");
    assert!(
        err.to_string().contains("/nonexistent/valkey-server"),
        "{err}"
    );
}

#[test]
fn redis_bad_args_fail_with_log() {
    let err = RedisServer::start(RedisOptions {
        extra_args: vec!["--no-such-option".into(), "1".into()],
        ..RedisOptions::default()
    })
    .expect_err("bad option must fail");
    let msg = err.to_string();
    assert!(matches!(err, TestkitError::RedisStart { .. }), "{msg}");
    assert!(msg.contains("no-such-option"), "{msg}");
}

#[test]
fn redis_pause_and_resume() {
    let redis = start(RedisOptions::default());
    assert_eq!(
        raw_ping(redis.port(), Duration::from_millis(200)).expect("ping"),
        "+PONG\r\n"
    );

    redis.pause().expect("pause");
    let t = Instant::now();
    let err =
        raw_ping(redis.port(), Duration::from_millis(200)).expect_err("paused server answered");
    assert!(
        matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "unexpected error {err}"
    );
    assert!(t.elapsed() >= Duration::from_millis(190));
    let err = redis
        .command_with_timeout(&["PING"], Duration::from_millis(200))
        .expect_err("paused");
    assert!(matches!(err, TestkitError::Timeout { .. }), "{err}");

    redis.resume().expect("resume");
    assert_eq!(
        raw_ping(redis.port(), Duration::from_secs(2)).expect("ping after resume"),
        "+PONG\r\n"
    );
    assert_eq!(redis.command(&["PING"]).expect("ping"), "PONG");
}

#[test]
fn redis_aof_survives_graceful_restart() {
    let mut redis = start(RedisOptions {
        appendonly: true,
        ..RedisOptions::default()
    });
    let port = redis.port();
    let old_pid = redis.pid().expect("running");
    redis.command(&["SET", "durable", "yes"]).expect("set");

    redis.shutdown().expect("shutdown");
    assert_eq!(redis.pid(), None);
    assert!(!pid_exists(old_pid), "old redis still alive");
    assert!(raw_ping(port, Duration::from_millis(200)).is_err());

    redis.restart().expect("restart");
    assert_eq!(redis.port(), port);
    assert_ne!(redis.pid(), Some(old_pid));
    assert_eq!(redis.command(&["GET", "durable"]).expect("get"), "yes");
}

#[test]
fn redis_aof_always_survives_sigkill() {
    let mut redis = start(RedisOptions {
        appendonly: true,
        ..RedisOptions::default()
    });
    let port = redis.port();
    let old_pid = redis.pid().expect("running");
    for i in 0..20 {
        redis
            .command(&["SET", &format!("k{i}"), &i.to_string()])
            .expect("set");
    }
    redis.stop().expect("stop");
    assert!(!pid_exists(old_pid), "killed redis still alive");
    assert!(!redis.is_running());

    redis.restart().expect("restart");
    assert_eq!(redis.port(), port);
    assert_eq!(redis.command(&["DBSIZE"]).expect("dbsize"), "20");
    assert_eq!(redis.command(&["GET", "k19"]).expect("get"), "19");
}

#[test]
fn redis_without_aof_loses_data_on_crash() {
    let mut redis = start(RedisOptions::default());
    redis.command(&["SET", "volatile", "1"]).expect("set");
    redis.stop().expect("stop");
    redis.restart().expect("restart");
    assert_eq!(redis.command(&["GET", "volatile"]).expect("get"), "(nil)");
}

#[test]
fn redis_restart_while_running_and_paused_ops_on_stopped() {
    let mut redis = start(RedisOptions::default());
    redis.pause().expect("pause");
    // restart of a paused server: graceful shutdown (with SIGCONT) then start.
    redis.restart().expect("restart");
    assert_eq!(redis.command(&["PING"]).expect("ping"), "PONG");

    redis.stop().expect("stop");
    redis.stop().expect("stop twice is a no-op");
    assert!(matches!(redis.pause(), Err(TestkitError::NotRunning(_))));
    assert!(matches!(redis.resume(), Err(TestkitError::NotRunning(_))));
}

#[test]
fn redis_drop_kills_process_and_removes_dir() {
    let redis = start(RedisOptions::default());
    let pid = redis.pid().expect("running");
    let dir = redis.dir().to_path_buf();
    assert!(pid_exists(pid));
    drop(redis);
    assert!(!pid_exists(pid), "redis pid {pid} survived drop");
    assert!(!dir.exists(), "temp dir {} survived drop", dir.display());
}

#[test]
fn redis_drop_kills_paused_process() {
    let redis = start(RedisOptions::default());
    let pid = redis.pid().expect("running");
    redis.pause().expect("pause");
    drop(redis);
    assert!(!pid_exists(pid), "paused redis pid {pid} survived drop");
}

#[test]
fn redis_drop_runs_on_panic() {
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let redis = start(RedisOptions::default());
        tx.send(redis.pid().expect("running")).expect("send");
        panic!("test panic while redis is running");
    })
    .join();
    assert!(result.is_err());
    let pid = rx.recv().expect("pid");
    assert!(!pid_exists(pid), "redis pid {pid} survived a panic");
}

#[test]
fn child_guard_kills_on_drop() {
    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    let mut child = ChildGuard::spawn(cmd).expect("spawn sleep");
    let pid = child.pid();
    assert!(child.is_running());
    assert!(pid_exists(pid));
    drop(child);
    assert!(!pid_exists(pid), "sleep pid {pid} survived drop");
}

#[test]
fn child_guard_kill_and_terminate() {
    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    let mut child = ChildGuard::spawn(cmd).expect("spawn sleep");
    child.kill().expect("kill");
    assert!(!child.is_running());
    assert!(!pid_exists(child.pid()));
    child.kill().expect("kill twice is a no-op");

    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    let mut child = ChildGuard::spawn(cmd).expect("spawn sleep");
    let t = Instant::now();
    let status = child.terminate().expect("terminate");
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(!status.success());
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(15),
        "{status}"
    );
    assert!(!child.is_running());
}

#[test]
fn child_guard_captures_output() {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "echo to-stdout; echo to-stderr >&2; exit 3"]);
    let mut child = ChildGuard::spawn(cmd).expect("spawn sh");
    let t = Instant::now();
    while child.is_running() {
        assert!(t.elapsed() < Duration::from_secs(5), "sh did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = child.terminate().expect("already exited");
    assert_eq!(status.code(), Some(3));
    assert_eq!(child.output(), "to-stdout\nto-stderr\n");
}

#[test]
fn child_guard_large_output_does_not_block() {
    // 1 MiB of output would fill a pipe and block the child; a file does not.
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "head -c 1048576 /dev/zero | tr '\\0' x; echo; echo done",
    ]);
    let mut child = ChildGuard::spawn(cmd).expect("spawn sh");
    let t = Instant::now();
    while child.is_running() {
        assert!(t.elapsed() < Duration::from_secs(10), "child blocked");
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.output();
    assert!(out.ends_with("done\n"));
    assert!(out.len() > 1_048_576);
}

#[test]
fn workspace_bin_reports_missing_binary() {
    let err = workspace_bin("definitely-not-a-spendgate-binary").expect_err("missing");
    match err {
        TestkitError::BinaryNotFound { name, searched } => {
            assert_eq!(name, "definitely-not-a-spendgate-binary");
            assert!(searched
                .iter()
                .any(|p| p.ends_with("target/debug/definitely-not-a-spendgate-binary")));
        }
        other => panic!("unexpected error {other}"),
    }
}

#[test]
fn workspace_bin_prefers_env_var() {
    // The env var is read at runtime; point it at an existing file.
    let name = "testkit-env-probe";
    let exe = std::env::current_exe().expect("current exe");
    std::env::set_var(format!("CARGO_BIN_EXE_{name}"), &exe);
    assert_eq!(workspace_bin(name).expect("found via env"), exe);
}

#[test]
fn missing_redis_message_says_how_to_install() {
    let err = TestkitError::RedisNotInstalled {
        searched: "/usr/bin/redis-server".into(),
    };
    assert!(err.to_string().contains("apt-get install -y redis-server"));
}

#[test]
fn handles_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<RedisServer>();
    assert_send_sync::<ChildGuard>();
    assert_send_sync::<TestkitError>();
}
