use std::env::consts::EXE_SUFFIX;
use std::path::{Path, PathBuf};

use crate::TestkitError;

/// Path to a binary of this workspace built by cargo.
///
/// Looks, in order, at:
/// 1. the env var `CARGO_BIN_EXE_<name>` (set by cargo for integration tests
///    of the package that owns the binary);
/// 2. the profile directory of the currently running test executable
///    (`target/<profile>/deps/it-xxxx` → `target/<profile>/<name>`);
/// 3. `target/debug/<name>` and `target/release/<name>` under the workspace
///    root (or `$CARGO_TARGET_DIR`), the root being found by walking up from
///    `CARGO_MANIFEST_DIR` (runtime, then this crate's compile-time value) and
///    from the current executable, looking for a `Cargo.toml` with `[workspace]`.
///
/// It does not build anything: the binary must already exist.
pub fn workspace_bin(name: &str) -> Result<PathBuf, TestkitError> {
    let file_name = format!("{name}{EXE_SUFFIX}");
    let mut searched: Vec<PathBuf> = Vec::new();

    let try_path = |p: PathBuf, searched: &mut Vec<PathBuf>| -> Option<PathBuf> {
        if searched.contains(&p) {
            return None;
        }
        let found = p.is_file();
        searched.push(p.clone());
        found.then_some(p)
    };

    if let Some(p) = std::env::var_os(format!("CARGO_BIN_EXE_{name}")) {
        if let Some(found) = try_path(PathBuf::from(p), &mut searched) {
            return Ok(found);
        }
    }

    let current_exe = std::env::current_exe().ok();

    // The running test binary usually lives in target/<profile>/deps/.
    if let Some(exe) = &current_exe {
        if let Some(parent) = exe.parent() {
            let profile_dir = if parent.file_name().is_some_and(|n| n == "deps") {
                parent.parent()
            } else {
                Some(parent)
            };
            if let Some(dir) = profile_dir {
                if let Some(found) = try_path(dir.join(&file_name), &mut searched) {
                    return Ok(found);
                }
            }
        }
    }

    let mut starts: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("CARGO_MANIFEST_DIR") {
        starts.push(PathBuf::from(d));
    }
    starts.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    if let Some(exe) = &current_exe {
        starts.push(exe.clone());
    }

    let mut target_dirs: Vec<PathBuf> = Vec::new();
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        let t = PathBuf::from(t);
        let t = if t.is_relative() {
            // cargo resolves a relative CARGO_TARGET_DIR against the cwd.
            std::env::current_dir().map(|cwd| cwd.join(&t)).unwrap_or(t)
        } else {
            t
        };
        target_dirs.push(t);
    }
    for start in &starts {
        if let Some(root) = find_workspace_root(start) {
            let t = root.join("target");
            if !target_dirs.contains(&t) {
                target_dirs.push(t);
            }
        }
    }

    for target in &target_dirs {
        for profile in ["debug", "release"] {
            if let Some(found) = try_path(target.join(profile).join(&file_name), &mut searched) {
                return Ok(found);
            }
        }
    }

    Err(TestkitError::BinaryNotFound {
        name: name.to_string(),
        searched,
    })
}

/// The nearest ancestor of `start` (inclusive) whose `Cargo.toml` declares a
/// `[workspace]`.
fn find_workspace_root(start: &Path) -> Option<PathBuf> {
    start.ancestors().find_map(|dir| {
        let manifest = dir.join("Cargo.toml");
        let text = std::fs::read_to_string(&manifest).ok()?;
        text.lines()
            .any(|l| l.trim() == "[workspace]")
            .then(|| dir.to_path_buf())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_this_workspace_root() {
        let root = find_workspace_root(Path::new(env!("CARGO_MANIFEST_DIR")))
            .expect("workspace root above the testkit crate");
        assert!(root.join("crates").join("spendgate-testkit").is_dir());
    }
}
