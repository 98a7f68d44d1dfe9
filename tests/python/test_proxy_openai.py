"""spendgate's OpenAI-compatible proxy, driven by the official `openai` Python package.

Run by the Rust integration test `proxy::official_openai_python_client`, which starts
spendgate in front of the mock upstream and passes, as environment variables:

  SPENDGATE_BASE_URL       e.g. http://127.0.0.1:PORT/v1
  SPENDGATE_METRICS_URL    e.g. http://127.0.0.1:PORT/metrics
  SPENDGATE_SERVICE_TOKEN  the service token (sent as the client's API key)
  SPENDGATE_SESSION        a guest session token
  SPENDGATE_MODEL          a configured model
  SPENDGATE_PRICES         "input,cached,output" in micros per million tokens
  SPENDGATE_UPSTREAM_KEY   the upstream's key, which must never reach the client

The server's config gives each conversation a budget of 1000 micros at 10/10/30 micros per
token: a call with max_tokens=10 fits, one with the default output bound (100) does not.

Runs with pytest, or directly (`python test_proxy_openai.py`), which prints
"N passed, M failed" and exits non-zero on any failure.
"""

import os
import sys
import time
import urllib.request

import checks  # the runner, beside this file

try:
    import openai
except ImportError:  # pragma: no cover - environment problem, reported plainly
    sys.stderr.write(
        "the `openai` package is missing: python3 -m venv .venv && .venv/bin/pip install openai\n"
    )
    sys.exit(2)

BASE_URL = os.environ.get("SPENDGATE_BASE_URL", "")
METRICS_URL = os.environ.get("SPENDGATE_METRICS_URL", "")
ADMIN_TOKEN = os.environ.get("SPENDGATE_ADMIN_TOKEN", "")
TOKEN = os.environ.get("SPENDGATE_SERVICE_TOKEN", "")
SESSION = os.environ.get("SPENDGATE_SESSION", "")
MODEL = os.environ.get("SPENDGATE_MODEL", "mock-model")
PRICES = [int(p) for p in os.environ.get("SPENDGATE_PRICES", "0,0,0").split(",")]
UPSTREAM_KEY = os.environ.get("SPENDGATE_UPSTREAM_KEY", "")
MESSAGES = [{"role": "user", "content": "Say hi"}]


def client(conversation, **kwargs):
    """A client as an operator's backend would build it: base URL and key, plus the guest's
    identity headers."""
    return openai.OpenAI(
        base_url=BASE_URL,
        api_key=TOKEN,
        timeout=20.0,
        default_headers={
            "Spendgate-Session": SESSION,
            "Spendgate-Client-Ip": "10.9.8.7",
            "Spendgate-Conversation": conversation,
        },
        **kwargs,
    )


def expected_charge(usage):
    """usage x prices, rounded up to the micro (integers only)."""
    cached = 0
    if usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens:
        cached = usage.prompt_tokens_details.cached_tokens
    p_in, p_cached, p_out = PRICES
    num = (usage.prompt_tokens - cached) * p_in + cached * p_cached + usage.completion_tokens * p_out
    return -(-num // 1_000_000)


def metric(prefix):
    # /metrics is served to the admin token on the API's listener.
    req = urllib.request.Request(METRICS_URL, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(prefix):
                return int(float(line[len(prefix):].strip()))
    return 0


def test_create():
    raw = client("py-create", max_retries=0).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=10
    )
    completion = raw.parse()
    assert completion.choices[0].message.content.startswith("tok0 tok1"), completion
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 10, completion.usage
    charged = int(raw.headers["spendgate-charged-micros"])
    assert charged == expected_charge(completion.usage), (charged, completion.usage)
    assert int(raw.headers["spendgate-reserved-micros"]) >= charged
    assert UPSTREAM_KEY not in raw.http_response.text
    assert all(UPSTREAM_KEY not in v for v in raw.headers.values())


def test_stream():
    stream = client("py-stream", max_retries=0).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, stream=True
    )
    parts = []
    for chunk in stream:
        # The usage chunk (no choices) that spendgate asked for is not passed on to a client
        # that did not ask for it: indexing choices[0] is safe, as with OpenAI.
        delta = chunk.choices[0].delta
        if delta.content:
            parts.append(delta.content)
    assert "".join(parts).split(" ") == ["tok%d" % i for i in range(10)], parts


def test_stream_with_usage():
    stream = client("py-stream-usage", max_retries=0).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
    assert usage is not None and usage.completion_tokens == 10, usage


def test_budget_refusal_is_a_rate_limit_error_and_not_retried():
    metric_name = (
        'spendgate_refusals_total{what="proxy_step",code="budget_exhausted",scope="conversation"} '
    )
    before = metric(metric_name)
    # Default retry settings: the library would retry a 429, but `x-should-retry: false`
    # tells it not to hammer a spent budget.
    started = time.monotonic()
    try:
        client("py-refused").chat.completions.create(model=MODEL, messages=MESSAGES)
    except openai.RateLimitError as e:
        assert e.status_code == 429
        assert e.code == "budget_exhausted", e.body
        assert e.type == "insufficient_quota", e.body
        assert e.body["scope"] == "conversation", e.body
        assert e.response.headers.get("x-should-retry") == "false"
        assert int(e.response.headers["retry-after"]) >= 1
    else:
        raise AssertionError("expected openai.RateLimitError")
    assert time.monotonic() - started < 5
    assert metric(metric_name) == before + 1, "the client retried a spent budget"


def test_stream_cut_by_the_upstream_raises_an_api_error():
    stream = client("py-cut", max_retries=0).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        stream=True,
        extra_headers={"x-mock-fault": "drop_mid_stream"},
    )
    got = []
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    except openai.APIError as e:
        assert e.code == "upstream_error", e.body
        assert "charged in full" in e.message, e.message
    else:
        raise AssertionError("expected openai.APIError")
    assert got, "content arrived before the cut"


# An upstream that ignores max_tokens=10 and generates 50 tokens (the mock's words).
PAST_THE_BOUND = {"x-mock-extra-completion-tokens": "40"}


def test_create_past_the_bound_is_cut_to_it():
    raw = client("py-past", max_retries=0).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, extra_headers=PAST_THE_BOUND
    )
    completion = raw.parse()
    words = completion.choices[0].message.content.split()
    assert words == ["tok%d" % i for i in range(10)], words
    assert completion.choices[0].finish_reason == "length"
    assert raw.headers["spendgate-output-cut"] == "true"
    # Charged for all the upstream generated and reported, above the reservation.
    assert completion.usage.completion_tokens == 50, completion.usage
    charged = int(raw.headers["spendgate-charged-micros"])
    assert charged == expected_charge(completion.usage), (charged, completion.usage)
    assert charged > int(raw.headers["spendgate-reserved-micros"])


def test_stream_past_the_bound_is_cut_at_it():
    stream = client("py-past-stream", max_retries=0).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        stream=True,
        extra_headers=PAST_THE_BOUND,
    )
    got = []
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    except openai.APIError as e:
        assert e.code == "upstream_error", e.body
        assert "bound" in e.message, e.message
    else:
        raise AssertionError("expected openai.APIError")
    words = "".join(got).split()
    assert words == ["tok%d" % i for i in range(10)], words


def test_upstream_error_passes_through():
    try:
        client("py-500", max_retries=0).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            extra_headers={"x-mock-fault": "http_500"},
        )
    except openai.InternalServerError as e:
        assert e.status_code == 500
    else:
        raise AssertionError("expected openai.InternalServerError")


TESTS = [
    test_create,
    test_stream,
    test_stream_with_usage,
    test_budget_refusal_is_a_rate_limit_error_and_not_retried,
    test_stream_cut_by_the_upstream_raises_an_api_error,
    test_upstream_error_passes_through,
    test_create_past_the_bound_is_cut_to_it,
    test_stream_past_the_bound_is_cut_at_it,
]


if __name__ == "__main__":
    checks.run(TESTS, openai)
