"""Ray's own metrics for the server's plumbing: off.

Every Ray process records metrics of its own work (a latency histogram per actor call, counters
per RPC) and exports them to its node's dashboard agent. For a shared supervisor and for the
server that work is plumbing, several calls per job: recording, exporting and ingesting them
cost about a tenth of the CPU a short job takes on the whole machine (measured with
`benchmarks.job_starts`). Ray reads the setting from each process's environment when the
process starts, so it is turned off for these processes alone; the cluster's other processes
keep the cluster's setting, and every job's own processes their node's.
"""

from __future__ import annotations

import os
from pathlib import Path

RAY_METRICS_ENV_VAR = "RAY_enable_metrics_collection"
# Set beside it in a supervisor's environment: its jobs' commands get the node's setting back.
METRICS_OFF_MARKER_ENV_VAR = "JOBS_SERVER_RAY_METRICS_OFF"

SUPERVISOR_ENV_VARS = {RAY_METRICS_ENV_VAR: "0", METRICS_OFF_MARKER_ENV_VAR: "1"}


_before: dict[str, str | None] = {}


def turn_off_for_this_process() -> None:
    """Before `ray.init` joins a cluster: this process's Ray core records no metrics. Not for
    an embedded cluster, whose processes `ray.init` starts with this environment."""
    _before.setdefault(RAY_METRICS_ENV_VAR, os.environ.get(RAY_METRICS_ENV_VAR))
    os.environ[RAY_METRICS_ENV_VAR] = "0"


def turn_back_on() -> None:
    """Undo `turn_off_for_this_process` (a join that failed: an embedded cluster starts)."""
    if RAY_METRICS_ENV_VAR not in _before:
        return
    value = _before.pop(RAY_METRICS_ENV_VAR)
    if value is None:
        os.environ.pop(RAY_METRICS_ENV_VAR, None)
    else:
        os.environ[RAY_METRICS_ENV_VAR] = value


def job_env_without_plumbing_setting(env: dict[str, str]) -> None:
    """Give a job's environment the node's setting back, where a supervisor's own setting
    replaced it: the value of the raylet that started this worker process, if it has one."""
    if not os.environ.get(METRICS_OFF_MARKER_ENV_VAR):
        return
    node_value = _raylet_setting()
    if node_value is None:
        env.pop(RAY_METRICS_ENV_VAR, None)
    else:
        env[RAY_METRICS_ENV_VAR] = node_value


# Read once per process. Not `functools.cache`: a cached function is pickled by reference, and a
# worker node has no jobs_server to import it from (the supervisor's code travels by value).
_raylet_settings: dict[str, str | None] = {}


def _raylet_setting() -> str | None:
    """The setting in the environment of this process's parent (the raylet that started it)."""
    if RAY_METRICS_ENV_VAR not in _raylet_settings:
        _raylet_settings[RAY_METRICS_ENV_VAR] = _read_raylet_setting()
    return _raylet_settings[RAY_METRICS_ENV_VAR]


def _read_raylet_setting() -> str | None:
    try:
        environ = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{RAY_METRICS_ENV_VAR}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None
