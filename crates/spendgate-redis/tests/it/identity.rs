//! The ledger's identity: `store init` makes a ledger id once and says what it found, stores
//! refuse a Redis without their pinned ledger, and a witness file catches a rollback that no
//! running store saw.

use crate::support::*;
use spendgate_core::*;
use spendgate_redis::{
    IdentityError, InitMode, Initialised, Mark, RedisOptions, RedisStore, RollbackConsent,
    WitnessFile,
};
use spendgate_store::{Store, StoreError};

/// The default policy without concurrency caps (runs here are admitted and left open).
fn policy() -> Policy {
    let mut p = Policy::default();
    for scope in [
        &mut p.global,
        &mut p.ip,
        &mut p.session,
        &mut p.conversation,
    ] {
        scope.concurrency = None;
    }
    p
}

fn run_req(id: &str) -> RunRequest {
    RunRequest {
        run_id: RunId(id.into()),
        session: format!("s-{id}"),
        ips: vec![IpScope {
            prefix: "192.0.2.1/32".into(),
            factor: 1,
        }],
        conversation: format!("c-{id}"),
        input_bytes: 10,
    }
}

fn pinned(opts: &RedisOptions, ledger: &str) -> RedisOptions {
    RedisOptions {
        ledger_id: Some(ledger.to_string()),
        ..opts.clone()
    }
}

fn refused_with(r: Result<impl std::fmt::Debug, StoreError>, words: &str) {
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains(words)),
        "expected a refusal saying {words:?}, got {r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_makes_a_ledger_once_and_says_what_it_found() {
    let server = server(false);
    let opts = options(&server, &fresh_prefix("id"), None);

    // Before any ledger: a store needs a pin at all, and refuses a prefix without its ledger.
    let r = RedisStore::open(opts.clone(), policy()).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("store.ledger_id is not set")),
        "{r:?}"
    );
    let r = RedisStore::open(pinned(&opts, "lg-123"), policy()).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("not a ledger id")),
        "{r:?}"
    );
    let early = open_only(pinned(&opts, PIN), policy()).await;
    refused_with(
        store_of(&early).admit_run(run_req("r0"), None).await,
        "no ledger",
    );

    // No pin, empty prefix: created. Again: found, unchanged. Pinned: a no-op that says so.
    let ledger = match RedisStore::init(&opts, InitMode::Routine).await {
        Ok(Initialised::Created {
            ledger,
            kept_data: false,
        }) => ledger,
        other => panic!("{other:?}"),
    };
    assert!(spendgate_redis::is_ledger_id(&ledger), "{ledger}");
    assert_eq!(
        RedisStore::init(&opts, InitMode::Routine)
            .await
            .expect("init"),
        Initialised::Found {
            ledger: ledger.clone()
        }
    );
    let mine = pinned(&opts, &ledger);
    for _ in 0..2 {
        assert_eq!(
            RedisStore::init(&mine, InitMode::Routine)
                .await
                .expect("init"),
            Initialised::Pinned {
                ledger: ledger.clone()
            }
        );
    }
    // The store pinned to another ledger refuses this one; pinned to it, it admits.
    refused_with(
        store_of(&early).admit_run(run_req("r1"), None).await,
        &ledger,
    );
    let store = open_only(mine.clone(), policy()).await;
    store_of(&store)
        .admit_run(run_req("r1"), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");
    // Another pin: refused, and told which ledger is there. --new-ledger over the intact
    // pinned one: refused.
    let r = RedisStore::init(&pinned(&opts, PIN), InitMode::Routine).await;
    assert!(
        matches!(r, Err(IdentityError::OtherLedger { found: Some(ref f), .. }) if *f == ledger),
        "{r:?}"
    );
    let r = RedisStore::init(&mine, InitMode::NewLedger).await;
    assert!(matches!(r, Err(IdentityError::Intact { .. })), "{r:?}");

    // A ledger made by a build before ledger ids: the pinned store refuses it, a pinned init
    // refuses it, an unpinned init gives it an id (its epoch and data unchanged).
    let meta = format!("{{{}}}:meta", opts.prefix);
    server.command(&["HDEL", &meta, "ledger"]).expect("HDEL");
    let late = open_only(mine.clone(), policy()).await;
    refused_with(
        store_of(&late).admit_run(run_req("r2"), None).await,
        "without an id",
    );
    let r = RedisStore::init(&mine, InitMode::Routine).await;
    assert!(
        matches!(r, Err(IdentityError::OtherLedger { found: None, .. })),
        "{r:?}"
    );
    let adopted = match RedisStore::init(&opts, InitMode::Routine).await {
        Ok(Initialised::Adopted { ledger }) => ledger,
        other => panic!("{other:?}"),
    };
    assert_ne!(adopted, ledger);
    let again = open_only(pinned(&opts, &adopted), policy()).await;
    let usage = store_of(&again).summary().await.expect("summary");
    assert!(usage.seq > 0, "the ledger's data is kept: {usage:?}");
    // The running store pinned to the first id keeps its epoch, which did not change: it was
    // checked at first contact. (Only the operator's commands write the id.)
    store_of(&store)
        .admit_run(run_req("r3"), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");

    // Ledger keys without the meta record: neither init nor --new-ledger builds on them.
    server.command(&["DEL", &meta]).expect("DEL");
    for mode in [InitMode::Routine, InitMode::NewLedger] {
        let r = RedisStore::init(&opts, mode).await;
        assert!(matches!(r, Err(IdentityError::Partial { .. })), "{r:?}");
    }
    let r = RedisStore::accept_reset(&pinned(&opts, &adopted), RollbackConsent::Given).await;
    assert!(matches!(r, Err(IdentityError::Partial { .. })), "{r:?}");
    let r = RedisStore::accept_reset(&opts, RollbackConsent::Given).await;
    assert!(matches!(r, Err(IdentityError::NotPinned)), "{r:?}");
}

/// `--new-ledger` over another ledger: a new id, the data kept (spend recorded there still
/// counts), and stores pinned to the old id refuse it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_ledger_over_another_keeps_its_data_under_a_new_id() {
    let server = server(false);
    let opts = options(&server, &fresh_prefix("id"), None);
    let store = open(opts.clone(), policy()).await;
    store_of(&store)
        .admit_run(run_req("r1"), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");
    let old = with_pin(opts.clone()).ledger_id.expect("pin");
    let seq = store_of(&store).summary().await.expect("summary").seq;
    let other = pinned(&opts, PIN);
    let new = match RedisStore::init(&other, InitMode::NewLedger).await {
        Ok(Initialised::Created {
            ledger,
            kept_data: true,
        }) => ledger,
        r => panic!("{r:?}"),
    };
    assert!(new != old && new != PIN);
    refused_with(store_of(&store).admit_run(run_req("r2"), None).await, &new);
    let renewed = open_only(pinned(&opts, &new), policy()).await;
    assert!(store_of(&renewed).summary().await.expect("summary").seq >= seq);
}

/// Redis reloads an older snapshot while every store restarts: none remembers the higher seq
/// in memory, but a witness file does. The restarted store refuses and marks the rollback
/// (so a store without a witness refuses too); an accepted rollback reopens, and the
/// witness follows the new epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_seen_by_no_running_store_is_caught_by_the_witness() {
    let server = server(false);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("spendgate.witness");
    let opts = RedisOptions {
        witness: Some(path.clone()),
        ..options(&server, &fresh_prefix("witness"), None)
    };
    let meta = format!("{{{}}}:meta", opts.prefix);
    let snapshot = format!("{{{}}}:meta-snapshot", opts.prefix);
    let store = open(opts.clone(), policy()).await;
    let witness = store.witness().expect("a witness");
    for i in 0..3 {
        store_of(&store)
            .admit_run(run_req(&format!("a{i}")), None)
            .await
            .expect("admit")
            .value
            .expect("admitted");
        if i == 0 {
            server
                .command(&["COPY", &meta, &snapshot, "REPLACE"])
                .expect("COPY");
        }
    }
    let high = store_of(&store).summary().await.expect("summary").seq;
    witness.flush().await.expect("flush (a clean shutdown)");
    drop(store);
    let file = WitnessFile::open(&path).expect("open");
    let mark = file.read().expect("read").expect("a mark");
    assert_eq!(mark.seq, high);

    // Redis reloads the older snapshot; every store is new.
    server
        .command(&["COPY", &snapshot, &meta, "REPLACE"])
        .expect("COPY");
    let restarted = open_only(opts.clone(), policy()).await;
    assert!(restarted.ready().await.is_err());
    refused_with(
        store_of(&restarted).admit_run(run_req("b1"), None).await,
        "rolled back",
    );
    // Marked in Redis: a store with no witness (an ephemeral disk) refuses too now.
    let bare = open_only(
        RedisOptions {
            witness: None,
            ..opts.clone()
        },
        policy(),
    )
    .await;
    refused_with(
        store_of(&bare).admit_run(run_req("b2"), None).await,
        "rolled back",
    );

    let pin = with_pin(opts.clone());
    let r = RedisStore::accept_reset(&pin, RollbackConsent::NotGiven).await;
    assert!(
        matches!(r, Err(IdentityError::RollbackNotAccepted { .. })),
        "{r:?}"
    );
    RedisStore::accept_reset(&pin, RollbackConsent::Given)
        .await
        .expect("accept the rollback");
    store_of(&restarted)
        .admit_run(run_req("b3"), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");
    let w = restarted.witness().expect("a witness");
    w.flush().await.expect("flush");
    let now: Mark = file.read().expect("read").expect("a mark");
    assert!(
        now.epoch != mark.epoch && now.epoch_at > mark.epoch_at,
        "{now:?}"
    );
    // And a store restarted on that witness admits.
    drop(restarted);
    let again = open_only(opts.clone(), policy()).await;
    store_of(&again)
        .admit_run(run_req("b4"), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_witness_of_another_ledger_or_a_damaged_one_stops_the_start() {
    let server = server(false);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w");
    let opts = RedisOptions {
        witness: Some(path.clone()),
        ..options(&server, &fresh_prefix("witness"), None)
    };
    let store = open(opts.clone(), policy()).await;
    store.ready().await.expect("ready");
    store
        .witness()
        .expect("witness")
        .flush()
        .await
        .expect("flush");
    drop(store);
    let r = RedisStore::open(pinned(&opts, PIN), policy()).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("move that file away")),
        "{r:?}"
    );
    std::fs::write(&path, "spendgate-witness 1\nledger").expect("damage");
    let r = RedisStore::open(with_pin(opts.clone()), policy()).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("not a spendgate witness")),
        "{r:?}"
    );
    let r = RedisStore::open(
        RedisOptions {
            witness: Some(dir.path().join("no/such/dir/w")),
            ..with_pin(opts.clone())
        },
        policy(),
    )
    .await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("lock file")),
        "{r:?}"
    );
    // Moved away, as the message says: the store starts and writes a new one.
    std::fs::remove_file(&path).expect("rm");
    let store = open_only(opts, policy()).await;
    store.ready().await.expect("ready");
    let w = store.witness().expect("witness");
    tokio::time::sleep(spendgate_redis::WITNESS_EVERY * 3).await;
    assert!(w.writes() >= 1);
}

fn store_of(s: &RedisStore) -> &dyn Store {
    s
}
