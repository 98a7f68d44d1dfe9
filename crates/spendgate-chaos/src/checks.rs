//! The checks of a run, as pure functions of what was recorded: the mock's own record of
//! what it served (by tag), the reservations the admin API listed, each scope's usage at
//! the end, and the driver's record of its calls.

use crate::observe::{Line, Observed, Seen};
use crate::record::{Record, Route, EXAMPLES_MAX};
use spendgate_core::{ModelPrice, TokenUsage};
use spendgate_mock_upstream::{Served, ServedTags};
use std::collections::{BTreeMap, HashMap, HashSet};

/// One check's outcome.
#[derive(Clone, Debug, Default)]
pub struct Check {
    pub name: &'static str,
    /// What it checks, in a few words.
    pub what: &'static str,
    pub violations: u64,
    pub examples: Vec<String>,
}

impl Check {
    fn new(name: &'static str, what: &'static str) -> Check {
        Check {
            name,
            what,
            ..Check::default()
        }
    }

    fn fail(&mut self, example: impl FnOnce() -> String) {
        self.violations += 1;
        if self.examples.len() < EXAMPLES_MAX {
            self.examples.push(example());
        }
    }

    pub fn ok(&self) -> bool {
        self.violations == 0
    }
}

/// A scope's usage at the end, by scope: the global line, and each session's and address's.
#[derive(Debug, Default)]
pub struct Usage {
    pub global: Option<Line>,
    /// By session index (into `Record::sessions`).
    pub sessions: HashMap<usize, Line>,
    /// By address.
    pub ips: HashMap<String, Line>,
}

/// The summary at the end, after the leases' wait.
#[derive(Debug, Default, Clone, Copy)]
pub struct End {
    pub held: u64,
    pub runs_active: u64,
    /// Whether the summary could be read at all.
    pub read: bool,
}

/// Served against budget, for the table.
#[derive(Debug, Default, Clone)]
pub struct Spend {
    pub global_served: u64,
    pub global_budget: u64,
    /// The largest share of its budget an address and a session was served (served, budget).
    pub ip_max: (u64, u64),
    pub session_max: (u64, u64),
    /// Cost the upstream served beyond the bound it was given (I1's exception: an overrun
    /// no one could have reserved).
    pub beyond_bound: u64,
    pub tags_served: u64,
}

pub struct Inputs<'a> {
    pub served: &'a ServedTags,
    pub record: &'a Record,
    pub observed: &'a Observed,
    pub usage: &'a Usage,
    pub end: End,
    pub price: ModelPrice,
}

fn cost(price: &ModelPrice, s: &Served) -> u64 {
    price
        .charge(&TokenUsage {
            prompt_tokens: s.prompt_tokens,
            completion_tokens: s.completion_tokens,
            cached_tokens: s.cached_tokens,
        })
        .0
}

/// The cost of what was served beyond the output bound the request carried.
fn beyond_bound(price: &ModelPrice, s: &Served) -> u64 {
    match s.max_tokens {
        Some(m) if s.completion_tokens > m => {
            let within = Served {
                completion_tokens: m,
                ..s.clone()
            };
            cost(price, s).saturating_sub(cost(price, &within))
        }
        _ => 0,
    }
}

/// What a reservation owes for what was served: its whole cost, except that output generated
/// past the bound the request carried by an upstream that then answered an error status
/// (`http_504`: the work done, no answer delivered) counts at the bound. No gateway sees
/// output that never reached it; spendgate charges such a call in full at the bound it
/// forwarded (its reservation), which is what an upstream honouring the bound costs.
fn owed(price: &ModelPrice, s: &Served) -> u64 {
    if s.status.is_some_and(|st| st >= 400) {
        cost(price, s).saturating_sub(beyond_bound(price, s))
    } else {
        cost(price, s)
    }
}

/// The charge a reservation ends with: what it was charged once terminal; while still held,
/// what its expiry will charge (a reservation left open is the `open` check's).
fn charge_of(r: &Seen) -> u64 {
    if r.terminal() {
        r.charged
    } else {
        r.reserved
    }
}

/// Every check, in the order the report lists them; and the spend figures.
pub fn run_checks(i: &Inputs<'_>) -> (Vec<Check>, Spend) {
    let mut harness = Check::new("harness", "the ground truth is whole");
    if i.served.evicted > 0 {
        let n = i.served.evicted;
        harness.fail(|| format!("the mock dropped {n} tags: its record is incomplete"));
    }
    for s in &i.served.served {
        if !i.record.tags.contains_key(&s.tag) {
            harness.fail(|| format!("the mock served tag {} that no guest sent", s.tag));
        }
    }
    let (overspend, spend) = overspend(i);
    let checks = vec![
        overspend,
        lost(i),
        books(i),
        open(i),
        codes(i),
        operator(i),
        harness,
    ];
    (checks, spend)
}

/// The session index of a tag's run.
fn session_of(i: &Inputs<'_>, tag: &str) -> Option<usize> {
    let t = i.record.tags.get(tag)?;
    i.record.runs.get(&t.run).copied()
}

/// Served cost (at spendgate's prices, beyond-bound excess aside) never exceeds the global
/// budget (less what the operator booked against it), an address's, or a session's.
fn overspend(i: &Inputs<'_>) -> (Check, Spend) {
    let mut c = Check::new(
        "overspend",
        "served <= every global, address and session budget",
    );
    let mut spend = Spend::default();
    let mut by_session: HashMap<usize, u64> = HashMap::new();
    let mut by_ip: BTreeMap<&str, u64> = BTreeMap::new();
    for s in &i.served.served {
        let excess = beyond_bound(&i.price, s);
        let counted = cost(&i.price, s).saturating_sub(excess);
        spend.beyond_bound += excess;
        if counted > 0 {
            spend.tags_served += 1;
        }
        spend.global_served += counted;
        if let Some(sess) = session_of(i, &s.tag) {
            *by_session.entry(sess).or_insert(0) += counted;
            *by_ip.entry(&i.record.sessions[sess].ip).or_insert(0) += counted;
        }
    }
    match &i.usage.global {
        Some(g) => {
            let booked = u64::try_from(i.record.squeeze.unwrap_or(0).max(0)).unwrap_or(0);
            let budget = g.limit.saturating_sub(booked);
            spend.global_budget = budget;
            if spend.global_served > budget {
                let served = spend.global_served;
                c.fail(|| format!("global: served {served} over its budget {budget}"));
            }
        }
        None => c.fail(|| "the global budget could not be read".into()),
    }
    let share = |(s, b): (u64, u64)| if b == 0 { 0.0 } else { s as f64 / b as f64 };
    for (sess, served) in &by_session {
        match i.usage.sessions.get(sess) {
            Some(l) => {
                if *served > l.limit {
                    let ip = &i.record.sessions[*sess].ip;
                    c.fail(|| {
                        format!(
                            "session #{sess} (from {ip}): served {served} over {}",
                            l.limit
                        )
                    });
                }
                if share((*served, l.limit)) > share(spend.session_max) {
                    spend.session_max = (*served, l.limit);
                }
            }
            None => c.fail(|| format!("session #{sess}: its usage could not be read")),
        }
    }
    for (ip, served) in &by_ip {
        match i.usage.ips.get(*ip) {
            Some(l) => {
                if *served > l.limit {
                    c.fail(|| format!("address {ip}: served {served} over {}", l.limit));
                }
                if share((*served, l.limit)) > share(spend.ip_max) {
                    spend.ip_max = (*served, l.limit);
                }
            }
            None => c.fail(|| format!("address {ip}: its usage could not be read")),
        }
    }
    (c, spend)
}

/// For every reservation the upstream served, spendgate charged at least what it served.
/// A proxied call whose answer never arrived (its replica was killed, its connection cut)
/// is known by its tag only: such calls are checked together, run by run, against the
/// reservations of the run that no answer named.
fn lost(i: &Inputs<'_>) -> Check {
    let mut c = Check::new("lost", "charged >= served, reservation by reservation");
    let named: HashSet<&str> = i
        .record
        .tags
        .values()
        .filter_map(|t| t.step.as_deref())
        .collect();
    let mut unnamed_served: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for s in &i.served.served {
        let served = owed(&i.price, s);
        if served == 0 {
            continue;
        }
        let Some(t) = i.record.tags.get(&s.tag) else {
            continue;
        };
        match &t.step {
            Some(step) => match i.observed.res.get(step) {
                Some(r) if charge_of(r) >= served => {}
                Some(r) => c.fail(|| {
                    format!(
                        "{} ({:?}, {} {}{}): served {served}, charged {} ({})",
                        s.tag,
                        t.route,
                        s.fault,
                        if s.stream { "stream" } else { "whole" },
                        if s.max_tokens.is_some_and(|m| s.completion_tokens > m) {
                            ", beyond its bound"
                        } else {
                            ""
                        },
                        charge_of(r),
                        r.state
                    )
                }),
                None => {
                    c.fail(|| format!("{}: served {served}, reservation {step} never seen", s.tag))
                }
            },
            None => {
                debug_assert_eq!(t.route, Route::Proxy);
                let e = unnamed_served.entry(&t.run).or_insert((0, 0));
                e.0 += served;
                e.1 += 1;
            }
        }
    }
    for (run, (served, calls)) in unnamed_served {
        let charged: u64 = i
            .observed
            .res
            .iter()
            .filter(|(id, r)| r.run == run && !named.contains(id.as_str()))
            .map(|(_, r)| charge_of(r))
            .sum();
        if charged < served {
            c.fail(|| {
                format!("run {run}: {calls} unanswered calls served {served}, its unnamed reservations charged {charged}")
            });
        }
    }
    c
}

/// The books reconcile: each scope's used spend is the sum of what its reservations were
/// charged (committed, unknown, expired; released charge nothing) plus what the operator
/// booked; unknown and expired charge in full; a reservation ends once.
fn books(i: &Inputs<'_>) -> Check {
    let mut c = Check::new(
        "books",
        "used = committed + unknown + expired, scope by scope",
    );
    let mut by_session: HashMap<usize, u64> = HashMap::new();
    let mut by_ip: HashMap<&str, u64> = HashMap::new();
    let mut global: u64 = 0;
    for (id, r) in &i.observed.res {
        let charged = if r.terminal() { r.charged } else { 0 };
        match r.state.as_str() {
            "unknown" | "expired" if r.charged < r.reserved => c.fail(|| {
                format!(
                    "{id}: {} charged {} of its {} (not in full)",
                    r.state, r.charged, r.reserved
                )
            }),
            "released" if r.charged != 0 => {
                c.fail(|| format!("{id}: released, yet charged {}", r.charged))
            }
            _ => {}
        }
        global += charged;
        match i.record.runs.get(&r.run) {
            Some(sess) => {
                *by_session.entry(*sess).or_insert(0) += charged;
                *by_ip.entry(&i.record.sessions[*sess].ip).or_insert(0) += charged;
            }
            None => c.fail(|| format!("{id}: of run {}, which no guest opened", r.run)),
        }
    }
    for f in &i.observed.flips {
        c.fail(|| format!("a reservation ended twice: {f}"));
    }
    c.violations += i
        .observed
        .flip_count
        .saturating_sub(i.observed.flips.len() as u64);
    match (&i.usage.global, i.record.squeeze_unknown) {
        (_, true) => {}
        (Some(g), false) => {
            let booked = u64::try_from(i.record.squeeze.unwrap_or(0).max(0)).unwrap_or(0);
            if g.used != global + booked {
                c.fail(|| {
                    format!(
                        "global: used {}, its reservations charged {global} (+{booked} booked)",
                        g.used
                    )
                });
            }
        }
        (None, false) => c.fail(|| "global: usage could not be read".into()),
    }
    for sess in by_session.keys() {
        if !i.usage.sessions.contains_key(sess) {
            c.fail(|| format!("session #{sess}: its usage could not be read"));
        }
    }
    for (sess, line) in &i.usage.sessions {
        let charged = by_session.get(sess).copied().unwrap_or(0);
        if line.used != charged {
            c.fail(|| {
                format!(
                    "session #{sess}: used {}, its reservations charged {charged}",
                    line.used
                )
            });
        }
    }
    for (ip, line) in &i.usage.ips {
        let charged = by_ip.get(ip.as_str()).copied().unwrap_or(0);
        if line.used != charged {
            c.fail(|| {
                format!(
                    "address {ip}: used {}, its reservations charged {charged}",
                    line.used
                )
            });
        }
    }
    c
}

/// After the load stops and the leases' TTL passes, nothing is held: no reservation, no
/// run's slots, no hold on any scope.
fn open(i: &Inputs<'_>) -> Check {
    let mut c = Check::new("open", "nothing held after the lease TTL");
    if !i.end.read {
        c.fail(|| "the summary could not be read at the end".into());
    }
    if i.end.held > 0 {
        let n = i.end.held;
        c.fail(|| format!("{n} reservations still held"));
    }
    if i.end.runs_active > 0 {
        let n = i.end.runs_active;
        c.fail(|| format!("{n} runs still active (holding their slots)"));
    }
    let held_seen = i.observed.res.values().filter(|r| !r.terminal()).count();
    if held_seen > 0 && i.end.held == 0 {
        c.fail(|| format!("{held_seen} reservations last listed as held were never seen to end"));
    }
    let lines = i
        .usage
        .global
        .iter()
        .map(|l| ("global".to_string(), l))
        .chain(
            i.usage
                .ips
                .iter()
                .map(|(ip, l)| (format!("address {ip}"), l)),
        )
        .chain(
            i.usage
                .sessions
                .iter()
                .map(|(s, l)| (format!("session #{s}"), l)),
        );
    for (name, l) in lines {
        if l.reserved > 0 {
            c.fail(|| format!("{name}: {} still reserved", l.reserved));
        }
    }
    c
}

/// Every refusal carried an error code of the contract, in the error shape.
fn codes(i: &Inputs<'_>) -> Check {
    let mut c = Check::new(
        "codes",
        "every refusal in the error shape, with a contract code",
    );
    c.violations = i.record.bad_answers;
    c.examples = i.record.bad_examples.clone();
    c
}

/// The operator's calls (and another address's session creation) were never refused for
/// capacity during a flood.
fn operator(i: &Inputs<'_>) -> Check {
    let mut c = Check::new(
        "operator",
        "no operator call refused for capacity in a flood",
    );
    c.violations = i.record.probes.refused + i.record.probes.other_refused;
    c.examples = i.record.probes.examples.clone();
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{SessionInfo, TagInfo};
    use spendgate_core::Micros;

    fn price() -> ModelPrice {
        ModelPrice {
            input_per_million: Micros(10_000_000),
            cached_input_per_million: Micros(5_000_000),
            output_per_million: Micros(30_000_000),
        }
    }

    fn served(tag: &str, prompt: u64, completion: u64, max: u64) -> Served {
        Served {
            tag: tag.into(),
            requests: 1,
            prompt_tokens: prompt,
            completion_tokens: completion,
            max_tokens: Some(max),
            status: Some(200),
            finished: true,
            fault: "none".into(),
            ..Served::default()
        }
    }

    fn seen(run: &str, state: &str, reserved: u64, charged: u64) -> Seen {
        Seen {
            run: run.into(),
            kind: "model:chaos-model".into(),
            state: state.into(),
            reserved,
            charged,
        }
    }

    fn line(kind: &str, limit: u64, used: u64) -> Line {
        Line {
            kind: kind.into(),
            limit,
            used,
            reserved: 0,
        }
    }

    /// One session on one address with one run of a decision step (tag = step "s1") and a
    /// proxied call whose answer was lost (tag "p1", its reservation "s2" unnamed).
    fn world() -> (Record, Observed, Usage, ServedTags) {
        let mut rec = Record::default();
        rec.sessions.push(SessionInfo {
            token: "t".into(),
            ip: "10.77.0.1".into(),
        });
        rec.runs.insert("r1".into(), 0);
        rec.tags.insert(
            "s1".into(),
            TagInfo {
                run: "r1".into(),
                route: Route::Decision,
                step: Some("s1".into()),
            },
        );
        rec.tags.insert(
            "p1".into(),
            TagInfo {
                run: "r1".into(),
                route: Route::Proxy,
                step: None,
            },
        );
        let mut obs = Observed::default();
        // s1: 10 prompt + 4 completion = 220; s2 expired at its 1000.
        obs.res
            .insert("s1".into(), seen("r1", "committed", 500, 220));
        obs.res
            .insert("s2".into(), seen("r1", "expired", 1000, 1000));
        let usage = Usage {
            global: Some(line("global", 100_000, 1220)),
            sessions: HashMap::from([(0, line("session", 5000, 1220))]),
            ips: HashMap::from([("10.77.0.1".to_string(), line("ip", 5000, 1220))]),
        };
        let served = ServedTags {
            served: vec![served("s1", 10, 4, 16), served("p1", 20, 8, 16)],
            evicted: 0,
        };
        (rec, obs, usage, served)
    }

    fn check(
        rec: &Record,
        obs: &Observed,
        usage: &Usage,
        served: &ServedTags,
    ) -> BTreeMap<&'static str, u64> {
        let (checks, _) = run_checks(&Inputs {
            served,
            record: rec,
            observed: obs,
            usage,
            end: End {
                held: 0,
                runs_active: 0,
                read: true,
            },
            price: price(),
        });
        checks.into_iter().map(|c| (c.name, c.violations)).collect()
    }

    #[test]
    fn a_sound_world_passes_every_check() {
        let (rec, obs, usage, served) = world();
        let v = check(&rec, &obs, &usage, &served);
        assert!(v.values().all(|n| *n == 0), "{v:?}");
    }

    #[test]
    fn each_check_catches_its_fault() {
        // Charged less than served.
        let (rec, mut obs, usage, served) = world();
        obs.res
            .insert("s1".into(), seen("r1", "committed", 500, 100));
        assert_eq!(check(&rec, &obs, &usage, &served)["lost"], 1);
        // An unanswered call served more than the run's unnamed reservations charged.
        let (rec, mut obs, mut usage, served) = world();
        obs.res.insert("s2".into(), seen("r1", "released", 1000, 0));
        usage.global = Some(line("global", 100_000, 220));
        usage.sessions.insert(0, line("session", 5000, 220));
        usage.ips.insert("10.77.0.1".into(), line("ip", 5000, 220));
        let v = check(&rec, &obs, &usage, &served);
        assert_eq!((v["lost"], v["books"]), (1, 0));
        // Served over a session's budget.
        let (rec, obs, mut usage, served) = world();
        usage.sessions.insert(0, line("session", 300, 1220));
        assert_eq!(check(&rec, &obs, &usage, &served)["overspend"], 1);
        // Used that does not match the reservations.
        let (rec, obs, mut usage, served) = world();
        usage.ips.insert("10.77.0.1".into(), line("ip", 5000, 220));
        assert_eq!(check(&rec, &obs, &usage, &served)["books"], 1);
        // Expired but not charged in full.
        let (rec, mut obs, usage, served) = world();
        obs.res.insert("s2".into(), seen("r1", "expired", 1000, 0));
        assert!(check(&rec, &obs, &usage, &served)["books"] >= 1);
        // Something still reserved.
        let (rec, obs, mut usage, served) = world();
        usage.global.as_mut().expect("global").reserved = 5;
        assert_eq!(check(&rec, &obs, &usage, &served)["open"], 1);
    }

    #[test]
    fn output_beyond_the_bound_never_delivered_is_owed_at_the_bound() {
        let p = price();
        let delivered = Served {
            tag: "t".into(),
            requests: 1,
            prompt_tokens: 10,
            completion_tokens: 100,
            max_tokens: Some(16),
            status: Some(200),
            finished: true,
            fault: "none".into(),
            ..Served::default()
        };
        assert_eq!(owed(&p, &delivered), cost(&p, &delivered));
        let undelivered = Served {
            status: Some(504),
            finished: false,
            fault: "http_504".into(),
            ..delivered.clone()
        };
        assert_eq!(owed(&p, &undelivered), 10 * 10 + 16 * 30);
    }

    #[test]
    fn cost_beyond_the_bound_is_not_an_overspend() {
        let (rec, obs, mut usage, mut served) = world();
        // 100 completion tokens against a bound of 16: 84 beyond it, 2520 micros.
        served.served[0] = served_with(100);
        let p = price();
        assert_eq!(beyond_bound(&p, &served.served[0]), 84 * 30);
        usage.sessions.insert(0, line("session", 1220, 1220));
        let v = check(&rec, &obs, &usage, &served);
        assert_eq!(v["overspend"], 0);
        assert_eq!(v["lost"], 1, "yet charged below what was served");
    }

    fn served_with(completion: u64) -> Served {
        served("s1", 10, completion, 16)
    }
}
