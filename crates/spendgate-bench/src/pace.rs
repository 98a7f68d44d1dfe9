//! Open-loop pacing for the load drivers (`spendgate-load`, `spendgate-proxy-load`).
//!
//! Requests are started from a dedicated OS thread that sleeps to each scheduled instant:
//! tokio's timer has a 1 ms granularity, so at 1,000/s and above it would start requests in
//! clumps and measure the clumps' queueing rather than the server.

use std::time::{Duration, Instant};

/// Calls `start(k, scheduled)` for every `k` in `0..total`, each at `begin + k × interval`,
/// from a new OS thread. Returns what the last call to `start` left in its state: the
/// thread's result once every call was made.
pub fn paced<S: Send + 'static>(
    total: u64,
    interval: Duration,
    mut state: S,
    mut start: impl FnMut(&mut S, u64, Instant) + Send + 'static,
) -> std::thread::JoinHandle<S> {
    std::thread::spawn(move || {
        let begin = Instant::now();
        for k in 0..total {
            let at = begin + interval.saturating_mul(u32::try_from(k).unwrap_or(u32::MAX));
            let wait = at.saturating_duration_since(Instant::now());
            if !wait.is_zero() {
                std::thread::sleep(wait);
            }
            start(&mut state, k, at);
        }
        state
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_every_index_in_order_no_earlier_than_scheduled() {
        let h = paced(
            20,
            Duration::from_millis(1),
            Vec::new(),
            |seen: &mut Vec<u64>, k, at| {
                assert!(Instant::now() >= at, "started before its instant");
                seen.push(k);
            },
        );
        let seen = h.join().expect("pacer");
        assert_eq!(seen, (0..20).collect::<Vec<_>>());
    }
}
