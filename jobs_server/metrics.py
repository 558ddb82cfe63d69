"""Prometheus metrics: HTTP requests by route, jobs by tenant and status, the queue (its jobs,
its caps, its refusals, the retries), what the jobs that ended used (peak memory and CPU time,
per attempt), the jobs each supervisor holds, this replica's database, jobs and leases, read
when scraped, and the webhooks' deliveries.

The per-tenant series are made for each scrape from the caller's view: an admin sees every
tenant's series, any other key only its own tenant's, and none of the server-wide series (HTTP
requests, retention, supervisors, the replica's), which count every tenant's work together.
The caps are configuration, not any tenant's work: every caller sees the server's (an
unlimited cap is exported as +Inf, so `used / cap` is 0 rather than missing)."""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jobs_server.manager import JobStatus
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.records import JobAttempt
from jobs_server.manager.replica import ReplicaState
from jobs_server.manager.supervisors import SupervisorOccupancy
from jobs_server.manager.tenancy import TenantLimits

# The status counted for a request cancelled before its handler returned: nginx's "client closed
# request", as no status of HTTP's own says that.
CANCELLED_REQUEST_STATUS = 499

# What an attempt used: from a shell command's few MiB to a large node's memory, by fours
# (4 MiB ... 256 GiB); from a tenth of a second of CPU to a day of it.
PEAK_MEMORY_BUCKETS_BYTES: Final = tuple(float(4**power << 22) for power in range(9))
CPU_SECONDS_BUCKETS: Final = (
    0.1,
    0.5,
    1.0,
    5.0,
    15.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    14400.0,
    86400.0,
)


class Distribution:
    """A histogram's state for one tenant (bucket counts, sum), exported per scrape: a
    registry's histogram would show every tenant's series to every caller."""

    def __init__(self, upper_bounds: tuple[float, ...]) -> None:
        self.upper_bounds = upper_bounds
        self.counts = [0] * (len(upper_bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # The first bucket whose upper bound is at or above the value (`le`).
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += 1
        self.total += value

    def cumulative_buckets(self) -> list[tuple[str, float]]:
        """(`le`, observations at or below it), +Inf last, as the exposition wants them."""
        bounds = [*map(floatToGoString, self.upper_bounds), "+Inf"]
        running, buckets = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            buckets.append((bound, float(running)))
        return buckets


@dataclass(frozen=True)
class QueueState:
    """The queue as one scrape sees it."""

    occupancy: Mapping[str, tuple[int, int]]
    """(jobs queued, jobs holding a running slot) by tenant."""
    max_running: int | None
    max_queued: int | None
    tenant_limits: Mapping[str, TenantLimits] = field(default_factory=dict)
    """The caps of each tenant the scrape shows."""


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
        self.webhook_deliveries = Counter(
            "jobs_server_webhook_deliveries",
            "Webhook delivery attempts' outcomes: delivered (2xx), retried (another attempt"
            " follows), failed (given up), disabled (its endpoint answered 410).",
            ["outcome"],
            registry=self.registry,
        )
        self.webhook_pending = Gauge(
            "jobs_server_webhook_deliveries_pending",
            "Webhook deliveries not yet accepted nor given up (the outbox, counted by this"
            " replica's sender at most every 10 s).",
            registry=self.registry,
        )
        self.webhook_attempt_duration = Histogram(
            "jobs_server_webhook_attempt_duration_seconds",
            "Time of one webhook delivery attempt, to the receiver's status or the error.",
            registry=self.registry,
        )
        # Per tenant, so kept here and shown per caller (a registry's counters are all or none).
        self.queue_full_refusals: collections.Counter[str] = collections.Counter()
        self.job_retries: collections.Counter[str] = collections.Counter()
        self.peak_memory: dict[str, Distribution] = collections.defaultdict(
            lambda: Distribution(PEAK_MEMORY_BUCKETS_BYTES)
        )
        self.cpu_seconds: dict[str, Distribution] = collections.defaultdict(
            lambda: Distribution(CPU_SECONDS_BUCKETS)
        )

    def observe_request(self, route: str, method: str, status: int, duration_s: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route).observe(duration_s)

    def observe_queue_full(self, tenant: str) -> None:
        """A submit of `tenant` was refused: 429 queue_full."""
        self.queue_full_refusals[tenant] += 1

    def observe_job_events(self, events: Iterable[JobEvent]) -> None:
        """Count the retries of each job whose end is among `events` (the archive's, as
        committed): its attempts after the first; and observe what each of its attempts used,
        where that was measured. The server learns a job's attempts from its record, which it
        reads at the job's end, so a retry and its use are counted when its job ends."""
        for event in events:
            record = event.record
            if (
                event.type is not JobEventType.STATUS
                or record is None
                or not record.status.is_terminal()
            ):
                continue
            if len(record.attempts) > 1:
                self.job_retries[record.tenant] += len(record.attempts) - 1
            for attempt in record.attempts:
                self._observe_use(record.tenant, attempt)

    def _observe_use(self, tenant: str, attempt: JobAttempt) -> None:
        if attempt.peak_memory_bytes is not None:
            self.peak_memory[tenant].observe(attempt.peak_memory_bytes)
        cpu_s = [s for s in (attempt.cpu_user_s, attempt.cpu_system_s) if s is not None]
        if cpu_s:
            self.cpu_seconds[tenant].observe(sum(cpu_s))

    def exposition(
        self,
        by_tenant: Mapping[str, Mapping[JobStatus, int]],
        queue: QueueState,
        *,
        jobs_counted: bool = True,
        supervisors: SupervisorOccupancy | None = None,
        replica: ReplicaState | None = None,
    ) -> bytes:
        """The text exposition format: the per-tenant series of the tenants of `by_tenant` (its
        job counts, every status, zeros included, unless not `jobs_counted`: the database did
        not answer) and the queue's caps; first, the server-wide series if `supervisors` is
        given, and the replica's if `replica` is (to an admin only)."""
        scraped = CollectorRegistry(auto_describe=False)
        if jobs_counted:
            scraped.register(_JobCounts(by_tenant))
        scraped.register(_QueueSeries(sorted(by_tenant), queue, self))
        scraped.register(_UseSeries(sorted(by_tenant), self))
        text = generate_latest(scraped)
        if supervisors is None:
            return text
        server_wide = CollectorRegistry(auto_describe=False)
        server_wide.register(_SupervisorSeries(supervisors))
        if replica is not None:
            server_wide.register(_ReplicaSeries(replica))
        return generate_latest(self.registry) + generate_latest(server_wide) + text


class _JobCounts(Collector):
    """`jobs_server_jobs{tenant, status}` of one scrape (no state shared between callers)."""

    def __init__(self, by_tenant: Mapping[str, Mapping[JobStatus, int]]) -> None:
        self._by_tenant = by_tenant

    def collect(self) -> list[Metric]:
        gauge = GaugeMetricFamily(
            "jobs_server_jobs",
            "Jobs the server knows, by tenant and status.",
            labels=["tenant", "status"],
        )
        for tenant, counts in sorted(self._by_tenant.items()):
            for status in JobStatus:
                gauge.add_metric([tenant, status.value], counts.get(status, 0))
        return [gauge]


class _SupervisorSeries(Collector):
    """How many jobs each shared supervisor holds, and how many have a supervisor of their own.

    A shared supervisor's series is there as long as the supervisor can hold jobs: this
    server's (`--shared-supervisors`, a bounded set) always, at 0 when idle, so an alert on it
    sees a value and not a series gone stale; another's (adopted after a restart, retired once
    idle) only while it holds jobs. One that dies is replaced under its name, so its series
    falls to 0 as its jobs end FAILED. A supervisor of a job's own is named for the run: a
    series each would be one per job, so they are counted together."""

    def __init__(self, occupancy: SupervisorOccupancy) -> None:
        self._occupancy = occupancy

    def collect(self) -> list[Metric]:
        shared = GaugeMetricFamily(
            "jobs_server_supervisor_jobs",
            "Jobs each shared supervisor holds (handed to it, not yet ended), by its Ray actor"
            " name: its death ends them all, FAILED.",
            labels=["supervisor"],
        )
        for name, jobs in sorted(self._occupancy.shared.items()):
            shared.add_metric([name], jobs)
        own = GaugeMetricFamily(
            "jobs_server_own_supervisor_jobs",
            "Jobs on a supervisor of their own (a runtime env or resources), one each.",
            value=self._occupancy.own,
        )
        return [shared, own]


class _ReplicaSeries(Collector):
    """This replica: its database, the jobs it owns and its leases. Each series is there on
    SQLite too (no leases: zeros), so a dashboard is the same whichever store a server uses."""

    def __init__(self, replica: ReplicaState) -> None:
        self._replica = replica

    def collect(self) -> list[Metric]:
        replica, leases = self._replica, self._replica.lease_counters
        return [
            GaugeMetricFamily(
                "jobs_server_database_connected",
                "1 if this replica's database answered a trivial read within 1 s at the scrape"
                " (SQLite: always), else 0: the job counts are then left out.",
                value=int(replica.database_connected),
            ),
            GaugeMetricFamily(
                "jobs_server_jobs_owned",
                "Live jobs this replica answers for: watched (handed to a supervisor, not yet"
                " ended) or waiting in its queue.",
                value=replica.jobs_owned,
            ),
            GaugeMetricFamily(
                "jobs_server_leases_held",
                "Leases this replica holds on its database (PostgreSQL: `server`; SQLite: none).",
                value=len(replica.leases_held),
            ),
            CounterMetricFamily(
                "jobs_server_leases_acquired",
                "Leases this replica took since its start (free, expired or taken over).",
                value=leases.acquired,
            ),
            CounterMetricFamily(
                "jobs_server_leases_taken_over",
                "Leases this replica took from another replica (or an earlier life of its"
                " own) whose lease had expired.",
                value=leases.taken_over,
            ),
            CounterMetricFamily(
                "jobs_server_leases_lost",
                "Leases this replica held and found taken over by another replica (it was"
                " frozen or cut off past the lease, and stepped down).",
                value=leases.lost,
            ),
        ]


def _cap(value: int | None) -> float:
    return math.inf if value is None else float(value)


class _QueueSeries(Collector):
    """The queue's series of one scrape: per tenant of `tenants` only, and the server's caps."""

    def __init__(self, tenants: list[str], queue: QueueState, metrics: ServerMetrics) -> None:
        self._tenants = tenants
        self._queue = queue
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        queued = GaugeMetricFamily(
            "jobs_server_queued_jobs",
            "Jobs waiting in the queue (PENDING behind a cap), by tenant.",
            labels=["tenant"],
        )
        holding = GaugeMetricFamily(
            "jobs_server_slot_holding_jobs",
            "Jobs holding a running slot (handed to a supervisor, not yet ended; counted"
            " against --max-running-jobs and the tenant's max_running), by tenant.",
            labels=["tenant"],
        )
        tenant_max_running = GaugeMetricFamily(
            "jobs_server_tenant_max_running_jobs",
            "A tenant's own max_running (tokens file); +Inf: none of its own.",
            labels=["tenant"],
        )
        tenant_max_queued = GaugeMetricFamily(
            "jobs_server_tenant_max_queued_jobs",
            "A tenant's own max_queued (tokens file); +Inf: none of its own.",
            labels=["tenant"],
        )
        refusals = CounterMetricFamily(
            "jobs_server_queue_full_refusals",
            "Submits refused with 429 queue_full (nothing recorded), by tenant.",
            labels=["tenant"],
        )
        retries = CounterMetricFamily(
            "jobs_server_job_retries",
            "Retries (attempts after the first) of the jobs that ended, counted at their end,"
            " by tenant.",
            labels=["tenant"],
        )
        for tenant in self._tenants:
            queued_jobs, holding_jobs = self._queue.occupancy.get(tenant, (0, 0))
            queued.add_metric([tenant], queued_jobs)
            holding.add_metric([tenant], holding_jobs)
            limits = self._queue.tenant_limits.get(tenant, TenantLimits())
            tenant_max_running.add_metric([tenant], _cap(limits.max_running))
            tenant_max_queued.add_metric([tenant], _cap(limits.max_queued))
            refusals.add_metric([tenant], self._metrics.queue_full_refusals[tenant])
            retries.add_metric([tenant], self._metrics.job_retries[tenant])
        max_running = GaugeMetricFamily(
            "jobs_server_max_running_jobs",
            "The server's --max-running-jobs; +Inf: unlimited.",
            value=_cap(self._queue.max_running),
        )
        max_queued = GaugeMetricFamily(
            "jobs_server_max_queued_jobs",
            "The server's --max-queued-jobs; +Inf: unlimited.",
            value=_cap(self._queue.max_queued),
        )
        return [
            queued,
            holding,
            max_running,
            max_queued,
            tenant_max_running,
            tenant_max_queued,
            refusals,
            retries,
        ]


class _UseSeries(Collector):
    """What the ended jobs' attempts used, per tenant of `tenants` only (zeros before the
    first): one observation per attempt that was measured, made when its job ended."""

    def __init__(self, tenants: list[str], metrics: ServerMetrics) -> None:
        self._tenants = tenants
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        peak_memory = HistogramMetricFamily(
            "jobs_server_job_peak_memory_bytes",
            "The memory high-water mark of each attempt of the jobs that ended (its cgroup's"
            " peak, else its largest process's RSS), observed at the job's end, by tenant.",
            labels=["tenant"],
        )
        cpu_seconds = HistogramMetricFamily(
            "jobs_server_job_cpu_seconds",
            "The CPU time (user + system) of each attempt of the jobs that ended, observed at"
            " the job's end, by tenant.",
            labels=["tenant"],
        )
        for family, by_tenant, bounds in (
            (peak_memory, self._metrics.peak_memory, PEAK_MEMORY_BUCKETS_BYTES),
            (cpu_seconds, self._metrics.cpu_seconds, CPU_SECONDS_BUCKETS),
        ):
            for tenant in self._tenants:
                # .get: a scrape adds no tenant to the metrics' state.
                distribution = by_tenant.get(tenant) or Distribution(bounds)
                family.add_metric(
                    [tenant], distribution.cumulative_buckets(), sum_value=distribution.total
                )
        return [peak_memory, cpu_seconds]


def route_name(request: web.Request) -> str:
    """The matched route's name, or `unmatched` (never the raw path: ids would explode labels)."""
    route = request.match_info.route
    name = getattr(route, "name", None)
    return name or "unmatched"
