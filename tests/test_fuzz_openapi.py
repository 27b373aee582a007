"""Fuzzing the HTTP API from its own OpenAPI schema (schemathesis): no case is a 5xx.

Every operation, the operator PUT included, gets valid (positive) and invalid (negative)
cases; the guard app caps max_tokens at 8, so the whole run stays short.
"""

import os
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import TEST_ADMIN_TOKEN

# 100 in the test run; SPECSERVE_FUZZ_CASES=900 gives the >5,000-case run of docs/reliability.md.
CASES_PER_OPERATION_AND_MODE = int(os.environ.get("SPECSERVE_FUZZ_CASES", "100"))


@pytest.fixture(scope="module")
def schema(guard_app):  # noqa: F811
    raw = guard_app.http.get("/openapi.json").json()
    return schemathesis.openapi.from_dict(raw)


def test_fuzzing_the_openapi_schema_finds_no_server_error(schema, guard_app):  # noqa: F811
    base_url, statuses, server_errors, sent = guard_app.prefix, Counter(), [], 0
    http = httpx.Client(timeout=60)
    start = time.monotonic()
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {"PUT /v1/speculation", "POST /v1/chat/completions", "POST /v1/completions"} <= {
        f"{op.method.upper()} {op.path}" for op in operations
    }
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=CASES_PER_OPERATION_AND_MODE,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal sent
                headers = {"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"} if case.method.upper() == "PUT" else None
                # httpx sends it: schemathesis's own requests transport trips over urllib3-future here.
                kw = case.as_transport_kwargs(base_url=base_url, headers=headers)
                data = kw.get("data")
                r = http.request(
                    kw["method"],
                    kw["url"],
                    headers=kw["headers"],
                    params=kw.get("params"),
                    json=kw.get("json"),
                    content=data if isinstance(data, (bytes, str)) else None,
                )
                sent += 1
                statuses[r.status_code] += 1
                if r.status_code >= 500:
                    server_errors.append((case.method, case.path, case.body, r.status_code, r.text[:200]))

            try:
                run()
            except Unsatisfiable:  # no invalid input exists for an operation without parameters
                assert mode is GenerationMode.NEGATIVE
    elapsed = time.monotonic() - start
    print(
        f"\nschemathesis: {sent} cases in {elapsed:.1f} s over {len(operations)} operations; statuses {dict(statuses)}"
    )
    assert not server_errors, server_errors[:5]
    assert sent >= 500
    assert guard_app.http.get("/health").status_code == 200
