"""Joining a Ray cluster, or starting the embedded local instance."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray

from jobs_server.errors import ClusterUnavailableError
from jobs_server.manager.cluster.head_jobs_cgroup import set_up_head_jobs_cgroup
from jobs_server.manager.cluster.ray_metrics import turn_back_on, turn_off_for_this_process
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.supervisor.cgroups import DEFAULT_JOBS_CGROUP, NO_CGROUPS
from jobs_server.manager.supervisor.containment import detect_containment

logger = logging.getLogger(__name__)

# Ray keeps the cluster's session name here.
_SESSION_KV_NAMESPACE = "session"
# As in `ray.init(address="local")`: always start a new local instance.
EMBEDDED_RAY_ADDRESS = "local"
_SESSION_NAME_KEY = "session_name"


# How often the server asks the GCS whether it is there, and how long it waits for the answer.
GCS_PROBE_INTERVAL_S = 1.0
GCS_PROBE_TIMEOUT_S = 2.0
# A GCS away this long is a lost cluster (by default; `--cluster-lost-exit-s`): without GCS fault
# tolerance nothing brings it back, and with it Ray's own processes give up after 60 s
# (`gcs_rpc_server_reconnect_timeout_s`). The server then exits non-zero, so systemd or
# Kubernetes starts it again on a working cluster.
CLUSTER_LOST_EXIT_S = 30.0
# The exit status of a server whose cluster is lost (EX_UNAVAILABLE).
CLUSTER_LOST_EXIT_CODE = 69
# How long the embedded Ray's processes get to end on SIGTERM when its GCS is gone at shutdown,
# before SIGKILL (`ray.shutdown()` gives each of them as long).
EMBEDDED_RAY_STOP_S = 1.0

# Ray's token authentication: the mode, and the file its processes read the token from.
_RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
_RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
_RAY_AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


@dataclass(frozen=True)
class RayConnection:
    gcs_address: str
    connected_here: bool
    """False if the process was already connected (tests, an embedding program): not ours to end."""
    embedded_token_dir: Path | None = None
    """The private directory of the embedded instance's generated token, removed at the end."""
    embedded: bool = False
    """This process started the Ray instance: its jobs end when the server does."""


@dataclass(frozen=True)
class ClusterInfo:
    """What `GET /api/version` reports about the cluster."""

    ray_version: str
    ray_commit: str
    session_name: str | None
    containment: str
    """How jobs are contained on the head node, where the shared supervisors run."""
    limits: str = "none"
    """How the head node enforces jobs' limits (cgroups.py `LimitsSupport`)."""


def connect_to_ray(address: str | None, *, embedded_node_ip: str) -> RayConnection:
    """Join `address`, else the cluster on this machine, else start a local one (blocking)."""
    if ray.is_initialized():
        return RayConnection(ray.get_runtime_context().gcs_address, connected_here=False)
    init_options: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    token_dir = None
    embedded = True
    if address == EMBEDDED_RAY_ADDRESS:
        token_dir = _start_embedded_ray(embedded_node_ip, init_options)
    elif address:
        logger.info("joining the Ray cluster at %s", address)
        turn_off_for_this_process()
        ray.init(address=address, **init_options)
        embedded = False
    elif _gcs_server_runs_here():
        try:
            turn_off_for_this_process()
            ray.init(address="auto", **init_options)
            logger.info("joined the Ray cluster running on this machine")
            embedded = False
        except ConnectionError:
            turn_back_on()  # the embedded cluster's processes keep theirs
            token_dir = _start_embedded_ray(embedded_node_ip, init_options)
    else:
        token_dir = _start_embedded_ray(embedded_node_ip, init_options)
    return RayConnection(
        ray.get_runtime_context().gcs_address,
        connected_here=True,
        embedded_token_dir=token_dir,
        embedded=embedded,
    )


def _gcs_server_runs_here() -> bool:
    """Whether a Ray cluster's GCS runs on this machine.

    Asked before `ray.init(address="auto")`, which otherwise falls back to the address file of
    the last cluster started here: if that cluster is gone, it retries it for minutes.
    """
    return any(process.info["name"] == "gcs_server" for process in psutil.process_iter(["name"]))


def _start_embedded_ray(node_ip: str, init_options: dict[str, Any]) -> Path | None:
    """Start the local instance; return the directory of the token it was given, if any."""
    logger.info("starting a local Ray instance on %s", node_ip)
    token_dir = _require_ray_token_auth()
    # No dashboard: it would serve a second jobs API beside ours.
    ray.init(
        address=EMBEDDED_RAY_ADDRESS,
        include_dashboard=False,
        _node_ip_address=node_ip,
        **init_options,
    )
    return token_dir


def _require_ray_token_auth() -> Path | None:
    """Turn Ray's token authentication on for the instance this process starts.

    Ray's GCS, raylet and workers listen on every interface, and each node's dashboard agent
    serves Ray's own job API (on 52365): without authentication, anyone who reaches one of them
    can run a job past this server. With RAY_AUTH_MODE=token every one of them refuses a caller
    without the token. A cluster that already uses Ray's token keeps it (the server shares it,
    see `ray_auth_token`); otherwise the instance gets a random token that only this process and
    Ray's processes (started by it, inheriting the path of a file only this user can read) know.
    Return that file's directory.
    """
    if os.environ.get(_RAY_AUTH_MODE_ENV, "").lower() == "token":
        return None
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    # Beside Ray's own temp files (RAY_TMPDIR when set); mode 0700. A file, not RAY_AUTH_TOKEN:
    # a job inherits the path (so its own `ray.init()` works), but `env` does not print the token.
    token_dir = Path(
        tempfile.mkdtemp(prefix="jobs-server-ray-auth-", dir=os.environ.get("RAY_TMPDIR"))
    )
    # Also when the server ends without its cleanup (sys.exit, an unhandled error).
    atexit.register(_remove_token_dir, token_dir)
    token_path = token_dir / "auth_token"
    token_path.touch(mode=0o600)
    token_path.write_text(secrets.token_hex(32))
    os.environ[_RAY_AUTH_MODE_ENV] = "token"
    os.environ[_RAY_AUTH_TOKEN_PATH_ENV] = str(token_path)
    # The token named by the variable would win over the file.
    os.environ.pop(_RAY_AUTH_TOKEN_ENV, None)
    # Ray reads both once per process; make it read them again.
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return token_dir


def disconnect_from_ray(connection: RayConnection, *, cluster_gone: bool = False) -> None:
    """Leave the cluster (and stop the embedded one) if this process connected to it.

    With `cluster_gone` (its GCS does not answer) Ray is not asked: `ray.shutdown()` waits on the
    GCS that is gone (its driver's shutdown: 5 s and more). What is left of the embedded
    instance's processes is ended here instead, and the caller's process must then end without
    Python's exit (`app.exit_without_ray`), whose Ray handler would call `ray.shutdown()` all
    the same.
    """
    try:
        if connection.connected_here and not cluster_gone:
            ray.shutdown()
        elif connection.connected_here and connection.embedded:
            _end_embedded_processes()
    finally:
        if connection.embedded_token_dir is not None:
            _remove_token_dir(connection.embedded_token_dir)


def _end_embedded_processes() -> None:
    """SIGTERM to what is left of the embedded Ray's processes, SIGKILL after
    EMBEDDED_RAY_STOP_S, as `ray.shutdown()` would end them. They are this process's descendants
    (`ray.init` started the GCS and the raylet, which started the rest; the server starts no
    other process), taken all at once: without its GCS the raylet that ends leaves its agents
    behind, and its workers with their jobs end with them."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=EMBEDDED_RAY_STOP_S)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if alive:
        psutil.wait_procs(alive, timeout=EMBEDDED_RAY_STOP_S)


def _remove_token_dir(token_dir: Path) -> None:
    shutil.rmtree(token_dir, ignore_errors=True)


@dataclass
class ClusterHealth:
    """Whether the cluster's GCS answers, as the cluster watch last saw it."""

    gcs_address: str
    session_name: str | None
    lost_after_s: float = CLUSTER_LOST_EXIT_S
    """How long the GCS may be away before the cluster is lost."""
    unavailable_reason: str | None = None
    unavailable_since_s: float | None = field(default=None, repr=False)
    """When the GCS stopped answering (time.monotonic()), None while it answers."""
    probe_kv: GcsKv = field(init=False, repr=False)
    """Made once, while the GCS answers: making a GCS client blocks until it can connect."""

    def __post_init__(self) -> None:
        self.probe_kv = GcsKv(
            self.gcs_address, _SESSION_KV_NAMESPACE, timeout_s=GCS_PROBE_TIMEOUT_S
        )

    def check(self) -> None:
        """Raise ClusterUnavailableError while the GCS is away."""
        if self.unavailable_reason is not None:
            raise ClusterUnavailableError(self.unavailable_reason)

    async def probe(self) -> None:
        """Ask the GCS once (a KV read, at most GCS_PROBE_TIMEOUT_S); ClusterUnavailableError if
        it does not answer. Records nothing: `probe_gcs` is the watch's."""
        await self.probe_kv.get(_SESSION_NAME_KEY)


async def probe_gcs(health: ClusterHealth, stopping: asyncio.Event | None = None) -> bool:
    """Ask the GCS (one KV read, at most GCS_PROBE_TIMEOUT_S) whether it is there and still the
    same cluster; record the answer in `health`; return whether the cluster is lost for good.
    A GCS found away once `stopping` is set is not reported here: the shutdown reports it."""
    try:
        session_name = await health.probe_kv.get(_SESSION_NAME_KEY)
    except ClusterUnavailableError:
        reason = f"Ray's GCS at {health.gcs_address} does not answer."
        replaced = False
    else:
        current = session_name.decode() if session_name is not None else None
        if current == health.session_name:
            if health.unavailable_reason is not None:
                logger.warning("Ray's GCS at %s answers again", health.gcs_address)
            health.unavailable_reason = health.unavailable_since_s = None
            return False
        # A GCS without fault tolerance that came back is a new, empty cluster.
        reason = (
            f"The Ray cluster at {health.gcs_address} is a new one (session {current}, not "
            f"{health.session_name}): the jobs and supervisors of this server are gone."
        )
        replaced = True
    if health.unavailable_since_s is None:
        if stopping is None or not stopping.is_set():
            logger.warning("%s Requests that need it answer 503 until it returns.", reason)
        health.unavailable_since_s = time.monotonic()
    away_s = time.monotonic() - health.unavailable_since_s
    health.unavailable_reason = f"{reason} Away for {away_s:.0f} s."
    return replaced or away_s >= health.lost_after_s


async def watch_cluster(health: ClusterHealth, stopping: asyncio.Event) -> str | None:
    """Probe the GCS every GCS_PROBE_INTERVAL_S, keeping `health` current; return why once the
    cluster is lost (its GCS away `health.lost_after_s`, or replaced by a new one), or None once
    `stopping` is set, after the probe in flight: a GCS call is not cancelled (leaving.py)."""
    # Polling: Ray sends no event when its GCS goes away or comes back.
    while True:
        lost = await probe_gcs(health, stopping)
        if stopping.is_set():
            return None
        if lost:
            return health.unavailable_reason or "The Ray cluster is lost."
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=GCS_PROBE_INTERVAL_S)
        if stopping.is_set():
            return None


async def read_cluster_info(
    gcs_address: str,
    *,
    jobs_cgroup: str | None = DEFAULT_JOBS_CGROUP,
    head_jobs_memory_max_bytes: int | None = None,
) -> ClusterInfo:
    """What the version reports, probed here on the head node as the shared supervisors probe
    it beside us; and the head's jobs cgroup set up (head_jobs_cgroup.py)."""
    session_name = await GcsKv(gcs_address, _SESSION_KV_NAMESPACE).get(_SESSION_NAME_KEY)
    containment = await asyncio.to_thread(detect_containment)
    jobs_tree = NO_CGROUPS
    if jobs_cgroup is not None:
        jobs_tree = await asyncio.to_thread(
            set_up_head_jobs_cgroup, jobs_cgroup, head_jobs_memory_max_bytes
        )
    return ClusterInfo(
        ray_version=ray.__version__,
        ray_commit=ray.__commit__,
        session_name=session_name.decode() if session_name is not None else None,
        containment=containment.value,
        limits=jobs_tree.support.value,
    )


def ray_auth_token() -> str | None:
    """The cluster's own token (RAY_AUTH_TOKEN, its file, or ~/.ray/auth_token), if Ray has one."""
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

    header = AuthenticationTokenLoader.instance().get_token_for_http_header()
    value = str(dict(header).get("authorization", ""))
    return value.removeprefix("Bearer ").strip() or None
