"""This server's address in the GCS, where Ray's clients look for the cluster's job server.

`ray job submit` without `--address` (or with the cluster's GCS address) and
`JobSubmissionClient("auto")` read the dashboard's `host:port` from the GCS KV store (key
`dashboard`, namespace `dashboard`), where Ray's dashboard writes it when it starts. With Ray's
dashboard off, nothing is there and they fail; so this server writes its own address there, and
removes it when it stops if it is still its own. It never takes the key from a server that
answers at the address there (Ray's dashboard, most likely); an address nobody answers at is
left over from a server that is gone, and is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket

import ray

from jobs_server.manager.live.kv import GcsKv

logger = logging.getLogger(__name__)

# ray._private.ray_constants.DASHBOARD_ADDRESS and KV_NAMESPACE_DASHBOARD.
DASHBOARD_ADDRESS_KEY = "dashboard"
DASHBOARD_KV_NAMESPACE = "dashboard"
# How long a connection to the registered address may take before it counts as nobody there.
LIVENESS_CONNECT_TIMEOUT_S = 1.0
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def registration_address(host: str, port: int) -> str:
    """`host:port` as Ray's clients expect it (they prepend `http://`): a wildcard bind is
    reached at the node's IP address, as Ray's dashboard registers itself."""
    if host in _WILDCARD_HOSTS:
        host = ray.util.get_node_ip_address()
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    return f"{host}:{port}"


class DashboardRegistration:
    """This server's address under Ray's dashboard key, while it runs."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._kv = GcsKv(ray.get_runtime_context().gcs_address, DASHBOARD_KV_NAMESPACE)
        self._registered = False

    async def register(self) -> bool:
        """Write our address unless a live server holds the key; return whether we did."""
        current = await self._kv.get(DASHBOARD_ADDRESS_KEY)
        if current is not None and current.decode() != self._address:
            holder = current.decode()
            if await asyncio.to_thread(_answers, holder):
                logger.info(
                    "not registering %s as the cluster's job server: %s (Ray's dashboard, or "
                    "another server) is registered and answers; `ray job` without --address "
                    "reaches it, not this server",
                    self._address,
                    holder,
                )
                return False
            logger.info("replacing the registration of %s, where nothing answers", holder)
        await self._kv.put(DASHBOARD_ADDRESS_KEY, self._address.encode())
        self._registered = True
        logger.info(
            "registered %s in the GCS as the cluster's job server (Ray's dashboard address)",
            self._address,
        )
        return True

    async def unregister(self) -> None:
        """Remove our address, if it is still ours (Ray's dashboard may have started since)."""
        if not self._registered:
            return
        self._registered = False
        current = await self._kv.get(DASHBOARD_ADDRESS_KEY)
        if current is not None and current.decode() == self._address:
            await self._kv.delete(DASHBOARD_ADDRESS_KEY)
            logger.info("removed the registration of %s from the GCS", self._address)


def _answers(address: str) -> bool:
    """Whether something accepts connections at `host:port` (blocking)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection(
            (host.strip("[]"), int(port)), timeout=LIVENESS_CONNECT_TIMEOUT_S
        ):
            return True
    except (OSError, ValueError):
        return False
