//! PostgreSQL's history on its own: idempotent inserts and retention by age and by size, on a
//! private PostgreSQL server.

use spendgate_core::history::{HistoryEvent, RefusalMinute, ReservationRecord, StepClass};
use spendgate_core::{
    Micros, RefusalCode, ReservationId, ReservationState, RunId, ScopeKind, UnixMs,
};
use spendgate_history_pg::PgHistory;
use spendgate_redis::history::HistorySink;
use spendgate_store::{HistoryFilter, HistoryReader};
use spendgate_testkit::PostgresServer;
use std::time::Duration;

const DAY: u64 = 86_400_000;
const NOW: UnixMs = UnixMs(1_796_040_000_000);

fn record(id: usize, at: UnixMs, charged: u64) -> HistoryEvent {
    HistoryEvent::Reservation(ReservationRecord {
        id: ReservationId(format!("s{id:04}")),
        run_id: RunId(format!("r{id:04}")),
        session: "sess".into(),
        conversation: "conv".into(),
        address: "10.0.0.1/32".into(),
        class: StepClass::Tool,
        name: "t".into(),
        retry: false,
        usage: None,
        units: Some(1),
        result_bytes: None,
        reserved: Micros(charged),
        charged: Micros(charged),
        state: ReservationState::Committed,
        created: at,
        resolved_at: at,
        overrun: false,
        result_too_large: false,
        counters: vec![],
    })
}

async fn count(pg: &PgHistory) -> usize {
    let all = HistoryFilter::period(UnixMs(0), UnixMs(u64::MAX / 2));
    pg.reservations(&all, None, 10_000)
        .await
        .expect("read")
        .items
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_keep_one_record_and_the_larger_charge_and_retention_bounds_age_and_size() {
    let server = PostgresServer::start().unwrap_or_else(|e| panic!("a private PostgreSQL: {e}"));
    let pg = PgHistory::new(&server.url());
    // 10 records 100 days old, 30 of today
    let mut events: Vec<HistoryEvent> = (0..10)
        .map(|i| record(i, UnixMs(NOW.0 - 100 * DAY), 5))
        .collect();
    events.extend((10..40).map(|i| record(i, UnixMs(NOW.0 - i as u64), 7)));
    pg.write(&events).await.expect("write");
    // again, one of them topped up (a late overrun), one lower: the larger charge stays
    let mut again = events.clone();
    again.push(record(20, UnixMs(NOW.0 - 20), 99));
    again.push(record(21, UnixMs(NOW.0 - 21), 1));
    pg.write(&again).await.expect("write again");
    assert_eq!(count(&pg).await, 40);
    let all = HistoryFilter::period(UnixMs(0), UnixMs(u64::MAX / 2));
    let page = pg.reservations(&all, None, 10_000).await.expect("read");
    let charged = |id: &str| {
        page.items
            .iter()
            .find(|r| r.id.0 == id)
            .map(|r| r.charged.0)
    };
    assert_eq!((charged("s0020"), charged("s0021")), (Some(99), Some(7)));
    // refusal minutes keep the largest count
    let m = RefusalMinute::of(NOW, RefusalCode::RateLimited, Some(ScopeKind::Ip));
    for n in [3, 5, 4] {
        pg.write(&[HistoryEvent::Refusals { at: m, count: n }])
            .await
            .expect("refusals");
    }
    let r = pg
        .refusals(UnixMs(0), UnixMs(u64::MAX / 2))
        .await
        .expect("read");
    assert_eq!(r, vec![(m, 5)]);

    // by age: the 10 old ones go
    let gone = pg
        .retain(NOW, Duration::from_millis(90 * DAY), 1_000)
        .await
        .expect("retain");
    assert_eq!(gone, 10);
    assert_eq!(count(&pg).await, 30);
    // by size: the oldest beyond 25 go
    pg.retain(NOW, Duration::from_millis(90 * DAY), 25)
        .await
        .expect("retain");
    assert_eq!(count(&pg).await, 25);
    let left = pg.reservations(&all, None, 10_000).await.expect("read");
    assert!(
        left.items.iter().all(|r| r.id.0.as_str() < "s0035"),
        "the newest are kept"
    );

    // PostgreSQL down: writes fail (the drain keeps its batch), and work again once it is back
    let mut server = server;
    server.kill();
    let w = pg.write(&events[..1]).await;
    assert!(w.is_err());
    server.restart().expect("restart");
    pg.write(&events[10..11])
        .await
        .expect("write after restart");
    assert_eq!(count(&pg).await, 25);
}
