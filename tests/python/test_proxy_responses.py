"""spendgate's `POST /v1/responses` (OpenAI's Responses API), driven by the official `openai`
Python package.

Run by the Rust integration test `proxy::responses::official_openai_responses_client`, which
starts spendgate in front of the mock upstream and passes, as environment variables:

  SPENDGATE_BASE_URL       e.g. http://127.0.0.1:PORT/v1
  SPENDGATE_MOCK_URL       the mock upstream, e.g. http://127.0.0.1:PORT (its /mock/stats)
  SPENDGATE_SERVICE_TOKEN  the service token (sent as the client's API key)
  SPENDGATE_SESSION        a guest session token
  SPENDGATE_MODEL          a configured model
  SPENDGATE_PRICES         "input,cached,output" in micros per million tokens
  SPENDGATE_TOOL_PRICE     the price of one `web_search` call, in micros
  SPENDGATE_UPSTREAM_KEY   the upstream's key, which must never reach the client

The server's config gives each conversation a budget of 2000 micros at 10/10/30 micros per
token, an output bound of 100 and `run.max_tool_calls` of 16; `web_search` is priced, and
`code_interpreter` is not. A call with max_output_tokens=10 fits the budget, one with the
default output bound (100) does not (the Rust tests check the clamp itself).

Runs directly (`python test_proxy_responses.py`), printing "N passed, M failed" and exiting
non-zero on any failure.
"""

import json
import os
import sys
import time
import urllib.parse
import urllib.request

import checks  # the runner, beside this file

try:
    import httpx
    import openai
except ImportError:  # pragma: no cover - environment problem, reported plainly
    sys.stderr.write(
        "the `openai` package is missing: python3 -m venv .venv && .venv/bin/pip install openai\n"
    )
    sys.exit(2)

BASE_URL = os.environ.get("SPENDGATE_BASE_URL", "")
MOCK_URL = os.environ.get("SPENDGATE_MOCK_URL", "")
TOKEN = os.environ.get("SPENDGATE_SERVICE_TOKEN", "")
SESSION = os.environ.get("SPENDGATE_SESSION", "")
MODEL = os.environ.get("SPENDGATE_MODEL", "mock-model")
PRICES = [int(p) for p in os.environ.get("SPENDGATE_PRICES", "0,0,0").split(",")]
TOOL_PRICE = int(os.environ.get("SPENDGATE_TOOL_PRICE", "0"))
UPSTREAM_KEY = os.environ.get("SPENDGATE_UPSTREAM_KEY", "")
IP = "10.9.8.7"


def client(conversation, requests=None, **kwargs):
    """A client as an operator's backend builds it: base URL and key, plus the guest's identity
    headers. `requests`: a list every HTTP request is appended to."""
    hooks = {"request": [lambda r: requests.append(r)]} if requests is not None else {}
    return openai.OpenAI(
        base_url=BASE_URL,
        api_key=TOKEN,
        timeout=20.0,
        default_headers={
            "Spendgate-Session": SESSION,
            "Spendgate-Client-Ip": IP,
            "Spendgate-Conversation": conversation,
        },
        http_client=httpx.Client(event_hooks=hooks),
        **kwargs,
    )


def model_charge(usage):
    """usage x prices, rounded up to the micro (integers only)."""
    cached = 0
    if usage.input_tokens_details is not None and usage.input_tokens_details.cached_tokens:
        cached = usage.input_tokens_details.cached_tokens
    p_in, p_cached, p_out = PRICES
    num = (usage.input_tokens - cached) * p_in + cached * p_cached + usage.output_tokens * p_out
    return -(-num // 1_000_000)


def get_json(url, token=None):
    headers = {"Authorization": "Bearer " + token} if token else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read().decode())


def conversation_used(conversation):
    """What the conversation's budget was charged, from `GET /v1/usage`."""
    query = urllib.parse.urlencode(
        {"session": SESSION, "client_ip": IP, "conversation": conversation}
    )
    usage = get_json(BASE_URL + "/usage?" + query, TOKEN)
    for s in usage["scopes"]:
        if s["kind"] == "conversation":
            assert s["reserved_micros"] == 0, s
            return s["used_micros"]
    raise AssertionError("no conversation scope in %r" % usage)


def mock_requests():
    return get_json(MOCK_URL + "/mock/stats")["requests"]


def hosted_calls(response):
    return sum(1 for item in response.output if item.type == "web_search_call")


def test_create():
    raw = client("rs-create", max_retries=0).responses.with_raw_response.create(
        model=MODEL, input="Say hi", max_output_tokens=10
    )
    response = raw.parse()
    assert response.output_text.startswith("tok0 tok1"), response
    assert response.usage.output_tokens == 10, response.usage
    charged = int(raw.headers["spendgate-charged-micros"])
    assert charged == model_charge(response.usage), (charged, response.usage)
    assert int(raw.headers["spendgate-reserved-micros"]) >= charged
    assert conversation_used("rs-create") == charged
    assert UPSTREAM_KEY not in raw.http_response.text


def test_priced_hosted_tool_is_reserved_and_charged():
    raw = client("rs-tool", max_retries=0).responses.with_raw_response.create(
        model=MODEL,
        input="Search the web",
        max_output_tokens=10,
        max_tool_calls=3,
        tools=[{"type": "web_search"}],
        extra_headers={"x-mock-hosted-tool-calls": "2"},
    )
    response = raw.parse()
    assert hosted_calls(response) == 2, response.output
    expected = model_charge(response.usage) + 2 * TOOL_PRICE
    assert int(raw.headers["spendgate-charged-micros"]) == expected, raw.headers
    # Reserved with the call: the model's bound and the 3 calls allowed.
    assert int(raw.headers["spendgate-reserved-micros"]) >= model_charge(response.usage) + 3 * TOOL_PRICE
    assert conversation_used("rs-tool") == expected


def test_streamed_hosted_tool_is_charged_from_the_final_event():
    stream = client("rs-tool-stream", max_retries=0).responses.create(
        model=MODEL,
        input="Search the web",
        max_output_tokens=10,
        max_tool_calls=2,
        tools=[{"type": "web_search_preview"}],
        stream=True,
    )
    text, completed = [], None
    for event in stream:
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            # (incomplete: the answer reached max_output_tokens)
            completed = event.response
    assert completed is not None, "the stream ended with its final response"
    assert "".join(text).split() == ["tok%d" % i for i in range(10)], text
    calls = hosted_calls(completed)
    assert calls == 1, completed.output
    assert conversation_used("rs-tool-stream") == model_charge(completed.usage) + calls * TOOL_PRICE


def test_unpriced_hosted_tool_is_refused_before_the_call():
    before = mock_requests()
    try:
        client("rs-unpriced", max_retries=0).responses.create(
            model=MODEL,
            input="Run this code",
            max_output_tokens=10,
            tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
        )
    except openai.BadRequestError as e:
        assert e.code == "model_not_allowed", e.body
        assert "code_interpreter" in e.message, e.message
    else:
        raise AssertionError("expected openai.BadRequestError")
    assert mock_requests() == before, "the refused call never reached the upstream"
    assert conversation_used("rs-unpriced") == 0


def test_budget_refusal_is_a_rate_limit_error_and_not_retried():
    # Default retry settings: `x-should-retry: false` keeps the library from retrying.
    requests = []
    started = time.monotonic()
    try:
        client("rs-refused", requests=requests).responses.create(model=MODEL, input="Say hi")
    except openai.RateLimitError as e:
        assert e.status_code == 429
        assert e.code == "budget_exhausted", e.body
        assert e.body["scope"] == "conversation", e.body
        assert e.response.headers.get("x-should-retry") == "false"
    else:
        raise AssertionError("expected openai.RateLimitError")
    assert len(requests) == 1, "the client retried a spent budget"
    assert time.monotonic() - started < 5


def test_stream_cut_by_the_upstream_raises_an_api_error():
    stream = client("rs-cut", max_retries=0).responses.create(
        model=MODEL,
        input="Say hi",
        max_output_tokens=10,
        stream=True,
        extra_headers={"x-mock-fault": "drop_mid_stream"},
    )
    got = []
    try:
        for event in stream:
            if event.type == "response.output_text.delta":
                got.append(event.delta)
    except openai.APIError as e:
        assert "charged in full" in e.message, e.message
    else:
        raise AssertionError("expected openai.APIError")
    assert got, "content arrived before the cut"


TESTS = [
    test_create,
    test_priced_hosted_tool_is_reserved_and_charged,
    test_streamed_hosted_tool_is_charged_from_the_final_event,
    test_unpriced_hosted_tool_is_refused_before_the_call,
    test_budget_refusal_is_a_rate_limit_error_and_not_retried,
    test_stream_cut_by_the_upstream_raises_an_api_error,
]


if __name__ == "__main__":
    checks.run(TESTS, openai)
