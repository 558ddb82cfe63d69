"""The application factory: the one place that wires settings, Ray, the manager and the routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable

import aiohttp_cors
from aiohttp import web

from jobs_server.access.auth import AccessPolicy, resolve_auth_token
from jobs_server.access.key_ring import KeyRing, reload_keys_on_sighup
from jobs_server.app_state import (
    ACCESS_POLICY_KEY,
    CLUSTER_AT_SHUTDOWN_KEY,
    CLUSTER_HEALTH_KEY,
    CLUSTER_INFO_KEY,
    DISK_GUARD_KEY,
    JOB_DETAILS_CACHE_KEY,
    JOB_MANAGER_KEY,
    KEY_RING_KEY,
    METRICS_KEY,
    OUTBOX_KEY,
    PACKAGE_STORE_KEY,
    RAY_DRIVERS_KEY,
    SETTINGS_KEY,
    SHUTTING_DOWN_KEY,
    UPLOAD_BUDGET_KEY,
    WEBHOOK_SECRETS_KEY,
    WEBHOOK_SENDER_KEY,
)
from jobs_server.disk_guard import DiskGuard
from jobs_server.errors import ClusterUnavailableError
from jobs_server.manager import (
    Backend,
    ClusterAtShutdown,
    ClusterHealth,
    DashboardRegistration,
    JobManager,
    PackageStore,
    RayDrivers,
    connect_to_ray,
    disconnect_from_ray,
    read_cluster_info,
    registration_address,
    watch_cluster,
)
from jobs_server.manager.archive.event_feed import EventFeed
from jobs_server.manager.archive.events import JobEvent
from jobs_server.manager.archive.interface import create_archive
from jobs_server.manager.archive.leadership import Leadership
from jobs_server.manager.archive.retention import RetentionPolicy
from jobs_server.manager.cluster.ray_cluster import CLUSTER_LOST_EXIT_CODE
from jobs_server.manager.limits import JobLimits
from jobs_server.manager.records import caching_record_parser
from jobs_server.manager.tenancy import RunAs
from jobs_server.metrics import ServerMetrics
from jobs_server.routes import ROUTE_TABLES
from jobs_server.serving.job_details_cache import JobDetailsJsonCache
from jobs_server.serving.leader_forwarding import (
    forwarding_session,
    leader_forwarding_middleware,
)
from jobs_server.serving.middlewares import (
    auth_middleware,
    cluster_health_middleware,
    cross_site_middleware,
    error_middleware,
    metrics_middleware,
    request_origin_middleware,
)
from jobs_server.serving.upload_budget import UploadBudget
from jobs_server.settings import Settings
from jobs_server.state_dir import prepare_state_dirs
from jobs_server.webhooks.notify_check import notify_validator
from jobs_server.webhooks.planner import delivery_planner, may_have_deliveries
from jobs_server.webhooks.sender import SenderOptions, WebhookSender
from jobs_server.webhooks.signing import WebhookSecrets, read_secret_file
from jobs_server.webhooks.targets import TargetPolicy

logger = logging.getLogger(__name__)

# Headroom over the largest package for the request line and headers.
_BODY_LIMIT_MARGIN_BYTES = 64 * 1024


def create_app(
    settings: Settings,
    *,
    backend: Backend | None = None,
    on_cluster_lost: Callable[[str], None] | None = None,
) -> web.Application:
    """Build the app. Without `backend` it joins Ray and starts the manager on startup, and undoes
    both on cleanup; with one (its owner starts and closes it) no Ray is touched.

    `on_cluster_lost(reason)` is called when the Ray cluster is gone for good; by default the
    process exits with CLUSTER_LOST_EXIT_CODE.
    """
    app = web.Application(
        middlewares=[
            metrics_middleware,
            error_middleware,
            request_origin_middleware,
            cross_site_middleware,
            auth_middleware,
            leader_forwarding_middleware,
            cluster_health_middleware,
        ],
        client_max_size=settings.max_package_bytes + _BODY_LIMIT_MARGIN_BYTES,
    )
    app[SETTINGS_KEY] = settings
    app[ACCESS_POLICY_KEY] = AccessPolicy.from_settings(settings)
    app[KEY_RING_KEY] = KeyRing(
        admin_token=resolve_auth_token(settings),
        tokens_file=settings.tokens_file,
        target_policy=TargetPolicy.from_settings(settings),
    )
    app[WEBHOOK_SECRETS_KEY] = WebhookSecrets(
        server=(
            ()
            if settings.webhook_secret_file is None
            else read_secret_file(settings.webhook_secret_file)
        ),
        webhooks_for=app[KEY_RING_KEY].webhooks_for,
    )
    app[JOB_DETAILS_CACHE_KEY] = JobDetailsJsonCache()
    app[METRICS_KEY] = ServerMetrics()
    app[SHUTTING_DOWN_KEY] = asyncio.Event()
    app[DISK_GUARD_KEY] = DiskGuard(
        [settings.state_dir, settings.log_dir], settings.min_free_disk_bytes
    )
    app[UPLOAD_BUDGET_KEY] = UploadBudget(settings.upload_bytes_in_flight_limit)
    app.on_shutdown.append(_end_log_streams)
    app.cleanup_ctx.append(forwarding_session)
    if backend is None:
        app.cleanup_ctx.append(_ray_backend)
        app.cleanup_ctx.append(_webhook_sender)
        app.cleanup_ctx.append(_dashboard_registration)
        # Ends first at shutdown: what it knows then stays for the shutdown's calls, and it
        # does not report the GCS away (answer 503 until it returns) as the server leaves.
        app.cleanup_ctx.append(_cluster_watch(on_cluster_lost or exit_for_lost_cluster))
    else:
        _use_backend(app, backend)
    # After joining Ray, whose start may set signal handlers of its own.
    app.cleanup_ctx.append(reload_keys_on_sighup(KEY_RING_KEY))
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


async def _end_log_streams(app: web.Application) -> None:
    """Followers end their streams (a websocket with 1001) within a tick of this; aiohttp then
    waits for them up to its shutdown timeout, before the cleanup that stops the manager."""
    app[SHUTTING_DOWN_KEY].set()


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
        cluster = app[CLUSTER_AT_SHUTDOWN_KEY]
        # A cluster that is gone keeps it: the next server replaces an address where nothing
        # answers. An embedded Ray ends with this server, its registration with it: not asked
        # (its GCS may be ending already, SIGTERM to the process group: a call would wait out
        # the GCS's timeout, about 6 s of a shutdown).
        if (
            registration is not None
            and not cluster.ends_with_the_server
            and await cluster.answers()
        ):
            with contextlib.suppress(ClusterUnavailableError):
                await cluster.call("removing this server's registration", registration.unregister)


def _use_backend(app: web.Application, backend: Backend) -> None:
    app[JOB_MANAGER_KEY] = backend.manager
    app[PACKAGE_STORE_KEY] = backend.package_store
    app[CLUSTER_INFO_KEY] = backend.cluster_info
    app[RAY_DRIVERS_KEY] = backend.drivers


async def _ray_backend(app: web.Application) -> AsyncIterator[None]:
    """Join Ray and run a manager on it while the app serves."""
    settings = app[SETTINGS_KEY]
    # ray.init blocks; nothing else runs on the loop yet, so run it here, on the main thread
    # that Ray expects. It also replaces the SIGTERM handler with its own (exit 1, with a stack
    # dump): put back aiohttp's, so SIGTERM shuts down as gracefully as SIGINT.
    sigterm_handler = signal.getsignal(signal.SIGTERM)
    connection = connect_to_ray(
        settings.ray_address, embedded_node_ip=settings.embedded_ray_node_ip
    )
    if sigterm_handler is not None:
        signal.signal(signal.SIGTERM, sigterm_handler)

    # The archive wakes the event feed after each commit; the feed reads gaps back from it.
    # The metrics count the retries of the jobs that end among them. The webhook sender looks
    # for the deliveries written with them (on PostgreSQL, any replica's).
    def on_events(events: list[JobEvent]) -> None:
        event_feed.publish(events)
        app[METRICS_KEY].observe_job_events(events)
        if may_have_deliveries(events, app[KEY_RING_KEY].webhooks_for):
            webhook_sender.wake()

    # 0700, before anything is written there: a job must not read the archive or other logs.
    prepare_state_dirs(settings.state_dir, settings.log_dir)
    archive = create_archive(
        None if settings.database_url is None else settings.database_url.get_secret_value(),
        settings.state_dir,
        on_events=on_events,
        parse=caching_record_parser(),
        database_timeout_s=settings.database_timeout_s,
        # In each change's transaction: the job's notify and its tenant's endpoints, as the
        # tokens file (re-read on SIGHUP) has them.
        plan_deliveries=delivery_planner(app[KEY_RING_KEY].webhooks_for),
    )
    event_feed = EventFeed(archive)
    target_policy = TargetPolicy.from_settings(settings)
    webhook_sender = WebhookSender(
        archive,
        policy=target_policy,
        secrets=app[WEBHOOK_SECRETS_KEY],
        options=SenderOptions.from_settings(settings),
        metrics=app[METRICS_KEY],
    )
    try:
        await archive.open()
    except BaseException:  # refused (a newer schema) or unreachable: leave Ray before exiting
        await asyncio.to_thread(disconnect_from_ray, connection)
        raise
    # Replicas on one database: one leads (does the work), the others forward writes.
    leadership = (
        None if settings.database_url is None else Leadership.of(archive, url=settings.replica_url)
    )
    manager = JobManager(
        gcs_address=connection.gcs_address,
        namespace=settings.namespace,
        archive=archive,
        event_feed=event_feed,
        log_dir=settings.log_dir,
        stop_grace_s=settings.stop_grace_s,
        job_start_timeout_s=settings.job_start_timeout_s,
        shared_supervisors=settings.shared_supervisors,
        jobs_nice=settings.jobs_nice,
        jobs_user=None if settings.jobs_user is None else RunAs.of(settings.jobs_user),
        jobs_cgroup=None if settings.no_job_cgroups else settings.jobs_cgroup,
        default_job_limits=JobLimits(
            memory_bytes=settings.job_memory_max_bytes,
            cpu_cores=settings.job_cpu_max_cores,
            max_processes=settings.job_max_processes,
        ),
        enforce_entrypoint_memory=settings.enforce_entrypoint_memory,
        # Bounded like the rest of a graceful stop.
        stop_jobs_on_close_s=(
            max(settings.shutdown_timeout_s, settings.stop_grace_s + 1.0)
            if connection.embedded
            else None
        ),
        retention=RetentionPolicy(
            max_age_s=settings.retention_max_age_s,
            max_jobs=settings.retention_max_jobs,
            interval_s=settings.retention_interval_s,
        ),
        on_retention_deleted=app[METRICS_KEY].retention_deleted_jobs.inc,
        max_running_jobs=settings.max_running_jobs,
        max_queued_jobs=settings.max_queued_jobs,
        # Read at each decision, so the caps of a tokens file re-read on SIGHUP apply at once.
        tenant_limits=app[KEY_RING_KEY].limits_for,
        retry_backoff_s=settings.retry_backoff_s,
        leadership=leadership,
        validate_notify=notify_validator(target_policy, app[WEBHOOK_SECRETS_KEY]),
    )
    app[KEY_RING_KEY].add_reload_listener(manager.limits_changed)
    cluster_info = await read_cluster_info(
        connection.gcs_address,
        jobs_cgroup=None if settings.no_job_cgroups else settings.jobs_cgroup,
        head_jobs_memory_max_bytes=settings.head_jobs_memory_max_bytes,
    )
    _use_backend(
        app,
        Backend(
            manager=manager,
            package_store=PackageStore(connection.gcs_address, settings.max_package_bytes),
            cluster_info=cluster_info,
            drivers=RayDrivers(connection.gcs_address),
        ),
    )
    app[CLUSTER_HEALTH_KEY] = ClusterHealth(
        connection.gcs_address, cluster_info.session_name, settings.cluster_lost_exit_s
    )
    app[CLUSTER_AT_SHUTDOWN_KEY] = cluster = ClusterAtShutdown(
        app[CLUSTER_HEALTH_KEY], ends_with_the_server=connection.embedded
    )
    app[OUTBOX_KEY] = archive
    app[WEBHOOK_SENDER_KEY] = webhook_sender
    try:
        await manager.start()
    except BaseException:  # the database lost before the lead was taken over: leave Ray
        if leadership is not None:
            await leadership.close()
        await archive.close()
        await asyncio.to_thread(disconnect_from_ray, connection)
        raise
    try:
        yield
    finally:
        try:
            # Asked once (bounded) unless the shutdown found it gone already, so that no call
            # of the manager's close waits out a GCS that is gone (SIGTERM to the whole process
            # group of an embedded server ends its Ray with it).
            await cluster.answers()
            await manager.close(cluster)
        finally:
            if leadership is not None:
                await leadership.close()
            await archive.close()
            # ray.shutdown() waits on the GCS: asked again (milliseconds while it is there).
            await cluster.answers()
            await asyncio.to_thread(disconnect_from_ray, connection, cluster_gone=cluster.gone)


async def _webhook_sender(app: web.Application) -> AsyncIterator[None]:
    """The webhook sender while the app serves (every replica runs one: claims keep them
    apart); stopped before the archive closes. Its sends in flight are sent again later."""
    sender = app.get(WEBHOOK_SENDER_KEY)
    if sender is None:
        yield  # the Ray backend did not start
        return
    task = asyncio.create_task(sender.run(), name="webhook-sender")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _cluster_watch(
    on_cluster_lost: Callable[[str], None],
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def cluster_watch(app: web.Application) -> AsyncIterator[None]:
        """Keep the cluster's health current (healthz reads it), and call `on_cluster_lost`
        when the cluster is gone for good."""
        health = app.get(CLUSTER_HEALTH_KEY)
        if health is None:
            yield  # not connected to Ray: nothing to watch
            return

        stopping = asyncio.Event()

        async def watch() -> None:
            reason = await watch_cluster(health, stopping)
            if reason is not None:
                on_cluster_lost(reason)

        task = asyncio.create_task(watch(), name="cluster-watch")
        try:
            yield
        finally:
            # Not cancelled: it ends after its probe in flight (at most GCS_PROBE_TIMEOUT_S).
            stopping.set()
            await task

    return cluster_watch


def left_the_cluster_gone(app: web.Application) -> bool:
    """Whether the app's shutdown found its Ray cluster gone, and so did not leave Ray: the
    process must then end with `exit_without_ray` (Python's own exit would call Ray)."""
    cluster = app.get(CLUSTER_AT_SHUTDOWN_KEY)
    return cluster is not None and cluster.gone


def exit_without_ray(status: int) -> None:
    """End the process now, once the shutdown is done (the archive closed, the embedded Ray's
    processes ended), without Python's exit, which would still wait on the GCS that is gone:
    Ray's exit handler calls `ray.shutdown()`, threads blocked in Ray calls are joined, and so
    is Ray's GCS client thread, which may be blocked reporting an error to the GCS (Ray's
    exception hook, for the answer to a call given up on): that thread kept the process about a
    minute, then crashed it (SIGSEGV). Nothing is lost: the archive is closed with every write,
    and the logs are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_for_lost_cluster(reason: str) -> None:
    """Exit at once, non-zero, so that systemd or Kubernetes starts the server again.

    Not a graceful shutdown: it would wait on the GCS that is gone (`ray.shutdown`), and what a
    graceful shutdown would save (watchers, followers) belongs to the cluster that is lost.
    """
    logger.critical("the Ray cluster is lost, exiting: %s", reason)
    logging.shutdown()
    os._exit(CLUSTER_LOST_EXIT_CODE)
