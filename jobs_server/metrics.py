"""Prometheus metrics: HTTP requests by route, and jobs by status (read when scraped)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jobs_server.manager import JobStatus

# The status counted for a request cancelled before its handler returned: nginx's "client closed
# request", as no status of HTTP's own says that.
CANCELLED_REQUEST_STATUS = 499


class ServerMetrics:
    """The server's metrics, in a registry of their own (not the process-wide default)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter(
            "jobs_server_http_requests",
            "HTTP requests answered, by route name, method and status (499: cancelled).",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "jobs_server_http_request_duration_seconds",
            "Time to answer a request (to the end of the body for streams), by route name.",
            ["route"],
            registry=self.registry,
        )
        self.jobs = Gauge(
            "jobs_server_jobs",
            "Jobs the server knows, by status.",
            ["status"],
            registry=self.registry,
        )
        self.retention_deleted_jobs = Counter(
            "jobs_server_retention_deleted_jobs",
            "Finished jobs deleted by retention (--retention-max-age-s, --retention-max-jobs).",
            registry=self.registry,
        )

    def observe_request(self, route: str, method: str, status: int, duration_s: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route).observe(duration_s)

    def exposition(self, by_status: Mapping[JobStatus, int]) -> bytes:
        """The text exposition format, with the job counts `by_status`."""
        for status in JobStatus:
            self.jobs.labels(status.value).set(by_status.get(status, 0))
        return generate_latest(self.registry)


def route_name(request: web.Request) -> str:
    """The matched route's name, or `unmatched` (never the raw path: ids would explode labels)."""
    route = request.match_info.route
    name = getattr(route, "name", None)
    return name or "unmatched"
