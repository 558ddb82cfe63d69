"""The Ray driver a job's command started, found the way Ray's own job server finds it.

Ray's job supervisor puts `job_submission_id` (and `job_name`) into the metadata of the job
config that a driver started by the job inherits (RAY_JOB_CONFIG_JSON_ENV_VAR); the driver's
entry in the GCS job table carries that metadata, and Ray's server reports the last such driver
as the submission's `job_id` and `driver_info`. We do the same, but a list of many jobs must
stay fast: a job is looked for only while it runs or shortly after it ended, at most once per
DRIVER_LOOKUP_INTERVAL_S, and what was found is remembered.

The job table is the cluster's: a restarted cluster (an embedded server's Ray, say) has
forgotten every driver of the jobs before. So a job's supervisor looks its driver up once more
as the job ends and writes it with the end (`JobRecord.ray_driver`); from then on the record
answers, in the KV and in the archive, and nobody looks again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ray._raylet import GcsClient  # type: ignore[attr-defined]

from jobs_server.manager.records import JobRecord, JobStatus, now_ms

# Re-exported: the driver's finders and their callers name it with them.
from jobs_server.manager.records import RayDriver as RayDriver

logger = logging.getLogger(__name__)

# Ray's names (ray.dashboard.modules.job.common): tools match on them.
JOB_SUBMISSION_ID_METADATA_KEY = "job_submission_id"
JOB_NAME_METADATA_KEY = "job_name"
# Drivers in these namespaces are Ray's own, never a job's (as in Ray's server).
_RAY_INTERNAL_NAMESPACE_PREFIX = "_ray_internal_"
# A job's driver may start any time while it runs: look again after this long.
DRIVER_LOOKUP_INTERVAL_S = 1.0
# A job that ended longer ago than this, and whose driver was never looked for (e.g. it ended
# before this server started), is not looked for: old jobs cost a list nothing.
RECENTLY_ENDED_S = 300.0
DRIVER_LOOKUP_TIMEOUT_S = 5.0
# A job's end waits for its supervisor's last look: on a GCS that does not answer, not long.
END_DRIVER_LOOKUP_TIMEOUT_S = 2.0
MAX_REMEMBERED_JOBS = 100_000


def driver_job_metadata(submission_id: str, metadata: dict[str, str]) -> dict[str, str]:
    """The job config metadata of a driver the job starts: Ray's two keys and the user's. A
    user's `job_name` wins, as in Ray's supervisor; its `job_submission_id` does not (Ray's
    does), since the driver would then be found as that other job's."""
    return {
        JOB_NAME_METADATA_KEY: submission_id,
        **metadata,
        JOB_SUBMISSION_ID_METADATA_KEY: submission_id,
    }


@dataclass(frozen=True)
class _Lookup:
    start_time: int | None
    """Of the job looked for: a deleted and resubmitted id is another job."""
    driver: RayDriver | None
    looked_at_s: float
    """time.monotonic() of the last look."""
    final: bool
    """Looked for after the job ended: the answer no longer changes."""


class RayDrivers:
    """Finds and remembers the Ray driver of each job whose command started one."""

    def __init__(self, gcs_address: str) -> None:
        self._client = GcsClient(address=gcs_address)
        self._lookups: dict[str, _Lookup] = {}

    async def find(self, records: Sequence[JobRecord]) -> dict[str, RayDriver]:
        """The Ray driver of each of `records` that has one, by submission id."""
        now_s = time.monotonic()
        ended_long_ago_ms = now_ms() - int(RECENTLY_ENDED_S * 1000)
        lookups = self._lookups
        found: dict[str, RayDriver] = {}
        to_look: list[JobRecord] = []
        # A list of 10,000 jobs passes here on every GET: the common cases cost a dict lookup.
        for record in records:
            submission_id = record.spec.submission_id
            if record.ray_driver is not None:
                found[submission_id] = record.ray_driver  # written with the job's end
                continue
            lookup = lookups.get(submission_id)
            if lookup is not None and lookup.start_time != record.start_time:
                lookup = None
            if lookup is None:
                if record.status is JobStatus.PENDING:
                    continue  # no command yet, so no driver
                if record.end_time is not None and record.end_time < ended_long_ago_ms:
                    continue  # ended before anyone looked (before this server started, say)
            else:
                if lookup.driver is not None:
                    found[submission_id] = lookup.driver
                # A job seen ended for the first time gets its last look at once: its driver may
                # have registered since the last look, and nobody may ask again.
                looked_lately = now_s - lookup.looked_at_s < DRIVER_LOOKUP_INTERVAL_S
                if lookup.final or (looked_lately and not record.status.is_terminal()):
                    continue
            to_look.append(record)
            # Concurrent requests for the same job wait for this look, not start their own.
            self._remember(record, lookup.driver if lookup else None, now_s, final=False)
        if not to_look:
            return found
        drivers = await self._drivers_of({record.submission_id for record in to_look})
        for record in to_look:
            previous = lookups.get(record.submission_id)
            driver = drivers.get(record.submission_id) or (previous.driver if previous else None)
            self._remember(record, driver, now_s, final=record.status.is_terminal())
            if driver is not None:
                found[record.submission_id] = driver
        return found

    def _remember(
        self, record: JobRecord, driver: RayDriver | None, looked_at_s: float, *, final: bool
    ) -> None:
        key = record.submission_id
        if key not in self._lookups and len(self._lookups) >= MAX_REMEMBERED_JOBS:
            del self._lookups[next(iter(self._lookups))]  # the oldest
        self._lookups[key] = _Lookup(record.start_time, driver, looked_at_s, final)

    async def last_driver_of(self, submission_id: str) -> RayDriver | None:
        """The job's last driver as the job table has it now (a job's end asks once, never
        remembered here: see the module's docstring); None if it has none, or the GCS did not
        answer within END_DRIVER_LOOKUP_TIMEOUT_S."""
        drivers = await self._drivers_of({submission_id}, timeout_s=END_DRIVER_LOOKUP_TIMEOUT_S)
        return drivers.get(submission_id)

    async def _drivers_of(
        self, submission_ids: set[str], *, timeout_s: float = DRIVER_LOOKUP_TIMEOUT_S
    ) -> dict[str, RayDriver]:
        """The last driver (by job id, as Ray's server has it) of each of `submission_ids`."""
        # The GCS filters one submission's drivers itself; for several, one read of the table.
        only = next(iter(submission_ids)) if len(submission_ids) == 1 else None
        try:
            entries: dict[Any, Any] = await self._client.async_get_all_job_info(
                job_or_submission_id=only,
                skip_submission_job_info_field=True,
                skip_is_running_tasks_field=True,
                timeout=timeout_s,
            )
        except Exception as error:  # the details are still worth answering without it
            logger.warning("could not read Ray's job table: %s", error)
            return {}
        return _last_drivers(entries.values(), submission_ids)


def _last_drivers(entries: Iterable[Any], submission_ids: set[str]) -> dict[str, RayDriver]:
    drivers: dict[str, RayDriver] = {}
    for entry in sorted(entries, key=lambda entry: entry.job_id.hex()):
        if entry.config.ray_namespace.startswith(_RAY_INTERNAL_NAMESPACE_PREFIX):
            continue
        submission_id = dict(entry.config.metadata).get(JOB_SUBMISSION_ID_METADATA_KEY)
        if submission_id in submission_ids:
            drivers[submission_id] = RayDriver(
                job_id=entry.job_id.hex(),
                node_ip_address=entry.driver_address.ip_address,
                pid=int(entry.driver_pid),
            )
    return drivers
