//! The `spendgate` command line: `check-config` validates, names bad keys and masks secrets;
//! `serve` refuses to start on a bad config before binding a port.

use std::process::Command;

fn spendgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_spendgate"))
}

#[test]
fn check_config_prints_the_effective_config_with_secrets_masked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ok.toml");
    std::fs::write(
        &path,
        "[server]\nservice_tokens = [\"env:SG_TEST_TOKEN\"]\n[limits.global]\nbudgets = [{ amount = \"2.50\", window = \"day\" }]\n",
    )
    .expect("write");
    let out = spendgate()
        .args(["check-config", "--config"])
        .arg(&path)
        .env("SG_TEST_TOKEN", "super-secret-value-123")
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains("super-secret-value-123"),
        "secret leaked:\n{stdout}"
    );
    assert!(stdout.contains("SG_TEST_TOKEN"), "{stdout}");
    assert!(stdout.contains("2.5"), "effective budget shown:\n{stdout}");
}

#[test]
fn bad_configs_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (text, key) in [
        ("[server]\nlisten_on = \"x\"\n", "listen_on"),
        ("[limits.global]\nbudgets = [{ amount = \"1.0000001\", window = \"day\" }]\n", "limits.global.budgets[0].amount"),
        ("[run]\nmode = \"sometimes\"\n", "run.mode"),
        ("[models.\"m\"]\nupstream = \"nowhere\"\ninput_per_million = \"1\"\noutput_per_million = \"1\"\n", "upstream"),
    ] {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, text).expect("write");
        for cmd in ["check-config", "serve"] {
            let out = spendgate().args([cmd, "--config"]).arg(&path).output().expect("run");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{cmd} accepted {text:?}");
            assert!(stderr.contains(key), "{cmd}: error for {text:?} does not name {key}: {stderr}");
        }
    }
}
