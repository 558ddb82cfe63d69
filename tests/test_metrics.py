"""Prometheus metrics: requests by route and jobs by status, from a live app; what the jobs
that ended used, per tenant."""

from __future__ import annotations

import math
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from jobs_server.manager import JobRecord, JobSpec, JobStatus
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.records import JobAttempt
from jobs_server.metrics import QueueState, ServerMetrics
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


# What each job used (issue 35): histograms per tenant of its attempts' peak memory and CPU.

MEBIBYTE = 1 << 20


def ended_job_event(
    event_id: int, tenant: str, attempts: list[JobAttempt], status: JobStatus = JobStatus.FAILED
) -> JobEvent:
    """The archive's event of a job that ended with these attempts."""
    spec = JobSpec(entrypoint="true", submission_id=f"job-{event_id}")
    record = JobRecord(spec=spec, status=status, attempts=tuple(attempts), tenant=tenant)
    return JobEvent(
        id=event_id,
        type=JobEventType.STATUS,
        submission_id=spec.submission_id,
        tenant=tenant,
        status=status,
        time=1,
        record=record,
    )


def measured(peak_bytes: int | None, user_s: float | None, system_s: float | None) -> JobAttempt:
    return JobAttempt(
        start_time=1,
        end_time=2,
        exit_code=0,
        log_offset=0,
        peak_memory_bytes=peak_bytes,
        cpu_user_s=user_s,
        cpu_system_s=system_s,
    )


def histogram(
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, tenant: str
) -> tuple[dict[float, float], float, float]:
    """A tenant's histogram in a scrape: its cumulative buckets by bound, its count, its sum."""
    buckets = {
        float(dict(labels)["le"]): value
        for (sample, labels), value in found.items()
        if sample == f"{name}_bucket" and dict(labels)["tenant"] == tenant
    }
    of_tenant = (("tenant", tenant),)
    return buckets, found[(f"{name}_count", of_tenant)], found[(f"{name}_sum", of_tenant)]


def test_ended_jobs_attempts_are_observed_once_per_tenant() -> None:
    metrics = ServerMetrics()
    running = ended_job_event(1, "team-a", [measured(None, None, None)], JobStatus.RUNNING)
    metrics.observe_job_events(
        [
            running,  # not ended: nothing observed
            # Two attempts, each observed; the first of them measured CPU only.
            ended_job_event(
                2, "team-a", [measured(None, 1.5, 0.5), measured(100 * MEBIBYTE, 3.0, 1.0)]
            ),
            ended_job_event(3, "team-a", [measured(3 * MEBIBYTE, 0.05, None)]),
            ended_job_event(4, "team-b", [measured(5 << 30, 7200.0, 60.0)]),
            ended_job_event(5, "team-b", [measured(None, None, None)]),  # unmeasured: none
        ]
    )
    queue = QueueState(occupancy={}, max_running=None, max_queued=None)
    counts = {"team-a": {JobStatus.FAILED: 2}, "team-b": {JobStatus.FAILED: 2}, "team-c": {}}
    found = samples(metrics.exposition(counts, queue).decode())

    buckets, count, total = histogram(found, "jobs_server_job_peak_memory_bytes", "team-a")
    assert (count, total) == (2, 103 * MEBIBYTE)
    assert buckets[4 * MEBIBYTE] == 1  # 3 MiB
    assert buckets[64 * MEBIBYTE] == 1
    assert buckets[256 * MEBIBYTE] == 2  # and 100 MiB
    assert buckets[math.inf] == 2
    buckets, count, total = histogram(found, "jobs_server_job_cpu_seconds", "team-a")
    assert count == 3
    assert total == pytest.approx(6.05)  # user + system, each attempt
    assert (buckets[0.1], buckets[1], buckets[5], buckets[math.inf]) == (1, 1, 3, 3)
    buckets, count, total = histogram(found, "jobs_server_job_peak_memory_bytes", "team-b")
    assert (count, total) == (1, 5 << 30)
    assert (buckets[4 << 30], buckets[16 << 30]) == (0, 1)
    buckets, count, total = histogram(found, "jobs_server_job_cpu_seconds", "team-b")
    assert (count, total, buckets[3600], buckets[86400]) == (1, 7260.0, 0, 1)
    # A tenant with nothing measured yet has its series, at zero.
    buckets, count, total = histogram(found, "jobs_server_job_cpu_seconds", "team-c")
    assert (count, total, buckets[math.inf]) == (0, 0, 0)
    # A key of one tenant is shown its own tenant's histograms only.
    own = samples(metrics.exposition({"team-b": {}}, queue).decode())
    assert not any(dict(labels).get("tenant") == "team-a" for _, labels in own)


async def test_a_real_jobs_use_is_observed_when_it_ends(client: TestClient[Any, Any]) -> None:
    """Waits for the supervisor's accounting (issue 35): a job that touches 50 MiB and spins
    0.5 s of CPU is one observation of each, of about that size."""
    script = (
        "import time; block = bytearray(50 << 20); deadline = time.process_time() + 0.5\n"
        "while time.process_time() < deadline: pass"
    )
    job_id = await submit(client, entrypoint=f"python -c '{script}'")
    job = await wait_for_status(client, job_id)
    assert job["status"] == "SUCCEEDED", job
    found = samples(await (await client.get("/metrics")).text())
    buckets, count, total = histogram(found, "jobs_server_job_peak_memory_bytes", "default")
    assert count == 1
    assert 50 * MEBIBYTE <= total <= 200 * MEBIBYTE
    assert buckets[16 * MEBIBYTE] == 0
    buckets, count, total = histogram(found, "jobs_server_job_cpu_seconds", "default")
    assert count == 1
    assert 0.45 <= total <= 5
