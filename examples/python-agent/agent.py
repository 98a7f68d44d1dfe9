"""A reference agent against `spendgate demo`: the official `openai` client through spendgate's
proxy for the model rounds, spendgate's Python client for the run and the paid tool.

    pip install openai ./clients/python
    SPENDGATE_TOKEN=demo-service-... python examples/python-agent/agent.py

The agent answers a question with a `web_search` tool: each model round is a step of one run
(the `Spendgate-Run` header), each search a paid tool step reserved before it runs. It goes on
while the model asks for a search or is cut at `max_tokens` ("go on"), until the model answers
or spendgate refuses the next step: the run's bounds (`max_model_rounds`, ...) or a budget.
Then it prints the guest's spend from `GET /v1/usage`.
"""

import json
import os

from openai import APIStatusError, OpenAI
from spendgate import Client, SpendgateRefusal

BASE = os.environ.get("SPENDGATE_URL", "http://127.0.0.1:8080")
TOKEN = os.environ["SPENDGATE_TOKEN"]  # the service token `spendgate demo` printed
GUEST_IP = "203.0.113.7"  # the guest's address, as your backend would know it
MODEL = "demo-mini"
QUESTION = "What does spendgate do? Search the web, then explain."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "web_search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                       "required": ["q"]},
    },
}]


def web_search(query: str) -> str:
    """The paid tool (a stand-in: a real one would call a search API)."""
    return f"3 results for {query[:40]!r}: spendgate keeps an LLM service within its budgets."


def main() -> None:
    sg = Client(BASE, TOKEN)
    guest = sg.session(client_ip=GUEST_IP).session  # POST /v1/sessions, as a guest arrives
    print(f"guest session {guest}")
    messages = [{"role": "user", "content": QUESTION}]
    with sg.run(guest, GUEST_IP, "python-agent", QUESTION) as run:  # POST /v1/runs
        print(f"run {run.run_id}: at most {run.bounds.max_model_rounds} model rounds")
        llm = OpenAI(base_url=BASE + "/v1", api_key=TOKEN, default_headers={
            "Spendgate-Session": guest, "Spendgate-Client-Ip": GUEST_IP,
            "Spendgate-Conversation": "python-agent", "Spendgate-Run": run.run_id})
        for round_no in range(1, 1000):  # spendgate's run bounds stop it long before
            # The demo's mock model calls a tool only when told to (here on the first round,
            # with a 4-word query); a real model decides for itself.
            mock = {"x-mock-fault": "tool_call", "x-mock-completion-tokens": "4"}
            mock = mock if round_no == 1 else {}
            try:
                raw = llm.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, tools=TOOLS, max_tokens=16,
                    extra_headers=mock)
            except APIStatusError as e:  # a refusal: nothing was spent on this round
                print(f"round {round_no}: refused, {e.code}: {e.message}")
                break
            reply = raw.parse()
            choice = reply.choices[0]
            print(f"round {round_no}: {choice.finish_reason}, charged "
                  f"{raw.headers['spendgate-charged-micros']} micros")
            messages.append(choice.message.model_dump(exclude_none=True))
            if choice.finish_reason == "tool_calls":
                for call in choice.message.tool_calls or []:
                    query = json.loads(call.function.arguments).get("q", "")
                    try:
                        with run.tool_step("web_search") as step:  # reserved before it runs
                            result = web_search(query)
                            paid = step.commit_units(1)
                        print(f"  web_search: charged {paid.charged_micros} micros")
                    except SpendgateRefusal as e:
                        print(f"  web_search: refused {e.code} ({e.scope})")
                        result = f"web_search was refused: {e.code}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            elif choice.finish_reason == "length":
                messages.append({"role": "user", "content": "Go on."})
            else:
                print("answer:", choice.message.content)
                break
    print(f"run finished: {run.finished.steps} steps, charged {run.finished.charged_micros} micros")

    session = sg.usage(session=guest).find("session")  # GET /v1/usage?session=...
    print(f"spent {session.used_micros} micros of the guest's {session.limit_micros} "
          f"({session.window})")


if __name__ == "__main__":
    main()
