"""The application factory: the one place that wires settings, Ray, the manager and the routes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp_cors
from aiohttp import web

from jobs_server.api_models import JobDetailsJsonCache
from jobs_server.auth import AccessPolicy, resolve_auth_token
from jobs_server.keys import (
    ACCESS_POLICY_KEY,
    CLUSTER_INFO_KEY,
    JOB_DETAILS_CACHE_KEY,
    JOB_MANAGER_KEY,
    METRICS_KEY,
    PACKAGE_STORE_KEY,
    SETTINGS_KEY,
)
from jobs_server.manager import (
    Backend,
    JobManager,
    PackageStore,
    connect_to_ray,
    disconnect_from_ray,
    read_cluster_info,
)
from jobs_server.metrics import ServerMetrics
from jobs_server.middlewares import (
    auth_middleware,
    cross_site_middleware,
    error_middleware,
    metrics_middleware,
)
from jobs_server.routes import ROUTE_TABLES
from jobs_server.settings import Settings

logger = logging.getLogger(__name__)

# Headroom over the largest package for the request line and headers.
_BODY_LIMIT_MARGIN_BYTES = 64 * 1024


def create_app(settings: Settings, *, backend: Backend | None = None) -> web.Application:
    """Build the app. Without `backend` it joins Ray and starts the manager on startup, and undoes
    both on cleanup; with one (its owner starts and closes it) no Ray is touched.
    """
    app = web.Application(
        middlewares=[metrics_middleware, error_middleware, cross_site_middleware, auth_middleware],
        client_max_size=settings.max_package_bytes + _BODY_LIMIT_MARGIN_BYTES,
    )
    app[SETTINGS_KEY] = settings
    app[ACCESS_POLICY_KEY] = AccessPolicy(
        token=resolve_auth_token(settings), cors_origins=frozenset(settings.cors_origins)
    )
    app[JOB_DETAILS_CACHE_KEY] = JobDetailsJsonCache()
    app[METRICS_KEY] = ServerMetrics()
    if backend is None:
        app.cleanup_ctx.append(_ray_backend)
    else:
        _use_backend(app, backend)
    for table in ROUTE_TABLES:
        app.router.add_routes(table)
    if settings.cors_origins:
        _allow_cors(app, settings.cors_origins)
    return app


def _allow_cors(app: web.Application, origins: list[str]) -> None:
    """CORS headers and preflight answers for the origins the operator allowed, and no other."""
    cors = aiohttp_cors.setup(
        app,
        defaults={
            origin: aiohttp_cors.ResourceOptions(  # type: ignore[no-untyped-call]
                allow_credentials=False,
                allow_headers=("Authorization", "X-Ray-Authorization", "Content-Type", "Range"),
                expose_headers=("Content-Range",),
            )
            for origin in origins
        },
    )
    for route in list(app.router.routes()):
        cors.add(route)


def _use_backend(app: web.Application, backend: Backend) -> None:
    app[JOB_MANAGER_KEY] = backend.manager
    app[PACKAGE_STORE_KEY] = backend.package_store
    app[CLUSTER_INFO_KEY] = backend.cluster_info


async def _ray_backend(app: web.Application) -> AsyncIterator[None]:
    """Join Ray and run a manager on it while the app serves."""
    settings = app[SETTINGS_KEY]
    # ray.init blocks; nothing else runs on the loop yet, so run it here, on the main thread
    # that Ray expects.
    connection = connect_to_ray(
        settings.ray_address, embedded_node_ip=settings.embedded_ray_node_ip
    )
    manager = JobManager(
        gcs_address=connection.gcs_address,
        namespace=settings.namespace,
        log_dir=settings.log_dir,
        stop_grace_s=settings.stop_grace_s,
        job_start_timeout_s=settings.job_start_timeout_s,
        shared_supervisors=settings.shared_supervisors,
    )
    _use_backend(
        app,
        Backend(
            manager=manager,
            package_store=PackageStore(connection.gcs_address, settings.max_package_bytes),
            cluster_info=await read_cluster_info(connection.gcs_address),
        ),
    )
    await manager.start()
    try:
        yield
    finally:
        await manager.close()
        await asyncio.to_thread(disconnect_from_ray, connection)
