"""schemathesis against the live `/openapi.json`: generated valid and invalid requests to
every operation get no 5xx, only documented status codes and content types, bodies that
match the schema, and every schema-invalid request is refused."""

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.conftest import API_KEY, MODEL_NAME

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance, negative_data_rejection]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def schema(live):
    return schemathesis.openapi.from_url(live.http_url + "/openapi.json", headers=AUTH)


def _operations(schema):
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_get_documented_answers(live, schema, mode):
    operations = _operations(schema)
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"}
    for operation in operations:
        if operation.path == "/metrics" or (mode == GenerationMode.NEGATIVE and len(operation.body) == 0):
            continue  # (metrics is plain text; operations without a body have no invalid input)

        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
        def run(case):
            # Valid requests mostly name the served model, so they reach the engine.
            if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                case.body["model"] = MODEL_NAME
            case.call_and_validate(base_url=live.http_url, headers=AUTH, checks=CHECKS, timeout=120)

        run()
