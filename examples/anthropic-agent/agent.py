"""A reference agent against `spendgate demo`: the official `anthropic` client through
spendgate's `/v1/messages` for the model rounds, spendgate's Python client for the run and
the paid tool.

    pip install anthropic ./clients/python
    SPENDGATE_TOKEN=demo-service-... python examples/anthropic-agent/agent.py

As examples/python-agent does with the `openai` client: each model round is a step of one run
(the `Spendgate-Run` header), each search a paid tool step reserved before it runs; it goes on
until the model answers or spendgate refuses the next step (the run's bounds, or a budget),
then prints the guest's spend from `GET /v1/usage`.
"""

import os

import anthropic
from spendgate import Client, SpendgateRefusal

BASE = os.environ.get("SPENDGATE_URL", "http://127.0.0.1:8080")
TOKEN = os.environ["SPENDGATE_TOKEN"]  # the service token `spendgate demo` printed
GUEST_IP = "203.0.113.7"  # the guest's address, as your backend would know it
MODEL = "demo-mini"
QUESTION = "What does spendgate do? Search the web, then explain."
TOOLS = [{
    "name": "web_search",
    "description": "Search the web",
    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}]


def web_search(query: str) -> str:
    """The paid tool (a stand-in: a real one would call a search API)."""
    return f"3 results for {query[:40]!r}: spendgate keeps an LLM service within its budgets."


def main() -> None:
    sg = Client(BASE, TOKEN)
    guest = sg.session(client_ip=GUEST_IP).session  # POST /v1/sessions, as a guest arrives
    print(f"guest session {guest}")
    messages = [{"role": "user", "content": QUESTION}]
    with sg.run(guest, GUEST_IP, "anthropic-agent", QUESTION) as run:  # POST /v1/runs
        print(f"run {run.run_id}: at most {run.bounds.max_model_rounds} model rounds")
        # The service token is the API key (sent as x-api-key).
        llm = anthropic.Anthropic(base_url=BASE, api_key=TOKEN, default_headers={
            "Spendgate-Session": guest, "Spendgate-Client-Ip": GUEST_IP,
            "Spendgate-Conversation": "anthropic-agent", "Spendgate-Run": run.run_id})
        for round_no in range(1, 1000):  # spendgate's run bounds stop it long before
            # The demo's mock model calls a tool only when told to (here on the first round,
            # with a 4-word query); a real model decides for itself.
            mock = {"x-mock-fault": "tool_call", "x-mock-completion-tokens": "4"}
            mock = mock if round_no == 1 else {}
            try:
                raw = llm.messages.with_raw_response.create(
                    model=MODEL, messages=messages, tools=TOOLS, max_tokens=16,
                    extra_headers=mock)
            except anthropic.APIStatusError as e:  # a refusal: nothing was spent on this round
                error = e.body.get("error", {}) if isinstance(e.body, dict) else {}
                print(f"round {round_no}: refused, {error.get('code')}: {error.get('message')}")
                break
            reply = raw.parse()
            print(f"round {round_no}: {reply.stop_reason}, charged "
                  f"{raw.headers['spendgate-charged-micros']} micros")
            messages.append({"role": "assistant", "content": reply.content})
            if reply.stop_reason == "tool_use":
                results = []
                for call in (b for b in reply.content if b.type == "tool_use"):
                    try:
                        with run.tool_step("web_search") as step:  # reserved before it runs
                            result = web_search(str(call.input.get("q", "")))
                            paid = step.commit_units(1)
                        print(f"  web_search: charged {paid.charged_micros} micros")
                    except SpendgateRefusal as e:
                        print(f"  web_search: refused {e.code} ({e.scope})")
                        result = f"web_search was refused: {e.code}"
                    results.append({"type": "tool_result", "tool_use_id": call.id,
                                    "content": result})
                messages.append({"role": "user", "content": results})
            elif reply.stop_reason == "max_tokens":
                messages.append({"role": "user", "content": "Go on."})
            else:
                print("answer:", "".join(b.text for b in reply.content if b.type == "text"))
                break
    print(f"run finished: {run.finished.steps} steps, charged {run.finished.charged_micros} micros")

    session = sg.usage(session=guest).find("session")  # GET /v1/usage?session=...
    print(f"spent {session.used_micros} micros of the guest's {session.limit_micros} "
          f"({session.window})")


if __name__ == "__main__":
    main()
