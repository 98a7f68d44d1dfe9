//! `sqlite`: placeholder, implemented next.
use crate::{Clock, Store, StoreError};
use async_trait::async_trait;
use spendgate_core::{Command, Policy, Reply};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct SqliteOptions {
    pub path: PathBuf,
}

pub struct SqliteStore {
    _policy: Policy,
    _clock: Arc<dyn Clock>,
}

impl SqliteStore {
    pub fn open(
        opts: SqliteOptions,
        policy: Policy,
        clock: Arc<dyn Clock>,
    ) -> Result<SqliteStore, StoreError> {
        let _ = opts;
        Ok(SqliteStore {
            _policy: policy,
            _clock: clock,
        })
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn execute(&self, _cmd: Command) -> Result<Reply, StoreError> {
        Err(StoreError::Unavailable("sqlite store not built yet".into()))
    }
    async fn ready(&self) -> Result<(), StoreError> {
        Err(StoreError::Unavailable("sqlite store not built yet".into()))
    }
    fn kind(&self) -> &'static str {
        "sqlite"
    }
}
