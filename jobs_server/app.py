"""The application factory: the one place that wires settings, Ray, the manager and the routes."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable

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
    RAY_DRIVERS_KEY,
    SETTINGS_KEY,
)
from jobs_server.manager import (
    DashboardRegistration,
    JobManager,
    PackageStore,
    RayDrivers,
    connect_to_ray,
    disconnect_from_ray,
    read_cluster_info,
    registration_address,
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


def create_app(settings: Settings, *, manager: JobManager | None = None) -> web.Application:
    """Build the app; it joins Ray and starts the manager on startup, and undoes both on cleanup.

    Pass `manager` to use one that the caller owns (it is neither started nor closed here).
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
    app.cleanup_ctx.append(_ray_and_manager(manager))
    app.cleanup_ctx.append(_dashboard_registration)
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


async def _dashboard_registration(app: web.Application) -> AsyncIterator[None]:
    """Our address where Ray's clients look for the cluster's job server, while we serve."""
    settings = app[SETTINGS_KEY]
    registration = None
    if settings.port == 0:
        logger.info("not registering with Ray: the port is chosen when listening (port 0)")
    elif settings.tls_cert is not None:
        # Ray's clients read the address as plain HTTP.
        logger.info("not registering with Ray: its clients would not use HTTPS")
    else:
        registration = DashboardRegistration(registration_address(settings.host, settings.port))
        await registration.register()
    try:
        yield
    finally:
        if registration is not None:
            await registration.unregister()


def _ray_and_manager(
    given_manager: JobManager | None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ray_and_manager(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS_KEY]
        # ray.init blocks; nothing else runs on the loop yet, so run it here, on the main thread
        # that Ray expects.
        sigterm_handler = signal.getsignal(signal.SIGTERM)
        connection = connect_to_ray(
            settings.ray_address, embedded_node_ip=settings.embedded_ray_node_ip
        )
        # Ray's driver installs its own SIGTERM handler, which ends the process at once; put
        # back the one Python had (aiohttp's graceful exit), so a stop runs every cleanup.
        signal.signal(signal.SIGTERM, sigterm_handler)
        manager = given_manager or JobManager(
            gcs_address=connection.gcs_address,
            namespace=settings.namespace,
            log_dir=settings.log_dir,
            stop_grace_s=settings.stop_grace_s,
            job_start_timeout_s=settings.job_start_timeout_s,
            shared_supervisors=settings.shared_supervisors,
        )
        app[JOB_MANAGER_KEY] = manager
        app[PACKAGE_STORE_KEY] = PackageStore(connection.gcs_address, settings.max_package_bytes)
        app[CLUSTER_INFO_KEY] = await read_cluster_info(connection.gcs_address)
        app[RAY_DRIVERS_KEY] = RayDrivers(connection.gcs_address)
        if given_manager is None:
            await manager.start()
        try:
            yield
        finally:
            if given_manager is None:
                await manager.close()
            await asyncio.to_thread(disconnect_from_ray, connection)

    return ray_and_manager
