"""Several replicas on one PostgreSQL database (issue 34): a submit through a follower against
one on the leader and one to Ray's job server, and the leader's death (kill -9) or freeze
(SIGSTOP) while the queue is full.

    .venv/bin/python -m benchmarks.replicas [--quick] [--keep-logs]

One Ray head node (its dashboard is Ray's job server) and one PostgreSQL server for the whole
run; each group of replicas gets a database and a namespace of its own. Three parts:

1. Latency: SUBMITS sequential `POST /api/jobs/` of `true` directly on the leader, through a
   follower (which forwards the write to the leader), and to Ray's job server, after a few
   warm-up submits each; p50 and p99, and the ratios ours/Ray's.
2. kill -9: three replicas with `--max-running-jobs CAP`; JOBS jobs `sleep S; echo ID >>
   marker` submitted through the replicas in turn; once CAP run (and no sooner than
   KILL_BEFORE_END_S before the first of them ends, so that the queue's next hand-over waits
   on the takeover, not on the sleep), kill -9 of the leader's process group. Measured from the
   kill: a follower's probe says `leader`; the first submit through a follower is accepted
   (retried every PROBE_INTERVAL_S with its submission_id while it is refused), for two
   clients at once, through each follower: one whose attempts give up after 2 s (this is the
   takeover, bounded by 10 s) and one that waits for every answer; the first job end (its line
   in the marker file); the first job that waited at the kill seen RUNNING (handed over). Then
   every job must end: each id in the marker
   file once, every job SUCCEEDED, and no list of the RUNNING jobs (every SAMPLE_INTERVAL_S, on
   the live replicas in turn) above CAP.
3. SIGSTOP: the same, with the leader frozen FREEZE_S (past its 6 s lease) instead, then
   SIGCONT: it must step down (run on as a follower; before 8f879d5, exit with status 75)
   and have run nothing twice.

Writes benchmarks/results-replicas.md (and prints it; progress on stderr); exits 1 if a check
failed. About 8 minutes on 2 cores (3 with `--quick`), most of it the jobs' sleeps and Ray's
own jobs ending.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import importlib.metadata
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from benchmarks.history import postgres_version
from benchmarks.processes import RayHead, kill_survivors, ray_head, set_up_benchmark_process
from benchmarks.report import Better, Figure, Metric, Results, Server, Unit, markdown_table
from benchmarks.stats import percentile
from tests.support.postgres import PostgresServer, running_postgres
from tests.support.processes import wait_until
from tests.support.replicas import (
    Replica,
    ReplicaGroup,
    RunningSampler,
    is_leader_unavailable,
    marker_lines,
)

logger = logging.getLogger("benchmarks.replicas")

RESULTS_PATH = Path(__file__).with_name("results-replicas.md")
REPLICAS = 3
WARM_UP_SUBMITS = 5
SUBMIT_WORKERS = 8
SAMPLE_INTERVAL_S = 0.2
REQUEST_TIMEOUT_S = 30.0
PROBE_INTERVAL_S = 0.2
PROBE_DEADLINE_S = 60.0
# A probe's attempt that took longer than this is explained under the table.
SLOW_ATTEMPT_S = 5.0
# The takeover's probe: a client whose every attempt gives up after 2 s (its submits retried with
# one submission_id), through one follower; beside it, through the other follower, a client that
# waits as long as an answer takes (the first attempt may have been forwarded to a frozen leader).
PROBE_TIMEOUTS_S = (2.0, REQUEST_TIMEOUT_S)
# How long a takeover may take (the bound): a slower one is a defect, said loudly.
TAKEOVER_BOUND_S = 10.0
# The leader is killed (or frozen) no sooner than this before the first running job ends:
# the queue's next hand-over then waits on the takeover (at most 8 s), not on the sleep.
KILL_BEFORE_END_S = 10.0
FREEZE_S = 10.0
# What a leader frozen past its lease does when it wakes: since 8f879d5 it steps down and
# follows; before, it exited 75 (the lease lost). Either way it writes nothing more.
STEPPED_DOWN = frozenset({"runs on as a follower", "exited 75"})
RUNNING_TIMEOUT_S = 300.0
RAY_DRAIN_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 60.0
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


@dataclass(frozen=True)
class Sizes:
    """How big a run is: the issue's case, or a small one (`--quick`)."""

    submits: int
    jobs: int
    cap: int
    sleep_s: int


FULL = Sizes(submits=100, jobs=700, cap=200, sleep_s=30)
QUICK = Sizes(submits=20, jobs=50, cap=20, sleep_s=15)


@dataclass
class Takeover:
    """What one leader's death (or freeze) did, and what the checks found."""

    how: str
    jobs: int = 0
    accepted: int = 0
    submit_errors: list[str] = field(default_factory=list)
    running_at_kill: int = 0
    pending_at_kill: int = 0
    leader_role_s: float | None = None
    probes: list[Probe] = field(default_factory=list)
    first_end_s: float | None = None
    first_handover_s: float | None = None
    all_ended_s: float | None = None
    max_running: int = 0
    samples: int = 0
    sample_errors: list[str] = field(default_factory=list)
    not_succeeded: dict[str, str] = field(default_factory=dict)
    ran_twice: dict[str, int] = field(default_factory=dict)
    never_ran: list[str] = field(default_factory=list)
    strangers: list[str] = field(default_factory=list)
    old_leader_after: str | None = None
    """After SIGCONT (freeze only): what the old leader did, in words."""

    @property
    def takeover_s(self) -> float | None:
        """From the kill to the acceptance of a client's submit with a short timeout."""
        return self.probes[0].accepted_s if self.probes else None

    def violations(self, cap: int) -> list[str]:
        """Every check that failed, in words."""
        found = []
        if self.submit_errors:
            found.append(f"{len(self.submit_errors)} submits refused: {self.submit_errors[:3]}")
        if self.ran_twice:
            found.append(f"jobs run more than once: {dict(list(self.ran_twice.items())[:10])}")
        if self.never_ran:
            found.append(f"{len(self.never_ran)} jobs never ran: {self.never_ran[:10]}")
        if self.strangers:
            found.append(f"marker lines of no job: {self.strangers[:10]}")
        if self.not_succeeded:
            items = list(self.not_succeeded.items())[:10]
            found.append(f"{len(self.not_succeeded)} jobs not SUCCEEDED: {items}")
        if self.max_running > cap:
            found.append(f"{self.max_running} RUNNING at once, over the cap of {cap}")
        if self.sample_errors:
            found.append(f"{len(self.sample_errors)} failed lists: {self.sample_errors[:3]}")
        takeover_s = self.takeover_s
        if takeover_s is None or takeover_s > TAKEOVER_BOUND_S:
            found.append(f"takeover (first submit accepted) {takeover_s} s > 10 s")
        if self.leader_role_s is None:
            found.append("no surviving replica said role leader")
        if self.first_handover_s is None:
            found.append("no job that waited at the kill was ever seen RUNNING")
        if self.all_ended_s is None:
            found.append("not every job ended before the deadline")
        if self.old_leader_after is not None and self.old_leader_after not in STEPPED_DOWN:
            found.append(f"the old leader did not step down: {self.old_leader_after}")
        return found


def request(replica: Replica | str, method: str, path: str, **kwargs: Any) -> requests.Response:
    """One request to a replica (or a URL), bounded by REQUEST_TIMEOUT_S."""
    kwargs.setdefault("timeout", REQUEST_TIMEOUT_S)
    if isinstance(replica, Replica):
        return replica.request(method, path, **kwargs)
    return requests.request(method, f"{replica}{path}", **kwargs)


def timed_submits(session: requests.Session, url: str, prefix: str, count: int) -> list[float]:
    """`count` POSTs of `true`, one after another on one connection; each one's latency."""
    latencies_s = []
    for number in range(count):
        body = {"entrypoint": "true", "submission_id": f"{prefix}-{number:03d}"}
        sent_s = time.perf_counter()
        response = session.post(f"{url}/api/jobs/", json=body, timeout=REQUEST_TIMEOUT_S)
        latencies_s.append(time.perf_counter() - sent_s)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
    return latencies_s


def wait_for_ends(url: str, ids: Sequence[str], timeout_s: float) -> bool:
    """Poll the list until every job of `ids` is terminal; whether they all were in time."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        statuses = {job.get("submission_id"): job["status"] for job in list_all(url)}
        if all(statuses.get(job_id) in TERMINAL for job_id in ids):
            return True
        time.sleep(1.0)
    return False


def list_all(url: str, **params: str) -> list[dict[str, Any]]:
    response = requests.get(f"{url}/api/jobs/", params=params, timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    return list(response.json())


def measure_latency(head: RayHead, group: ReplicaGroup, sizes: Sizes) -> Results:
    """Sequential submits on the leader, through a follower and to Ray's job server."""
    leader = group.leader()
    follower = next(replica for replica in group.replicas if replica is not leader)
    targets = {"leader": leader.url, "follower": follower.url, "ray": head.dashboard_url}
    latencies: dict[str, list[float]] = {}
    for name, url in targets.items():
        with requests.Session() as session:
            timed_submits(session, url, f"warm-{name}", WARM_UP_SUBMITS)
            logger.info("latency: %d submits to %s (%s)", sizes.submits, name, url)
            latencies[name] = timed_submits(session, url, f"lat-{name}", sizes.submits)
    results = Results()
    ours: dict[str, Figure] = {}
    for name in ("leader", "follower"):
        ours[f"{name}_p50"] = Figure(percentile(latencies[name], 50))
        ours[f"{name}_p99"] = Figure(percentile(latencies[name], 99))
    results.record(Server.OURS, ours)
    ray = latencies["ray"]
    results.record(
        Server.RAY, {"p50": Figure(percentile(ray, 50)), "p99": Figure(percentile(ray, 99))}
    )
    # Ray's jobs each start a worker process: let them end before the takeovers are timed.
    ray_jobs = [
        str(job["submission_id"])
        for job in list_all(head.dashboard_url)
        if str(job.get("submission_id") or "").startswith(("warm-ray", "lat-ray"))
    ]
    ours_ids = [
        f"{prefix}-{name}-{n:03d}"
        for prefix, count in (("warm", WARM_UP_SUBMITS), ("lat", sizes.submits))
        for name in ("leader", "follower")
        for n in range(count)
    ]
    if not wait_for_ends(leader.url, ours_ids, RAY_DRAIN_TIMEOUT_S):
        results.note(Server.OURS, f"its {len(ours_ids)} jobs had not all ended after 300 s")
    started_s = time.monotonic()
    if not wait_for_ends(head.dashboard_url, ray_jobs, RAY_DRAIN_TIMEOUT_S):
        results.note(Server.RAY, f"its {len(ray_jobs)} jobs had not all ended after 300 s")
    logger.info("Ray's %d jobs ended in %.1f s", len(ray_jobs), time.monotonic() - started_s)
    return results


LATENCY_METRICS = [
    Metric(
        "leader_p50",
        "`POST /api/jobs/` p50, on the leader",
        Unit.SECONDS,
        Better.LOWER,
        ray_key="p50",
    ),
    Metric(
        "follower_p50",
        "`POST /api/jobs/` p50, through a follower",
        Unit.SECONDS,
        Better.LOWER,
        ray_key="p50",
    ),
    Metric(
        "leader_p99",
        "`POST /api/jobs/` p99, on the leader",
        Unit.SECONDS,
        Better.LOWER,
        ray_key="p99",
    ),
    Metric(
        "follower_p99",
        "`POST /api/jobs/` p99, through a follower",
        Unit.SECONDS,
        Better.LOWER,
        ray_key="p99",
    ),
]


class Sampler(RunningSampler):
    """The RUNNING jobs every SAMPLE_INTERVAL_S, each time on the next replica it may use: the
    most at once, when each job was first seen RUNNING, and when the marker file first grew
    after `mark()` (a job's end, seen by its own write)."""

    def __init__(self, replicas: Sequence[Replica], marker: Path) -> None:
        super().__init__(replicas, interval_s=SAMPLE_INTERVAL_S)
        self._marker = marker
        self.first_running_s: dict[str, float] = {}
        self._marker_size_at_mark: int | None = None
        self.marker_grew_s: float | None = None

    def mark(self) -> None:
        """From now on, note when the marker file first grows."""
        with self._lock:
            self._marker_size_at_mark = marker_size(self._marker)
            self.marker_grew_s = None

    def _observe(self, jobs: list[dict[str, Any]], seen_s: float) -> None:
        for job in jobs:
            self.first_running_s.setdefault(str(job["submission_id"]), seen_s)

    def _after_sample(self) -> None:
        grown = self._marker_size_at_mark is not None and self.marker_grew_s is None
        if grown and marker_size(self._marker) > (self._marker_size_at_mark or 0):
            self.marker_grew_s = time.monotonic()


def marker_size(marker: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return marker.stat().st_size
    return 0


def submit_all(group: ReplicaGroup, bodies: list[dict[str, str]]) -> list[str]:
    """Submit every body, through the replicas in turn, SUBMIT_WORKERS at a time; the errors."""
    replicas = group.replicas

    def one(numbered: tuple[int, dict[str, str]]) -> str | None:
        number, body = numbered
        replica = replicas[number % len(replicas)]
        try:
            response = request(replica, "POST", "/api/jobs/", json=body)
        except requests.RequestException as error:
            return f"{body['submission_id']} on {replica}: {error}"
        if response.status_code != 200:
            return f"{body['submission_id']} on {replica}: {response.status_code} {response.text}"
        return None

    with ThreadPoolExecutor(SUBMIT_WORKERS) as pool:
        return [error for error in pool.map(one, enumerate(bodies)) if error is not None]


def marker_job(marker: Path, job_id: str, sleep_s: int) -> dict[str, str]:
    return {"entrypoint": f"sleep {sleep_s}; echo {job_id} >> {marker}", "submission_id": job_id}


@dataclass
class Probe:
    """A client's submit through a follower, retried until accepted."""

    timeout_s: float
    accepted_s: float | None = None
    refused_503: int = 0
    timed_out: int = 0
    longest_attempt_s: float = 0.0
    others: list[str] = field(default_factory=list)


def first_accepted_submit(
    replica: Replica, body: dict[str, str], since_s: float, timeout_s: float
) -> Probe:
    """Submit `body` through `replica`, each attempt bounded by `timeout_s`, again every
    PROBE_INTERVAL_S until accepted (a 409 too: an earlier attempt was done though its answer
    was lost); `accepted_s` counts from `since_s` (None: not within PROBE_DEADLINE_S)."""
    probe = Probe(timeout_s)
    while time.monotonic() < since_s + PROBE_DEADLINE_S:
        sent_s = time.monotonic()
        try:
            response = request(replica, "POST", "/api/jobs/", json=body, timeout=timeout_s)
        except requests.Timeout:
            probe.timed_out += 1
            response = None
        except requests.RequestException as error:
            probe.others.append(f"{type(error).__name__}: {error}")
            response = None
        probe.longest_attempt_s = max(probe.longest_attempt_s, time.monotonic() - sent_s)
        if response is not None:
            if response.status_code in (200, 409):
                probe.accepted_s = time.monotonic() - since_s
                if response.status_code == 409:
                    probe.others.append(f"409 {response.text[:200]}")
                return probe
            if is_leader_unavailable(response):
                probe.refused_503 += 1
            else:
                probe.others.append(f"{response.status_code} {response.text[:200]}")
        time.sleep(PROBE_INTERVAL_S)
    return probe


def after_the_wake(old_leader: Replica) -> str:
    """What a leader woken after its lease was taken does: exits (how), or runs on (its role)."""
    deadline_s = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline_s:
        status = old_leader.process.poll()
        if status is not None:
            return f"exited {status}"
        if old_leader.role() == "follower":
            return "runs on as a follower"
        time.sleep(0.5)
    return f"still runs after {EXIT_TIMEOUT_S:.0f} s, role {old_leader.role()}"


def first_leader_role(replicas: Sequence[Replica], since_s: float) -> float | None:
    """Seconds from `since_s` until one of `replicas` says role leader (None: not in a minute)."""
    while time.monotonic() < since_s + 60:
        if any(replica.role() == "leader" for replica in replicas):
            return time.monotonic() - since_s
        time.sleep(0.1)
    return None


def takeover(group: ReplicaGroup, sizes: Sizes, how: str, work_dir: Path) -> Takeover:
    """The queue full, the leader killed (`how` kill) or frozen (`how` freeze): the figures."""
    result = Takeover(how)
    marker = work_dir / f"marker-{how}"
    prefix = f"{how}-{uuid.uuid4().hex[:4]}"
    ids = [f"{prefix}-{number:04d}" for number in range(sizes.jobs)]
    probe_ids = [f"{prefix}-late-{n}" for n in range(len(PROBE_TIMEOUTS_S))]
    result.jobs = len(ids) + len(probe_ids)
    leader = group.leader()
    survivors = [replica for replica in group.replicas if replica is not leader]
    with Sampler(group.replicas, marker) as sampler:
        started_s = time.monotonic()
        result.submit_errors = submit_all(
            group, [marker_job(marker, job_id, sizes.sleep_s) for job_id in ids]
        )
        result.accepted = len(ids) - len(result.submit_errors)
        logger.info(
            "%s: %d submitted in %.1f s (%d refused)",
            how,
            result.accepted,
            time.monotonic() - started_s,
            len(result.submit_errors),
        )

        def cap_reached() -> bool:
            return len(list_all(survivors[0].url, status="RUNNING")) >= sizes.cap

        wait_until(cap_reached, RUNNING_TIMEOUT_S, f"{sizes.cap} jobs to run")
        first_running_s = min(sampler.first_running_s.values(), default=time.monotonic())
        kill_at_s = first_running_s + sizes.sleep_s - KILL_BEFORE_END_S
        time.sleep(max(0.0, kill_at_s - time.monotonic()))
        sampler.use(survivors)
        pending_at_kill = {
            str(job["submission_id"]) for job in list_all(survivors[0].url, status="PENDING")
        }
        result.pending_at_kill = len(pending_at_kill)
        result.running_at_kill = len(list_all(survivors[0].url, status="RUNNING"))
        logger.info(
            "%s: %d RUNNING, %d PENDING; %s of the leader %s",
            how,
            result.running_at_kill,
            result.pending_at_kill,
            how,
            leader,
        )
        sampler.mark()
        killed_s = time.monotonic()
        if how == "kill":
            leader.kill()
        else:
            leader.freeze()
        with ThreadPoolExecutor(3) as pool:
            role = pool.submit(first_leader_role, survivors, killed_s)
            probes = [
                pool.submit(
                    first_accepted_submit,
                    follower,
                    marker_job(marker, probe_id, 1),
                    killed_s,
                    timeout_s,
                )
                for follower, probe_id, timeout_s in zip(
                    survivors, probe_ids, PROBE_TIMEOUTS_S, strict=True
                )
            ]
            if how == "freeze":
                time.sleep(max(0.0, killed_s + FREEZE_S - time.monotonic()))
                leader.thaw()
                logger.info("freeze: SIGCONT after %.1f s", time.monotonic() - killed_s)
            result.leader_role_s = role.result()
            result.probes = [probe.result() for probe in probes]
        for probe in result.probes:
            result.submit_errors += [f"probe: {other}" for other in probe.others]
        logger.info(
            "%s: a survivor says leader after %s s; probes %s",
            how,
            result.leader_role_s,
            result.probes,
        )
        timeout_s = (sizes.jobs / sizes.cap + 3) * sizes.sleep_s * 2 + RUNNING_TIMEOUT_S
        all_ids = [*ids, *probe_ids]
        if wait_for_ends(survivors[0].url, all_ids, timeout_s):
            result.all_ended_s = time.monotonic() - killed_s
        if how == "freeze":
            result.old_leader_after = after_the_wake(leader)
        if sampler.marker_grew_s is not None:
            result.first_end_s = sampler.marker_grew_s - killed_s
    handovers = [
        seen_s
        for job_id, seen_s in sampler.first_running_s.items()
        if job_id in pending_at_kill | set(probe_ids)
    ]
    if handovers:
        result.first_handover_s = min(handovers) - killed_s
    result.max_running = max(sampler.counts, default=0)
    result.samples = len(sampler.counts)
    result.sample_errors = sampler.errors
    statuses = {str(job["submission_id"]): str(job["status"]) for job in list_all(survivors[0].url)}
    result.not_succeeded = {
        job_id: statuses.get(job_id, "missing")
        for job_id in all_ids
        if statuses.get(job_id) != "SUCCEEDED"
    }
    ran = collections.Counter(marker_lines(marker))
    result.ran_twice = {job_id: count for job_id, count in ran.items() if count > 1}
    result.never_ran = [job_id for job_id in all_ids if ran[job_id] == 0]
    result.strangers = sorted(set(ran) - set(all_ids))
    for violation in result.violations(sizes.cap):
        logger.error("%s: VIOLATION: %s", how, violation)
    logger.info("%s: %s", how, result)
    return result


@contextlib.contextmanager
def replica_group(
    head: RayHead, postgres: PostgresServer, work_dir: Path, cap: int
) -> Iterator[ReplicaGroup]:
    """REPLICAS replicas with `--max-running-jobs cap` on a new database, stopped on exit."""
    work_dir.mkdir()
    group = ReplicaGroup(
        work_dir,
        head.gcs_address,
        postgres.create_database(),
        REPLICAS,
        extra_args=["--max-running-jobs", str(cap)],
        namespace=f"bench_replicas_{uuid.uuid4().hex[:8]}",
    )
    started_s = time.monotonic()
    try:
        group.start()
        logger.info("%d replicas answered after %.1f s", REPLICAS, time.monotonic() - started_s)
        yield group
    finally:
        group.stop()


def fmt_s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def takeover_rows(result: Takeover, sizes: Sizes) -> list[tuple[str, str]]:
    return [
        (
            f"jobs (`sleep {sizes.sleep_s}` each, cap {sizes.cap}); "
            f"RUNNING / PENDING at the {result.how}",
            f"{result.jobs}; {result.running_at_kill} / {result.pending_at_kill}",
        ),
        ("→ a surviving replica's probe says `leader`", fmt_s(result.leader_role_s)),
        *(
            (
                f"→ first submit through a follower accepted, attempts bounded by "
                f"{probe.timeout_s:.0f} s (503s; timeouts; longest attempt)",
                f"{fmt_s(probe.accepted_s)} ({probe.refused_503}; {probe.timed_out}; "
                f"{fmt_s(probe.longest_attempt_s)})",
            )
            for probe in result.probes
        ),
        ("→ first job end (its line in the marker file)", fmt_s(result.first_end_s)),
        ("→ first job that waited seen RUNNING (handed over)", fmt_s(result.first_handover_s)),
        ("→ every job ended", fmt_s(result.all_ended_s)),
        (
            "most RUNNING at once (lists every 0.2 s, on the live replicas in turn)",
            f"{result.max_running} (cap {sizes.cap}; {result.samples} lists)",
        ),
        (
            "ids in the marker file: twice or more / never / of no job",
            f"{len(result.ran_twice)} / {len(result.never_ran)} / {len(result.strangers)}",
        ),
        ("jobs not SUCCEEDED", str(len(result.not_succeeded))),
        *(
            [("the old leader after SIGCONT", result.old_leader_after)]
            if result.old_leader_after is not None
            else []
        ),
    ]


def code_version() -> str:
    """The commit the run measured, and the files it changed in the working tree (others may
    be editing the same tree)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", "jobs_server"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()[1::2]
    if not changed:
        return f"commit {commit or 'unknown'}"
    return f"commit {commit or 'unknown'} with uncommitted changes to {', '.join(changed)}"


def render(
    latency: Results | None,
    takeovers: list[Takeover],
    sizes: Sizes,
    started: datetime.datetime,
    elapsed_s: float,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
    code: str,
) -> str:
    lines = [
        "# Several replicas on one PostgreSQL (issue 34)",
        "",
        f"- date: {started.isoformat(timespec='seconds')}; the run took {elapsed_s / 60:.1f} min",
        f"- machine: {os.cpu_count()} cores; load average (1, 5, 15 min) before: "
        f"{', '.join(f'{x:.2f}' for x in load[0])}; after: "
        f"{', '.join(f'{x:.2f}' for x in load[1])}",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root)",
        f"- code: {code}",
        f"- Ray {importlib.metadata.version('ray')}, PostgreSQL {postgres_version()}, "
        f"{REPLICAS} replicas",
        "",
        f"## Submit latency ({sizes.submits} sequential `true` each, after "
        f"{WARM_UP_SUBMITS} warm-up)",
        "",
    ]
    if latency is None:
        lines.append("not run")
    else:
        lines.append(markdown_table(LATENCY_METRICS, latency))
        lines += ["", *[f"- {note}" for note in latency.notes]]
    for result in takeovers:
        title = (
            "kill -9 of the leader"
            if result.how == "kill"
            else (f"SIGSTOP of the leader for {FREEZE_S:.0f} s, then SIGCONT")
        )
        lines += [
            "",
            f"## {title}",
            "",
            f"| from the {'kill' if result.how == 'kill' else 'SIGSTOP'} | |",
            "|---|---:|",
            *[f"| {what} | {value} |" for what, value in takeover_rows(result, sizes)],
            "",
        ]
        for probe in result.probes:
            if probe.longest_attempt_s > SLOW_ATTEMPT_S:
                lines.append(
                    f"One attempt through a follower (bounded by {probe.timeout_s:.0f} s) took "
                    f"{probe.longest_attempt_s:.1f} s: a write forwarded to a leader that is "
                    "frozen waits until it wakes (the follower bounds only the connection to "
                    "the leader, and the frozen process's socket still accepts).\n"
                )
        violations = result.violations(sizes.cap)
        if violations:
            lines += ["**VIOLATIONS:**", "", *[f"- **{v}**" for v in violations]]
        else:
            lines.append("Every check held.")
    lines += ["", "## How it measures", "", *(__doc__ or "").split("\n\n", 2)[2].splitlines()]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replicas",
        description="Several replicas on one PostgreSQL (issue 34): latency and takeovers.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"small sizes ({QUICK.submits} submits, {QUICK.jobs} jobs, cap {QUICK.cap})",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    set_up_benchmark_process()
    started = datetime.datetime.now().astimezone()
    started_s = time.monotonic()
    load_before = os.getloadavg()
    code = code_version()
    work_dir = Path(tempfile.mkdtemp(prefix="jobs-replicas-", dir="/tmp"))
    latency: Results | None = None
    takeovers: list[Takeover] = []
    try:
        with running_postgres() as postgres, ray_head(work_dir) as head:
            with replica_group(head, postgres, work_dir / "kill", sizes.cap) as group:
                latency = measure_latency(head, group, sizes)
                takeovers.append(takeover(group, sizes, "kill", work_dir))
            with replica_group(head, postgres, work_dir / "freeze", sizes.cap) as group:
                takeovers.append(takeover(group, sizes, "freeze", work_dir))
    finally:
        for pid, cmdline in kill_survivors(str(work_dir)):
            logger.warning("process %d outlived its process group (killed): %s", pid, cmdline)
        if args.keep_logs:
            logger.info("logs kept in %s", work_dir)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    report = render(
        latency,
        takeovers,
        sizes,
        started,
        time.monotonic() - started_s,
        (load_before, os.getloadavg()),
        code,
    )
    RESULTS_PATH.write_text(report)
    sys.stdout.write(report)
    logger.info("written to %s", RESULTS_PATH)
    if any(result.violations(sizes.cap) for result in takeovers) or len(takeovers) < 2:
        sys.exit(1)


if __name__ == "__main__":
    main()
