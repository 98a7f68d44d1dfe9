"""An agent that holds a step and never resolves it, for the killed-agent test.

``python agent.py URL SERVICE_TOKEN sync|async``: opens a session, a run and a model step,
prints ``{"session", "run_id", "step_id", "reserved_micros"}`` as one line, then works
forever (its heartbeat renews the lease) until it is killed.
"""

import asyncio
import json
import sys
import time

from spendgate import AsyncClient, Client

MODEL = "gpt-4o-mini"


def say(session: str, run_id: str, step_id: str, reserved: int) -> None:
    line = {"session": session, "run_id": run_id, "step_id": step_id, "reserved_micros": reserved}
    print(json.dumps(line), flush=True)


def sync_agent(url: str, token: str) -> None:
    with Client(url, token) as sg:
        guest = sg.session(client_ip="203.0.113.9").session
        with sg.run(guest, "203.0.113.9", "agent", "hi") as run:
            with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100) as step:
                say(guest, run.run_id, step.step_id, step.reserved_micros)
                while True:
                    time.sleep(1)


async def async_agent(url: str, token: str) -> None:
    async with AsyncClient(url, token) as sg:
        guest = (await sg.session(client_ip="203.0.113.9")).session
        async with sg.run(guest, "203.0.113.9", "agent", "hi") as run:
            async with run.model_step(MODEL, prompt_tokens=1000, max_output_tokens=100) as step:
                say(guest, run.run_id, step.step_id, step.reserved_micros)
                while True:
                    await asyncio.sleep(1)


if __name__ == "__main__":
    if sys.argv[3] == "async":
        asyncio.run(async_agent(sys.argv[1], sys.argv[2]))
    else:
        sync_agent(sys.argv[1], sys.argv[2])
