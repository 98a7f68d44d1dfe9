//! The witness: a replica's record, on its own disk, of the ledger's high-water mark (its id,
//! epoch and the highest `ledger_seq` seen), so that a Redis that comes back older than what
//! was seen is caught even when every replica restarted with it and none remembers in memory.
//!
//! * **Atomic.** A write goes to `PATH.tmp`, is fsynced, renamed over `PATH`, and the directory
//!   fsynced: a crash leaves the old mark or the new one, never a torn file. A file that does
//!   not parse (or fails its check line) is refused, never taken for "no witness".
//! * **Shareable.** Every read and write of `PATH` holds an advisory lock (`flock`) on
//!   `PATH.lock`, and a write merges: it never replaces a mark that covers its own (a later
//!   epoch, or the same epoch at a seq as high). So replicas on one host may share one file:
//!   it then holds the highest mark any of them saw, and a replica restarted there starts from
//!   it. The lock is held for one read or one write (milliseconds), never across them.
//! * **Off the request path.** The store writes at most every [`WITNESS_EVERY`], from a task
//!   of its own (on a blocking thread), and once more at a clean shutdown
//!   ([`crate::Witness::flush`]). What a crash loses is the last interval's advance: a rollback
//!   smaller than that, after every replica crashed too, is not seen.

use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The most often a store writes its witness (and the longest its mark on disk lags behind
/// what it saw, but for a crash).
pub const WITNESS_EVERY: Duration = Duration::from_millis(200);
/// Longest witness file read (a mark is about 200 bytes).
const WITNESS_BYTES_MAX: u64 = 4096;
/// Longest wait for another process's lock on the file (it holds it for one read or write).
const LOCK_WAIT_MAX: Duration = Duration::from_secs(2);
/// First line of a witness file: the format.
const HEADER: &str = "spendgate-witness 1";

#[derive(Debug, thiserror::Error)]
pub enum WitnessError {
    #[error("witness file {path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "witness file {path} is not a spendgate witness ({why}); refusing to start without \
         knowing the ledger's high-water mark: look at it, then move it away if the ledger it \
         guarded is no longer wanted"
    )]
    Corrupt { path: PathBuf, why: String },
    #[error(
        "witness file {path} is held by another process for more than {LOCK_WAIT_MAX:?}: \
         a stuck writer, or a file system without working locks"
    )]
    Locked { path: PathBuf },
    #[error(
        "witness file {path} holds the high-water mark of ledger {found}, not of ledger \
         {pinned} that store.ledger_id pins: refusing. If the config was changed to a new ledger \
         on purpose (after `spendgate store init --new-ledger`), move that file away (it is the \
         record of the old ledger); otherwise the pin is wrong"
    )]
    OtherLedger {
        path: PathBuf,
        found: String,
        pinned: String,
    },
}

/// A high-water mark of one ledger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mark {
    /// The ledger id (`store.ledger_id`).
    pub ledger: String,
    /// The epoch the seq was seen under.
    pub epoch: String,
    /// When that epoch was written (Redis clock, ms): a later one was accepted after it.
    pub epoch_at: u64,
    /// The highest `ledger_seq` seen under that epoch.
    pub seq: u64,
}

impl Mark {
    /// Whether `self` is at or past `other`: the same ledger, and a later epoch or the same
    /// epoch at a seq at least as high.
    pub fn covers(&self, other: &Mark) -> bool {
        self.ledger == other.ledger
            && (self.epoch_at > other.epoch_at
                || (self.epoch == other.epoch && self.seq >= other.seq))
    }

    fn encode(&self) -> String {
        let body = format!(
            "{HEADER}\nledger {}\nepoch {}\nepoch_at {}\nseq {}\n",
            self.ledger, self.epoch, self.epoch_at, self.seq
        );
        let check = hex::encode(&Sha256::digest(body.as_bytes())[..8]);
        format!("{body}check {check}\n")
    }

    fn decode(text: &str) -> Result<Mark, String> {
        let (body, check) = text
            .strip_suffix('\n')
            .and_then(|t| t.rsplit_once('\n'))
            .ok_or("no check line")?;
        let body = format!("{body}\n");
        let want = hex::encode(&Sha256::digest(body.as_bytes())[..8]);
        if check != format!("check {want}") {
            return Err("its check line does not match its content".into());
        }
        let mut lines = body.lines();
        if lines.next() != Some(HEADER) {
            return Err(format!("the first line is not {HEADER:?}"));
        }
        let mut field = |name: &str| -> Result<String, String> {
            let line = lines.next().ok_or(format!("no {name} line"))?;
            let value = line
                .strip_prefix(name)
                .and_then(|v| v.strip_prefix(' '))
                .ok_or(format!("expected {name}, found {line:?}"))?;
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!("{name} is not a word"));
            }
            Ok(value.to_string())
        };
        let ledger = field("ledger")?;
        let epoch = field("epoch")?;
        let epoch_at = field("epoch_at")?
            .parse()
            .map_err(|_| "epoch_at is not a number")?;
        let seq = field("seq")?.parse().map_err(|_| "seq is not a number")?;
        if lines.next().is_some() {
            return Err("lines after seq".into());
        }
        Ok(Mark {
            ledger,
            epoch,
            epoch_at,
            seq,
        })
    }
}

/// One witness file and its lock file.
#[derive(Debug)]
pub struct WitnessFile {
    path: PathBuf,
    lock: File,
    /// `flock` excludes other open files, not users of this one: this excludes them.
    local: std::sync::Mutex<()>,
}

/// Held while the file is read or written; released on drop (and by the kernel when the
/// process dies).
pub(crate) struct Held<'a> {
    file: &'a File,
    _local: std::sync::MutexGuard<'a, ()>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let _ = rustix::fs::flock(self.file, rustix::fs::FlockOperation::Unlock);
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

impl WitnessFile {
    /// Opens `path`'s lock file (`PATH.lock`, created if missing): fails when its directory
    /// cannot be written, so that a wrong path is found at start, not at the first write.
    pub fn open(path: &Path) -> Result<WitnessFile, WitnessError> {
        let lock_path = with_suffix(path, ".lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|source| WitnessError::Io {
                path: lock_path,
                what: "cannot create its lock file (is the directory there and writable?)",
                source,
            })?;
        Ok(WitnessFile {
            path: path.to_path_buf(),
            lock,
            local: std::sync::Mutex::new(()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, what: &'static str) -> impl FnOnce(std::io::Error) -> WitnessError + '_ {
        move |source| WitnessError::Io {
            path: self.path.clone(),
            what,
            source,
        }
    }

    /// Takes the lock, waiting at most [`LOCK_WAIT_MAX`] for another process.
    pub(crate) fn hold(&self, exclusive: bool) -> Result<Held<'_>, WitnessError> {
        use rustix::fs::FlockOperation as Op;
        let op = if exclusive {
            Op::NonBlockingLockExclusive
        } else {
            Op::NonBlockingLockShared
        };
        let local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        let start = Instant::now();
        loop {
            match rustix::fs::flock(&self.lock, op) {
                Ok(()) => {
                    return Ok(Held {
                        file: &self.lock,
                        _local: local,
                    })
                }
                Err(e) if e == rustix::io::Errno::WOULDBLOCK || e == rustix::io::Errno::INTR => {
                    if start.elapsed() >= LOCK_WAIT_MAX {
                        return Err(WitnessError::Locked {
                            path: self.path.clone(),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(self.io("cannot lock it")(e.into())),
            }
        }
    }

    /// The mark the file holds; `None` when there is no file yet.
    pub fn read(&self) -> Result<Option<Mark>, WitnessError> {
        let _held = self.hold(false)?;
        self.read_held()
    }

    fn read_held(&self) -> Result<Option<Mark>, WitnessError> {
        let file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.io("cannot open it")(e)),
        };
        let mut text = String::new();
        file.take(WITNESS_BYTES_MAX + 1)
            .read_to_string(&mut text)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::InvalidData => WitnessError::Corrupt {
                    path: self.path.clone(),
                    why: "not text".into(),
                },
                _ => self.io("cannot read it")(e),
            })?;
        if text.len() as u64 > WITNESS_BYTES_MAX {
            return Err(WitnessError::Corrupt {
                path: self.path.clone(),
                why: format!("longer than {WITNESS_BYTES_MAX} bytes"),
            });
        }
        Mark::decode(&text)
            .map(Some)
            .map_err(|why| WitnessError::Corrupt {
                path: self.path.clone(),
                why,
            })
    }

    /// Records `mark` unless the file already holds one that covers it (written by this
    /// process earlier, or by another replica sharing the file). Returns whether it wrote.
    /// A file of another ledger is left alone (an error): it is another ledger's record.
    pub fn record(&self, mark: &Mark) -> Result<bool, WitnessError> {
        let _held = self.hold(true)?;
        if let Some(found) = self.read_held()? {
            if found.ledger != mark.ledger {
                return Err(WitnessError::OtherLedger {
                    path: self.path.clone(),
                    found: found.ledger,
                    pinned: mark.ledger.clone(),
                });
            }
            if found.covers(mark) {
                return Ok(false);
            }
        }
        self.write_atomic(mark.encode().as_bytes())?;
        Ok(true)
    }

    /// Temp file, fsync, rename over the file, fsync of the directory.
    fn write_atomic(&self, bytes: &[u8]) -> Result<(), WitnessError> {
        let tmp = with_suffix(&self.path, ".tmp");
        let mut f = File::create(&tmp).map_err(self.io("cannot create its temp file"))?;
        f.write_all(bytes)
            .map_err(self.io("cannot write its temp file"))?;
        f.sync_all()
            .map_err(self.io("cannot fsync its temp file"))?;
        drop(f);
        std::fs::rename(&tmp, &self.path)
            .map_err(self.io("cannot rename its temp file over it"))?;
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(self.io("cannot fsync its directory"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(epoch: &str, at: u64, seq: u64) -> Mark {
        Mark {
            ledger: "lg-0123456789abcdef0123456789abcdef".into(),
            epoch: epoch.into(),
            epoch_at: at,
            seq,
        }
    }

    #[test]
    fn a_mark_reads_back_and_damage_is_refused() {
        let m = mark("f8-aa", 1_700_000_000_000, 15_000);
        assert_eq!(Mark::decode(&m.encode()), Ok(m.clone()));
        let text = m.encode();
        for damaged in [
            text.replace("seq 15000", "seq 10000"),
            text.replace("seq 15000", "seq 150000"),
            text[..text.len() - 3].to_string(),
            text.replace(HEADER, "spendgate-witness 9"),
            String::new(),
            "garbage\n".into(),
        ] {
            assert!(Mark::decode(&damaged).is_err(), "{damaged:?}");
        }
    }

    #[test]
    fn covers_orders_epochs_then_seqs() {
        let m = mark("f8-aa", 100, 50);
        assert!(m.covers(&mark("f8-aa", 100, 50)));
        assert!(m.covers(&mark("f8-aa", 100, 49)));
        assert!(!m.covers(&mark("f8-aa", 100, 51)));
        assert!(m.covers(&mark("f8-old", 99, 1_000_000)), "a later epoch");
        assert!(!m.covers(&mark("f8-new", 101, 0)), "an earlier epoch");
        let mut other = mark("f8-aa", 100, 10);
        other.ledger = "lg-ffffffffffffffffffffffffffffffff".into();
        assert!(!m.covers(&other) && !other.covers(&m));
    }

    #[test]
    fn record_merges_and_never_goes_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w");
        let a = WitnessFile::open(&path).expect("open");
        let b = WitnessFile::open(&path).expect("open again (another replica)");
        assert_eq!(a.read().expect("read"), None);
        assert!(a.record(&mark("f8-aa", 100, 10)).expect("record"));
        assert!(b.record(&mark("f8-aa", 100, 30)).expect("record"));
        // A replica that saw less does not lower the mark another one wrote.
        assert!(!a.record(&mark("f8-aa", 100, 20)).expect("record"));
        assert_eq!(b.read().expect("read"), Some(mark("f8-aa", 100, 30)));
        // An accepted reset (a later epoch) moves it, whatever its seq.
        assert!(a.record(&mark("f8-bb", 200, 5)).expect("record"));
        assert!(!b.record(&mark("f8-aa", 100, 40)).expect("record"));
        assert_eq!(a.read().expect("read"), Some(mark("f8-bb", 200, 5)));
        let mut other = mark("f8-cc", 300, 1);
        other.ledger = "lg-ffffffffffffffffffffffffffffffff".into();
        assert!(matches!(
            a.record(&other),
            Err(WitnessError::OtherLedger { .. })
        ));
        assert_eq!(a.read().expect("read"), Some(mark("f8-bb", 200, 5)));
    }

    #[test]
    fn a_write_is_atomic_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w");
        let w = WitnessFile::open(&path).expect("open");
        w.record(&mark("f8-aa", 1, 1)).expect("record");
        // A crash between the temp file and the rename leaves the old mark, whole.
        std::fs::write(with_suffix(&path, ".tmp"), b"spendgate-witness 1\nledger").expect("tmp");
        assert_eq!(w.read().expect("read"), Some(mark("f8-aa", 1, 1)));
        w.record(&mark("f8-aa", 1, 2))
            .expect("record over a stale temp file");
        assert_eq!(w.read().expect("read"), Some(mark("f8-aa", 1, 2)));
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["w", "w.lock"]);
        // A torn or edited file is refused, not taken for "no witness".
        std::fs::write(&path, "spendgate-witness 1\nledger lg-x\n").expect("damage");
        assert!(matches!(w.read(), Err(WitnessError::Corrupt { .. })));
        assert!(matches!(
            w.record(&mark("f8-aa", 1, 3)),
            Err(WitnessError::Corrupt { .. })
        ));
        std::fs::write(&path, vec![b'x'; 10_000]).expect("too long");
        assert!(matches!(w.read(), Err(WitnessError::Corrupt { .. })));
    }

    #[test]
    fn a_lock_held_elsewhere_bounds_the_wait() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w");
        let a = WitnessFile::open(&path).expect("open");
        let b = WitnessFile::open(&path).expect("open");
        let held = a.hold(true).expect("lock");
        let start = Instant::now();
        assert!(matches!(
            b.record(&mark("f8-aa", 1, 1)),
            Err(WitnessError::Locked { .. })
        ));
        assert!(start.elapsed() >= LOCK_WAIT_MAX);
        assert!(start.elapsed() < LOCK_WAIT_MAX + Duration::from_secs(2));
        drop(held);
        assert!(b.record(&mark("f8-aa", 1, 1)).expect("record"));
    }

    #[test]
    fn a_directory_that_cannot_be_written_is_found_at_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = WitnessFile::open(&dir.path().join("missing/w"));
        assert!(matches!(r, Err(WitnessError::Io { .. })), "{r:?}");
    }
}
