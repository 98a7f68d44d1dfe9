// Every error answer of spendgate as a typed exception (docs/errors.md).

import type { ErrorBody } from "./types.js";

export interface SpendgateErrorInit {
  status?: number | undefined;
  code?: string | undefined;
  scope?: string | null | undefined;
  retryAfterS?: number | null | undefined;
  ledgerSeq?: number | null | undefined;
  body?: unknown;
}

/**
 * Base of every error this package throws. `status` is the HTTP status (undefined when no
 * answer came), `code` the error code (match on it, not on `message`), `scope` the scope
 * that refused or null, `retryAfterS` the `Retry-After` seconds or null, `ledgerSeq` the
 * ledger's sequence number when the refusal changed the ledger, `body` the decoded answer.
 */
export class SpendgateError extends Error {
  readonly status: number | undefined;
  readonly code: string;
  readonly scope: string | null;
  readonly retryAfterS: number | null;
  readonly ledgerSeq: number | null;
  readonly body: unknown;

  constructor(message: string, init: SpendgateErrorInit = {}) {
    super(message);
    this.name = new.target.name;
    this.status = init.status;
    this.code = init.code ?? "";
    this.scope = init.scope ?? null;
    this.retryAfterS = init.retryAfterS ?? null;
    this.ledgerSeq = init.ledgerSeq ?? null;
    this.body = init.body;
  }
}

/** No answer from spendgate after every retry (connection refused, reset, timeout). */
export class SpendgateConnectionError extends SpendgateError {}

/** A limit refused to admit paid work: do not do the work. */
export class SpendgateRefusal extends SpendgateError {}
/** 429 `rate_limited`: a request rate; retry after `retryAfterS`. */
export class RateLimited extends SpendgateRefusal {}
/** 429 `concurrency_limited`: too many active runs in a scope. */
export class ConcurrencyLimited extends SpendgateRefusal {}
/** 429 `budget_exhausted`: a budget is spent until its window resets. */
export class BudgetExhausted extends SpendgateRefusal {}
/** 429 `budget_held`: calls in flight hold the budget's room; retry soon. */
export class BudgetHeld extends SpendgateRefusal {}
/** 400 `run_bound_exceeded`: the run used up a bound, or ended. */
export class RunBoundExceeded extends SpendgateRefusal {}
/** 413 `payload_too_large`: the input is over `run.max_input_bytes`. */
export class PayloadTooLarge extends SpendgateRefusal {}
/** 400 `context_too_large`: the prompt is over `run.max_context_tokens`. */
export class ContextTooLarge extends SpendgateRefusal {}
/** 400 `model_not_allowed`: the model or tool has no price (no price, no call). */
export class ModelNotAllowed extends SpendgateRefusal {}
/** 503 `cutoff_engaged`: an operator engaged the kill switch. */
export class CutoffEngaged extends SpendgateRefusal {}

/** 503 `store_unavailable`: the store did not answer; nothing new is admitted. */
export class StoreUnavailable extends SpendgateError {}
/** 400 (405, 415, 431) `invalid_request`. */
export class InvalidRequest extends SpendgateError {}
/** 409 `idempotency_conflict`: a key reused with another body. */
export class IdempotencyConflict extends SpendgateError {}
/** 401 `unauthorized`. */
export class Unauthorized extends SpendgateError {}
/** 403 `challenge_required`: solve `challenge` and create the session again. */
export class ChallengeRequired extends SpendgateError {
  get challenge(): Record<string, unknown> | null {
    const b = this.body as { challenge?: unknown } | undefined;
    return b && typeof b.challenge === "object" && b.challenge !== null
      ? (b.challenge as Record<string, unknown>)
      : null;
  }
}
/** 409 `reservation_closed`: the step was already resolved another way. */
export class ReservationClosed extends SpendgateError {}
/** 409 `run_closed`: a heartbeat on a run that already ended. */
export class RunClosed extends SpendgateError {}
/** 404 `not_found`. */
export class NotFound extends SpendgateError {}
/** Any other error answer (`timeout`, `internal_error`, ...). */
export class ServerError extends SpendgateError {}

type ErrorClass = new (message: string, init?: SpendgateErrorInit) => SpendgateError;

export const ERRORS_BY_CODE: Readonly<Record<string, ErrorClass>> = {
  rate_limited: RateLimited,
  concurrency_limited: ConcurrencyLimited,
  budget_exhausted: BudgetExhausted,
  budget_held: BudgetHeld,
  run_bound_exceeded: RunBoundExceeded,
  payload_too_large: PayloadTooLarge,
  context_too_large: ContextTooLarge,
  model_not_allowed: ModelNotAllowed,
  cutoff_engaged: CutoffEngaged,
  store_unavailable: StoreUnavailable,
  invalid_request: InvalidRequest,
  idempotency_conflict: IdempotencyConflict,
  unauthorized: Unauthorized,
  challenge_required: ChallengeRequired,
  reservation_closed: ReservationClosed,
  run_closed: RunClosed,
  not_found: NotFound,
};

function intOrNull(v: unknown): number | null {
  return typeof v === "number" && Number.isInteger(v) ? v : null;
}

/** The exception for an error answer: by its `code`, else by its status. */
export function errorFromAnswer(
  status: number,
  body: unknown,
  retryAfterHeader: string | null,
): SpendgateError {
  const whole = (typeof body === "object" && body !== null ? body : {}) as Partial<ErrorBody>;
  const d = (typeof whole.error === "object" && whole.error !== null ? whole.error : {}) as Partial<
    Record<string, unknown>
  >;
  const code = typeof d.code === "string" ? d.code : "";
  const message = typeof d.message === "string" && d.message ? d.message : `HTTP ${status}`;
  let retry = intOrNull(d.retry_after_s);
  if (retry === null && retryAfterHeader !== null && /^\d+$/.test(retryAfterHeader)) {
    retry = Number(retryAfterHeader);
  }
  const Cls = ERRORS_BY_CODE[code] ?? ServerError;
  return new Cls(message, {
    status,
    code,
    scope: typeof d.scope === "string" ? d.scope : null,
    retryAfterS: retry,
    ledgerSeq: intOrNull(whole.ledger_seq),
    body,
  });
}
