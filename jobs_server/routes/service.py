"""What the service says about itself: its probe `/api/healthz`, Ray's `/api/version`,
Prometheus `/metrics` and its contract `/api/openapi.yaml`."""

from __future__ import annotations

import asyncio
from importlib import resources

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jobs_server.api_models import DiskHealth, HealthResponse, VersionResponse
from jobs_server.app_state import (
    CLUSTER_HEALTH_KEY,
    CLUSTER_INFO_KEY,
    DISK_GUARD_KEY,
    JOB_MANAGER_KEY,
    KEY_RING_KEY,
    METRICS_KEY,
    PRINCIPAL_KEY,
    SETTINGS_KEY,
)
from jobs_server.metrics import QueueState
from jobs_server.serving.request_body import json_response

# Ray's Jobs API version; its clients check it.
JOBS_API_VERSION = "4"

routes = web.RouteTableDef()


@routes.get("/api/healthz", name="healthz")
async def healthz(request: web.Request) -> web.Response:
    """200 once the server is connected to Ray and serving; 503 (saying why) while Ray's GCS
    is away or the archive's database does not answer. It reads what the cluster watch last
    saw, so a probe costs no call to Ray, and one trivial read of the archive. A nearly full
    disk is reported, not a failure: the server still serves and its jobs go on."""
    health = request.app.get(CLUSTER_HEALTH_KEY)
    if health is not None:
        health.check()
    await request.app[JOB_MANAGER_KEY].check_database()
    space = await request.app[DISK_GUARD_KEY].space()
    disk = DiskHealth(
        free_bytes=space.free_bytes, min_free_bytes=space.min_free_bytes, low=space.is_low
    )
    return json_response(HealthResponse(disk=disk))


@routes.get("/metrics", name="metrics")
async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition: jobs by tenant and status and the queue's series (the
    caller's tenant only, unless an admin calls) and caps; HTTP requests by route and the jobs
    each supervisor holds (to an admin only: they count every tenant's)."""
    scope = request[PRINCIPAL_KEY].tenant_scope
    # Counted in the archive: a scrape never reads the whole history.
    counts = await request.app[JOB_MANAGER_KEY].count_by_tenant(tenant=scope)
    keys = request.app[KEY_RING_KEY]
    # Every tenant a key names has its series, zeros before its first job.
    for tenant in keys.tenants if scope is None else {scope}:
        counts.setdefault(tenant, {})
    settings = request.app[SETTINGS_KEY]
    manager = request.app[JOB_MANAGER_KEY]
    queue = QueueState(
        occupancy=manager.queue_occupancy(),
        max_running=settings.max_running_jobs,
        max_queued=settings.max_queued_jobs,
        tenant_limits={tenant: keys.limits_for(tenant) for tenant in counts},
    )
    return web.Response(
        body=request.app[METRICS_KEY].exposition(
            counts, queue, supervisors=manager.supervisor_occupancy() if scope is None else None
        ),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


@routes.get("/api/openapi.yaml", name="openapi")
async def openapi(request: web.Request) -> web.Response:
    """This API's contract, the document the tests check the server against."""
    document = await asyncio.to_thread(_read_openapi_document)
    return web.Response(body=document, headers={"Content-Type": "application/yaml"})


def _read_openapi_document() -> bytes:
    return (resources.files("jobs_server") / "openapi.yaml").read_bytes()


@routes.get("/api/version", name="version")
async def version(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER_INFO_KEY]
    return json_response(
        VersionResponse(
            version=JOBS_API_VERSION,
            ray_version=cluster.ray_version,
            ray_commit=cluster.ray_commit,
            session_name=cluster.session_name,
            containment=cluster.containment,
        )
    )
