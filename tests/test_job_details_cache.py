"""The details cache is bounded in bytes, whatever the history's length (issue 14, item 7)."""

from __future__ import annotations

from jobs_server.manager import JobRecord, JobSpec, JobStatus
from jobs_server.serving.job_details_cache import JobDetailsJsonCache


def finished(index: int) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="x" * 200, submission_id=f"job-{index}"),
        status=JobStatus.SUCCEEDED,
        start_time=1,
        end_time=2,
        run_id=f"run-{index}",
    )


def test_the_cache_holds_at_most_its_bytes_and_answers_the_same_json() -> None:
    cache = JobDetailsJsonCache(max_bytes=10_000)
    texts = [cache.json_for(finished(index)) for index in range(200)]
    assert 0 < cache.size_bytes <= 10_000
    assert [cache.json_for(finished(index)) for index in range(200)] == texts
    assert cache.size_bytes <= 10_000


def test_a_live_job_is_never_cached() -> None:
    cache = JobDetailsJsonCache(max_bytes=10_000)
    cache.json_for(finished(0).with_changes(status=JobStatus.RUNNING, end_time=None))
    assert cache.size_bytes == 0


def test_a_scan_reads_the_cache_without_filling_it() -> None:
    cache = JobDetailsJsonCache(max_bytes=100_000)
    kept = cache.json_for(finished(0))
    held = cache.size_bytes
    scanned = [cache.json_for(finished(index), remember=False) for index in range(100)]
    assert cache.size_bytes == held
    assert scanned[0] is kept  # the cached text itself, not a copy made again
    assert scanned[1:] == [cache.json_for(finished(index)) for index in range(1, 100)]
