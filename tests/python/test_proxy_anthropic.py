"""spendgate's `POST /v1/messages`, driven by the official `anthropic` Python package.

Run by the Rust integration test `proxy::messages::official_anthropic_python_client`, which
starts spendgate in front of the mock upstream (an `api = "anthropic"` upstream) and passes,
as environment variables:

  SPENDGATE_BASE_URL       e.g. http://127.0.0.1:PORT (the client appends /v1/messages)
  SPENDGATE_MOCK_URL       the mock upstream, e.g. http://127.0.0.1:PORT (its /mock/served)
  SPENDGATE_SERVICE_TOKEN  the service token (sent as the client's API key: x-api-key)
  SPENDGATE_SESSION        a guest session token
  SPENDGATE_MODEL          a model served by the Anthropic-shaped upstream
  SPENDGATE_PRICES         "input,cache_read,cache_write,output" in micros per million tokens
  SPENDGATE_UPSTREAM_KEY   the upstream's key, which must never reach the client

The server's config gives each conversation a budget of 5000 micros at 10 micros per input
token (25 per cache write, 1 per cache read) and 30 per output token, an output bound of 100
and a context bound of 2000 tokens: a short call fits even at the output bound, one with a
prompt of 1,200 bytes does not.

Runs directly (`python test_proxy_anthropic.py`), printing "N passed, M failed" and exiting
non-zero on any failure.
"""

import json
import os
import sys
import urllib.parse
import urllib.request

import checks  # the runner, beside this file

try:
    import anthropic
    import httpx
except ImportError:  # pragma: no cover - environment problem, reported plainly
    sys.stderr.write(
        "the `anthropic` package is missing: python3 -m venv .venv && "
        ".venv/bin/pip install anthropic\n"
    )
    sys.exit(2)

BASE_URL = os.environ.get("SPENDGATE_BASE_URL", "")
MOCK_URL = os.environ.get("SPENDGATE_MOCK_URL", "")
TOKEN = os.environ.get("SPENDGATE_SERVICE_TOKEN", "")
SESSION = os.environ.get("SPENDGATE_SESSION", "")
MODEL = os.environ.get("SPENDGATE_MODEL", "claude-mock")
P_IN, P_READ, P_WRITE, P_OUT = [
    int(p) for p in os.environ.get("SPENDGATE_PRICES", "0,0,0,0").split(",")
]
UPSTREAM_KEY = os.environ.get("SPENDGATE_UPSTREAM_KEY", "")
IP = "10.9.8.7"
MESSAGES = [{"role": "user", "content": "Say hi"}]


def client(conversation, requests=None, **kwargs):
    """A client as an operator's backend builds it: base URL and key (sent as x-api-key),
    plus the guest's identity headers. `requests`: a list every HTTP request is appended to."""
    hooks = {"request": [lambda r: requests.append(r)]} if requests is not None else {}
    return anthropic.Anthropic(
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


def ceil_div(a, b):
    return -(-a // b)


def expected_charge(usage, caching=False):
    """The usage x prices, rounded up to the micro (integers only). A call that asks for
    caching is priced with its input and cache writes as tokens at the cache write price,
    rounded up to whole tokens (docs/contract.md)."""
    read = usage.cache_read_input_tokens or 0
    write = usage.cache_creation_input_tokens or 0
    if caching:
        tokens = ceil_div(usage.input_tokens * P_IN + write * P_WRITE, P_WRITE)
        num = tokens * P_WRITE + read * P_READ + usage.output_tokens * P_OUT
    else:
        num = usage.input_tokens * P_IN + write * P_WRITE + read * P_READ + usage.output_tokens * P_OUT
    return ceil_div(num, 1_000_000)


def exact_cost(usage):
    read = usage.cache_read_input_tokens or 0
    write = usage.cache_creation_input_tokens or 0
    num = usage.input_tokens * P_IN + write * P_WRITE + read * P_READ + usage.output_tokens * P_OUT
    return ceil_div(num, 1_000_000)


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


def served(tag):
    """The mock's ground truth for a tag, or None when no request carried it."""
    for s in get_json(MOCK_URL + "/mock/served")["served"]:
        if s["tag"] == tag:
            return s
    return None


def conversation_used(conversation):
    """What the conversation's budget has used, from GET /v1/usage (service token)."""
    q = urllib.parse.urlencode({"session": SESSION, "client_ip": IP, "conversation": conversation})
    req = urllib.request.Request(
        BASE_URL + "/v1/usage?" + q, headers={"Authorization": "Bearer " + TOKEN}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        scopes = json.loads(r.read().decode())["scopes"]
    return sum(s["used_micros"] for s in scopes if s["kind"] == "conversation")


def test_create():
    raw = client("an-create", max_retries=0).messages.with_raw_response.create(
        model=MODEL, max_tokens=10, messages=MESSAGES, extra_headers={"x-mock-tag": "an-create"}
    )
    msg = raw.parse()
    assert msg.type == "message" and msg.content[0].type == "text", msg
    assert msg.content[0].text.startswith("tok0"), msg.content
    assert msg.usage.output_tokens == 10, msg.usage
    charged = int(raw.headers["spendgate-charged-micros"])
    assert charged == expected_charge(msg.usage), (charged, msg.usage)
    assert raw.headers["spendgate-outcome"] == "committed"
    assert conversation_used("an-create") == charged
    assert UPSTREAM_KEY not in raw.http_response.text
    s = served("an-create")
    assert s["shape"] == "messages" and s["max_tokens"] == 10, s


def test_stream():
    c = client("an-stream", max_retries=0)
    with c.messages.stream(
        model=MODEL, max_tokens=10, messages=MESSAGES, extra_headers={"x-mock-tag": "an-stream"}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.startswith("tok0"), text
    assert final.usage.output_tokens == 10 and final.usage.input_tokens > 0, final.usage
    assert conversation_used("an-stream") == expected_charge(final.usage)
    s = served("an-stream")
    assert s["stream"] and s["finished"] and s["completion_tokens"] == 10, s


def test_stream_events():
    """The raw event stream (create(stream=True)): message_start, deltas, message_delta."""
    events = list(
        client("an-events", max_retries=0).messages.create(
            model=MODEL, max_tokens=10, messages=MESSAGES, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "content_block_delta" in kinds and "message_delta" in kinds, kinds


def test_cache_classes_priced():
    """Cache writes and reads, each priced: a request with cache_control is reserved with its
    input at the cache write price, and charged the documented rounding above the exact cost."""
    raw = client("an-cache", max_retries=0).messages.with_raw_response.create(
        model=MODEL,
        max_tokens=10,
        system=[{"type": "text", "text": "You are terse. " * 8, "cache_control": {"type": "ephemeral"}}],
        messages=MESSAGES,
        extra_headers={"x-mock-cache-write-tokens": "20", "x-mock-cached-tokens": "7"},
    )
    msg = raw.parse()
    assert msg.usage.cache_creation_input_tokens == 20, msg.usage
    assert msg.usage.cache_read_input_tokens == 7, msg.usage
    charged = int(raw.headers["spendgate-charged-micros"])
    assert charged == expected_charge(msg.usage, caching=True), (charged, msg.usage)
    exact = exact_cost(msg.usage)
    assert exact <= charged <= exact + ceil_div(P_WRITE, 1_000_000), (exact, charged)


def test_max_tokens_clamped():
    """max_tokens over the run's output bound (100) is clamped: the mock is asked for 100."""
    raw = client("an-clamp", max_retries=0).messages.with_raw_response.create(
        model=MODEL,
        max_tokens=5000,
        messages=MESSAGES,
        extra_headers={"x-mock-tag": "an-clamp", "x-mock-completion-tokens": "3"},
    )
    assert raw.headers["spendgate-max-output-tokens"] == "100", raw.headers
    assert served("an-clamp")["max_tokens"] == 100


def test_context_too_large_never_reaches_the_mock():
    """A prompt over the context bound is refused (400, invalid_request_error, code
    context_too_large) before any reservation, and never reaches the mock."""
    big = "word " * 1000
    try:
        client("an-big", max_retries=0).messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[{"role": "user", "content": big}],
            extra_headers={"x-mock-tag": "an-big"},
        )
    except anthropic.BadRequestError as e:
        assert e.status_code == 400
        assert e.body["type"] == "error", e.body
        assert e.body["error"]["type"] == "invalid_request_error", e.body
        assert e.body["error"]["code"] == "context_too_large", e.body
    else:
        raise AssertionError("an over-context prompt was not refused")
    assert served("an-big") is None, "the refused prompt reached the mock"
    assert conversation_used("an-big") == 0


def test_budget_refusal_is_a_rate_limit_error_once():
    """A budget refusal raises RateLimitError once: the client (2 retries by default) does
    not retry it (x-should-retry: false), and the mock never sees it."""
    sent = []
    try:
        client("an-budget", requests=sent).messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[{"role": "user", "content": "x" * 1200}],
            extra_headers={"x-mock-tag": "an-budget"},
        )
    except anthropic.RateLimitError as e:
        assert e.status_code == 429
        assert e.body["error"]["type"] == "rate_limit_error", e.body
        assert e.body["error"]["code"] == "budget_exhausted", e.body
        assert e.body["error"]["scope"] == "conversation", e.body
        assert e.response.headers["x-should-retry"] == "false"
        assert int(e.response.headers["retry-after"]) >= 1
    else:
        raise AssertionError("the call over budget was admitted")
    assert len(sent) == 1, f"the client sent {len(sent)} requests"
    assert served("an-budget") is None


def test_image_refused():
    try:
        client("an-image", max_retries=0).messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                        {"type": "text", "text": "what is this?"},
                    ],
                }
            ],
        )
    except anthropic.BadRequestError as e:
        assert e.body["error"]["code"] == "invalid_request", e.body
    else:
        raise AssertionError("an image was admitted without a price")


TESTS = [
    test_create,
    test_stream,
    test_stream_events,
    test_cache_classes_priced,
    test_max_tokens_clamped,
    test_context_too_large_never_reaches_the_mock,
    test_budget_refusal_is_a_rate_limit_error_once,
    test_image_refused,
]


if __name__ == "__main__":
    checks.run(TESTS, anthropic)
