"""Typed application state: every `web.AppKey` the app uses, in one place."""

from __future__ import annotations

import asyncio

from aiohttp import web

from jobs_server.auth import AccessPolicy
from jobs_server.job_details_cache import JobDetailsJsonCache
from jobs_server.manager import ClusterHealth, ClusterInfo, JobManager, PackageStore, RayDrivers
from jobs_server.metrics import ServerMetrics
from jobs_server.settings import Settings

SETTINGS_KEY = web.AppKey("settings", Settings)
JOB_MANAGER_KEY = web.AppKey("job_manager", JobManager)
PACKAGE_STORE_KEY = web.AppKey("package_store", PackageStore)
CLUSTER_INFO_KEY = web.AppKey("cluster_info", ClusterInfo)
CLUSTER_HEALTH_KEY = web.AppKey("cluster_health", ClusterHealth)
JOB_DETAILS_CACHE_KEY = web.AppKey("job_details_cache", JobDetailsJsonCache)
ACCESS_POLICY_KEY = web.AppKey("access_policy", AccessPolicy)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
# Set when the server begins to shut down: open log streams end.
SHUTTING_DOWN_KEY = web.AppKey("shutting_down", asyncio.Event)
RAY_DRIVERS_KEY = web.AppKey("ray_drivers", RayDrivers)

# Set by the authentication middleware on each request, read by the audit log.
AUTHENTICATED_KEY = web.RequestKey("authenticated", bool)
