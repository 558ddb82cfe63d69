"""Wall time of the terminal client's `jobs-server list`, against Ray's `ray job list`.

    .venv/bin/python -m benchmarks.client_cli [--runs 15] [--jobs 20]

Starts a Ray head node with its dashboard (Ray's job server) and jobs-server on the same
cluster, submits `--jobs` trivial jobs to each, then times whole processes, start to exit, one
after the other: `jobs-server list` against ours, `ray job list` against Ray's server, and
`ray job list` against ours (Ray's CLI pays for importing Ray whichever server it asks). One
untimed run of each comes first, so every module is compiled (`.pyc`) as after an install.
Prints a table and writes it to benchmarks/results-client.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from benchmarks.processes import jobs_server, ray_head
from benchmarks.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results-client.md"
BIN = Path(sys.executable).parent
TARGET_S = 0.3
logger = logging.getLogger(__name__)


def child_environment() -> dict[str, str]:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = str(ROOT)
    # As an installed package has: compiled modules.
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    return environment


def wall_times_s(command: Sequence[str], runs: int) -> tuple[list[float], list[float]]:
    """Seconds from start to exit of `command`, and the CPU seconds it used (user + system: on
    a busy machine the better guide to what it costs), `runs` times after one untimed run."""
    environment = child_environment()
    walls, cpus = [], []
    for run in range(runs + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run(command, env=environment, stdout=subprocess.DEVNULL, check=True)
        wall_s = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if run:
            walls.append(wall_s)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return walls, cpus


def submit_trivial_jobs(url: str, count: int) -> None:
    for _ in range(count):
        request = urllib.request.Request(
            f"{url}/api/jobs/",
            data=json.dumps({"entrypoint": "true"}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()


def listed_count(url: str) -> int:
    with urllib.request.urlopen(f"{url}/api/jobs/", timeout=60) as response:
        return len(json.loads(response.read()))


def row(name: str, times: tuple[list[float], list[float]], baseline_s: float) -> str:
    walls, cpus = times
    median = statistics.median(walls)
    return (
        f"| {name} | {median * 1000:.0f} ms | {percentile(walls, 90) * 1000:.0f} ms |"
        f" {min(walls) * 1000:.0f} ms | {statistics.median(cpus) * 1000:.0f} ms |"
        f" {median / baseline_s:.3f} |"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--jobs", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-client-") as work:
        work_dir = Path(work)
        with ray_head(work_dir) as head, jobs_server(head.gcs_address, work_dir) as ours:
            submit_trivial_jobs(ours.url, args.jobs)
            submit_trivial_jobs(head.dashboard_url, args.jobs)
            counts = (listed_count(ours.url), listed_count(head.dashboard_url))
            logger.info("listing %d jobs (ours) and %d (Ray's)", *counts)
            ray_cli = [str(BIN / "ray"), "job", "list", "--address"]
            ours_client = wall_times_s(
                [str(BIN / "jobs-server"), "list", "--url", ours.url], args.runs
            )
            ray_on_ray = wall_times_s([*ray_cli, head.dashboard_url], args.runs)
            ray_on_ours = wall_times_s([*ray_cli, ours.url], args.runs)
    load_after = os.getloadavg()[0]
    baseline = statistics.median(ray_on_ray[0])
    median = statistics.median(ours_client[0])
    verdict = "met" if median <= TARGET_S else "not met"
    table = "\n".join(
        [
            "| command (whole process, start to exit) | wall p50 | wall p90 | wall min"
            " | CPU p50 | wall p50 / `ray job list` on Ray's |",
            "|---|---:|---:|---:|---:|---|",
            row("`jobs-server list` → jobs-server", ours_client, baseline),
            row("`ray job list` → Ray's job server", ray_on_ray, baseline),
            row("`ray job list` → jobs-server", ray_on_ours, baseline),
        ]
    )
    report = (
        f"# The terminal client's start-up\n\n"
        f"`python -m benchmarks.client_cli --runs {args.runs} --jobs {args.jobs}`"
        f" ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; {counts[0]} jobs listed by"
        f" ours, {counts[1]} by Ray's; {args.runs} timed runs each after one untimed; load"
        f" average {load_before:.1f} before, {load_after:.1f} after: absolute times grow with"
        f" the machine's load, the ratios much less).\n\n"
        f"{table}\n\n"
        f"Target: `jobs-server list` ≤ {TARGET_S * 1000:.0f} ms wall time (p50): **{verdict}**"
        f" ({median * 1000:.0f} ms).\n"
    )
    RESULTS.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
