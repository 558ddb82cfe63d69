"""Fuzzing the contract: requests generated from openapi.yaml against a live server process.

Every answer must be documented and match its schema, and no request may get a 5xx. Bounded:
a fixed number of examples per operation. Generated jobs are made harmless first: their command
is `true` and their runtime env at most `env_vars` (a generated `pip` list would install
packages, a generated entrypoint would run arbitrary shell).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

pytestmark = pytest.mark.ray

SCHEMA = schemathesis.openapi.from_path(Path(__file__).resolve().parent.parent / "openapi.yaml")
EXAMPLES_PER_OPERATION = 30
# Run counts are kept here, and reported by the last test of the module.
REQUESTS_SENT: list[str] = []


def make_harmless(case: Any) -> None:
    body = case.body
    if isinstance(body, dict) and case.operation.definition.raw.get("operationId") == "submit_job":
        entrypoint = body.get("entrypoint")
        # Only a command the server would accept is replaced: an invalid one must stay invalid.
        if (
            isinstance(entrypoint, str)
            and entrypoint.strip()
            and "\x00" not in entrypoint
            and len(entrypoint) <= 128 * 1024
        ):
            body["entrypoint"] = "true"
        runtime_env = body.get("runtime_env")
        if isinstance(runtime_env, dict):
            body["runtime_env"] = {k: v for k, v in runtime_env.items() if k == "env_vars"}


# Endless streams (a websocket, the event stream) never answer in full; their parameters are
# checked by tests/test_streams.py and tests/test_events.py.
OPERATIONS = [
    result.ok()
    for result in SCHEMA.exclude(
        operation_id=["tail_job_logs", "stream_events"]
    ).get_all_operations()
]


# One test per operation, each with its own id: schemathesis' own `parametrize()` gives every
# operation the same node id, and pytest-xdist, which tells tests apart by node id, ran one.
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda operation: operation.label)
def test_generated_requests_get_documented_answers(operation: Any, server_url: str) -> None:
    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    def answers_as_documented(case: Any) -> None:
        make_harmless(case)
        REQUESTS_SENT.append(case.operation.label)
        case.call_and_validate(
            base_url=server_url,
            timeout=30,
            # A valid request may still be refused for a reason the schema cannot express (the
            # job id does not exist, the job already ended): only the server's rules decide that.
            excluded_checks=[checks.positive_data_acceptance],
        )

    answers_as_documented()


def test_the_fuzzer_ran(capsys: Any) -> None:
    """Reports how many requests the fuzzing sent (visible with -s or in the summary)."""
    with capsys.disabled():
        operations = len(set(REQUESTS_SENT))
        print(f"\nfuzzing sent {len(REQUESTS_SENT)} requests over {operations} operations")
    assert len(set(REQUESTS_SENT)) >= 10
