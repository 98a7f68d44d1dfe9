//! The shared conformance suite (`spendgate-conformance`) for the memory and sqlite backends.
//!
//! Neither has a second handle on one store (`replica` is `None`), so the I4 case skips here
//! and runs on Redis: a `MemoryStore` is one process's own ledger (handing back the same `Arc`
//! would pass I4 without sharing anything), and a SQLite file is held by one process
//! exclusively, by design (SPEC §7).

use spendgate_conformance::{conformance_tests, Backend};
use spendgate_core::{Policy, UnixMs};
use spendgate_store::{ManualClock, MemoryStore, SqliteOptions, SqliteStore, Store};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// `memory`: not durable, so `reopen` is `None`; it has nothing that can fail, so
/// `set_failing` is `false` (the I3 cases skip).
#[derive(Default)]
struct MemoryBackend {
    clock: Mutex<Option<ManualClock>>,
}

#[async_trait::async_trait]
impl Backend for MemoryBackend {
    async fn open(&self, policy: Policy, start: UnixMs) -> Arc<dyn Store> {
        let clock = ManualClock::new(start);
        *self.clock.lock().expect("clock lock") = Some(clock.clone());
        Arc::new(MemoryStore::with_history(policy, Arc::new(clock)))
    }

    fn advance(&self, ms: u64) {
        if let Some(c) = self.clock.lock().expect("clock lock").as_ref() {
            c.advance_ms(ms);
        }
    }

    async fn reopen(&self) -> Option<Arc<dyn Store>> {
        None
    }
}

/// What `reopen` needs to open the last store again.
struct Opened {
    path: PathBuf,
    policy: Policy,
    clock: ManualClock,
}

/// `sqlite`: one fresh file per `open` in a temporary directory; `reopen` opens the same
/// file again with the same policy and clock. `set_failing` injects `SQLITE_FULL` into every
/// write (`SqliteOptions::write_fault`): the batch's transaction fails whole and the store
/// reloads its ledger from the file, as on a full disk; unlike an I/O error it is not fatal,
/// so clearing it recovers the store without a restart.
struct SqliteBackend {
    dir: tempfile::TempDir,
    fault: Arc<AtomicI32>,
    files: AtomicUsize,
    last: Mutex<Option<Opened>>,
}

impl SqliteBackend {
    fn new() -> SqliteBackend {
        SqliteBackend {
            dir: tempfile::tempdir().expect("temporary directory"),
            fault: Arc::new(AtomicI32::new(0)),
            files: AtomicUsize::new(0),
            last: Mutex::new(None),
        }
    }

    fn open_file(&self, o: &Opened) -> Arc<dyn Store> {
        let store = SqliteStore::open(
            SqliteOptions {
                write_fault: Some(self.fault.clone()),
                ..SqliteOptions::new(&o.path)
            },
            o.policy.clone(),
            Arc::new(o.clock.clone()),
        )
        .unwrap_or_else(|e| panic!("open {}: {e}", o.path.display()));
        Arc::new(store)
    }
}

#[async_trait::async_trait]
impl Backend for SqliteBackend {
    async fn open(&self, policy: Policy, start: UnixMs) -> Arc<dyn Store> {
        let n = self.files.fetch_add(1, Ordering::SeqCst);
        let opened = Opened {
            path: self.dir.path().join(format!("ledger-{n}.db")),
            policy,
            clock: ManualClock::new(start),
        };
        let store = self.open_file(&opened);
        *self.last.lock().expect("backend lock") = Some(opened);
        store
    }

    fn advance(&self, ms: u64) {
        if let Some(o) = self.last.lock().expect("backend lock").as_ref() {
            o.clock.advance_ms(ms);
        }
    }

    async fn reopen(&self) -> Option<Arc<dyn Store>> {
        let last = self.last.lock().expect("backend lock");
        let o = last.as_ref().expect("reopen before open");
        Some(self.open_file(o))
    }

    async fn set_failing(&self, failing: bool) -> bool {
        /// `SQLITE_FULL`: the transaction is rolled back whole; not fatal (see `WriteError`).
        const SQLITE_FULL: i32 = 13;
        self.fault
            .store(if failing { SQLITE_FULL } else { 0 }, Ordering::SeqCst);
        true
    }
}

mod memory {
    use super::*;
    conformance_tests!(MemoryBackend::default());
}

mod sqlite {
    use super::*;
    conformance_tests!(SqliteBackend::new());
}
