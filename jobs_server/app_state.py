"""Typed application state: every `web.AppKey` the app uses, in one place."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from jobs_server.access.auth import AccessPolicy
from jobs_server.access.key_ring import KeyHold, KeyRing
from jobs_server.disk_guard import DiskGuard
from jobs_server.manager import (
    ClusterAtShutdown,
    ClusterHealth,
    ClusterInfo,
    DriverFinderApi,
    JobManagerApi,
    PackageStoreApi,
)
from jobs_server.manager.archive.outbox import Outbox
from jobs_server.manager.tenancy import Principal
from jobs_server.metrics import ServerMetrics
from jobs_server.serving.job_details_cache import JobDetailsJsonCache
from jobs_server.serving.upload_budget import UploadBudget
from jobs_server.settings import Settings
from jobs_server.webhooks.sender import WebhookSender
from jobs_server.webhooks.signing import WebhookSecrets

SETTINGS_KEY = web.AppKey("settings", Settings)
# Typed by Protocol, so the real manager and the tests' fakes both fit (a Protocol is not a
# concrete class, hence the subscript rather than a type argument).
JOB_MANAGER_KEY = web.AppKey[JobManagerApi]("job_manager")
PACKAGE_STORE_KEY = web.AppKey[PackageStoreApi]("package_store")
CLUSTER_INFO_KEY = web.AppKey("cluster_info", ClusterInfo)
CLUSTER_HEALTH_KEY = web.AppKey("cluster_health", ClusterHealth)
# What the shutdown finds of the cluster: once one of its calls finds it gone, the rest are
# skipped, and the process ends without leaving Ray (cli.serve).
CLUSTER_AT_SHUTDOWN_KEY = web.AppKey("cluster_at_shutdown", ClusterAtShutdown)
JOB_DETAILS_CACHE_KEY = web.AppKey("job_details_cache", JobDetailsJsonCache)
ACCESS_POLICY_KEY = web.AppKey("access_policy", AccessPolicy)
# The keys the server accepts (re-read on SIGHUP); its `limits_for(tenant)` are the caps of
# each tenant that the tokens file sets.
KEY_RING_KEY = web.AppKey("key_ring", KeyRing)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
# Set when the server begins to shut down: open log streams end.
SHUTTING_DOWN_KEY = web.AppKey("shutting_down", asyncio.Event)
RAY_DRIVERS_KEY = web.AppKey[DriverFinderApi]("ray_drivers")
DISK_GUARD_KEY = web.AppKey("disk_guard", DiskGuard)
UPLOAD_BUDGET_KEY = web.AppKey("upload_budget", UploadBudget)
# The archive's webhook deliveries (GET /api/jobs/{id}/deliveries), and their sender: set by
# the Ray backend (an app on a given backend has no archive of its own, and no deliveries).
OUTBOX_KEY = web.AppKey[Outbox]("outbox")
WEBHOOK_SENDER_KEY = web.AppKey("webhook_sender", WebhookSender)
# Which secrets sign a delivery: --webhook-secret-file's (read at start) and the tenants'.
WEBHOOK_SECRETS_KEY = web.AppKey("webhook_secrets", WebhookSecrets)
# The client a follower forwards job writes to the leader with (serving/leader_forwarding.py).
FORWARDING_SESSION_KEY = web.AppKey("forwarding_session", aiohttp.ClientSession)

# Set by the authentication middleware on each request, read by the audit log.
AUTHENTICATED_KEY = web.RequestKey("authenticated", bool)
# Who calls, set by the authentication middleware on every request that needs a key (and on
# every request when the server has none): handlers scope the manager's calls by it.
PRINCIPAL_KEY = web.RequestKey("principal", Principal)
# A streamed response's hold on the key it was opened with (see serving/streams.py): made by the
# first of its parts that asks, kept by the key ring while the stream is open.
KEY_HOLD_KEY = web.RequestKey("key_hold", KeyHold)
