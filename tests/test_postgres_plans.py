"""How PostgreSQL runs the archive's statements on a long history: a statement every write runs
reads an index range, not the whole table (issue 34, the 100,000-job benchmark). Plans, not
timings: the scans a write made, as the database counts them."""

from __future__ import annotations

import time

import psycopg
import pytest

from jobs_server.manager.archive.postgres import PostgresArchive
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id

pytestmark = pytest.mark.postgres

# Jobs (an event each) in the history before the write: enough pages that a scan of the
# events table is a choice the planner makes, not the only way.
HISTORY_JOBS = 3_000
# The server's counters reach the statistics views once its session is idle (at most 10 s
# later, PostgreSQL 15's PGSTAT_IDLE_INTERVAL).
STATS_DEADLINE_S = 20.0
RANDOM_PAGE_COST = 100


def finished(number: int) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=f"old-{number:05d}"),
        status=JobStatus.SUCCEEDED,
        start_time=1_000 + number,
        end_time=2_000 + number,
        run_id=new_run_id(),
    )


def events_table_counters(url: str) -> tuple[int, int]:
    """The events table's sequential scans and rows inserted so far, as the views show them."""
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute(
            "SELECT seq_scan, n_tup_ins FROM pg_stat_user_tables WHERE relname = 'events'"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def counters_after_insert(url: str, inserted_before: int) -> tuple[int, int]:
    """The counters once they count a row inserted after `inserted_before`: the scans the
    same transaction made are counted by then too."""
    deadline = time.monotonic() + STATS_DEADLINE_S
    while True:
        scans, inserted = events_table_counters(url)
        if inserted > inserted_before:
            return scans, inserted
        assert time.monotonic() < deadline, "the insert never reached pg_stat_user_tables"
        time.sleep(0.2)


async def test_a_write_does_not_scan_every_event(postgres_url: str) -> None:
    """Every write transaction trims the events beyond the newest `max_events`. Its bound
    came from a subquery, unknown when PostgreSQL plans the DELETE: it planned for a third of
    the table, and on a 100,000-job history read all of it (a seq scan, 84 ms of every write)."""
    archive = PostgresArchive(postgres_url)
    await archive.open()
    try:
        await archive.insert_many([finished(number) for number in range(HISTORY_JOBS)])
    finally:
        await archive.close()
    with psycopg.connect(postgres_url, autocommit=True) as db:
        # A long-lived events table is a ring (old rows trimmed, their space reused), its ids
        # no longer in page order: each page of an index range is a random read. Priced so
        # here, on a small table, as the benchmark's history was.
        name = postgres_url.rsplit("/", 1)[1]
        db.execute(f'ALTER DATABASE "{name}" SET random_page_cost = {RANDOM_PAGE_COST}')
        db.execute("ANALYZE events")
    archive = PostgresArchive(postgres_url)
    await archive.open()
    try:
        scans_before, inserted_before = counters_after_insert(postgres_url, 0)

        await archive.insert(
            JobRecord(spec=JobSpec(entrypoint="true", submission_id="new"), run_id=new_run_id())
        )

        scans_after, _ = counters_after_insert(postgres_url, inserted_before)
        assert scans_after == scans_before
        newest = (await archive.event_id_range())[1]
        assert newest > 2 * HISTORY_JOBS  # its events are written
    finally:
        await archive.close()


async def test_the_trim_still_keeps_the_newest_events(postgres_url: str) -> None:
    archive = PostgresArchive(postgres_url, max_events=5)
    await archive.open()
    try:
        await archive.insert_many([finished(number) for number in range(8)])
        oldest, newest = await archive.event_id_range()
        assert newest - oldest + 1 == 5
        await archive.insert(
            JobRecord(spec=JobSpec(entrypoint="true", submission_id="new"), run_id=new_run_id())
        )
        oldest, newer = await archive.event_id_range()
        assert newer > newest
        assert newer - oldest + 1 == 5
    finally:
        await archive.close()
