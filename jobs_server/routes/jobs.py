"""Submit, list, inspect, stop and delete jobs."""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs_server.api_models import (
    DeleteJobResponse,
    JobDetails,
    StopJobRequest,
    StopJobResponse,
    SubmissionId,
    SubmitJobRequest,
    SubmitJobResponse,
)
from jobs_server.audit import audit, redacted_runtime_env
from jobs_server.errors import InvalidRequestError
from jobs_server.keys import (
    DISK_GUARD_KEY,
    JOB_DETAILS_CACHE_KEY,
    JOB_MANAGER_KEY,
    RAY_DRIVERS_KEY,
    SETTINGS_KEY,
)
from jobs_server.manager import JobStatus, new_submission_id
from jobs_server.request_body import (
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
    record = await request.app[JOB_MANAGER_KEY].submit_job(body.to_spec(new_submission_id()))
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
    """Query of `GET /api/jobs/` (extensions; without them the list is Ray's: every job)."""

    model_config = ConfigDict(extra="forbid")

    status: str | None = Field(None, description="Comma-separated statuses to keep.")
    after: SubmissionId | None = None
    limit: Annotated[int, Field(ge=1, le=10_000)] | None = None

    def statuses(self) -> frozenset[JobStatus] | None:
        if self.status is None:
            return None
        names = [name.strip().upper() for name in self.status.split(",") if name.strip()]
        unknown = [name for name in names if name not in JobStatus.__members__]
        if unknown or not names:
            raise InvalidRequestError(
                f"status: expected statuses among {', '.join(JobStatus)}, got {self.status!r}"
            )
        return frozenset(JobStatus[name] for name in names)


@routes.get("/api/jobs/", name="list_jobs")
async def list_jobs(request: web.Request) -> web.Response:
    try:
        query = ListJobsQuery.model_validate(dict(request.query))
    except ValidationError as error:
        raise InvalidRequestError(describe_validation_error(error)) from error
    page = await request.app[JOB_MANAGER_KEY].list_jobs(
        statuses=query.statuses(), after=query.after, limit=query.limit
    )
    cache = request.app[JOB_DETAILS_CACHE_KEY]
    drivers = await request.app[RAY_DRIVERS_KEY].find(page.records)
    text = (
        "["
        + ",".join(
            cache.json_for(record, drivers.get(record.submission_id)) for record in page.records
        )
        + "]"
    )
    response = web.Response(text=text, content_type="application/json")
    if page.next_after is not None:
        next_page = request.rel_url.update_query(after=page.next_after)
        response.headers["Link"] = f'<{next_page}>; rel="next"'
    return response


@routes.get("/api/jobs/{job_id}", name="get_job")
async def get_job(request: web.Request) -> web.Response:
    record = await request.app[JOB_MANAGER_KEY].get_job(request.match_info["job_id"])
    drivers = await request.app[RAY_DRIVERS_KEY].find([record])
    return json_response(JobDetails.from_record(record, drivers.get(record.submission_id)))


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
        request.match_info["job_id"], grace_period_s=grace_period_s
    )
    audit(request, "stop", request.match_info["job_id"], stopped=stopped)
    return json_response(StopJobResponse(stopped=stopped))


@routes.delete("/api/jobs/{job_id}", name="delete_job")
async def delete_job(request: web.Request) -> web.Response:
    await request.app[JOB_MANAGER_KEY].delete_job(request.match_info["job_id"])
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
