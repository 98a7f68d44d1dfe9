//! A proxied step's hold, from its reservation until it is settled: the lease renewed
//! meanwhile, the settlement never below what was shown, retried when the store is away.

use crate::bounds::{LEASE_RENEWAL_MIN, SETTLE_RETRIES_MAX, SETTLE_RETRY_PAUSES};
use crate::responses::HostedSeen;
use serde_json::Value;
use spendgate_core::{
    Applied, Command, Micros, ModelPrice, Reply, ReservationId, Resolution, Resolved, RunId,
    Settlement, TokenUsage, UnixMs,
};
use spendgate_http::{AppState, Shared};
use spendgate_store::StoreError;
use spendgate_tokens::OutputTally;
use spendgate_wire::plant;
use std::time::Duration;

/// Resolutions being retried now (bounded by [`SETTLE_RETRIES_MAX`]).
pub(crate) static SETTLE_RETRIES: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// One slot of [`SETTLE_RETRIES`], given back on drop.
pub(crate) struct RetrySlot;

impl RetrySlot {
    pub(crate) fn take() -> Option<RetrySlot> {
        use std::sync::atomic::Ordering;
        SETTLE_RETRIES
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < SETTLE_RETRIES_MAX).then_some(n + 1)
            })
            .ok()
            .map(|_| RetrySlot)
    }
}

impl Drop for RetrySlot {
    fn drop(&mut self) {
        SETTLE_RETRIES.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Resolves a step exactly once; if dropped unresolved (client gone, task cancelled), the
/// step is resolved from the usage already read whole, else marked `unknown` (charged in
/// full; or at a usage read that costs more, see [`StepGuard::unsure`]), and a one-step run
/// is finished. Resolution runs on its own task, so a client going
/// away while the store answers cannot cut it short. While the step is unresolved, its run's
/// lease is renewed, so that a call longer than `store.lease_ttl_s` keeps its slots (one
/// generation per conversation) and is not expired under a live holder; the lease never
/// outlives the run's deadline, which bounds the call.
pub(crate) struct StepGuard {
    pub(crate) state: Shared,
    pub(crate) step: Option<ReservationId>,
    pub(crate) run: Option<RunId>,
    /// A usage the proxy finished reading (trusted even if the stream is cut later).
    pub(crate) usage: Option<TokenUsage>,
    /// The largest usage read, trusted or not (see [`StepGuard::unsure`]).
    pub(crate) seen: Option<TokenUsage>,
    /// The step's price and reservation: what a usage read would cost, against the hold.
    pub(crate) price: ModelPrice,
    pub(crate) reserved: Micros,
    /// The prompt bound and the output bound the step reserved for.
    pub(crate) prompt_bound: u64,
    pub(crate) bound: u64,
    /// The output counted so far (see [`StepGuard::settlement`]).
    pub(crate) output: OutputTally,
    /// The task renewing the run's lease; stopped when the step is resolved.
    pub(crate) renewal: Option<tokio::task::AbortHandle>,
    /// The run's deadline once known ([`StepGuard::stopped`], [`StepGuard::deadline`]).
    pub(crate) stop: tokio::sync::watch::Receiver<Option<tokio::time::Instant>>,
    /// Set when the run was found ended under the call ([`StepGuard::stopped`]).
    pub(crate) ended: tokio::sync::watch::Receiver<bool>,
    /// The hosted tools' steps reserved with the call (`/v1/responses`), settled with it.
    pub(crate) hosted: Vec<HostedHold>,
    /// The hosted calls the answer showed so far.
    pub(crate) hosted_seen: HostedSeen,
}

/// The local instant of a store time (the store's clock is this machine's, or Redis's).
pub(crate) fn instant_of(at: UnixMs) -> tokio::time::Instant {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    tokio::time::Instant::now() + Duration::from_millis(at.0.saturating_sub(now_ms))
}

impl StepGuard {
    /// `deadline`: the run's, when the caller knows it (a run the proxy opened); else the
    /// first renewal, at once, learns it.
    pub(crate) fn new(
        state: Shared,
        hold: Hold,
        run_id: RunId,
        own_run: bool,
        deadline: Option<UnixMs>,
    ) -> StepGuard {
        // A third of the lease: two renewals may fail or be late before it runs out.
        let every = (state.config.store.lease_ttl / 3).max(LEASE_RENEWAL_MIN);
        let (stop_tx, stop) = tokio::sync::watch::channel(deadline.map(instant_of));
        let (ended_tx, ended) = tokio::sync::watch::channel(false);
        let renewal = {
            let state = state.clone();
            let run_id = run_id.clone();
            tokio::spawn(async move {
                let mut known = deadline.is_some();
                loop {
                    if known {
                        tokio::time::sleep(every).await;
                    }
                    match state.store.heartbeat(run_id.clone()).await {
                        Ok(a) => {
                            known = true;
                            let _ = stop_tx.send(Some(instant_of(a.value.deadline)));
                            // At its deadline: the lease can grow no more.
                            if a.value.lease_until >= a.value.deadline {
                                return;
                            }
                        }
                        // The run has ended (finished, expired): its holds were settled
                        // without this call, which must stop now.
                        Err(StoreError::Ledger(e, _)) => {
                            tracing::warn!(error = %e, run = %run_id.0, "a proxied call's run ended under it; stopping the call");
                            let _ = ended_tx.send(true);
                            return;
                        }
                        Err(e) => {
                            known = true;
                            tracing::warn!(error = %e, run = %run_id.0, "could not renew a proxied run's lease")
                        }
                    }
                }
            })
            .abort_handle()
        };
        StepGuard {
            state,
            step: Some(hold.step),
            run: own_run.then_some(run_id),
            usage: None,
            seen: None,
            price: hold.price,
            reserved: hold.reserved,
            prompt_bound: hold.prompt_bound,
            bound: hold.bound,
            output: OutputTally::default(),
            renewal: Some(renewal),
            stop,
            ended,
            hosted: hold.hosted,
            hosted_seen: HostedSeen::default(),
        }
    }

    /// Completes when the call must stop: at the run's deadline (a run never exceeds its
    /// seconds, I5; past it, its lease is over and its holds are charged, so paid work must
    /// not go on), or when the run ended under the call.
    pub(crate) fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (deadline, mut ended) = (self.deadline(), self.ended.clone());
        async move {
            let ended = async move {
                if ended.wait_for(|e| *e).await.is_err() {
                    // The renewal stopped without finding the run ended: only the deadline.
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = deadline => {}
                () = ended => {}
            }
        }
    }

    /// Completes at the run's deadline only. A drain of what an upstream already sent
    /// ([`crate::sse::drain`]) goes on when the run ends under it (the output it reads was
    /// served, and a late overrun still charges it), but never past the deadline.
    pub(crate) fn deadline(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.clone();
        async move {
            loop {
                let at = *rx.borrow_and_update();
                let changed = async {
                    if rx.changed().await.is_err() {
                        // No more news: the last word stands.
                        std::future::pending::<()>().await;
                    }
                };
                match at {
                    Some(at) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(at) => return,
                            _ = changed => {}
                        }
                    }
                    None => changed.await,
                }
            }
        }
    }

    /// How to resolve the step from what was observed (see [`settlement`]).
    pub(crate) fn settlement(
        &self,
        trusted: Option<TokenUsage>,
        seen: Option<TokenUsage>,
        output: OutputTally,
    ) -> Resolution {
        settlement(
            (self.price, self.reserved),
            (self.prompt_bound, self.bound),
            Observed {
                trusted,
                seen,
                output,
            },
        )
    }

    pub(crate) fn take(&mut self) -> Option<(ReservationId, Option<RunId>)> {
        if let Some(r) = self.renewal.take() {
            r.abort();
        }
        let step = self.step.take()?;
        Some((step, self.run.take()))
    }

    /// The resolutions of the hosted tools' steps, when the call's step is resolved `how`
    /// (see [`hosted_settlement`]); emptied.
    fn take_hosted(&mut self, how: &Resolution) -> Vec<(ReservationId, Resolution)> {
        let seen = std::mem::take(&mut self.hosted_seen);
        std::mem::take(&mut self.hosted)
            .into_iter()
            .map(|h| {
                let how = hosted_settlement(&h, how, &seen);
                (h.step, how)
            })
            .collect()
    }

    /// Resolves a step (and finishes a one-step run). When the store cannot be reached, the
    /// resolution is tried again in the background, [`SETTLE_RETRY_PAUSES`] apart: the hold
    /// stays until then, and expires charged in full if no retry lands first (I3).
    pub(crate) async fn settle(
        state: Shared,
        step: ReservationId,
        run: Option<RunId>,
        how: Resolution,
        hosted: Vec<(ReservationId, Resolution)>,
    ) -> Option<Applied<Resolved>> {
        let step_name = step.0.clone();
        let mut cmds = vec![Command::Resolve { step, how }];
        for (step, how) in hosted {
            cmds.push(Command::Resolve { step, how });
        }
        if let Some(run) = run {
            cmds.push(Command::Finish { run });
        }
        match Self::settle_once(&state, cmds.clone(), &step_name, false).await {
            Ok(a) => Some(a),
            Err(e @ (StoreError::Unavailable(_) | StoreError::Timeout(_))) => {
                let Some(slot) = RetrySlot::take() else {
                    tracing::warn!(error = %e, step = %step_name, "could not resolve a proxied step, and {SETTLE_RETRIES_MAX} retries are pending already; it will expire and be charged in full");
                    return None;
                };
                tracing::warn!(error = %e, step = %step_name, "could not resolve a proxied step; retrying (else it expires and is charged in full)");
                tokio::spawn(async move {
                    let _slot = slot;
                    for pause in SETTLE_RETRY_PAUSES {
                        tokio::time::sleep(pause).await;
                        match Self::settle_once(&state, cmds.clone(), &step_name, true).await {
                            Ok(_) => return,
                            Err(StoreError::Unavailable(_) | StoreError::Timeout(_)) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, step = %step_name, "could not resolve a proxied step on a retry; it will expire and be charged in full");
                                return;
                            }
                        }
                    }
                    tracing::warn!(step = %step_name, "could not resolve a proxied step after retries; it will expire and be charged in full");
                });
                None
            }
            Err(e) => {
                // The hold stays; it expires and is charged in full.
                tracing::warn!(error = %e, "could not resolve a proxied step; it will expire and be charged in full");
                None
            }
        }
    }

    /// One attempt of [`StepGuard::settle`]; counts and alerts what it applied. `retried`: an
    /// earlier attempt failed, so an answer that repeats an outcome repeats that attempt's
    /// (it applied after all), which nobody counted yet.
    pub(crate) async fn settle_once(
        state: &AppState,
        cmds: Vec<Command>,
        step_name: &str,
        retried: bool,
    ) -> Result<Applied<Resolved>, StoreError> {
        let mut answers = state.store.execute_many(cmds).await.into_iter();
        let mut r = match answers.next() {
            Some(Ok(Reply::Resolved(a))) => Ok(a),
            Some(Ok(other)) => Err(StoreError::Unavailable(format!(
                "unexpected answer {other:?}"
            ))),
            Some(Err(e)) => Err(e),
            None => Err(StoreError::Unavailable("no answer".into())),
        };
        if let Ok(call) = r.as_mut() {
            // The hosted tools' resolutions (the call's charge and hold include theirs), then
            // the one-step run's finish.
            for answer in answers {
                if let Ok(Reply::Resolved(t)) = &answer {
                    call.value.charged = call.value.charged.add_capped(t.value.charged);
                    call.value.reserved = call.value.reserved.add_capped(t.value.reserved);
                }
                match answer {
                    Err(e) => {
                        tracing::warn!(error = %e, "could not resolve a hosted tool's step or finish a one-step proxy run; what stays held expires, charged in full");
                    }
                    Ok(Reply::Resolved(t)) if (!t.value.repeated || retried) && t.value.overrun => {
                        state.metrics.overrun();
                        state
                            .alerts
                            .overrun(step_name, t.value.reserved.0, t.value.charged.0);
                        tracing::warn!(
                            charged = t.value.charged.0,
                            reserved = t.value.reserved.0,
                            "overrun: an upstream made more hosted tool calls than reserved, charged in full"
                        );
                    }
                    Ok(_) => {}
                }
            }
        }
        let a = r?;
        // (unknown outcomes are counted from the history, whoever resolved them)
        if (!a.value.repeated || retried) && a.value.overrun {
            state.metrics.overrun();
            state
                .alerts
                .overrun(step_name, a.value.reserved.0, a.value.charged.0);
            tracing::warn!(
                charged = a.value.charged.0,
                reserved = a.value.reserved.0,
                "overrun: upstream usage above the reservation, charged in full"
            );
        }
        Ok(a)
    }

    pub(crate) async fn resolve(mut self, how: Resolution) -> Option<Applied<Resolved>> {
        let (step, run) = self.take()?;
        let hosted = self.take_hosted(&how);
        let state = self.state.clone();
        tokio::spawn(Self::settle(state, step, run, how, hosted))
            .await
            .ok()
            .flatten()
    }
}

impl Drop for StepGuard {
    fn drop(&mut self) {
        let Some((step, run)) = self.take() else {
            return;
        };
        let how = if self.usage.is_none() && plant::on(plant::Plant::DropReleases) {
            Resolution::Release
        } else {
            self.settlement(self.usage, self.seen, self.output)
        };
        let hosted = self.take_hosted(&how);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(Self::settle(self.state.clone(), step, run, how, hosted));
        }
    }
}

/// What a proxied step's hold covers.
pub(crate) struct Hold {
    pub(crate) step: ReservationId,
    pub(crate) price: ModelPrice,
    pub(crate) reserved: Micros,
    /// The prompt bound reserved for.
    pub(crate) prompt_bound: u64,
    /// The output bound forwarded.
    pub(crate) bound: u64,
    /// The hosted tools' steps reserved with the call.
    pub(crate) hosted: Vec<HostedHold>,
}

/// A hosted tool's step, reserved with a `/v1/responses` call for `calls` calls.
#[derive(Clone, Debug)]
pub(crate) struct HostedHold {
    pub(crate) step: ReservationId,
    /// The output item type of its calls (`web_search_call`).
    pub(crate) call_type: String,
    /// The calls reserved (the `max_tool_calls` forwarded).
    pub(crate) calls: u64,
}

/// How a hosted tool's step ends, with its call's step resolved `how`: released with it (no
/// work was done); committed at the calls the answer showed when they were all seen (the
/// answer read whole, or its stream's final event), none included; else charged in full
/// (`unknown`), or committed at the calls seen when more than were reserved (an upstream past
/// its `max_tool_calls`: an overrun, SPEC I1b).
pub(crate) fn hosted_settlement(
    hold: &HostedHold,
    how: &Resolution,
    seen: &HostedSeen,
) -> Resolution {
    if matches!(how, Resolution::Release) {
        return Resolution::Release;
    }
    let calls = seen.calls.get(&hold.call_type).copied().unwrap_or(0);
    if seen.whole || calls > hold.calls {
        Resolution::Commit(Settlement::Units(calls))
    } else {
        Resolution::Unknown
    }
}

/// What the proxy observed of a step's answer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Observed {
    /// A usage that covers the whole answer (read whole, nothing after it).
    pub(crate) trusted: Option<TokenUsage>,
    /// The largest usage read, trusted or not.
    pub(crate) seen: Option<TokenUsage>,
    /// The output counted ([`OutputCounter`]).
    pub(crate) output: OutputTally,
}

/// How a proxied step ends, never charged below what the upstream is shown to have served
/// (SPEC I1b):
/// - a trusted usage is committed, its completion tokens never below the output counted
///   ([`OutputTally::floor`]: an upstream that reports less than it sent is charged what
///   it sent);
/// - without one (no usage, a usage followed by more content, a stream cut, an error
///   event), the step is `unknown`, charged its reservation, unless the usage read (or the
///   prompt bound, without one) with the output counted costs more: that is committed, an
///   overrun (charged, counted and alerted). The output counted is the floor while it is
///   within the bound (an upstream that kept to its bound is covered by the reservation),
///   and the most the text can have cost ([`OutputTally::upper`]) once the floor shows the
///   upstream went past it.
pub(crate) fn settlement(
    (price, reserved): (ModelPrice, Micros),
    (prompt_bound, bound): (u64, u64),
    o: Observed,
) -> Resolution {
    if let Some(u) = o.trusted {
        return Resolution::Commit(Settlement::Tokens(TokenUsage {
            completion_tokens: u.completion_tokens.max(o.output.floor),
            ..u
        }));
    }
    let counted = if o.output.floor > bound {
        o.output.upper
    } else {
        o.output.floor
    };
    let base = o.seen.unwrap_or(TokenUsage {
        prompt_tokens: prompt_bound,
        completion_tokens: 0,
        cached_tokens: 0,
    });
    let u = TokenUsage {
        completion_tokens: base.completion_tokens.max(counted),
        ..base
    };
    if price.charge(&u) > reserved {
        Resolution::Commit(Settlement::Tokens(u))
    } else {
        Resolution::Unknown
    }
}

pub(crate) fn usage_of(v: &Value) -> Option<TokenUsage> {
    let u = v.get("usage")?;
    if u.is_null() {
        return None;
    }
    let prompt_tokens = u.get("prompt_tokens")?.as_u64()?;
    let mut completion_tokens = u.get("completion_tokens")?.as_u64()?;
    // OpenAI counts reasoning tokens inside `completion_tokens`. A usage that reports more
    // reasoning than completion tokens cannot be read that way: both are charged.
    let reasoning = u
        .get("completion_tokens_details")
        .and_then(|d| d.get("reasoning_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    if reasoning > completion_tokens {
        completion_tokens = completion_tokens.saturating_add(reasoning);
    }
    // Some providers (xAI's) count reasoning outside `completion_tokens` but inside
    // `total_tokens`: whatever the total holds beyond the prompt was generated.
    if let Some(total) = u.get("total_tokens").and_then(Value::as_u64) {
        completion_tokens = completion_tokens.max(total.saturating_sub(prompt_tokens));
    }
    let details = u.get("prompt_tokens_details");
    let detail = |k: &str| {
        details
            .and_then(|d| d.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    // Cache writes (OpenRouter's `cache_write_tokens`) are billed above the input price (up
    // to twice it): each is charged once more at the input price.
    let prompt_tokens = prompt_tokens.saturating_add(detail("cache_write_tokens"));
    Some(TokenUsage {
        prompt_tokens,
        completion_tokens,
        cached_tokens: detail("cached_tokens"),
    })
}
