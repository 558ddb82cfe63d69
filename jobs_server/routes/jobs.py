"""Submit, list, inspect, stop and delete jobs."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime
from typing import Annotated, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs_server.api_models import (
    MAX_DEPENDENCIES,
    SUBMISSION_ID_PATTERN,
    DeleteJobResponse,
    JobDetails,
    StopJobRequest,
    StopJobResponse,
    SubmissionId,
    SubmitJobRequest,
    SubmitJobResponse,
)
from jobs_server.app_state import (
    DISK_GUARD_KEY,
    JOB_DETAILS_CACHE_KEY,
    JOB_MANAGER_KEY,
    PRINCIPAL_KEY,
    RAY_DRIVERS_KEY,
    SETTINGS_KEY,
)
from jobs_server.audit import audit, redacted_runtime_env
from jobs_server.errors import InvalidRequestError, JobNotFoundError
from jobs_server.manager import JobManagerApi, JobQuery, JobRecord, JobStatus, new_submission_id
from jobs_server.serving.query_params import parse_statuses
from jobs_server.serving.request_body import (
    describe_validation_error,
    json_response,
    read_json_model,
    read_optional_json_model,
)

routes = web.RouteTableDef()


@routes.post("/api/jobs/", name="submit_job")
async def submit_job(request: web.Request) -> web.Response:
    await request.app[DISK_GUARD_KEY].ensure_space("a submit")
    body = await read_json_model(
        request, SubmitJobRequest, max_bytes=request.app[SETTINGS_KEY].max_request_bytes
    )
    record = await request.app[JOB_MANAGER_KEY].submit_job(
        body.to_spec(new_submission_id), tenant=request[PRINCIPAL_KEY].tenant
    )
    audit(
        request,
        "submit",
        record.submission_id,
        entrypoint_bytes=len(body.entrypoint.encode()),
        runtime_env=redacted_runtime_env(record.spec.runtime_env),
    )
    return json_response(
        SubmitJobResponse(job_id=record.submission_id, submission_id=record.submission_id)
    )


class ListJobsQuery(BaseModel):
    """Query of `GET /api/jobs/` (extensions; without them the list is Ray's: every job).
    `metadata.<key>=<value>` parameters are taken apart before this model sees the rest."""

    model_config = ConfigDict(extra="forbid")

    status: str | None = Field(None, description="Comma-separated statuses to keep.")
    submission_id: str | None = Field(
        None, description="Comma-separated ids: those jobs only (a job's dependencies at once)."
    )
    after: SubmissionId | None = None
    limit: Annotated[int, Field(ge=1, le=10_000)] | None = None
    submitted_after: str | None = None
    submitted_before: str | None = None
    order: Literal["asc", "desc"] = "asc"

    def statuses(self) -> frozenset[JobStatus] | None:
        return parse_statuses(self.status)

    def submission_ids(self) -> list[str] | None:
        """The ids asked for, each once, in their order; None: no such filter."""
        if self.submission_id is None:
            return None
        others = [
            name
            for name in ("status", "after", "limit", "submitted_after", "submitted_before")
            if getattr(self, name) is not None
        ]
        if others:
            raise InvalidRequestError(f"submission_id: not with {others[0]}")
        ids = list(dict.fromkeys(self.submission_id.split(",")))
        if len(ids) > MAX_IDS_LISTED:
            raise InvalidRequestError(f"submission_id: at most {MAX_IDS_LISTED} ids")
        for job_id in ids:
            if not _SUBMISSION_ID.match(job_id) or job_id in (".", ".."):
                raise InvalidRequestError(f"submission_id: {job_id!r} is not a submission id")
        return ids

    def to_query(self, metadata: tuple[tuple[str, str], ...]) -> JobQuery:
        return JobQuery(
            statuses=self.statuses(),
            submitted_after=_unix_ms("submitted_after", self.submitted_after),
            submitted_before=_unix_ms("submitted_before", self.submitted_before),
            metadata=metadata,
            descending=self.order == "desc",
        )


# Jobs a list by id names at most: as many as a job may depend on.
MAX_IDS_LISTED = MAX_DEPENDENCIES
_SUBMISSION_ID = re.compile(SUBMISSION_ID_PATTERN)
_METADATA_PREFIX = "metadata."
# Unix ms from 2001 on have 13 digits; a bound beyond what SQLite's integers hold is refused.
_MAX_MS = 2**62


def _unix_ms(name: str, value: str | None) -> int | None:
    """Unix milliseconds, or an RFC 3339 date-time (with its offset) as milliseconds."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit() and len(text) <= 18:
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("z", "Z").replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None or "T" not in text.upper():
        raise InvalidRequestError(
            f"{name}: expected unix milliseconds or an RFC 3339 date-time with its offset"
            f" (e.g. 2026-01-31T12:00:00Z), got {value!r}"
        )
    return int(moment.timestamp() * 1000)


def _list_query(request: web.Request) -> tuple[ListJobsQuery, JobQuery]:
    plain: dict[str, str] = {}
    metadata: list[tuple[str, str]] = []
    for name, value in request.query.items():
        if name.startswith(_METADATA_PREFIX) and len(name) > len(_METADATA_PREFIX):
            metadata.append((name[len(_METADATA_PREFIX) :], value))
        elif name in plain:
            raise InvalidRequestError(f"{name}: given more than once")
        else:
            plain[name] = value
    try:
        query = ListJobsQuery.model_validate(plain)
    except ValidationError as error:
        raise InvalidRequestError(describe_validation_error(error)) from error
    return query, query.to_query(tuple(metadata))


@routes.get("/api/jobs/", name="list_jobs")
async def list_jobs(request: web.Request) -> web.StreamResponse:
    query, job_query = _list_query(request)
    manager = request.app[JOB_MANAGER_KEY]
    ids = query.submission_ids()
    if ids is not None:
        found = await _jobs_by_id(manager, ids, request[PRINCIPAL_KEY].tenant_scope)
        text = "[" + ",".join(await _details_json(request, found)) + "]"
        return web.Response(text=text, content_type="application/json")
    if query.limit is None:
        return await _stream_jobs(request, job_query, query.after)
    page = await manager.list_jobs(
        query=job_query,
        after=query.after,
        limit=query.limit,
        tenant=request[PRINCIPAL_KEY].tenant_scope,
    )
    text = "[" + ",".join(await _details_json(request, page.records)) + "]"
    response = web.Response(text=text, content_type="application/json")
    if page.next_after is not None:
        next_page = request.rel_url.update_query(after=page.next_after)
        response.headers["Link"] = f'<{next_page}>; rel="next"'
    return response


async def _jobs_by_id(
    manager: JobManagerApi, ids: list[str], tenant: str | None
) -> list[JobRecord]:
    """The jobs among `ids` that exist (of `tenant`; None: any), each as its GET reads it, in
    the order of `ids`."""

    async def read(job_id: str) -> JobRecord | None:
        try:
            return await manager.get_job(job_id, tenant=tenant)
        except JobNotFoundError:
            return None

    found = await asyncio.gather(*(read(job_id) for job_id in ids))
    return [record for record in found if record is not None]


async def _details_json(
    request: web.Request, records: list[JobRecord], *, remember: bool = True
) -> list[str]:
    cache = request.app[JOB_DETAILS_CACHE_KEY]
    drivers = await request.app[RAY_DRIVERS_KEY].find(records)
    # Whether a job's dependencies are met changes after it ended (one deleted): its details
    # are made each time, never cached.
    met = await request.app[JOB_MANAGER_KEY].dependencies_met(records)
    return [
        JobDetails.from_record(
            record,
            drivers.get(record.submission_id),
            dependencies_met=met[record.submission_id],
        ).model_dump_json()
        if record.submission_id in met
        else cache.json_for(record, drivers.get(record.submission_id), remember=remember)
        for record in records
    ]


async def _stream_jobs(
    request: web.Request, query: JobQuery, after: str | None
) -> web.StreamResponse:
    """The whole list as one JSON array, written batch by batch as the archive is read: a long
    history is never one string in memory."""
    batches = request.app[JOB_MANAGER_KEY].stream_jobs(
        query, after=after, tenant=request[PRINCIPAL_KEY].tenant_scope
    )
    # The first batch before the headers: a bad `after` is still a 400.
    first = await anext(batches, None)
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    await response.prepare(request)
    await response.write(b"[")
    separator = ""
    batch = first
    while batch is not None:
        # A scan of the whole history: served from the cache, never filling it.
        texts = await _details_json(request, batch, remember=False)
        if texts:
            await response.write((separator + ",".join(texts)).encode())
            separator = ","
        batch = await anext(batches, None)
    await response.write(b"]")
    await response.write_eof()
    return response


@routes.get("/api/jobs/{job_id}", name="get_job")
async def get_job(request: web.Request) -> web.Response:
    manager = request.app[JOB_MANAGER_KEY]
    record = await manager.get_job(
        request.match_info["job_id"], tenant=request[PRINCIPAL_KEY].tenant_scope
    )
    drivers = await request.app[RAY_DRIVERS_KEY].find([record])
    met = await manager.dependencies_met([record])
    return json_response(
        JobDetails.from_record(
            record,
            drivers.get(record.submission_id),
            dependencies_met=met.get(record.submission_id),
        )
    )


@routes.post("/api/jobs/{job_id}/stop", name="stop_job")
async def stop_job(request: web.Request) -> web.Response:
    body = await read_optional_json_model(
        request, StopJobRequest, max_bytes=request.app[SETTINGS_KEY].max_request_bytes
    )
    grace_period_s = _grace_period_from_query(request)
    if body is not None and body.grace_period_s is not None:
        grace_period_s = body.grace_period_s
    _check_grace_ceiling(grace_period_s, request.app[SETTINGS_KEY].max_stop_grace_s)
    stopped = await request.app[JOB_MANAGER_KEY].stop_job(
        request.match_info["job_id"],
        grace_period_s=grace_period_s,
        tenant=request[PRINCIPAL_KEY].tenant_scope,
    )
    audit(request, "stop", request.match_info["job_id"], stopped=stopped)
    return json_response(StopJobResponse(stopped=stopped))


@routes.delete("/api/jobs/{job_id}", name="delete_job")
async def delete_job(request: web.Request) -> web.Response:
    await request.app[JOB_MANAGER_KEY].delete_job(
        request.match_info["job_id"], tenant=request[PRINCIPAL_KEY].tenant_scope
    )
    audit(request, "delete", request.match_info["job_id"])
    return json_response(DeleteJobResponse(deleted=True))


def _grace_period_from_query(request: web.Request) -> float | None:
    raw = request.query.get("grace_period_s")
    if raw is None:
        return None
    try:
        return StopJobRequest(grace_period_s=float(raw)).grace_period_s
    except ValueError as error:
        raise InvalidRequestError(
            f"grace_period_s: expected a finite number of seconds >= 0, got {raw!r}"
        ) from error


def _check_grace_ceiling(grace_period_s: float | None, max_stop_grace_s: float) -> None:
    """A grace period without a ceiling would make a job that ignores SIGTERM unkillable."""
    if grace_period_s is not None and grace_period_s > max_stop_grace_s:
        raise InvalidRequestError(
            f"grace_period_s: at most {max_stop_grace_s:g} s (the server's --max-stop-grace-s),"
            f" got {grace_period_s:g}"
        )
