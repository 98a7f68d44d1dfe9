"""The asyncio client: ``AsyncClient``, ``AsyncRun``, ``AsyncStep``; the heartbeat is a task."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, Dict, Optional, Tuple, Type

import httpx

from . import _core
from ._errors import (
    NotFound,
    RunClosed,
    SpendgateConnectionError,
    SpendgateError,
    error_from_answer,
)
from ._sync import _json, _json_or_none
from ._types import (
    FinishAnswer,
    Heartbeat,
    Resolution,
    RunAnswer,
    RunBounds,
    Session,
    StepAnswer,
    Usage,
)


class AsyncClient:
    """The asyncio twin of :class:`spendgate.Client` (same arguments, awaitable calls)."""

    def __init__(
        self,
        base_url: str,
        service_token: Optional[str] = None,
        *,
        timeout: float = _core.DEFAULT_TIMEOUT_S,
        max_retries: int = _core.DEFAULT_MAX_RETRIES,
        heartbeat_interval_s: Optional[float] = None,
        http_client: Optional[httpx.AsyncClient] = None,
    ) -> None:
        token = _core.service_token_from(service_token)
        self._max_retries = _core.check_retries(max_retries)
        self._heartbeat_fixed = heartbeat_interval_s
        self._heartbeat_learned: Optional[float] = None
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=timeout)
        self._base = base_url.rstrip("/")
        self._headers = {"authorization": f"Bearer {token}"}

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def session(self, client_ip: Optional[str] = None) -> Session:
        body: Dict[str, Any] = {} if client_ip is None else {"client_ip": client_ip}
        ans, _ = await self._call("POST", "/v1/sessions", body, None, _core.POLICY_ONCE)
        return Session.from_json(ans)

    def run(
        self,
        session: str,
        client_ip: str,
        conversation: str,
        input_text: Optional[str] = None,
        *,
        input_bytes: Optional[int] = None,
        idempotency_key: Optional[str] = None,
    ) -> "AsyncRun":
        """A run, admitted when its ``async with`` block is entered (or on ``open()``)."""
        body = _core.run_body(session, client_ip, conversation, input_text, input_bytes)
        return AsyncRun(self, body, _core.new_key(idempotency_key))

    async def usage(
        self,
        session: str,
        client_ip: Optional[str] = None,
        conversation: Optional[str] = None,
    ) -> Usage:
        params = _core.usage_params(session, client_ip, conversation)
        ans, _ = await self._call("GET", "/v1/usage", None, None, _core.POLICY_ONCE, params)
        return Usage.from_json(ans)

    async def _call(
        self,
        method: str,
        path: str,
        body: Optional[Dict[str, Any]],
        key: Optional[str],
        policy: str,
        params: Optional[Dict[str, str]] = None,
    ) -> Tuple[Dict[str, Any], httpx.Headers]:
        headers = dict(self._headers)
        if key is not None:
            headers["idempotency-key"] = key
        attempt = 0
        while True:
            err: Optional[SpendgateError]
            last: SpendgateError
            try:
                r = await self._http.request(
                    method, self._base + path, json=body, headers=headers, params=params
                )
            except httpx.TransportError as e:
                err = None
                last = SpendgateConnectionError(f"{method} {path}: {e!r}")
            else:
                if r.status_code < 400:
                    return _json(r), r.headers
                err = error_from_answer(r.status_code, _json_or_none(r), r.headers.get("retry-after"))
                last = err
            if attempt >= self._max_retries or not _core.should_retry(policy, err):
                raise last
            await asyncio.sleep(_core.retry_wait(attempt, err))
            attempt += 1


class _AsyncHeartbeat:
    """A task that renews a run's lease while any of its steps is held."""

    def __init__(self, run: "AsyncRun") -> None:
        self._run = run
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), _core.HEARTBEAT_JOIN_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._task.cancel()

    async def _sleep(self, wait: float) -> bool:
        """Whether it was stopped while waiting."""
        try:
            await asyncio.wait_for(self._stop.wait(), wait)
        except asyncio.TimeoutError:
            return False
        return True

    async def _loop(self) -> None:
        client = self._run._client
        wait = client._heartbeat_fixed or client._heartbeat_learned or _core.HEARTBEAT_FIRST_S
        while not await self._sleep(wait):
            try:
                hb, headers = await self._run._beat()
            except (RunClosed, NotFound):
                return
            except SpendgateError:
                wait = _core.HEARTBEAT_MIN_S if wait <= 0 else wait
                continue
            learned = _core.heartbeat_interval(hb.lease_until, headers.get("date"))
            if client._heartbeat_fixed is None:
                client._heartbeat_learned = learned
                wait = learned
            else:
                wait = min(client._heartbeat_fixed, learned)


class AsyncRun:
    """A run: ``async with client.run(...) as run:``; ``finish`` on leaving the block."""

    def __init__(self, client: AsyncClient, body: Dict[str, Any], key: str) -> None:
        self._client = client
        self._body = body
        self._key = key
        self._answer: Optional[RunAnswer] = None
        self.finished: Optional[FinishAnswer] = None
        self._held = 0
        self._heartbeat: Optional[_AsyncHeartbeat] = None

    @property
    def answer(self) -> RunAnswer:
        if self._answer is None:
            raise RuntimeError("the run is not open: use it in an async with block, or open()")
        return self._answer

    @property
    def run_id(self) -> str:
        return self.answer.run_id

    @property
    def deadline(self) -> str:
        return self.answer.deadline

    @property
    def bounds(self) -> RunBounds:
        return self.answer.bounds

    @property
    def reserved_micros(self) -> int:
        return self.answer.reserved_micros

    async def open(self) -> RunAnswer:
        if self._answer is None:
            ans, _ = await self._client._call(
                "POST", "/v1/runs", self._body, self._key, _core.POLICY_CREATE
            )
            self._answer = RunAnswer.from_json(ans)
        return self._answer

    async def __aenter__(self) -> "AsyncRun":
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if exc_type is None:
            await self.finish()
            return
        try:
            await self.finish()
        except (SpendgateError, asyncio.CancelledError):
            pass  # the run's lease expires; its held steps are charged in full

    async def finish(self) -> FinishAnswer:
        await self._stop_heartbeat()
        ans, _ = await self._client._call(
            "POST", f"/v1/runs/{_core.path_id(self.run_id)}/finish", None, None,
            _core.POLICY_RESOLVE,
        )
        self.finished = FinishAnswer.from_json(ans)
        return self.finished

    async def heartbeat(self) -> Heartbeat:
        return (await self._beat())[0]

    async def _beat(self) -> Tuple[Heartbeat, httpx.Headers]:
        ans, headers = await self._client._call(
            "POST", f"/v1/runs/{_core.path_id(self.run_id)}/heartbeat", None, None,
            _core.POLICY_ONCE,
        )
        return Heartbeat.from_json(ans), headers

    def model_step(
        self,
        model: str,
        *,
        prompt_tokens: Optional[int] = None,
        prompt_text: Optional[str] = None,
        max_output_tokens: Optional[int] = None,
        retry: bool = False,
        idempotency_key: Optional[str] = None,
    ) -> "AsyncStep":
        body = _core.model_step_body(model, prompt_tokens, prompt_text, max_output_tokens, retry)
        return AsyncStep(self, body, _core.new_key(idempotency_key))

    def tool_step(
        self, tool: str, *, units: Optional[int] = None, idempotency_key: Optional[str] = None
    ) -> "AsyncStep":
        return AsyncStep(self, _core.tool_step_body(tool, units), _core.new_key(idempotency_key))

    def _hold(self) -> None:
        self._held += 1
        if self._heartbeat is None:
            self._heartbeat = _AsyncHeartbeat(self)

    async def _unhold(self) -> None:
        self._held -= 1
        if self._held == 0:
            await self._stop_heartbeat()

    async def _stop_heartbeat(self) -> None:
        hb, self._heartbeat = self._heartbeat, None
        if hb is not None:
            await hb.stop()


class AsyncStep:
    """A reserved step: ``async with run.model_step(...) as step:``; see :class:`spendgate.Step`."""

    def __init__(self, run: AsyncRun, body: Dict[str, Any], key: str) -> None:
        self._run = run
        self._body = body
        self._key = key
        self._answer: Optional[StepAnswer] = None
        self._holding = False
        self.resolution: Optional[Resolution] = None

    @property
    def answer(self) -> StepAnswer:
        if self._answer is None:
            raise RuntimeError("the step is not open: use it in an async with block, or open()")
        return self._answer

    @property
    def step_id(self) -> str:
        return self.answer.step_id

    @property
    def reserved_micros(self) -> int:
        return self.answer.reserved_micros

    @property
    def max_output_tokens(self) -> Optional[int]:
        return self.answer.max_output_tokens

    @property
    def output_shrunk(self) -> bool:
        return self.answer.output_shrunk

    async def open(self) -> StepAnswer:
        if self._answer is None:
            path = f"/v1/runs/{_core.path_id(self._run.run_id)}/steps"
            ans, _ = await self._run._client._call(
                "POST", path, self._body, self._key, _core.POLICY_CREATE
            )
            self._answer = StepAnswer.from_json(ans)
            self._holding = True
            self._run._hold()
        return self._answer

    async def __aenter__(self) -> "AsyncStep":
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        try:
            if self.resolution is not None:
                return
            if exc_type is not None:
                try:
                    await self.unknown()
                except (SpendgateError, asyncio.CancelledError):
                    pass  # still held: its lease expires and it is charged in full
                return
            _core.warn_unresolved(self.step_id)
            await self.unknown()
        finally:
            await self._settle()

    async def commit(
        self,
        usage: Any = None,
        *,
        prompt_tokens: Optional[int] = None,
        completion_tokens: Optional[int] = None,
        cached_tokens: Optional[int] = None,
    ) -> Resolution:
        body = {"usage": _core.usage_body(usage, prompt_tokens, completion_tokens, cached_tokens)}
        return await self._resolve("commit", body)

    async def commit_units(self, units: int) -> Resolution:
        return await self._resolve("commit", {"units": _core._non_negative("units", units)})

    async def commit_result_bytes(self, result_bytes: int) -> Resolution:
        n = _core._non_negative("result_bytes", result_bytes)
        return await self._resolve("commit", {"result_bytes": n})

    async def release(self) -> Resolution:
        return await self._resolve("release", None)

    async def unknown(self) -> Resolution:
        return await self._resolve("unknown", None)

    async def _resolve(self, what: str, body: Optional[Dict[str, Any]]) -> Resolution:
        path = f"/v1/steps/{_core.path_id(self.step_id)}/{what}"
        try:
            ans, _ = await self._run._client._call(
                "POST", path, body, None, _core.POLICY_RESOLVE
            )
        except SpendgateError as e:
            if e.code in _core.CLOSED_CODES:
                await self._settle()
            raise
        self.resolution = Resolution.from_json(ans)
        await self._settle()
        return self.resolution

    async def _settle(self) -> None:
        if self._holding:
            self._holding = False
            await self._run._unhold()
