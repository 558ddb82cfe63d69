"""Prometheus metrics: requests by route and jobs by status, from a live app."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.support.api import submit, wait_for_status


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_count_requests_by_route_and_jobs_by_status(
    client: TestClient[Any, Any],
) -> None:
    job_id = await submit(client, entrypoint="true")
    await wait_for_status(client, job_id)
    failing = await submit(client, entrypoint="exit 2")
    await wait_for_status(client, failing)
    assert (await client.get("/api/jobs/no-such-job")).status == 404
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.content_type == "text/plain"
    found = samples(await response.text())
    assert found[("jobs_server_jobs", (("status", "SUCCEEDED"), ("tenant", "default")))] == 1
    assert found[("jobs_server_jobs", (("status", "FAILED"), ("tenant", "default")))] == 1
    assert found[("jobs_server_jobs", (("status", "RUNNING"), ("tenant", "default")))] == 0
    submits = (("method", "POST"), ("route", "submit_job"), ("status", "200"))
    assert found[("jobs_server_http_requests_total", submits)] == 2
    not_found = (("method", "GET"), ("route", "get_job"), ("status", "404"))
    assert found[("jobs_server_http_requests_total", not_found)] == 1
    # Job ids never become label values.
    assert job_id not in await response.text()
