"""The JSON of finished jobs' details, kept once made: a long list of jobs is mostly joined."""

from __future__ import annotations

from collections import OrderedDict

from jobs_server.api_models import JobDetails
from jobs_server.manager import JobRecord, RayDriver

# What the cache may hold, in bytes of JSON text (a finished job's details are ~1 KiB).
DEFAULT_MAX_BYTES = 32 * 1024 * 1024

_Key = tuple[str, str, int | None, int | None, str | None]


class JobDetailsJsonCache:
    """The JSON of finished jobs' details, which never changes; bounded in bytes, the least
    recently used go first."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._json: OrderedDict[_Key, str] = OrderedDict()

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def json_for(
        self, record: JobRecord, driver: RayDriver | None = None, *, remember: bool = True
    ) -> str:
        """The details' JSON, from the cache if there; `remember=False` for a one-off scan (the
        whole list streamed): it would only evict what pages and polls reuse, and hold the
        cache's full size in memory for the scan's sake."""
        if not record.status.is_terminal():
            return JobDetails.from_record(record, driver).model_dump_json()
        # A deleted and resubmitted id is another run; a driver found after the job ended makes
        # other details.
        key = (
            record.submission_id,
            record.run_id,
            record.start_time,
            record.end_time,
            driver.job_id if driver is not None else None,
        )
        text = self._json.get(key)
        if text is not None:
            self._json.move_to_end(key)
            return text
        text = JobDetails.from_record(record, driver).model_dump_json()
        size = len(text)
        if not remember or size > self._max_bytes:
            return text
        while self._bytes + size > self._max_bytes:
            _, evicted = self._json.popitem(last=False)
            self._bytes -= len(evicted)
        self._json[key] = text
        self._bytes += size
        return text
