"""The asyncio client against a live spendgate."""

from __future__ import annotations

import asyncio

import pytest

from spendgate import AsyncClient, BudgetExhausted, RunBoundExceeded, SpendgateRefusal

from conftest import LEASE_TTL_S, SERVICE, Server, StartServer

IP = "198.51.100.4"
MODEL = "gpt-4o-mini"


def test_an_async_run_is_charged_to_the_micro(server: Server) -> None:
    async def go() -> None:
        async with AsyncClient(server.url, SERVICE) as sg:
            guest = (await sg.session(client_ip=IP)).session
            async with sg.run(guest, IP, "a1", "hi") as run:
                async with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100) as s:
                    assert s.reserved_micros == 210
                    # Responses API usage shape
                    r = await s.commit({"input_tokens": 1000, "output_tokens": 40})
                    assert r.charged_micros == 150 + 24
                async with run.tool_step("fetch", units=4) as t:
                    assert (await t.commit_result_bytes(10)).charged_micros == 4_000
            assert run.finished is not None and run.finished.charged_micros == 4_174
            u = (await sg.usage(session=guest)).find("session")
            assert u is not None and (u.used_micros, u.reserved_micros) == (4_174, 0)

    asyncio.run(go())


def test_an_async_exception_or_cancel_marks_the_step_unknown(server: Server) -> None:
    async def go() -> None:
        async with AsyncClient(server.url, SERVICE) as sg:
            guest = (await sg.session(client_ip=IP)).session
            async with sg.run(guest, IP, "a2", "hi") as run:
                with pytest.raises(RuntimeError):
                    async with run.tool_step("web_search") as s1:
                        raise RuntimeError("the tool failed midway")
                assert s1.resolution is not None and s1.resolution.state == "unknown"

                started = asyncio.Event()
                holder = {}

                async def worker() -> None:
                    async with run.tool_step("web_search") as s2:
                        holder["step"] = s2
                        started.set()
                        await asyncio.sleep(60)

                task = asyncio.ensure_future(worker())
                await started.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                s2 = holder["step"]
                assert s2.resolution is not None
                assert (s2.resolution.state, s2.resolution.charged_micros) == ("unknown", 10_000)
            for s in (s1, s2):
                row = server.reservation(s.step_id)
                assert row is not None and row["state"] == "unknown"
            u = (await sg.usage(session=guest)).find("session")
            assert u is not None and u.used_micros == 20_000

    asyncio.run(go())


def test_the_async_heartbeat_keeps_a_held_step_alive(server: Server) -> None:
    async def go() -> None:
        async with AsyncClient(server.url, SERVICE) as sg:
            guest = (await sg.session(client_ip=IP)).session
            async with sg.run(guest, IP, "a3", "hi") as run:
                async with run.model_step(MODEL, prompt_tokens=10, max_output_tokens=10) as s:
                    await asyncio.sleep(LEASE_TTL_S * 2.5)
                    r = await s.commit(prompt_tokens=10, completion_tokens=10)
                    assert r.state == "committed"

    asyncio.run(go())


def test_async_refusals_are_typed(start_server: StartServer) -> None:
    limits = {
        "session": 'rate = "100000/second"\nburst = 100000\nconcurrency = 1000\n'
        'budgets = [{ amount = "0.000151", window = "day" }]\n',
    }
    server = start_server(limits=limits, run='max_model_rounds = 1\nmax_cost = "10"\n')

    async def go() -> None:
        async with AsyncClient(server.url, SERVICE) as sg:
            guest = (await sg.session(client_ip=IP)).session
            async with sg.run(guest, IP, "a4", "hi") as run:
                async with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=1) as s:
                    await s.commit(prompt_tokens=1000, completion_tokens=1)
                with pytest.raises(RunBoundExceeded) as e:
                    await run.model_step(MODEL, prompt_tokens=1).open()
                assert (e.value.status, e.value.scope) == (400, "run")
            with pytest.raises(BudgetExhausted) as e2:
                async with sg.run(guest, IP, "a5", "hi"):
                    pytest.fail("a run admitted on a spent budget")
            assert isinstance(e2.value, SpendgateRefusal)
            assert (e2.value.status, e2.value.code, e2.value.scope) == (
                429, "budget_exhausted", "session")

    asyncio.run(go())
