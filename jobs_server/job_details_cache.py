"""The JSON of finished jobs' details, kept once made: a long list of jobs is mostly joined."""

from __future__ import annotations

from jobs_server.api_models import JobDetails
from jobs_server.manager import JobRecord, RayDriver


class JobDetailsJsonCache:
    """The JSON of finished jobs' details, which never changes; bounded, the oldest go first."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._max_entries = max_entries
        self._json: dict[tuple[str, str, int | None, int | None, str | None], str] = {}

    def json_for(self, record: JobRecord, driver: RayDriver | None = None) -> str:
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
        if text is None:
            if len(self._json) >= self._max_entries:
                del self._json[next(iter(self._json))]  # the oldest
            text = self._json[key] = JobDetails.from_record(record, driver).model_dump_json()
        return text
