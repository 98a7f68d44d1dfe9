"""What the sync and async clients share: bounds, request bodies, retries, lease timing."""

from __future__ import annotations

import datetime as _dt
import email.utils
import os
import uuid
import warnings
from typing import Any, Dict, Mapping, Optional
from urllib.parse import quote

from ._errors import SpendgateError

#: Seconds each HTTP call may take (connect, send, wait, read) before it counts as failed.
DEFAULT_TIMEOUT_S = 10.0
#: Retries of a call that got no answer (or 500/504, which may have applied): each reuses
#: the call's ``Idempotency-Key``, so nothing is held twice.
DEFAULT_MAX_RETRIES = 2
#: Upper bound of ``max_retries``.
MAX_RETRIES_MAX = 10
#: First wait between retries; it doubles each time.
RETRY_BACKOFF_S = 0.25
#: Longest wait between retries, whatever ``Retry-After`` says.
RETRY_WAIT_MAX_S = 5.0
#: A held step's run is renewed at this fraction of the lease left after each heartbeat.
HEARTBEAT_FRACTION = 1.0 / 3.0
#: Bounds of the interval between heartbeats, in seconds.
HEARTBEAT_MIN_S = 0.25
HEARTBEAT_MAX_S = 60.0
#: Until a heartbeat has told the lease, the first one goes out at once.
HEARTBEAT_FIRST_S = 0.0
#: How long leaving a block waits for the heartbeat to stop.
HEARTBEAT_JOIN_S = 5.0
#: ``Idempotency-Key`` bound of the server (1 to 100 visible ASCII characters).
IDEMPOTENCY_KEY_MAX = 100

#: Answers to commit, release or unknown after which the step is no longer held.
CLOSED_CODES = ("reservation_closed", "not_found")

#: Retry on no answer and on 500/504 (the call may have applied): run and step creation.
POLICY_CREATE = "create"
#: As create, and on 503 ``store_unavailable`` too: commit, release, unknown, finish, which
#: are idempotent by id and which leave the step held (then charged in full) if they fail.
POLICY_RESOLVE = "resolve"
#: No retry: reads and heartbeats (the heartbeat loop retries on its own schedule).
POLICY_ONCE = "once"


class UnresolvedStepWarning(UserWarning):
    """A step block ended with neither commit nor release: it was marked ``unknown``."""


def service_token_from(token: Optional[str]) -> str:
    t = token if token is not None else os.environ.get("SPENDGATE_SERVICE_TOKEN")
    if not t:
        raise ValueError("no service token: pass service_token= or set SPENDGATE_SERVICE_TOKEN")
    return t


def check_retries(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_RETRIES_MAX:
        raise ValueError(f"max_retries must be an integer from 0 to {MAX_RETRIES_MAX}")
    return n


def new_key(key: Optional[str]) -> str:
    if key is None:
        return "sg-" + uuid.uuid4().hex
    if not 1 <= len(key) <= IDEMPOTENCY_KEY_MAX or not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError("idempotency_key must be 1 to 100 visible ASCII characters")
    return key


def path_id(id_: str) -> str:
    return quote(id_, safe="")


def should_retry(policy: str, err: Optional[SpendgateError]) -> bool:
    """Whether a failed call is retried. ``err`` is None when no answer came."""
    if policy == POLICY_ONCE:
        return False
    if err is None:
        return True
    if err.status in (500, 504) and err.code in ("internal_error", "timeout", ""):
        return True
    return policy == POLICY_RESOLVE and err.code == "store_unavailable"


def retry_wait(attempt: int, err: Optional[SpendgateError]) -> float:
    wait: float = RETRY_BACKOFF_S * (2.0**attempt)
    if err is not None and err.retry_after_s is not None:
        wait = max(wait, float(err.retry_after_s))
    return min(wait, RETRY_WAIT_MAX_S)


def _non_negative(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return v


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def usage_body(
    usage: Any,
    prompt_tokens: Optional[int],
    completion_tokens: Optional[int],
    cached_tokens: Optional[int],
) -> Dict[str, Any]:
    """The ``usage`` of a commit, from keywords or from an OpenAI usage (a mapping or object).

    Takes OpenAI's Chat Completions usage (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``) and its Responses usage (``input_tokens``,
    ``output_tokens``, ``input_tokens_details.cached_tokens``). Anthropic's usage counts
    cached input apart and is refused: pass the keywords instead.
    """
    if usage is not None:
        if prompt_tokens is not None or completion_tokens is not None:
            raise ValueError("pass a usage or prompt_tokens/completion_tokens, not both")
        if _field(usage, "cache_read_input_tokens") is not None or (
            _field(usage, "cache_creation_input_tokens") is not None
        ):
            raise ValueError(
                "an Anthropic usage counts cached input apart: commit with prompt_tokens="
                "input+cache_read+cache_creation, cached_tokens=cache_read, completion_tokens"
            )
        prompt_tokens = _field(usage, "prompt_tokens")
        completion_tokens = _field(usage, "completion_tokens")
        details = _field(usage, "prompt_tokens_details")
        if prompt_tokens is None and completion_tokens is None:
            prompt_tokens = _field(usage, "input_tokens")
            completion_tokens = _field(usage, "output_tokens")
            details = _field(usage, "input_tokens_details")
        if cached_tokens is None:
            cached_tokens = _field(usage, "cached_tokens")
        if cached_tokens is None and details is not None:
            cached_tokens = _field(details, "cached_tokens")
    body: Dict[str, Any] = {
        "prompt_tokens": _non_negative("prompt_tokens", prompt_tokens),
        "completion_tokens": _non_negative("completion_tokens", completion_tokens),
    }
    if cached_tokens is not None:
        body["cached_tokens"] = _non_negative("cached_tokens", cached_tokens)
    return body


def run_body(
    session: str,
    client_ip: str,
    conversation: str,
    input_text: Optional[str],
    input_bytes: Optional[int],
) -> Dict[str, Any]:
    if (input_text is None) == (input_bytes is None):
        raise ValueError("pass exactly one of input_text and input_bytes")
    body: Dict[str, Any] = {
        "session": session,
        "client_ip": client_ip,
        "conversation": conversation,
    }
    if input_text is not None:
        body["input_text"] = input_text
    else:
        body["input_bytes"] = _non_negative("input_bytes", input_bytes)
    return body


def model_step_body(
    model: str,
    prompt_tokens: Optional[int],
    prompt_text: Optional[str],
    max_output_tokens: Optional[int],
    retry: bool,
) -> Dict[str, Any]:
    if (prompt_tokens is None) == (prompt_text is None):
        raise ValueError("pass exactly one of prompt_tokens and prompt_text")
    body: Dict[str, Any] = {"kind": "model", "model": model}
    if prompt_tokens is not None:
        body["prompt_tokens"] = _non_negative("prompt_tokens", prompt_tokens)
    else:
        body["prompt_text"] = prompt_text
    if max_output_tokens is not None:
        body["max_output_tokens"] = _non_negative("max_output_tokens", max_output_tokens)
    if retry:
        body["retry"] = True
    return body


def tool_step_body(tool: str, units: Optional[int]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"kind": "tool", "tool": tool}
    if units is not None:
        body["units"] = _non_negative("units", units)
    return body


def usage_params(
    session: str, client_ip: Optional[str], conversation: Optional[str]
) -> Dict[str, str]:
    params = {"session": session}
    if client_ip is not None:
        params["client_ip"] = client_ip
    if conversation is not None:
        params["conversation"] = conversation
    return params


def _parse_time(s: str) -> Optional[_dt.datetime]:
    try:
        t = _dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=_dt.timezone.utc)


def heartbeat_interval(lease_until: str, date_header: Optional[str]) -> float:
    """The wait before the next heartbeat: a fraction of the lease the server just granted.

    The lease left is measured against the answer's ``Date`` (the server's clock), so a
    skewed local clock does not matter.
    """
    until = _parse_time(lease_until)
    now: Optional[_dt.datetime] = None
    if date_header:
        try:
            now = email.utils.parsedate_to_datetime(date_header)
        except (TypeError, ValueError):
            now = None
    if now is None:
        now = _dt.datetime.now(_dt.timezone.utc)
    if until is None:
        return HEARTBEAT_MIN_S
    left = (until - now).total_seconds()
    return min(HEARTBEAT_MAX_S, max(HEARTBEAT_MIN_S, left * HEARTBEAT_FRACTION))


def warn_unresolved(step_id: str) -> None:
    warnings.warn(
        f"step {step_id} ended with neither commit nor release: marked unknown "
        "(charged in full)",
        UnresolvedStepWarning,
        stacklevel=3,
    )
