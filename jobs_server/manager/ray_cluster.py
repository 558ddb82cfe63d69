"""Joining a Ray cluster, or starting the embedded local instance."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psutil
import ray

from jobs_server.manager.kv import GcsKv

logger = logging.getLogger(__name__)

# Ray keeps the cluster's session name here.
_SESSION_KV_NAMESPACE = "session"
# As in `ray.init(address="local")`: always start a new local instance.
EMBEDDED_RAY_ADDRESS = "local"
_SESSION_NAME_KEY = "session_name"


@dataclass(frozen=True)
class RayConnection:
    gcs_address: str
    connected_here: bool
    """False if the process was already connected (tests, an embedding program): not ours to end."""


@dataclass(frozen=True)
class ClusterInfo:
    """What `GET /api/version` reports about the cluster."""

    ray_version: str
    ray_commit: str
    session_name: str | None


def connect_to_ray(address: str | None, *, embedded_node_ip: str) -> RayConnection:
    """Join `address`, else the cluster on this machine, else start a local one (blocking)."""
    if ray.is_initialized():
        return RayConnection(ray.get_runtime_context().gcs_address, connected_here=False)
    init_options: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address == EMBEDDED_RAY_ADDRESS:
        _start_embedded_ray(embedded_node_ip, init_options)
    elif address:
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, **init_options)
    elif _gcs_server_runs_here():
        try:
            ray.init(address="auto", **init_options)
            logger.info("joined the Ray cluster running on this machine")
        except ConnectionError:
            _start_embedded_ray(embedded_node_ip, init_options)
    else:
        _start_embedded_ray(embedded_node_ip, init_options)
    return RayConnection(ray.get_runtime_context().gcs_address, connected_here=True)


def _gcs_server_runs_here() -> bool:
    """Whether a Ray cluster's GCS runs on this machine.

    Asked before `ray.init(address="auto")`, which otherwise falls back to the address file of
    the last cluster started here: if that cluster is gone, it retries it for minutes.
    """
    return any(process.info["name"] == "gcs_server" for process in psutil.process_iter(["name"]))


def _start_embedded_ray(node_ip: str, init_options: dict[str, Any]) -> None:
    logger.info("starting a local Ray instance on %s", node_ip)
    # No dashboard: it would serve a second, unauthenticated jobs API beside ours.
    ray.init(
        address=EMBEDDED_RAY_ADDRESS,
        include_dashboard=False,
        _node_ip_address=node_ip,
        **init_options,
    )


def disconnect_from_ray(connection: RayConnection) -> None:
    """Leave the cluster (and stop the embedded one) if this process connected to it."""
    if connection.connected_here:
        ray.shutdown()


async def read_cluster_info(gcs_address: str) -> ClusterInfo:
    session_name = await GcsKv(gcs_address, _SESSION_KV_NAMESPACE).get(_SESSION_NAME_KEY)
    return ClusterInfo(
        ray_version=ray.__version__,
        ray_commit=ray.__commit__,
        session_name=session_name.decode() if session_name is not None else None,
    )


def ray_auth_token() -> str | None:
    """The cluster's own token (RAY_AUTH_TOKEN, its file, or ~/.ray/auth_token), if Ray has one."""
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

    header = AuthenticationTokenLoader.instance().get_token_for_http_header()
    value = str(dict(header).get("authorization", ""))
    return value.removeprefix("Bearer ").strip() or None
