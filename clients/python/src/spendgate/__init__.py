"""spendgate: a client for spendgate's decision API.

Reserve before each paid step, commit what it used after, and let a lost outcome be charged
in full::

    from spendgate import Client

    with Client("http://127.0.0.1:8080", service_token) as sg:
        with sg.run(session=guest, client_ip=ip, conversation=cid, input_text=msg) as run:
            with run.model_step("gpt-4o-mini", prompt_tokens=900, max_output_tokens=400) as step:
                answer = call_model(max_tokens=step.max_output_tokens)
                step.commit(answer.usage)
"""

from ._async import AsyncClient, AsyncRun, AsyncStep
from ._core import UnresolvedStepWarning
from ._errors import (
    BudgetExhausted,
    BudgetHeld,
    ChallengeRequired,
    ConcurrencyLimited,
    ContextTooLarge,
    CutoffEngaged,
    IdempotencyConflict,
    InvalidRequest,
    ModelNotAllowed,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ReservationClosed,
    RunBoundExceeded,
    RunClosed,
    ServerError,
    SpendgateConnectionError,
    SpendgateError,
    SpendgateRefusal,
    StoreUnavailable,
    Unauthorized,
)
from ._sync import Client, Run, Step
from ._types import (
    FinishAnswer,
    Heartbeat,
    Resolution,
    RunAnswer,
    RunBounds,
    Session,
    StepAnswer,
    Usage,
    UsageScope,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncRun",
    "AsyncStep",
    "BudgetExhausted",
    "BudgetHeld",
    "ChallengeRequired",
    "Client",
    "ConcurrencyLimited",
    "ContextTooLarge",
    "CutoffEngaged",
    "FinishAnswer",
    "Heartbeat",
    "IdempotencyConflict",
    "InvalidRequest",
    "ModelNotAllowed",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "ReservationClosed",
    "Resolution",
    "Run",
    "RunAnswer",
    "RunBoundExceeded",
    "RunBounds",
    "RunClosed",
    "ServerError",
    "Session",
    "SpendgateConnectionError",
    "SpendgateError",
    "SpendgateRefusal",
    "Step",
    "StepAnswer",
    "StoreUnavailable",
    "Unauthorized",
    "UnresolvedStepWarning",
    "Usage",
    "UsageScope",
]
