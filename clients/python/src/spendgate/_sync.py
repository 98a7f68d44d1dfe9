"""The blocking client: ``Client``, ``Run``, ``Step``; the heartbeat is a thread."""

from __future__ import annotations

import threading
import time
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


class Client:
    """A client of spendgate's decision API, with the service token.

    ``heartbeat_interval_s`` fixes the interval between heartbeats of a run with a held step;
    by default it is a third of the lease each heartbeat reports. Close it (or use it as a
    context manager) to close its connections.
    """

    def __init__(
        self,
        base_url: str,
        service_token: Optional[str] = None,
        *,
        timeout: float = _core.DEFAULT_TIMEOUT_S,
        max_retries: int = _core.DEFAULT_MAX_RETRIES,
        heartbeat_interval_s: Optional[float] = None,
        http_client: Optional[httpx.Client] = None,
    ) -> None:
        token = _core.service_token_from(service_token)
        self._max_retries = _core.check_retries(max_retries)
        self._heartbeat_fixed = heartbeat_interval_s
        self._heartbeat_learned: Optional[float] = None
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout)
        self._base = base_url.rstrip("/")
        self._headers = {"authorization": f"Bearer {token}"}

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def session(self, client_ip: Optional[str] = None) -> Session:
        """Creates a guest session (``POST /v1/sessions``) for a guest at ``client_ip``."""
        body: Dict[str, Any] = {} if client_ip is None else {"client_ip": client_ip}
        ans, _ = self._call("POST", "/v1/sessions", body, None, _core.POLICY_ONCE)
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
    ) -> "Run":
        """A run, admitted when its ``with`` block is entered (or on ``open()``)."""
        body = _core.run_body(session, client_ip, conversation, input_text, input_bytes)
        return Run(self, body, _core.new_key(idempotency_key))

    def usage(
        self,
        session: str,
        client_ip: Optional[str] = None,
        conversation: Optional[str] = None,
    ) -> Usage:
        """Every budget that applies to a guest (``GET /v1/usage``), global included."""
        params = _core.usage_params(session, client_ip, conversation)
        ans, _ = self._call("GET", "/v1/usage", None, None, _core.POLICY_ONCE, params)
        return Usage.from_json(ans)

    def _call(
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
                r = self._http.request(
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
            time.sleep(_core.retry_wait(attempt, err))
            attempt += 1


def _json_or_none(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _json(r: httpx.Response) -> Dict[str, Any]:
    v = _json_or_none(r)
    if not isinstance(v, dict):
        raise SpendgateError(
            f"spendgate answered {r.status_code} without a JSON object", status=r.status_code
        )
    return v


class _Heartbeat:
    """A thread that renews a run's lease while any of its steps is held."""

    def __init__(self, run: "Run") -> None:
        self._run = run
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"spendgate-heartbeat-{run.run_id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_core.HEARTBEAT_JOIN_S)

    def _loop(self) -> None:
        client = self._run._client
        wait = client._heartbeat_fixed or client._heartbeat_learned or _core.HEARTBEAT_FIRST_S
        while not self._stop.wait(wait):
            try:
                hb, headers = self._run._beat()
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


class Run:
    """A run: ``with client.run(...) as run:``; ``finish`` on leaving the block."""

    def __init__(self, client: Client, body: Dict[str, Any], key: str) -> None:
        self._client = client
        self._body = body
        self._key = key
        self._answer: Optional[RunAnswer] = None
        self.finished: Optional[FinishAnswer] = None
        self._lock = threading.Lock()
        self._held = 0
        self._heartbeat: Optional[_Heartbeat] = None

    # -- the run's answer
    @property
    def answer(self) -> RunAnswer:
        if self._answer is None:
            raise RuntimeError("the run is not open: use it in a with block, or call open()")
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

    # -- lifecycle
    def open(self) -> RunAnswer:
        """Admits the run (``POST /v1/runs``); a refusal raises a ``SpendgateRefusal``."""
        if self._answer is None:
            ans, _ = self._client._call(
                "POST", "/v1/runs", self._body, self._key, _core.POLICY_CREATE
            )
            self._answer = RunAnswer.from_json(ans)
        return self._answer

    def __enter__(self) -> "Run":
        self.open()
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if exc_type is None:
            self.finish()
            return
        try:
            self.finish()
        except SpendgateError:
            pass  # the run's lease expires; its held steps are charged in full

    def finish(self) -> FinishAnswer:
        """Ends the run: steps still held become ``unknown`` (charged in full)."""
        self._stop_heartbeat()
        ans, _ = self._client._call(
            "POST", f"/v1/runs/{_core.path_id(self.run_id)}/finish", None, None,
            _core.POLICY_RESOLVE,
        )
        self.finished = FinishAnswer.from_json(ans)
        return self.finished

    def heartbeat(self) -> Heartbeat:
        """Renews the run's lease now (the background heartbeat does it while a step is held)."""
        return self._beat()[0]

    def _beat(self) -> Tuple[Heartbeat, httpx.Headers]:
        ans, headers = self._client._call(
            "POST", f"/v1/runs/{_core.path_id(self.run_id)}/heartbeat", None, None,
            _core.POLICY_ONCE,
        )
        return Heartbeat.from_json(ans), headers

    # -- steps
    def model_step(
        self,
        model: str,
        *,
        prompt_tokens: Optional[int] = None,
        prompt_text: Optional[str] = None,
        max_output_tokens: Optional[int] = None,
        retry: bool = False,
        idempotency_key: Optional[str] = None,
    ) -> "Step":
        """A model step, reserved when its ``with`` block is entered (or on ``open()``)."""
        body = _core.model_step_body(model, prompt_tokens, prompt_text, max_output_tokens, retry)
        return Step(self, body, _core.new_key(idempotency_key))

    def tool_step(
        self, tool: str, *, units: Optional[int] = None, idempotency_key: Optional[str] = None
    ) -> "Step":
        """A paid tool step, reserved when its ``with`` block is entered (or on ``open()``)."""
        return Step(self, _core.tool_step_body(tool, units), _core.new_key(idempotency_key))

    def _hold(self) -> None:
        with self._lock:
            self._held += 1
            if self._heartbeat is None:
                self._heartbeat = _Heartbeat(self)

    def _unhold(self) -> None:
        hb = None
        with self._lock:
            self._held -= 1
            if self._held == 0:
                hb, self._heartbeat = self._heartbeat, None
        if hb is not None:
            hb.stop()

    def _stop_heartbeat(self) -> None:
        with self._lock:
            hb, self._heartbeat = self._heartbeat, None
        if hb is not None:
            hb.stop()


class Step:
    """A reserved step: ``with run.model_step(...) as step:`` then ``step.commit(usage)``.

    Leaving the block on an exception marks the step ``unknown`` (charged in full). Leaving it
    with neither commit nor release also marks it ``unknown`` and warns
    (``UnresolvedStepWarning``): spendgate cannot know whether the paid work happened.
    """

    def __init__(self, run: Run, body: Dict[str, Any], key: str) -> None:
        self._run = run
        self._body = body
        self._key = key
        self._answer: Optional[StepAnswer] = None
        self._holding = False
        self.resolution: Optional[Resolution] = None

    @property
    def answer(self) -> StepAnswer:
        if self._answer is None:
            raise RuntimeError("the step is not open: use it in a with block, or call open()")
        return self._answer

    @property
    def step_id(self) -> str:
        return self.answer.step_id

    @property
    def reserved_micros(self) -> int:
        return self.answer.reserved_micros

    @property
    def max_output_tokens(self) -> Optional[int]:
        """The output bound to give the model (``None`` for a tool)."""
        return self.answer.max_output_tokens

    @property
    def output_shrunk(self) -> bool:
        return self.answer.output_shrunk

    def open(self) -> StepAnswer:
        """Reserves the step; a refusal raises a ``SpendgateRefusal``."""
        if self._answer is None:
            path = f"/v1/runs/{_core.path_id(self._run.run_id)}/steps"
            ans, _ = self._run._client._call(
                "POST", path, self._body, self._key, _core.POLICY_CREATE
            )
            self._answer = StepAnswer.from_json(ans)
            self._holding = True
            self._run._hold()
        return self._answer

    def __enter__(self) -> "Step":
        self.open()
        return self

    def __exit__(
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
                    self.unknown()
                except SpendgateError:
                    pass  # still held: its lease expires and it is charged in full
                return
            _core.warn_unresolved(self.step_id)
            self.unknown()
        finally:
            self._settle()

    def commit(
        self,
        usage: Any = None,
        *,
        prompt_tokens: Optional[int] = None,
        completion_tokens: Optional[int] = None,
        cached_tokens: Optional[int] = None,
    ) -> Resolution:
        """Commits a model step's usage: an OpenAI usage object or mapping, or the keywords."""
        body = {"usage": _core.usage_body(usage, prompt_tokens, completion_tokens, cached_tokens)}
        return self._resolve("commit", body)

    def commit_units(self, units: int) -> Resolution:
        """Commits a tool step by the units it used."""
        return self._resolve("commit", {"units": _core._non_negative("units", units)})

    def commit_result_bytes(self, result_bytes: int) -> Resolution:
        """Commits a tool step by its result's size (flagged when over the run's bound)."""
        n = _core._non_negative("result_bytes", result_bytes)
        return self._resolve("commit", {"result_bytes": n})

    def release(self) -> Resolution:
        """No paid work started: nothing is charged."""
        return self._resolve("release", None)

    def unknown(self) -> Resolution:
        """The outcome is not known: the full reservation is charged."""
        return self._resolve("unknown", None)

    def _resolve(self, what: str, body: Optional[Dict[str, Any]]) -> Resolution:
        path = f"/v1/steps/{_core.path_id(self.step_id)}/{what}"
        try:
            ans, _ = self._run._client._call("POST", path, body, None, _core.POLICY_RESOLVE)
        except SpendgateError as e:
            if e.code in _core.CLOSED_CODES:
                self._settle()  # the step is closed: nothing to keep alive
            raise
        self.resolution = Resolution.from_json(ans)
        self._settle()
        return self.resolution

    def _settle(self) -> None:
        if self._holding:
            self._holding = False
            self._run._unhold()
