"""Submit, list, inspect, stop and delete jobs."""

from __future__ import annotations

from aiohttp import web

from jobs_server.api_models import (
    DeleteJobResponse,
    JobDetails,
    StopJobRequest,
    StopJobResponse,
    SubmitJobRequest,
    SubmitJobResponse,
)
from jobs_server.audit import audit, redacted_runtime_env
from jobs_server.errors import InvalidRequestError
from jobs_server.keys import JOB_DETAILS_CACHE_KEY, JOB_MANAGER_KEY, SETTINGS_KEY
from jobs_server.manager import new_submission_id
from jobs_server.request_body import json_response, read_json_model, read_optional_json_model

routes = web.RouteTableDef()


@routes.post("/api/jobs/", name="submit_job")
async def submit_job(request: web.Request) -> web.Response:
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


@routes.get("/api/jobs/", name="list_jobs")
async def list_jobs(request: web.Request) -> web.Response:
    records = await request.app[JOB_MANAGER_KEY].list_jobs()
    cache = request.app[JOB_DETAILS_CACHE_KEY]
    text = "[" + ",".join(cache.json_for(record) for record in records) + "]"
    return web.Response(text=text, content_type="application/json")


@routes.get("/api/jobs/{job_id}", name="get_job")
async def get_job(request: web.Request) -> web.Response:
    record = await request.app[JOB_MANAGER_KEY].get_job(request.match_info["job_id"])
    return json_response(JobDetails.from_record(record))


@routes.post("/api/jobs/{job_id}/stop", name="stop_job")
async def stop_job(request: web.Request) -> web.Response:
    body = await read_optional_json_model(
        request, StopJobRequest, max_bytes=request.app[SETTINGS_KEY].max_request_bytes
    )
    grace_period_s = _grace_period_from_query(request)
    if body is not None and body.grace_period_s is not None:
        grace_period_s = body.grace_period_s
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
