"""What the service says about itself: its probe `/api/healthz`, Ray's `/api/version`,
Prometheus `/metrics` and its contract `/api/openapi.yaml`."""

from __future__ import annotations

import asyncio
from importlib import resources

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jobs_server.access.auth import token_from_headers
from jobs_server.api_models import (
    DiskHealth,
    ErrorDetail,
    HealthResponse,
    HealthUnavailableResponse,
    ReplicaHealth,
    VersionResponse,
)
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
from jobs_server.errors import DatabaseUnavailableError
from jobs_server.manager.archive.outage import UNAVAILABLE_MESSAGE
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
    disk is reported, not a failure: the server still serves and its jobs go on. Both answers
    but the GCS's 503 say what this replica knows of itself (its database, jobs, leases)."""
    health = request.app.get(CLUSTER_HEALTH_KEY)
    if health is not None:
        health.check()
    state = await request.app[JOB_MANAGER_KEY].replica_state()
    replica = ReplicaHealth.from_state(state, sees_every_tenant=_sees_every_tenant(request))
    if not state.database_connected:
        # The error middleware's 503, with the replica beside the error: a probe's answer.
        unavailable = DatabaseUnavailableError(UNAVAILABLE_MESSAGE)
        response = json_response(
            HealthUnavailableResponse(
                error=ErrorDetail(code=unavailable.code, message=unavailable.message),
                replica=replica,
            ),
            status=503,
        )
        response.headers.update(unavailable.response_headers())
        return response
    space = await request.app[DISK_GUARD_KEY].space()
    disk = DiskHealth(
        free_bytes=space.free_bytes, min_free_bytes=space.min_free_bytes, low=space.is_low
    )
    return json_response(HealthResponse(disk=disk, replica=replica))


def _sees_every_tenant(request: web.Request) -> bool:
    """Whether the caller may see what counts every tenant's work, as /metrics' server-wide
    series: an admin key, or a server without keys. The probe needs no key, so one is only
    looked at if given, and a wrong one is no error here."""
    principal = request.get(PRINCIPAL_KEY)  # set on every request of a server without keys
    if principal is None:
        given = token_from_headers(request.headers)
        principal = None if given is None else request.app[KEY_RING_KEY].principal_for(given)
    return principal is not None and principal.tenant_scope is None


@routes.get("/metrics", name="metrics")
async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition: jobs by tenant and status and the queue's series (the
    caller's tenant only, unless an admin calls) and caps; HTTP requests by route, the jobs
    each supervisor holds and this replica's database, jobs and leases (to an admin only: they
    count every tenant's). While the database is away the scrape still answers, saying so,
    without the job counts it would read there."""
    scope = request[PRINCIPAL_KEY].tenant_scope
    manager = request.app[JOB_MANAGER_KEY]
    replica = await manager.replica_state()
    # Counted in the archive: a scrape never reads the whole history.
    counts = await manager.count_by_tenant(tenant=scope) if replica.database_connected else {}
    keys = request.app[KEY_RING_KEY]
    occupancy = manager.queue_occupancy()
    # Every tenant a key names has its series, zeros before its first job; so has every tenant
    # with queued or running jobs (the archive's counts name them too, when it answers).
    for tenant in [*keys.tenants, *occupancy] if scope is None else [scope]:
        counts.setdefault(tenant, {})
    settings = request.app[SETTINGS_KEY]
    queue = QueueState(
        occupancy=occupancy,
        max_running=settings.max_running_jobs,
        max_queued=settings.max_queued_jobs,
        tenant_limits={tenant: keys.limits_for(tenant) for tenant in counts},
    )
    return web.Response(
        body=request.app[METRICS_KEY].exposition(
            counts,
            queue,
            jobs_counted=replica.database_connected,
            supervisors=manager.supervisor_occupancy() if scope is None else None,
            replica=replica if scope is None else None,
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
            limits=cluster.limits,
        )
    )
