//! The shared conformance suite (`spendgate-conformance`) for the memory and sqlite backends.

use spendgate_conformance::{conformance_tests, Backend};
use spendgate_core::{Policy, UnixMs};
use spendgate_store::{ManualClock, MemoryStore, SqliteOptions, SqliteStore, Store};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// `memory`: not durable, so `reopen` is `None`.
#[derive(Default)]
struct MemoryBackend {
    clock: Mutex<Option<ManualClock>>,
}

#[async_trait::async_trait]
impl Backend for MemoryBackend {
    async fn open(&self, policy: Policy, start: UnixMs) -> Arc<dyn Store> {
        let clock = ManualClock::new(start);
        *self.clock.lock().expect("clock lock") = Some(clock.clone());
        Arc::new(MemoryStore::new(policy, Arc::new(clock)))
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
/// file again with the same policy and clock.
struct SqliteBackend {
    dir: tempfile::TempDir,
    files: AtomicUsize,
    last: Mutex<Option<Opened>>,
}

impl SqliteBackend {
    fn new() -> SqliteBackend {
        SqliteBackend {
            dir: tempfile::tempdir().expect("temporary directory"),
            files: AtomicUsize::new(0),
            last: Mutex::new(None),
        }
    }

    fn open_file(o: &Opened) -> Arc<dyn Store> {
        let store = SqliteStore::open(
            SqliteOptions::new(&o.path),
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
        let store = SqliteBackend::open_file(&opened);
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
        Some(SqliteBackend::open_file(o))
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
