//! The fault schedule: a pure function of the run's length, its seed, the fault kinds switched
//! on and the number of replicas, so the same seed always gives the same schedule.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

/// A kind of fault, or of misbehaviour in the load, that a run can switch on (`--faults`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL a replica, start it again a few seconds later.
    Kill,
    /// SIGSTOP Redis, SIGCONT it a moment later.
    Pause,
    /// SIGKILL Redis and start it again on its AOF.
    Restart,
    /// One address opens many connections to a replica's public session route, each sending
    /// its headers and one byte of body, and holds them.
    Flood,
    /// The upstream is slow (a long wait before its first byte, a slow stream) or hangs.
    Slow,
    /// The upstream drops the connection mid-answer, or ends a stream early.
    Drop,
    /// The upstream answers 500 (no work done) or 504 (work done, answer lost).
    Http5xx,
    /// The upstream answers without usage.
    NoUsage,
    /// Per request: the upstream generates beyond the output bound it was given.
    Overbound,
    /// Per request: a guest leaves a proxied stream mid-way.
    Disconnect,
    /// Per run: the operator's backend vanishes mid-run (no commit, no finish): the run's
    /// lease must expire and charge what it held.
    Vanish,
}

impl FaultKind {
    pub const ALL: [FaultKind; 11] = [
        FaultKind::Kill,
        FaultKind::Pause,
        FaultKind::Restart,
        FaultKind::Flood,
        FaultKind::Slow,
        FaultKind::Drop,
        FaultKind::Http5xx,
        FaultKind::NoUsage,
        FaultKind::Overbound,
        FaultKind::Disconnect,
        FaultKind::Vanish,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Pause => "pause",
            FaultKind::Restart => "restart",
            FaultKind::Flood => "flood",
            FaultKind::Slow => "slow",
            FaultKind::Drop => "drop",
            FaultKind::Http5xx => "5xx",
            FaultKind::NoUsage => "nousage",
            FaultKind::Overbound => "overbound",
            FaultKind::Disconnect => "disconnect",
            FaultKind::Vanish => "vanish",
        }
    }

    pub fn parse(s: &str) -> Option<FaultKind> {
        FaultKind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Placed on the timeline (the others happen per request, all along the run).
    pub fn scheduled(self) -> bool {
        !matches!(
            self,
            FaultKind::Overbound | FaultKind::Disconnect | FaultKind::Vanish
        )
    }

    /// Acts on a process (replica, Redis) or on a replica's capacity: never two at once.
    pub fn exclusive(self) -> bool {
        matches!(
            self,
            FaultKind::Kill | FaultKind::Pause | FaultKind::Restart | FaultKind::Flood
        )
    }

    /// Changes how the upstream answers while its window is open.
    pub fn upstream(self) -> bool {
        matches!(
            self,
            FaultKind::Slow | FaultKind::Drop | FaultKind::Http5xx | FaultKind::NoUsage
        )
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The fault kinds switched on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultSet(pub BTreeSet<FaultKind>);

impl FaultSet {
    pub fn all() -> FaultSet {
        FaultSet(FaultKind::ALL.into_iter().collect())
    }

    pub fn none() -> FaultSet {
        FaultSet(BTreeSet::new())
    }

    pub fn of(kinds: &[FaultKind]) -> FaultSet {
        FaultSet(kinds.iter().copied().collect())
    }

    /// `all`, `none`, or a comma-separated list of kind names.
    pub fn parse(s: &str) -> Result<FaultSet, String> {
        match s.trim() {
            "all" => return Ok(FaultSet::all()),
            "none" | "" => return Ok(FaultSet::none()),
            _ => {}
        }
        let mut set = BTreeSet::new();
        for part in s.split(',') {
            let part = part.trim();
            let kind = FaultKind::parse(part).ok_or_else(|| {
                format!(
                    "unknown fault kind {part:?}; known: all, none, {}",
                    FaultKind::ALL.map(FaultKind::name).join(", ")
                )
            })?;
            set.insert(kind);
        }
        Ok(FaultSet(set))
    }

    pub fn has(&self, k: FaultKind) -> bool {
        self.0.contains(&k)
    }
}

impl fmt::Display for FaultSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.len() == FaultKind::ALL.len() {
            return f.write_str("all");
        }
        if self.0.is_empty() {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.0.iter().map(|k| k.name()).collect();
        f.write_str(&names.join(","))
    }
}

/// One scheduled fault: `kind` from `at` (since the load began) for `len`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub at: Duration,
    pub kind: FaultKind,
    pub len: Duration,
    /// The replica a `kill` or `flood` acts on.
    pub replica: usize,
}

impl Event {
    pub fn end(&self) -> Duration {
        self.at + self.len
    }

    pub fn covers(&self, t: Duration) -> bool {
        self.at <= t && t < self.end()
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = self.at.as_secs_f64();
        let len = self.len.as_secs_f64();
        match self.kind {
            FaultKind::Kill => write!(
                f,
                "t={at:7.2}s kill replica {} (down {len:.2}s)",
                self.replica
            ),
            FaultKind::Pause => write!(f, "t={at:7.2}s pause redis for {len:.2}s"),
            FaultKind::Restart => write!(f, "t={at:7.2}s kill redis, restart it after {len:.2}s"),
            FaultKind::Flood => write!(
                f,
                "t={at:7.2}s slow-body flood on replica {} for {len:.2}s",
                self.replica
            ),
            k => write!(f, "t={at:7.2}s upstream {k} for {len:.2}s"),
        }
    }
}

/// How long a flood lasts: twice the server's 10 s body deadline, so that a server that
/// holds a request slot per slow body shows it once the flood is at its height (it takes
/// the server's accept queue a few seconds to let thousands of connections in).
pub const FLOOD_HOLD: Duration = Duration::from_secs(20);
/// Faults begin after this share of the run and end before this one (the load goes on
/// around them; the last part lets the system settle before the load stops).
const SPAN: (f64, f64) = (0.08, 0.85);
/// One of each scheduled kind per this many seconds of load (at least one).
pub const SECONDS_PER_FAULT: u64 = 120;
/// Least time between two exclusive faults.
const GAP: Duration = Duration::from_millis(500);

/// How many of each scheduled kind a run of `seconds` gets.
pub fn per_kind(seconds: u64) -> usize {
    usize::try_from((seconds / SECONDS_PER_FAULT).max(1)).unwrap_or(1)
}

fn secs(rng: &mut StdRng, lo: f64, hi: f64) -> Duration {
    Duration::from_secs_f64(rng.random_range(lo..=hi))
}

/// The schedule of a run: `n` faults of each scheduled kind (`None`: [`per_kind`]),
/// exclusive faults (process and capacity faults) one after another in slots spread over the
/// run, upstream windows anywhere in the same span. Sorted by time.
pub fn schedule(
    seconds: u64,
    seed: u64,
    kinds: &FaultSet,
    replicas: usize,
    n: Option<usize>,
) -> Vec<Event> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_f417);
    let n = n.unwrap_or_else(|| per_kind(seconds));
    let total = seconds as f64;
    let (from, to) = (total * SPAN.0, total * SPAN.1);
    let replicas = replicas.max(1);

    let mut exclusive: Vec<FaultKind> = kinds
        .0
        .iter()
        .copied()
        .filter(|k| k.scheduled() && k.exclusive())
        .flat_map(|k| std::iter::repeat_n(k, n))
        .collect();
    exclusive.shuffle(&mut rng);
    // Each exclusive fault takes its length and a gap; what is left of the span is spread
    // before them at random (all of them scaled down if they do not fit).
    let lens: Vec<Duration> = exclusive
        .iter()
        .map(|kind| match kind {
            FaultKind::Kill => secs(&mut rng, 2.0, 4.0),
            FaultKind::Pause => secs(&mut rng, 0.5, 2.5),
            FaultKind::Restart => secs(&mut rng, 0.3, 1.0),
            _ => FLOOD_HOLD,
        })
        .collect();
    let gap = GAP.as_secs_f64();
    let need: f64 = lens.iter().map(|l| l.as_secs_f64() + gap).sum();
    let span = to - from;
    let scale = if need > span { span / need } else { 1.0 };
    let slack = (span - need * scale).max(0.0);
    let weights: Vec<f64> = (0..=lens.len())
        .map(|_| rng.random_range(0.0..1.0))
        .collect();
    let total: f64 = weights.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let mut events = Vec::new();
    let mut cursor = from;
    for ((kind, len), w) in exclusive.into_iter().zip(lens).zip(&weights) {
        cursor += slack * w / total;
        let len = Duration::from_secs_f64(len.as_secs_f64() * scale);
        events.push(Event {
            at: Duration::from_secs_f64(cursor),
            kind,
            len,
            replica: rng.random_range(0..replicas),
        });
        cursor += len.as_secs_f64() + gap * scale;
    }
    for kind in kinds.0.iter().copied().filter(|k| k.upstream()) {
        for _ in 0..n {
            let len = secs(&mut rng, 3.0, 8.0);
            let latest = (to - len.as_secs_f64()).max(from);
            events.push(Event {
                at: Duration::from_secs_f64(rng.random_range(from..=latest)),
                kind,
                len,
                replica: 0,
            });
        }
    }
    events.sort_by(|a, b| a.at.cmp(&b.at).then(a.kind.cmp(&b.kind)));
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let a = schedule(600, 7, &FaultSet::all(), 3, None);
        let b = schedule(600, 7, &FaultSet::all(), 3, None);
        let c = schedule(600, 8, &FaultSet::all(), 3, None);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn exclusive_faults_never_overlap_and_end_in_the_span() {
        for seed in 0..50 {
            for seconds in [20, 90, 1200] {
                let s = schedule(seconds, seed, &FaultSet::all(), 3, None);
                let ex: Vec<&Event> = s.iter().filter(|e| e.kind.exclusive()).collect();
                for w in ex.windows(2) {
                    assert!(w[0].end() <= w[1].at, "seed {seed}: {} then {}", w[0], w[1]);
                }
                for e in &s {
                    assert!(
                        e.end().as_secs_f64() <= seconds as f64 * SPAN.1 + 1e-6,
                        "{e}"
                    );
                    assert!(e.replica < 3);
                }
            }
        }
    }

    #[test]
    fn a_twenty_minute_run_has_at_least_five_of_each_scheduled_kind() {
        let s = schedule(1200, 1, &FaultSet::all(), 3, None);
        for k in FaultKind::ALL.into_iter().filter(|k| k.scheduled()) {
            assert!(s.iter().filter(|e| e.kind == k).count() >= 5, "{k}");
        }
        // A flood holds past the server's body deadline.
        assert!(s
            .iter()
            .filter(|e| e.kind == FaultKind::Flood)
            .all(|e| e.len == FLOOD_HOLD));
    }

    #[test]
    fn fault_sets_parse_and_print() {
        assert_eq!(FaultSet::parse("all"), Ok(FaultSet::all()));
        let s = FaultSet::parse("kill, 5xx").expect("parse");
        assert_eq!(s, FaultSet::of(&[FaultKind::Kill, FaultKind::Http5xx]));
        assert_eq!(s.to_string(), "kill,5xx");
        assert!(FaultSet::parse("kill,nope").is_err());
        assert_eq!(schedule(90, 1, &FaultSet::none(), 3, None), Vec::new());
    }
}
