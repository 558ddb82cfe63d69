"""The HTTP client of the webhook sender: every name resolved at each send, refused if any of
its addresses is refused, and connected to only the addresses checked (the connector connects
to what its resolver answers: a second DNS answer cannot slip in between); no redirect is ever
followed (the sender asks for none), no proxy from the environment, no cookies kept."""

from __future__ import annotations

import ipaddress
import socket

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from jobs_server.webhooks.targets import TargetPolicy


class RefusedTargetError(OSError):
    """A target's name resolves to an address the policy refuses (an OSError, so aiohttp
    reports it as a connection that could not be made)."""


class CheckedResolver(AbstractResolver):
    """A resolver that answers only addresses the policy allows, and refuses a name if any of
    its addresses is refused (a name that also points inside is not sent to at all)."""

    def __init__(self, policy: TargetPolicy, inner: AbstractResolver | None = None) -> None:
        self._policy = policy
        self._inner = inner or DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        for result in results:
            problem = self._policy.address_problem(ipaddress.ip_address(result["host"]))
            if problem is not None:
                raise RefusedTargetError(f"refused: {host} resolves to {problem}")
        return results

    async def close(self) -> None:
        await self._inner.close()


def webhook_session(policy: TargetPolicy, *, max_in_flight: int) -> aiohttp.ClientSession:
    """The sender's client (made on the running loop; its owner closes it)."""
    connector = aiohttp.TCPConnector(
        resolver=CheckedResolver(policy),
        # Every send resolves again and checks what it gets.
        use_dns_cache=False,
        limit=max_in_flight,
    )
    return aiohttp.ClientSession(
        connector=connector,
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        headers={"User-Agent": "jobs-server-webhooks"},
        auto_decompress=False,
    )
