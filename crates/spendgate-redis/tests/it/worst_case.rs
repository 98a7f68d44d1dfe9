//! Scripts stay short even in the worst case the limits allow: many full runs, each holding
//! its maximum of steps against the maximum of address prefixes, expiring at once. Redis runs
//! one script at a time, so a long one would stall every replica (and hit BUSY at 5 s).

use crate::support::*;
use spendgate_core::*;
use spendgate_store::{ManualClock, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RUNS: usize = 300;
/// Far below Redis' busy-script threshold (5 s), with room for a loaded test machine; a
/// quiet machine takes about 0.1 s per batch of 256 run expiries.
const SCRIPT_MAX: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mass_expiry_is_bounded_per_script() {
    let server = server(false);
    let clock = ManualClock::new(UnixMs(1_800_000_000_000));
    let mut p = Policy::default();
    for sp in [
        &mut p.global,
        &mut p.ip,
        &mut p.session,
        &mut p.conversation,
    ] {
        sp.rate = None;
        sp.concurrency = None;
        for b in &mut sp.budgets {
            b.amount = Micros(1_000_000_000_000);
        }
    }
    p.run.max_cost = Micros(1_000_000_000_000);
    let store = open(
        options(
            &server,
            &fresh_prefix("worst"),
            Some(Arc::new(clock.clone())),
        ),
        p.clone(),
    )
    .await;
    let s: &dyn Store = &store;
    let steps = p.run.max_tool_calls;
    for i in 0..RUNS {
        let run = RunId(format!("run{i}"));
        let ips = vec![
            IpScope {
                prefix: format!("10.0.{i}.1/32"),
                factor: 1,
            },
            IpScope {
                prefix: format!("2001:db8:{i}::/56"),
                factor: 4,
            },
            IpScope {
                prefix: format!("2001:db8:{i}::/48"),
                factor: 16,
            },
        ];
        let req = RunRequest {
            run_id: run.clone(),
            session: format!("s{i}"),
            ips,
            conversation: format!("c{i}"),
            input_bytes: 1,
        };
        s.admit_run(req, None)
            .await
            .expect("admit")
            .value
            .expect("admitted");
        for j in 0..steps {
            let req = StepRequest {
                run_id: run.clone(),
                step_id: ReservationId(format!("{}.{j}", run.0)),
                kind: StepKind::Tool {
                    tool: "t".into(),
                    price: ToolPrice {
                        per_call: Micros(1),
                        per_unit: Micros::ZERO,
                    },
                    units: 0,
                },
            };
            s.reserve_step(req, None)
                .await
                .expect("reserve")
                .value
                .expect("reserved");
        }
    }
    clock.advance_ms(p.lease_ttl_ms + 1);
    let mut expired = 0;
    let mut longest = Duration::ZERO;
    while expired < RUNS {
        let t = Instant::now();
        let n = s.sweep().await.expect("sweep").value;
        longest = longest.max(t.elapsed());
        assert!(
            n > 0 && n <= EXPIRIES_PER_CALL_MAX,
            "one bounded batch: {n}"
        );
        expired += n;
    }
    println!("longest sweep of {RUNS} expiring runs: {longest:?}");
    assert!(longest < SCRIPT_MAX, "a sweep script took {longest:?}");
    let summary = s.summary().await.expect("summary");
    assert_eq!(summary.runs_active, 0);
    assert_eq!(
        summary.reservations.get("expired"),
        Some(&(RUNS as u64 * steps as u64))
    );
    assert_eq!(summary.held_micros, Micros::ZERO);
    assert_eq!(summary.charged_micros, Micros(RUNS as u64 * steps as u64));
}
