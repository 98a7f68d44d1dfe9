"""spendgate's `POST /v1/embeddings`, driven by the official `openai` Python package.

Run by the Rust integration test `proxy::embeddings::official_openai_client_embeddings`,
which starts spendgate in front of the mock upstream and passes, as environment variables:

  SPENDGATE_BASE_URL       e.g. http://127.0.0.1:PORT/v1
  SPENDGATE_MOCK_URL       the mock upstream, e.g. http://127.0.0.1:PORT (its /mock/served)
  SPENDGATE_SERVICE_TOKEN  the service token (sent as the client's API key)
  SPENDGATE_SESSION        a guest session token
  SPENDGATE_MODEL          an embeddings model
  SPENDGATE_INPUT_PRICE    its input price, in micros per million tokens

The config bounds the context at 2000 tokens (a token a byte) and gives each conversation a
budget of 5000 micros at 10 micros a token.

Runs directly, printing "N passed, M failed" and exiting non-zero on any failure.
"""

import json
import os
import sys
import urllib.request

import checks  # the runner, beside this file

try:
    import httpx
    import openai
except ImportError:  # pragma: no cover - environment problem, reported plainly
    sys.stderr.write("the `openai` package is missing: .venv/bin/pip install openai\n")
    sys.exit(2)

BASE_URL = os.environ.get("SPENDGATE_BASE_URL", "")
MOCK_URL = os.environ.get("SPENDGATE_MOCK_URL", "")
TOKEN = os.environ.get("SPENDGATE_SERVICE_TOKEN", "")
SESSION = os.environ.get("SPENDGATE_SESSION", "")
MODEL = os.environ.get("SPENDGATE_MODEL", "embed-mock")
P_IN = int(os.environ.get("SPENDGATE_INPUT_PRICE", "0"))


def client(conversation, requests=None, **kwargs):
    hooks = {"request": [lambda r: requests.append(r)]} if requests is not None else {}
    return openai.OpenAI(
        base_url=BASE_URL,
        api_key=TOKEN,
        timeout=20.0,
        default_headers={
            "Spendgate-Session": SESSION,
            "Spendgate-Client-Ip": "10.9.8.7",
            "Spendgate-Conversation": conversation,
        },
        http_client=httpx.Client(event_hooks=hooks),
        **kwargs,
    )


def served(tag):
    with urllib.request.urlopen(MOCK_URL + "/mock/served", timeout=10) as r:
        for s in json.loads(r.read().decode())["served"]:
            if s["tag"] == tag:
                return s
    return None


def test_one_input_charged_from_usage():
    raw = client("e-one", max_retries=0).embeddings.with_raw_response.create(
        model=MODEL, input="hello world", extra_headers={"x-mock-tag": "e-one"}
    )
    r = raw.parse()
    assert len(r.data) == 1 and len(r.data[0].embedding) == 8, r
    charged = int(raw.headers["spendgate-charged-micros"])
    assert charged == -(-r.usage.prompt_tokens * P_IN // 1_000_000), (charged, r.usage)
    assert raw.headers["spendgate-max-output-tokens"] == "0"
    assert served("e-one")["shape"] == "embeddings"


def test_a_batch_is_counted_as_a_whole():
    batch = ["first input", "second", "a third one"]
    raw = client("e-batch", max_retries=0).embeddings.with_raw_response.create(
        model=MODEL, input=batch
    )
    r = raw.parse()
    assert [d.index for d in r.data] == [0, 1, 2], r
    # Reserved for every input's bytes, a token each (the bytes tokenizer).
    assert int(raw.headers["spendgate-reserved-micros"]) == -(
        -sum(len(b) for b in batch) * P_IN // 1_000_000
    )
    assert int(raw.headers["spendgate-charged-micros"]) == -(-r.usage.prompt_tokens * P_IN // 1_000_000)


def test_a_batch_over_the_context_never_reaches_the_mock():
    try:
        client("e-big", max_retries=0).embeddings.create(
            model=MODEL, input=["x" * 900] * 3, extra_headers={"x-mock-tag": "e-big"}
        )
    except openai.BadRequestError as e:
        assert e.code == "context_too_large", e.body
    else:
        raise AssertionError("a batch over the context bound was admitted")
    assert served("e-big") is None


def test_a_budget_refusal_is_raised_once():
    sent = []
    try:
        client("e-budget", requests=sent).embeddings.create(
            model=MODEL, input=["y" * 600] * 2, extra_headers={"x-mock-tag": "e-budget"}
        )
    except openai.RateLimitError as e:
        assert e.code == "budget_exhausted", e.body
    else:
        raise AssertionError("a call over budget was admitted")
    assert len(sent) == 1, f"the client sent {len(sent)} requests"
    assert served("e-budget") is None


TESTS = [
    test_one_input_charged_from_usage,
    test_a_batch_is_counted_as_a_whole,
    test_a_batch_over_the_context_never_reaches_the_mock,
    test_a_budget_refusal_is_raised_once,
]


if __name__ == "__main__":
    checks.run(TESTS, openai)
