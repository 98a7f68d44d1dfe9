"""The answer types against docs/openapi.json: the same fields as each schema."""

import dataclasses
import json

import pytest

import spendgate
from spendgate._errors import ERRORS_BY_CODE

from conftest import REPO

DOC = json.loads((REPO / "docs" / "openapi.json").read_text())
SCHEMAS = DOC["components"]["schemas"]

PAIRS = [
    (spendgate.RunBounds, "RunBoundsAnswer"),
    (spendgate.RunAnswer, "RunAnswer"),
    (spendgate.StepAnswer, "StepAnswer"),
    (spendgate.Resolution, "ResolvedAnswer"),
    (spendgate.Heartbeat, "HeartbeatAnswer"),
    (spendgate.FinishAnswer, "FinishAnswer"),
    (spendgate.UsageScope, "UsageScope"),
    (spendgate.Usage, "UsageAnswer"),
]


@pytest.mark.parametrize("cls,schema", PAIRS, ids=[s for _, s in PAIRS])
def test_answer_types_have_the_document_s_fields(cls: type, schema: str) -> None:
    fields = {f.name for f in dataclasses.fields(cls)} - {"raw"}
    assert fields == set(SCHEMAS[schema]["properties"]), schema


def test_session_answer_fields_are_in_the_document() -> None:
    fields = {f.name for f in dataclasses.fields(spendgate.Session)}
    assert fields <= set(SCHEMAS["SessionAnswer"]["properties"])


def test_every_refusal_code_of_the_document_has_its_class() -> None:
    codes = set(SCHEMAS["ErrorCode"]["enum"])
    assert set(ERRORS_BY_CODE) <= codes
    refusals = {
        "rate_limited", "concurrency_limited", "budget_exhausted", "budget_held",
        "run_bound_exceeded", "payload_too_large", "context_too_large", "model_not_allowed",
        "cutoff_engaged",
    }
    for code in refusals:
        assert issubclass(ERRORS_BY_CODE[code], spendgate.SpendgateRefusal), code
    assert not issubclass(ERRORS_BY_CODE["store_unavailable"], spendgate.SpendgateRefusal)
