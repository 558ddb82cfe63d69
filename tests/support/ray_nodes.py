"""Ray for the tests and benchmarks: where its nodes listen, its CLI, a node started with `ray
start`, the environment test clusters need, and ending a test's actors."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import ray

from tests.support.processes import wait_until

RAY_NODE_IP = "127.0.0.2"
RAY_BIN = Path(sys.executable).parent / "ray"

# Credentials of the S3-compatible test server (moto accepts any).
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


# The GCS addresses of the clusters the suite starts (tests/conftest.py checks Ray's address
# file against them at the end).
SUITE_CLUSTER_ADDRESSES: set[str] = set()


def isolate_environment() -> None:
    """This process's environment (its children inherit it) for test clusters: Ray's own token
    authentication off (test clusters are not about it), and no RAY_ADDRESS (Ray's clients prefer
    it over the address they are given; tests name addresses) nor JOBS_SERVER_* setting."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    for name in list(os.environ):
        if name == "RAY_ADDRESS" or name.startswith("JOBS_SERVER_"):
            del os.environ[name]


def kill_actors_in_namespace(namespace: str) -> None:
    """Supervisors are detached and outlive their server; a test's die with the test."""
    if not ray.is_initialized():
        return
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == namespace:
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(actor["name"], namespace=namespace))


@dataclass(frozen=True)
class RayNode:
    process: subprocess.Popen[bytes]
    ip: str
    log_path: Path
    temp_dir: Path | None = None
    """The node's TMPDIR, where supervisors there spool job logs (worker nodes only)."""

    def wait_until_started(self) -> None:
        wait_until(
            lambda: (
                "Ray runtime started" in self.log_path.read_text(errors="replace")
                or self.process.poll() is not None
            ),
            90,
            f"the Ray node on {self.ip}",
        )
        assert self.process.poll() is None, self.log_path.read_text(errors="replace")

    def raylet(self) -> psutil.Process:
        raylets = [
            child
            for child in psutil.Process(self.process.pid).children(recursive=True)
            if child.name() == "raylet"
        ]
        assert len(raylets) == 1, raylets
        return raylets[0]


def start_ray_node(
    args: list[str],
    ip: str,
    log_path: Path,
    env: dict[str, str] | None = None,
    temp_dir: Path | None = None,
) -> RayNode:
    """`ray start --block ARGS` in a process group of its own."""
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                str(RAY_BIN),
                "start",
                "--block",
                f"--node-ip-address={ip}",
                "--disable-usage-stats",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return RayNode(process, ip, log_path, temp_dir)


RAY_CLI = str(RAY_BIN)
