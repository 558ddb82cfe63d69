"""One aiohttp client for the Jobs REST API, which Ray's job server and ours both speak."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.support.api import TERMINAL_STATUSES

STARTED_STATUSES = frozenset(TERMINAL_STATUSES | {"RUNNING"})
REQUEST_TIMEOUT_S = 120.0
ERROR_BODY_CHARS = 300


class ApiError(Exception):
    """A request the server answered with an error status."""


@dataclass(frozen=True)
class Submitted:
    """A job the server accepted: when its POST was sent and how long the answer took."""

    submission_id: str
    sent_at_s: float
    latency_s: float


@dataclass
class Watch:
    """When each watched job was first seen in a wanted status, and in which."""

    seen_at_s: dict[str, float] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    poll_errors: list[str] = field(default_factory=list)

    def missing(self, submission_ids: Iterable[str]) -> list[str]:
        """The jobs that were never seen in a wanted status."""
        return [job_id for job_id in submission_ids if job_id not in self.seen_at_s]


class JobsApi:
    """The jobs API of one server, at `base_url`, over a shared `aiohttp.ClientSession`."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self._session = session
        self._base_url = base_url.rstrip("/")

    @property
    def session(self) -> aiohttp.ClientSession:
        """The shared session, for requests this class does not wrap (log streams)."""
        return self._session

    def url(self, path: str) -> str:
        """The absolute URL of `path` on this server."""
        return self._base_url + path

    async def _request(self, method: str, path: str, json_body: object = None) -> Any:
        async with self._session.request(method, self._base_url + path, json=json_body) as response:
            text = await response.text()
            if response.status >= 400:
                raise ApiError(f"{method} {path} -> {response.status}: {text[:ERROR_BODY_CHARS]!r}")
            return await response.json(content_type=None) if text else None

    async def submit(
        self, entrypoint: str, submission_id: str, *, resources: dict[str, float] | None = None
    ) -> Submitted:
        """POST a job (that asks for custom `resources`, if given); time the request."""
        request: dict[str, object] = {"entrypoint": entrypoint, "submission_id": submission_id}
        if resources:
            request["entrypoint_resources"] = resources
        sent_at_s = time.monotonic()
        body = await self._request("POST", "/api/jobs/", request)
        latency_s = time.monotonic() - sent_at_s
        return Submitted(str(body["submission_id"]), sent_at_s, latency_s)

    async def job(self, submission_id: str) -> dict[str, Any]:
        """GET /api/jobs/{id}: the job's details."""
        return dict(await self._request("GET", f"/api/jobs/{submission_id}"))

    async def status(self, submission_id: str) -> str:
        """The job's current status."""
        return str((await self.job(submission_id))["status"])

    async def list_jobs_body(self) -> bytes:
        """GET /api/jobs/, read to its last byte but not parsed."""
        async with self._session.get(self._base_url + "/api/jobs/") as response:
            body = await response.read()
            if response.status >= 400:
                raise ApiError(f"GET /api/jobs/ -> {response.status}: {body[:ERROR_BODY_CHARS]!r}")
            return body

    async def list_jobs(self) -> list[dict[str, Any]]:
        """Every job the server lists (Ray's also lists driver jobs)."""
        body = await self._request("GET", "/api/jobs/")
        return list(body)

    async def list_statuses(self) -> dict[str, str]:
        """submission_id -> status, for every submitted job the server lists."""
        return {
            str(job["submission_id"]): str(job["status"])
            for job in await self.list_jobs()
            if job.get("submission_id")
        }

    async def stop(self, submission_id: str) -> None:
        """Ask the server to stop the job (with the server's default grace period)."""
        await self._request("POST", f"/api/jobs/{submission_id}/stop")

    async def delete(self, submission_id: str) -> None:
        """Delete a terminal job (and, on our server, its log)."""
        await self._request("DELETE", f"/api/jobs/{submission_id}")


def new_session(max_connections: int = 256) -> aiohttp.ClientSession:
    """A client session for loopback benchmarking: enough connections, generous timeouts."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    )


async def submit_all_at_once(
    api: JobsApi, entrypoint: str, submission_ids: list[str]
) -> tuple[list[Submitted], list[str]]:
    """Send every POST at the same moment; the accepted jobs and the errors."""
    results = await asyncio.gather(
        *(api.submit(entrypoint, job_id) for job_id in submission_ids), return_exceptions=True
    )
    return _split(results)


async def submit_with_workers(
    api: JobsApi,
    entrypoint: str,
    submission_ids: list[str],
    workers: int,
    deadline_s: float,
) -> tuple[list[Submitted], list[str]]:
    """Submit with `workers` requests in flight until all are sent or `deadline_s` passes."""
    queue = list(reversed(submission_ids))
    results: list[Submitted | BaseException] = []

    async def worker() -> None:
        for _ in range(len(submission_ids)):
            if not queue or time.monotonic() > deadline_s:
                return
            job_id = queue.pop()
            try:
                results.append(await api.submit(entrypoint, job_id))
            except (ApiError, aiohttp.ClientError, TimeoutError) as error:
                results.append(error)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return _split(results)


def _split(results: Iterable[Submitted | BaseException]) -> tuple[list[Submitted], list[str]]:
    accepted: list[Submitted] = []
    errors: list[str] = []
    for result in results:
        if isinstance(result, Submitted):
            accepted.append(result)
        elif isinstance(result, Exception):
            errors.append(f"{type(result).__name__}: {result}")
        else:
            raise result
    return accepted, errors


async def watch_statuses(
    api: JobsApi,
    submission_ids: Collection[str],
    wanted: Callable[[str], bool],
    *,
    interval_s: float,
    timeout_s: float,
) -> Watch:
    """Poll GET /api/jobs/ until every job is seen in a `wanted` status, or `timeout_s` passes.

    Polls at least once, so a zero timeout reads the statuses as they are.

    One list request serves every job, so watching many jobs does not load the server with many
    requests; a job is timed when the first response that shows it in a wanted status arrives.
    """
    watch = Watch()
    pending = set(submission_ids)
    deadline_s = time.monotonic() + timeout_s
    for _ in range(max(1, int(timeout_s / interval_s) + 1)):
        try:
            statuses = await api.list_statuses()
        except (ApiError, aiohttp.ClientError, TimeoutError) as error:
            watch.poll_errors.append(f"{type(error).__name__}: {error}")
            statuses = {}
        seen_at_s = time.monotonic()
        for job_id in list(pending):
            status = statuses.get(job_id)
            if status is not None and wanted(status):
                watch.seen_at_s[job_id] = seen_at_s
                watch.status[job_id] = status
                pending.discard(job_id)
        if not pending or time.monotonic() >= deadline_s:
            break
        await asyncio.sleep(interval_s)
    return watch


def is_terminal(status: str) -> bool:
    """SUCCEEDED, FAILED or STOPPED: the job will not change again."""
    return status in TERMINAL_STATUSES


def has_started(status: str) -> bool:
    """RUNNING, or already past it."""
    return status in STARTED_STATUSES
