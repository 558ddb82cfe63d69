"""`GET /api/jobs/?submission_id=a,b,c`: the jobs among those ids that exist and the key may see,
in the order given, in one request (the web page reads a job's dependencies so); the ids' bounds
and the parameters it does not take with it are 400s."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.support.api import submit


async def test_the_jobs_of_the_ids_in_their_order_without_the_missing(
    fake_client: TestClient[Any, Any],
) -> None:
    first = await submit(fake_client, entrypoint="one")
    second = await submit(fake_client, entrypoint="two", depends_on=[{"submission_id": first}])
    await submit(fake_client, entrypoint="not asked for")
    response = await fake_client.get(f"/api/jobs/?submission_id={second},nope,{first},{second}")
    assert response.status == 200, await response.text()
    jobs = await response.json()
    assert [job["submission_id"] for job in jobs] == [second, first]
    assert jobs[0]["depends_on"][0]["submission_id"] == first
    single = await (await fake_client.get(f"/api/jobs/{first}")).json()
    assert jobs[1] == single  # each as its GET gives it


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("submission_id=" + ",".join(f"j{i}" for i in range(101)), "at most 100"),
        ("submission_id=a,,b", "not a submission id"),
        ("submission_id=a/b", "not a submission id"),
        ("submission_id=a&limit=5", "not with limit"),
        ("submission_id=a&status=RUNNING", "not with status"),
    ],
)
async def test_bad_ids_and_other_parameters_are_refused(
    fake_client: TestClient[Any, Any], query: str, says: str
) -> None:
    response = await fake_client.get(f"/api/jobs/?{query}")
    assert response.status == 400, await response.text()
    body = await response.json()
    assert body["error"]["code"] == "invalid_request"
    assert says in body["error"]["message"], body
