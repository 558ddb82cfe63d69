"""Ray's own metrics are off for the server's plumbing (the server's Ray core, its shared
supervisors) and for nothing else: a job's processes keep the node's setting."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import ray

from jobs_server.manager.cluster import ray_metrics
from jobs_server.manager.cluster.ray_metrics import RAY_METRICS_ENV_VAR
from jobs_server.settings import Settings
from tests.support.api import Client, job_logs, submit, wait_for_status

SHARED_SUPERVISOR_PREFIX = "jobs_server_shared_supervisor:"


def _shared_supervisor_pid(namespace: str) -> int:
    (name,) = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace and actor["name"].startswith(SHARED_SUPERVISOR_PREFIX)
    ]
    return int(ray.get(ray.get_actor(name, namespace=namespace).pid.remote(), timeout=30))


async def test_metrics_are_off_for_the_shared_supervisor_not_for_its_jobs(
    client: Client, settings: Settings
) -> None:
    prints_setting = f'echo "metrics=${{{RAY_METRICS_ENV_VAR}-unset}}"'
    job_id = await submit(client, entrypoint=f"{prints_setting}; env")
    job = await wait_for_status(client, job_id)
    logs = await job_logs(client, job_id)
    assert job["status"] == "SUCCEEDED", logs
    # The test cluster's nodes do not set it: the job sees what the node has.
    assert logs.startswith("metrics=unset\n"), logs
    assert "JOBS_SERVER_RAY_METRICS_OFF" not in logs
    supervisor = psutil.Process(_shared_supervisor_pid(settings.namespace))
    assert supervisor.environ().get(RAY_METRICS_ENV_VAR) == "0"
    # Where a job's command finds the node's setting: the raylet that started the supervisor.
    assert supervisor.parent().name() == "raylet"
    # A job may set it itself.
    own_id = await submit(
        client,
        entrypoint=prints_setting,
        runtime_env={"env_vars": {RAY_METRICS_ENV_VAR: "1"}},
    )
    own = await wait_for_status(client, own_id, timeout_s=120)
    assert own["status"] == "SUCCEEDED", own
    assert await job_logs(client, own_id) == "metrics=1\n"


def test_the_server_joins_a_cluster_with_its_own_metrics_off(ray_connection: str) -> None:
    """Ray reads the setting when `ray.init` starts the server's core worker."""
    script = (
        "import os\n"
        "from jobs_server.manager.cluster.ray_cluster import connect_to_ray\n"
        f"connect_to_ray({ray_connection!r}, embedded_node_ip='127.0.0.2')\n"
        f"print(os.environ.get({RAY_METRICS_ENV_VAR!r}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != RAY_METRICS_ENV_VAR}
    printed = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip().splitlines()[-1] == "0"


@pytest.mark.parametrize("before", [None, "1"])
def test_an_embedded_cluster_after_a_failed_join_keeps_the_setting(
    monkeypatch: pytest.MonkeyPatch, before: str | None
) -> None:
    if before is None:
        monkeypatch.delenv(RAY_METRICS_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(RAY_METRICS_ENV_VAR, before)
    ray_metrics.turn_off_for_this_process()
    assert os.environ[RAY_METRICS_ENV_VAR] == "0"
    ray_metrics.turn_back_on()
    assert os.environ.get(RAY_METRICS_ENV_VAR) == before
