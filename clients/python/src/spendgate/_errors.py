"""Every error answer of spendgate as a typed exception (docs/errors.md)."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Type


class SpendgateError(Exception):
    """Base of every error this library raises.

    ``status`` is the HTTP status (``None`` when no answer arrived), ``code`` the error code of
    docs/errors.md (match on it, not on ``message``), ``scope`` the scope that refused
    (``global``, ``ip``, ``session``, ``conversation``, ``run``) or ``None``, ``retry_after_s``
    the ``Retry-After`` seconds or ``None``, ``ledger_seq`` the ledger's sequence number when
    the refusal changed the ledger, ``body`` the whole decoded answer.
    """

    def __init__(
        self,
        message: str,
        *,
        status: Optional[int] = None,
        code: str = "",
        scope: Optional[str] = None,
        retry_after_s: Optional[int] = None,
        ledger_seq: Optional[int] = None,
        body: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.scope = scope
        self.retry_after_s = retry_after_s
        self.ledger_seq = ledger_seq
        self.body: Dict[str, Any] = dict(body) if body is not None else {}

    def __str__(self) -> str:
        where = f" (scope {self.scope})" if self.scope else ""
        return f"{self.status} {self.code}{where}: {self.message}"


class SpendgateConnectionError(SpendgateError):
    """No answer from spendgate after every retry (connection refused, timeout, reset)."""


class SpendgateRefusal(SpendgateError):
    """A limit refused to admit paid work: do not do the work."""


class RateLimited(SpendgateRefusal):
    """429 ``rate_limited``: a request rate; retry after ``retry_after_s``."""


class ConcurrencyLimited(SpendgateRefusal):
    """429 ``concurrency_limited``: too many active runs in a scope."""


class BudgetExhausted(SpendgateRefusal):
    """429 ``budget_exhausted``: a budget is spent until its window resets."""


class BudgetHeld(SpendgateRefusal):
    """429 ``budget_held``: calls in flight hold the budget's room; retry soon."""


class RunBoundExceeded(SpendgateRefusal):
    """400 ``run_bound_exceeded``: the run used up a bound, or ended."""


class PayloadTooLarge(SpendgateRefusal):
    """413 ``payload_too_large``: the input is over ``run.max_input_bytes``."""


class ContextTooLarge(SpendgateRefusal):
    """400 ``context_too_large``: the prompt is over ``run.max_context_tokens``."""


class ModelNotAllowed(SpendgateRefusal):
    """400 ``model_not_allowed``: the model or tool has no price (no price, no call)."""


class CutoffEngaged(SpendgateRefusal):
    """503 ``cutoff_engaged``: an operator engaged the kill switch."""


class StoreUnavailable(SpendgateError):
    """503 ``store_unavailable``: the store did not answer; nothing new is admitted."""


class InvalidRequest(SpendgateError):
    """400 (405, 415, 431) ``invalid_request``: the request cannot be used as sent."""


class IdempotencyConflict(SpendgateError):
    """409 ``idempotency_conflict``: a key reused with another body."""


class Unauthorized(SpendgateError):
    """401 ``unauthorized``: a token or session is missing, wrong or expired."""


class ChallengeRequired(SpendgateError):
    """403 ``challenge_required``: solve ``challenge`` and create the session again."""

    @property
    def challenge(self) -> Optional[Dict[str, Any]]:
        c = self.body.get("challenge")
        return c if isinstance(c, dict) else None


class ReservationClosed(SpendgateError):
    """409 ``reservation_closed``: the step was already resolved another way."""


class RunClosed(SpendgateError):
    """409 ``run_closed``: a heartbeat on a run that already ended."""


class NotFound(SpendgateError):
    """404 ``not_found``: no such route, run or step."""


class ServerError(SpendgateError):
    """Any other error answer (``timeout``, ``internal_error``, ``request_timeout``, ...)."""


ERRORS_BY_CODE: Dict[str, Type[SpendgateError]] = {
    "rate_limited": RateLimited,
    "concurrency_limited": ConcurrencyLimited,
    "budget_exhausted": BudgetExhausted,
    "budget_held": BudgetHeld,
    "run_bound_exceeded": RunBoundExceeded,
    "payload_too_large": PayloadTooLarge,
    "context_too_large": ContextTooLarge,
    "model_not_allowed": ModelNotAllowed,
    "cutoff_engaged": CutoffEngaged,
    "store_unavailable": StoreUnavailable,
    "invalid_request": InvalidRequest,
    "idempotency_conflict": IdempotencyConflict,
    "unauthorized": Unauthorized,
    "challenge_required": ChallengeRequired,
    "reservation_closed": ReservationClosed,
    "run_closed": RunClosed,
    "not_found": NotFound,
}


def _int_or_none(v: Any) -> Optional[int]:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    return None


def error_from_answer(
    status: int, body: Any, retry_after_header: Optional[str]
) -> SpendgateError:
    """The exception for an error answer: by its ``code``, else by its status."""
    detail: Mapping[str, Any] = {}
    whole: Mapping[str, Any] = {}
    if isinstance(body, dict):
        whole = body
        d = body.get("error")
        if isinstance(d, dict):
            detail = d
    code = detail.get("code") if isinstance(detail.get("code"), str) else ""
    message = detail.get("message") if isinstance(detail.get("message"), str) else ""
    scope = detail.get("scope") if isinstance(detail.get("scope"), str) else None
    retry = _int_or_none(detail.get("retry_after_s"))
    if retry is None and retry_after_header is not None and retry_after_header.isdigit():
        retry = int(retry_after_header)
    cls = ERRORS_BY_CODE.get(str(code), ServerError)
    return cls(
        str(message) or f"HTTP {status}",
        status=status,
        code=str(code),
        scope=scope,
        retry_after_s=retry,
        ledger_seq=_int_or_none(whole.get("ledger_seq")),
        body=whole,
    )
