"""The answers of the decision API (docs/openapi.json), as frozen dataclasses.

Money is integer micros (millionths of the currency unit); times are RFC 3339 strings as the
server sent them. Each answer keeps the decoded JSON in ``raw``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional


def _int(m: Mapping[str, Any], key: str) -> int:
    v = m.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"spendgate answered without an integer {key!r}: {dict(m)!r}")
    return v


def _opt_int(m: Mapping[str, Any], key: str) -> Optional[int]:
    v = m.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(m: Mapping[str, Any], key: str) -> str:
    v = m.get(key)
    if not isinstance(v, str):
        raise ValueError(f"spendgate answered without a string {key!r}: {dict(m)!r}")
    return v


@dataclass(frozen=True)
class RunBounds:
    """A run's bounds, as admitted (`RunBoundsAnswer`)."""

    max_input_bytes: int
    max_context_tokens: int
    max_output_tokens: int
    max_tool_result_bytes: int
    max_model_rounds: int
    max_tool_calls: int
    max_retries: int
    max_seconds: int
    max_cost_micros: int

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "RunBounds":
        return cls(**{k: _int(m, k) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class RunAnswer:
    """`POST /v1/runs`: an admitted run."""

    run_id: str
    deadline: str
    bounds: RunBounds
    reserved_micros: int
    ledger_seq: int
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "RunAnswer":
        b = m.get("bounds")
        return cls(
            run_id=_str(m, "run_id"),
            deadline=_str(m, "deadline"),
            bounds=RunBounds.from_json(b if isinstance(b, dict) else {}),
            reserved_micros=_int(m, "reserved_micros"),
            ledger_seq=_int(m, "ledger_seq"),
            raw=dict(m),
        )


@dataclass(frozen=True)
class StepAnswer:
    """`POST /v1/runs/{run_id}/steps`: an admitted step."""

    step_id: str
    reserved_micros: int
    max_output_tokens: Optional[int]
    output_shrunk: bool
    ledger_seq: int
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "StepAnswer":
        return cls(
            step_id=_str(m, "step_id"),
            reserved_micros=_int(m, "reserved_micros"),
            max_output_tokens=_opt_int(m, "max_output_tokens"),
            output_shrunk=m.get("output_shrunk") is True,
            ledger_seq=_int(m, "ledger_seq"),
            raw=dict(m),
        )


@dataclass(frozen=True)
class Resolution:
    """`commit`, `release`, `unknown`: the step, resolved."""

    state: str
    charged_micros: int
    reserved_micros: int
    overrun: bool
    repeated: bool
    ledger_seq: int
    result_too_large: bool
    message: Optional[str]
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "Resolution":
        msg = m.get("message")
        return cls(
            state=_str(m, "state"),
            charged_micros=_int(m, "charged_micros"),
            reserved_micros=_int(m, "reserved_micros"),
            overrun=m.get("overrun") is True,
            repeated=m.get("repeated") is True,
            ledger_seq=_int(m, "ledger_seq"),
            result_too_large=m.get("result_too_large") is True,
            message=msg if isinstance(msg, str) else None,
            raw=dict(m),
        )


@dataclass(frozen=True)
class Heartbeat:
    """`POST /v1/runs/{run_id}/heartbeat`: the run's lease, extended."""

    lease_until: str
    deadline: str
    ledger_seq: int

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "Heartbeat":
        return cls(
            lease_until=_str(m, "lease_until"),
            deadline=_str(m, "deadline"),
            ledger_seq=_int(m, "ledger_seq"),
        )


@dataclass(frozen=True)
class FinishAnswer:
    """`POST /v1/runs/{run_id}/finish`: the run, closed (`finished` or `expired`)."""

    state: str
    charged_micros: int
    #: What the run's budgets were charged (`whole_run`: its hold as committed or expired).
    budgets_charged_micros: int
    steps: int
    repeated: bool
    ledger_seq: int
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "FinishAnswer":
        return cls(
            state=_str(m, "state"),
            charged_micros=_int(m, "charged_micros"),
            budgets_charged_micros=_int(m, "budgets_charged_micros"),
            steps=_int(m, "steps"),
            repeated=m.get("repeated") is True,
            ledger_seq=_int(m, "ledger_seq"),
            raw=dict(m),
        )


@dataclass(frozen=True)
class UsageScope:
    """One budget that applies, in its current window."""

    kind: str
    id: Optional[str]
    window: str
    window_id: str
    limit_micros: int
    used_micros: int
    reserved_micros: int
    remaining_micros: int
    overrun: bool
    resets_at: Optional[str]

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "UsageScope":
        i = m.get("id")
        r = m.get("resets_at")
        return cls(
            kind=_str(m, "kind"),
            id=i if isinstance(i, str) else None,
            window=_str(m, "window"),
            window_id=_str(m, "window_id"),
            limit_micros=_int(m, "limit_micros"),
            used_micros=_int(m, "used_micros"),
            reserved_micros=_int(m, "reserved_micros"),
            remaining_micros=_int(m, "remaining_micros"),
            overrun=m.get("overrun") is True,
            resets_at=r if isinstance(r, str) else None,
        )


@dataclass(frozen=True)
class Usage:
    """`GET /v1/usage`: every budget that applies, global included."""

    scopes: List[UsageScope]

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "Usage":
        s = m.get("scopes")
        rows = s if isinstance(s, list) else []
        return cls(scopes=[UsageScope.from_json(r) for r in rows if isinstance(r, dict)])

    def find(self, kind: str, window: Optional[str] = None) -> Optional[UsageScope]:
        """The first scope of this kind (and window, if given)."""
        for s in self.scopes:
            if s.kind == kind and (window is None or s.window == window):
                return s
        return None


@dataclass(frozen=True)
class Session:
    """`POST /v1/sessions`: a guest session."""

    session: str
    expires_at: str

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> "Session":
        return cls(session=_str(m, "session"), expires_at=_str(m, "expires_at"))
