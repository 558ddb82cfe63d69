"""Prometheus metrics: HTTP requests by route, and jobs by tenant and status (read when scraped).

The job counts are made for each scrape from the caller's view: an admin sees every tenant's
series, any other key only its own tenant's, and none of the server-wide series (HTTP requests,
retention), which count every tenant's traffic together."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

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
        self.retention_deleted_jobs = Counter(
            "jobs_server_retention_deleted_jobs",
            "Finished jobs deleted by retention (--retention-max-age-s, --retention-max-jobs).",
            registry=self.registry,
        )

    def observe_request(self, route: str, method: str, status: int, duration_s: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route).observe(duration_s)

    def exposition(
        self, by_tenant: Mapping[str, Mapping[JobStatus, int]], *, server_wide: bool
    ) -> bytes:
        """The text exposition format: the job counts `by_tenant` (every status of each of its
        tenants, zeros included), after the server-wide series if `server_wide`."""
        jobs = CollectorRegistry(auto_describe=False)
        jobs.register(_JobCounts(by_tenant))
        text = generate_latest(jobs)
        return generate_latest(self.registry) + text if server_wide else text


class _JobCounts(Collector):
    """`jobs_server_jobs{tenant, status}` of one scrape (no state shared between callers)."""

    def __init__(self, by_tenant: Mapping[str, Mapping[JobStatus, int]]) -> None:
        self._by_tenant = by_tenant

    def collect(self) -> list[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            "jobs_server_jobs",
            "Jobs the server knows, by tenant and status.",
            labels=["tenant", "status"],
        )
        for tenant, counts in sorted(self._by_tenant.items()):
            for status in JobStatus:
                gauge.add_metric([tenant, status.value], counts.get(status, 0))
        return [gauge]


def route_name(request: web.Request) -> str:
    """The matched route's name, or `unmatched` (never the raw path: ids would explode labels)."""
    route = request.match_info.route
    name = getattr(route, "name", None)
    return name or "unmatched"
