//! Key names do not depend on what clients send (issue 3): every key of a deployment starts
//! with its `{prefix}` hash tag, and a counter's key ends in the SHA-1 of its encoding, so an
//! outside id (a conversation, a session, an address prefix) of any content or length never
//! appears in, or lengthens, a key.

use crate::support::*;
use spendgate_core::*;
use spendgate_store::{ManualClock, Store};
use spendgate_testkit::RespValue;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_keys_are_fixed_length_hashes_of_outside_ids() {
    let server = server(false);
    let prefix = fresh_prefix("keys");
    let store = open(options(&server, &prefix, None), Policy::default()).await;
    let s: &dyn Store = &store;
    // Ids as long as the ledger takes, holding a hash tag of their own and glob characters.
    let conversation = format!("{{c}}*?[x]{}", "c".repeat(ID_BYTES_MAX - 8));
    let session = format!("{{s}}{}", "s".repeat(ID_BYTES_MAX - 3));
    assert_eq!(
        (conversation.len(), session.len()),
        (ID_BYTES_MAX, ID_BYTES_MAX)
    );
    let run = RunId("run_keys".into());
    s.admit_run(
        RunRequest {
            run_id: run.clone(),
            session: session.clone(),
            ips: vec![IpScope {
                prefix: "2001:db8:ffff:ffff::/64".into(),
                factor: 1,
            }],
            conversation: conversation.clone(),
            input_bytes: 1,
        },
        None,
    )
    .await
    .expect("admit")
    .value
    .expect("admitted");
    let step = ReservationId("run_keys.0".into());
    s.reserve_step(tool_step(&run.0, &step.0, 10), None)
        .await
        .expect("reserve")
        .value
        .expect("reserved");
    s.resolve(step, Resolution::Commit(Settlement::Units(0)))
        .await
        .expect("commit");

    let keys = match server.query(&["KEYS", "*"]).expect("KEYS") {
        RespValue::Array(Some(items)) => items
            .into_iter()
            .map(|k| match k {
                RespValue::Bulk(Some(b)) => String::from_utf8(b).expect("utf-8 key"),
                other => panic!("a key name: {other:?}"),
            })
            .collect::<Vec<_>>(),
        other => panic!("KEYS answered {other:?}"),
    };
    let base = format!("{{{prefix}}}");
    let counter = format!("{base}:c:");
    let mut counters = 0;
    for k in &keys {
        assert!(
            k.starts_with(&base),
            "a key outside the deployment's tag: {k:?}"
        );
        assert!(
            !k.contains("ccccccc") && !k.contains("sssssss") && !k.contains("2001:db8"),
            "an outside id in a key name: {k:?}"
        );
        if let Some(digest) = k.strip_prefix(&counter) {
            assert!(
                digest.len() == 40 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
                "a counter key that is not a SHA-1 digest: {k:?}"
            );
            counters += 1;
        }
    }
    // The day budgets of the address, the session and the conversation (the global one and
    // the run's are counters too, and may live elsewhere: at least these three are keys).
    assert!(counters >= 3, "counter keys: {keys:?}");
    // The scopes are still listed by their ids.
    let usage = s
        .usage(vec![(
            ScopeKey::new(ScopeKind::Conversation, &conversation),
            1,
        )])
        .await
        .expect("usage");
    assert!(
        usage.iter().any(|u| u.used == Micros(10)),
        "the conversation's counter is found by its id: {usage:?}"
    );
}

/// A run's step ids are a list of their own, not part of the run record: the record that
/// every step call rewrites (a reservation, its commit) weighs the same after its tenth step
/// as after its first, and the list goes when the run is purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_record_stays_the_same_size_however_many_steps_it_took() {
    let server = server(false);
    let prefix = fresh_prefix("steps");
    let clock = ManualClock::new(UnixMs(1_796_082_000_000));
    let opts = options(&server, &prefix, Some(Arc::new(clock.clone())));
    let store = open(opts, Policy::default()).await;
    let s: &dyn Store = &store;
    let run = RunId(format!("run_{}", "0".repeat(44)));
    let who = spendgate_conformance::support::Who::new("s", "c", "192.0.2.1/32");
    s.admit_run(who.run(&run.0), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");
    let base = format!("{{{prefix}}}");
    let run_key = format!("{base}:r:{}", run.0);
    let steps_key = format!("{base}:rs:{}", run.0);
    let strlen = |k: &str| cmd(&server, &["STRLEN", k]);
    let mut sizes = Vec::new();
    for n in 0..10 {
        let step = ReservationId(format!("stp_{n:044}"));
        s.reserve_step(tool_step(&run.0, &step.0, 10), None)
            .await
            .expect("reserve")
            .value
            .expect("reserved");
        // the last step stays held: finishing the run charges it, found through the list
        if n < 9 {
            s.resolve(step, Resolution::Commit(Settlement::Units(0)))
                .await
                .expect("commit");
        }
        sizes.push(strlen(&run_key));
    }
    assert!(
        sizes.iter().all(|s| s == &sizes[0]),
        "run record sizes: {sizes:?}"
    );
    assert_eq!(cmd(&server, &["LLEN", &steps_key]), "10");
    let finished = s.finish(run.clone()).await.expect("finish").value;
    assert_eq!(
        (finished.steps, finished.charged),
        (10, Micros(100)),
        "every step charged, the held one in full: {finished:?}"
    );
    // past the retention of an ended run's records, a sweep purges the run and its list
    clock.advance_ms(RECORD_RETENTION_MS + 1_000);
    s.sweep().await.expect("sweep");
    assert_eq!(
        (
            cmd(&server, &["EXISTS", &run_key]),
            cmd(&server, &["EXISTS", &steps_key]),
            cmd(&server, &["EXISTS", &format!("{base}:s:stp_{:044}", 9)]),
        ),
        ("0".into(), "0".into(), "0".into()),
        "the run, its step list and its reservations are purged"
    );
}
