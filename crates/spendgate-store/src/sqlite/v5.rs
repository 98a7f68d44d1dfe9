//! Reading files of schema versions 4, 5 and 6. Versions 4 and 5's run records listed the
//! run's steps (a list that grew with every step, so a run's tenth step rewrote ten ids).
//! Version 6 keeps that list in memory only and rebuilds it from the reservations at open.
//! Version 7 appends the run's tally (`Run::tally`, for the usage history), which older runs
//! load empty. Every other record has the same layout in all four versions.

use serde::{Deserialize, Serialize};
use spendgate_core::{
    IpScope, Record, ReservationId, ReservationMode, RunBounds, RunId, RunState, ScopeKey, UnixMs,
};

/// `Record::Run`'s variant index, which postcard writes as the record's first byte (a
/// varint below 128). A unit test checks it against the current `Record`.
pub(super) const RUN_VARIANT: u8 = 3;

/// A run's record as versions 4 and 5 wrote it: the fields of today's `Run` with `steps`
/// between `slots` and `hold` (postcard is positional: the order is the layout).
#[derive(Serialize, Deserialize)]
struct Run {
    id: RunId,
    session: String,
    conversation: String,
    ips: Vec<IpScope>,
    created: UnixMs,
    deadline: UnixMs,
    lease_until: UnixMs,
    rounds: u32,
    tool_calls: u32,
    retries: u32,
    state: RunState,
    ended_at: Option<UnixMs>,
    slots: Vec<ScopeKey>,
    steps: Vec<ReservationId>,
    hold: Option<ReservationId>,
    bounds: RunBounds,
    mode: ReservationMode,
}

impl From<Run> for spendgate_core::Run {
    fn from(r: Run) -> spendgate_core::Run {
        // `steps` is dropped: the ledger lists a run's steps from its reservations.
        spendgate_core::Run {
            id: r.id,
            session: r.session,
            conversation: r.conversation,
            ips: r.ips,
            created: r.created,
            deadline: r.deadline,
            lease_until: r.lease_until,
            rounds: r.rounds,
            tool_calls: r.tool_calls,
            retries: r.retries,
            state: r.state,
            ended_at: r.ended_at,
            slots: r.slots,
            hold: r.hold,
            bounds: r.bounds,
            mode: r.mode,
            tally: spendgate_core::RunTally::default(),
        }
    }
}

/// A run's record as version 6 wrote it: today's `Run` without its tally.
#[derive(Serialize, Deserialize)]
struct RunV6 {
    id: RunId,
    session: String,
    conversation: String,
    ips: Vec<IpScope>,
    created: UnixMs,
    deadline: UnixMs,
    lease_until: UnixMs,
    rounds: u32,
    tool_calls: u32,
    retries: u32,
    state: RunState,
    ended_at: Option<UnixMs>,
    slots: Vec<ScopeKey>,
    hold: Option<ReservationId>,
    bounds: RunBounds,
    mode: ReservationMode,
}

impl From<RunV6> for spendgate_core::Run {
    fn from(r: RunV6) -> spendgate_core::Run {
        spendgate_core::Run {
            id: r.id,
            session: r.session,
            conversation: r.conversation,
            ips: r.ips,
            created: r.created,
            deadline: r.deadline,
            lease_until: r.lease_until,
            rounds: r.rounds,
            tool_calls: r.tool_calls,
            retries: r.retries,
            state: r.state,
            ended_at: r.ended_at,
            slots: r.slots,
            hold: r.hold,
            bounds: r.bounds,
            mode: r.mode,
            tally: spendgate_core::RunTally::default(),
        }
    }
}

/// The layout of an older file's run records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Old {
    /// Versions 4 and 5: with the run's steps.
    V5,
    /// Version 6: without the run's tally.
    V6,
}

/// Decodes one record of the old layout from the front of `bytes`.
pub(super) fn take_record(bytes: &[u8], old: Old) -> postcard::Result<(Record, &[u8])> {
    match (bytes.split_first(), old) {
        (Some((&RUN_VARIANT, rest)), Old::V5) => {
            let (run, rest) = postcard::take_from_bytes::<Run>(rest)?;
            Ok((Record::Run(run.into()), rest))
        }
        (Some((&RUN_VARIANT, rest)), Old::V6) => {
            let (run, rest) = postcard::take_from_bytes::<RunV6>(rest)?;
            Ok((Record::Run(run.into()), rest))
        }
        _ => postcard::take_from_bytes(bytes),
    }
}

/// One log entry: a record's key and the record (`None`: deleted).
pub(super) type Entry = (String, Option<Record>);

/// Decodes one log entry of the old layout from the front of `bytes`.
pub(super) fn take_entry(bytes: &[u8], old: Old) -> postcard::Result<(Entry, &[u8])> {
    let (key, rest) = postcard::take_from_bytes::<String>(bytes)?;
    match rest.split_first() {
        Some((0, rest)) => Ok(((key, None), rest)),
        Some((1, rest)) => {
            let (record, rest) = take_record(rest, old)?;
            Ok(((key, Some(record)), rest))
        }
        _ => Err(postcard::Error::DeserializeBadOption),
    }
}

/// Encodes `run` as version 6 wrote it (for the tests that make an old file).
#[doc(hidden)]
pub fn encode_run_v6(run: &spendgate_core::Run) -> postcard::Result<Vec<u8>> {
    let old = RunV6 {
        id: run.id.clone(),
        session: run.session.clone(),
        conversation: run.conversation.clone(),
        ips: run.ips.clone(),
        created: run.created,
        deadline: run.deadline,
        lease_until: run.lease_until,
        rounds: run.rounds,
        tool_calls: run.tool_calls,
        retries: run.retries,
        state: run.state,
        ended_at: run.ended_at,
        slots: run.slots.clone(),
        hold: run.hold.clone(),
        bounds: run.bounds,
        mode: run.mode,
    };
    let mut bytes = vec![RUN_VARIANT];
    bytes.extend(postcard::to_allocvec(&old)?);
    Ok(bytes)
}

/// Encodes `run` with `steps` as versions 4 and 5 wrote it (for the tests that make an old
/// file).
#[doc(hidden)]
pub fn encode_run(
    run: &spendgate_core::Run,
    steps: Vec<ReservationId>,
) -> postcard::Result<Vec<u8>> {
    let old = Run {
        id: run.id.clone(),
        session: run.session.clone(),
        conversation: run.conversation.clone(),
        ips: run.ips.clone(),
        created: run.created,
        deadline: run.deadline,
        lease_until: run.lease_until,
        rounds: run.rounds,
        tool_calls: run.tool_calls,
        retries: run.retries,
        state: run.state,
        ended_at: run.ended_at,
        slots: run.slots.clone(),
        steps,
        hold: run.hold.clone(),
        bounds: run.bounds,
        mode: run.mode,
    };
    let mut bytes = vec![RUN_VARIANT];
    bytes.extend(postcard::to_allocvec(&old)?);
    Ok(bytes)
}
