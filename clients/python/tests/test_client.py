"""The sync client against a live spendgate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import httpx
import pytest

import spendgate
from spendgate import (
    BudgetExhausted,
    BudgetHeld,
    Client,
    ConcurrencyLimited,
    ContextTooLarge,
    CutoffEngaged,
    ModelNotAllowed,
    PayloadTooLarge,
    RateLimited,
    ReservationClosed,
    RunBoundExceeded,
    SpendgateRefusal,
    StoreUnavailable,
    UnresolvedStepWarning,
)

from conftest import LEASE_TTL_S, SERVICE, Redis, Server, StartServer

IP = "203.0.113.7"
MODEL = "gpt-4o-mini"


def client(server: Server, **kw: Any) -> Client:
    return Client(server.url, SERVICE, **kw)


def usage_of(sg: Client, session: str, kind: str, conversation: str = "c1") -> spendgate.UsageScope:
    u = sg.usage(session=session, client_ip=IP, conversation=conversation)
    scope = u.find(kind)
    assert scope is not None, f"no {kind} scope in {u}"
    return scope


def test_a_multi_step_run_is_charged_to_the_micro(server: Server) -> None:
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        with sg.run(session=guest, client_ip=IP, conversation="c1", input_text="hi") as run:
            assert run.run_id.startswith("run_")
            assert run.bounds.max_output_tokens == 1024
            with run.model_step(MODEL, prompt_tokens=1200, max_output_tokens=400) as s1:
                # 1200 x 0.15 + 400 x 0.60 per million
                assert (s1.reserved_micros, s1.max_output_tokens) == (420, 400)
                # an OpenAI usage object: 800 uncached, 400 cached, 300 out
                usage = SimpleNamespace(
                    prompt_tokens=1200,
                    completion_tokens=300,
                    prompt_tokens_details=SimpleNamespace(cached_tokens=400),
                )
                r1 = s1.commit(usage)
            assert (r1.state, r1.charged_micros) == ("committed", 120 + 30 + 180)
            with run.model_step(MODEL, prompt_tokens=2000, max_output_tokens=50) as s2:
                r2 = s2.commit({"prompt_tokens": 2000, "completion_tokens": 10})
            assert r2.charged_micros == 300 + 6
            with run.tool_step("web_search") as s3:
                assert s3.max_output_tokens is None
                r3 = s3.commit_units(1)
            assert r3.charged_micros == 10_000
            with run.tool_step("fetch", units=5) as s4:
                r4 = s4.commit_units(3)
            assert r4.charged_micros == 3_000
            with run.tool_step("web_search") as s5:
                r5 = s5.release()
            assert (r5.state, r5.charged_micros) == ("released", 0)
            # a repeat answers the first outcome
            assert s1.commit(usage).repeated
        total = 330 + 306 + 10_000 + 3_000
        assert run.finished is not None
        assert (run.finished.state, run.finished.charged_micros) == ("finished", total)
        u = sg.usage(session=guest, client_ip=IP, conversation="c1")
        kinds = sorted({s.kind for s in u.scopes})
        assert kinds == ["global", "session"], "only these have budgets in this config"
        s = u.find("session")
        assert s is not None
        assert (s.used_micros, s.reserved_micros, s.limit_micros) == (total, 0, 100_000_000)
        assert s.remaining_micros == s.limit_micros - total
        g = u.find("global", "day")
        assert g is not None and g.used_micros >= total


def test_usage_lists_every_scope_with_a_budget(start_server: StartServer) -> None:
    limits = {
        "session": 'rate = "100000/second"\nburst = 100000\nconcurrency = 1000\n'
        'budgets = [{ amount = "1", window = "day" }]\n',
        "conversation": 'concurrency = 1000\nbudgets = [{ amount = "0.5", window = "hour" }]\n',
    }
    server = start_server(limits=limits)
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        with sg.run(guest, IP, "c1", "hi") as run:
            with run.model_step(MODEL, prompt_text="hello there") as step:
                held = usage_of(sg, guest, "session")
                assert held.reserved_micros == step.reserved_micros > 0
                step.commit(prompt_tokens=1000, completion_tokens=1000)
        for kind, limit in (("session", 1_000_000), ("conversation", 500_000)):
            s = usage_of(sg, guest, kind)
            assert (s.limit_micros, s.used_micros, s.reserved_micros) == (limit, 750, 0), s


def test_an_exception_in_a_step_marks_it_unknown_charged_in_full(server: Server) -> None:
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        step = None
        with pytest.raises(ZeroDivisionError):
            with sg.run(guest, IP, "c1", "hi") as run:
                with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100) as step:
                    1 / 0
        assert step is not None and step.resolution is not None
        assert step.resolution.state == "unknown"
        assert step.resolution.charged_micros == step.reserved_micros == 210
        row = server.reservation(step.step_id)
        assert row is not None and (row["state"], row["charged_micros"]) == ("unknown", 210)
        assert run.finished is not None and run.finished.charged_micros == 210
        g = sg.usage(session=guest).find("session")
        assert g is not None and (g.used_micros, g.reserved_micros) == (210, 0)


def test_a_step_left_without_commit_is_unknown_and_warns(server: Server) -> None:
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        with sg.run(guest, IP, "c1", "hi") as run:
            with pytest.warns(UnresolvedStepWarning):
                with run.tool_step("web_search") as step:
                    pass
        assert step.resolution is not None
        assert (step.resolution.state, step.resolution.charged_micros) == ("unknown", 10_000)


def test_a_run_left_with_a_step_open_charges_it_in_full(server: Server) -> None:
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        with sg.run(guest, IP, "c1", "hi") as run:
            step = run.tool_step("web_search")
            step.open()
        assert run.finished is not None and run.finished.charged_micros == 10_000
        row = server.reservation(step.step_id)
        assert row is not None and row["state"] == "unknown"


def refusal(err: SpendgateRefusal, status: int, code: str, scope: Any) -> None:
    assert isinstance(err, SpendgateRefusal)
    assert (err.status, err.code, err.scope) == (status, code, scope), err.body


def test_budget_refusals_raise_typed_exceptions(start_server: StartServer) -> None:
    limits = {
        "session": 'rate = "100000/second"\nburst = 100000\nconcurrency = 1000\n'
        'budgets = [{ amount = "0.0003", window = "day" }]\n',
    }
    server = start_server(limits=limits)
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        with sg.run(guest, IP, "c1", "hi") as run:
            with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100) as held:
                assert held.reserved_micros == 210
                with pytest.raises(BudgetHeld) as e:
                    run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100).open()
                refusal(e.value, 429, "budget_held", "session")
                assert e.value.retry_after_s is not None and e.value.retry_after_s >= 1
                held.commit(prompt_tokens=1000, completion_tokens=100)
            with pytest.raises(BudgetExhausted) as e2:
                with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100):
                    pytest.fail("admitted past the budget")
            refusal(e2.value, 429, "budget_exhausted", "session")
            # the time to the day's end
            assert e2.value.retry_after_s is not None and 0 < e2.value.retry_after_s <= 86_400
            assert e2.value.ledger_seq is not None


def test_rate_and_concurrency_refusals(start_server: StartServer) -> None:
    limits = {
        "session": 'rate = "1/minute"\nburst = 1\nconcurrency = 1000\nbudgets = []\n',
        "conversation": "concurrency = 1\nbudgets = []\n",
    }
    server = start_server(limits=limits)
    with client(server) as sg:
        a, b = sg.session(client_ip=IP).session, sg.session(client_ip=IP).session
        with sg.run(a, IP, "shared", "hi"):
            with pytest.raises(RateLimited) as e:
                with sg.run(a, IP, "other", "hi"):
                    pytest.fail("admitted past the rate")
            refusal(e.value, 429, "rate_limited", "session")
            assert e.value.retry_after_s is not None and e.value.retry_after_s >= 1
            with pytest.raises(ConcurrencyLimited) as e2:
                with sg.run(b, IP, "shared", "hi"):
                    pytest.fail("admitted past the concurrency cap")
            refusal(e2.value, 429, "concurrency_limited", "conversation")
            assert e2.value.retry_after_s == 1


def test_run_bound_refusals(start_server: StartServer) -> None:
    server = start_server(run='max_tool_calls = 1\nmax_input_bytes = 100\nmax_cost = "10"\n')
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        with pytest.raises(PayloadTooLarge) as e0:
            sg.run(guest, IP, "c1", "x" * 101).open()
        refusal(e0.value, 413, "payload_too_large", "run")
        with sg.run(guest, IP, "c1", input_bytes=100) as run:
            with run.tool_step("web_search") as step:
                step.commit_units(1)
            with pytest.raises(RunBoundExceeded) as e:
                with run.tool_step("web_search"):
                    pytest.fail("admitted past max_tool_calls")
            refusal(e.value, 400, "run_bound_exceeded", "run")
            assert e.value.retry_after_s is None
            with pytest.raises(ContextTooLarge) as e2:
                run.model_step(MODEL, prompt_tokens=16_001).open()
            refusal(e2.value, 400, "context_too_large", "run")
            with pytest.raises(ModelNotAllowed) as e3:
                run.model_step("gpt-unpriced", prompt_tokens=10).open()
            assert (e3.value.status, e3.value.code) == (400, "model_not_allowed")


def test_cutoff_refuses_with_its_own_exception(start_server: StartServer) -> None:
    server = start_server()
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        server.admin("PUT", "/admin/v1/cutoff", {"engaged": True, "reason": "test"})
        with pytest.raises(CutoffEngaged) as e:
            sg.run(guest, IP, "c1", "hi").open()
        refusal(e.value, 503, "cutoff_engaged", "global")
        assert e.value.retry_after_s == 60


def test_a_commit_after_expiry_is_refused(server: Server) -> None:
    """Without the heartbeat (a step opened by hand and left), the lease runs out."""
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        run = sg.run(guest, IP, "c1", "hi")
        run.open()
        step = run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100)
        step.open()
        run._stop_heartbeat()  # as if the heartbeat were lost
        wait_for_state(server, step.step_id, "expired")
        with pytest.raises(ReservationClosed):
            step.commit(prompt_tokens=10, completion_tokens=1)


def test_the_heartbeat_keeps_a_held_step_alive(server: Server) -> None:
    with client(server) as sg:
        guest = sg.session(client_ip=IP).session
        with sg.run(guest, IP, "c1", "hi") as run:
            with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100) as step:
                time.sleep(LEASE_TTL_S * 2.5)
                row = server.reservation(step.step_id)
                assert row is not None and row["state"] == "held", row
                r = step.commit(prompt_tokens=1000, completion_tokens=100)
        assert (r.state, r.charged_micros) == ("committed", 210)


class DropFirstAnswer(httpx.BaseTransport):
    """Sends each request; loses the answer of the first one to each path (a reset)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: List[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()
        first = all(r.url.path != request.url.path for r in self.seen)
        self.seen.append(request)
        if first and request.method == "POST" and request.url.path != "/v1/sessions":
            raise httpx.ReadError("connection reset after the request left")
        return response


def test_a_lost_answer_is_retried_with_the_same_idempotency_key(server: Server) -> None:
    transport = DropFirstAnswer()
    with client(server, http_client=httpx.Client(transport=transport)) as sg:
        guest = sg.session(client_ip=IP).session
        with sg.run(guest, IP, "c1", "hi") as run:
            with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100) as step:
                g = sg.usage(session=guest).find("session")
                assert g is not None and g.reserved_micros == 210, "held once, not twice"
                step.commit(prompt_tokens=1000, completion_tokens=50)
        keys: Dict[str, List[Optional[str]]] = {}
        for r in transport.seen:
            if r.url.path == "/v1/runs" or r.url.path.endswith("/steps"):
                keys.setdefault(r.url.path, []).append(r.headers.get("idempotency-key"))
        assert len(keys) == 2
        for sent in keys.values():
            assert len(sent) == 2 and sent[0] == sent[1] and sent[0], keys
        g = sg.usage(session=guest).find("session")
        assert g is not None and (g.used_micros, g.reserved_micros) == (180, 0)


def wait_for_state(
    server: Server, step_id: str, state: str, limit_s: float = 15.0
) -> Dict[str, Any]:
    deadline = time.monotonic() + limit_s
    row = None
    while time.monotonic() < deadline:
        row = server.reservation(step_id)
        if row is not None and row["state"] == state:
            return row
        time.sleep(0.1)
    raise AssertionError(f"step {step_id} not {state} after {limit_s}s: {row}")


AGENT = Path(__file__).with_name("agent.py")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_agent_s_held_step_expires_and_is_charged_in_full(
    server: Server, python: str, mode: str
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(_paths())}
    agent = subprocess.Popen(
        [python, str(AGENT), server.url, SERVICE, mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        assert agent.stdout is not None
        line = agent.stdout.readline()
        assert line, f"the agent printed nothing: {agent.stderr.read() if agent.stderr else ''}"
        held = json.loads(line)
        # alive, its heartbeat keeps the step held past the lease
        time.sleep(LEASE_TTL_S * 2.5)
        row = server.reservation(held["step_id"])
        assert row is not None and row["state"] == "held", row
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        row = wait_for_state(server, held["step_id"], "expired", LEASE_TTL_S + 10)
        assert row["charged_micros"] == row["reserved_micros"] == held["reserved_micros"] == 210
        expired = [r["id"] for r in server.reservations("expired")]
        assert held["step_id"] in expired
        with client(server) as sg:
            g = sg.usage(session=held["session"]).find("session")
            assert g is not None and (g.used_micros, g.reserved_micros) == (210, 0)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)


def _paths() -> List[str]:
    src = str(Path(spendgate.__file__).resolve().parents[1])
    return [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def test_a_store_that_cannot_answer_raises_store_unavailable(
    start_server: StartServer, redis: Redis
) -> None:
    store = f'kind = "redis"\nurl = "{redis.url}"\nprefix = "pyclient"\nwitness_path = "off"'
    server = start_server(store=store)
    with client(server, max_retries=0) as sg:
        guest = sg.session(client_ip=IP).session
        run = sg.run(guest, IP, "c1", "hi")
        run.open()
        with run.tool_step("web_search") as step:
            step.commit_units(1)
        redis.stop()  # the store is gone
        with pytest.raises(StoreUnavailable) as e:
            run.tool_step("web_search").open()
        assert not isinstance(e.value, SpendgateRefusal)
        assert (e.value.status, e.value.code) == (503, "store_unavailable")
        assert e.value.retry_after_s == 1
        with pytest.raises(StoreUnavailable):
            sg.run(guest, IP, "c2", "hi").open()
        # leaving a run block cannot finish it either: the error says so
        with pytest.raises(StoreUnavailable):
            run.__exit__(None, None, None)
