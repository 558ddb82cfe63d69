"""Ray for the tests and benchmarks: where its nodes listen, its CLI, and ending a test's actors."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import ray

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


def gcs_is_up(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0
