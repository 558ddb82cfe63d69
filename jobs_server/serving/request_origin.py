"""Where a request really comes from: the names it may reach us by, the proxies believed about it.

- DNS rebinding: a page on `evil.example` whose name the attacker rebinds to 127.0.0.1 talks to
  us as its own origin, so Origin and Host agree and say `evil.example`. The one thing it cannot
  choose is that name: a request's Host must be one this server answers to (`HostAllowList`).
  An address literal is always allowed: a page reached by address has no name to rebind, and a
  browser connects to exactly the address it names.
- Behind a TLS-terminating proxy the browser's origin is `https://<public name>`, which only the
  proxy knows; it says so in `X-Forwarded-Proto`/`-Host`/`-For`, which anyone could send. They are
  believed only from the peers named by `--forwarded-allow-ips` (`ProxyTrust`), as uvicorn and
  gunicorn do.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import yarl
from multidict import MultiMapping

from jobs_server.errors import InvalidForwardedHeaderError

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Names that can only mean this machine (a browser resolves `localhost` itself).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
# Bind addresses that name no host: every interface.
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
# `*` in --allowed-hosts or --forwarded-allow-ips: any.
ANY = "*"
# A Host header: a DNS name or an IPv4 address, or an IPv6 address in brackets; then a port.
_HOST_HEADER = re.compile(
    r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_.])?))"
    r"(?::[0-9]{1,5})?"
)
# What X-Forwarded-Proto may say, and what it means for the browser's origin.
_FORWARDED_SCHEMES = {"http": "http", "https": "https", "ws": "http", "wss": "https"}


def host_name(host: str) -> str | None:
    """The host part of a Host header, normalised (lower case, no trailing dot, IPv6 compressed
    in brackets); None when it is not a host."""
    match = _HOST_HEADER.fullmatch(host.strip())
    if match is None:
        return None
    if match["ipv6"] is not None:
        try:
            return f"[{ipaddress.IPv6Address(match['ipv6']).compressed}]"
        except ValueError:
            return None
    return match["name"].lower().rstrip(".")


def _is_address_literal(name: str) -> bool:
    if name.startswith("["):
        return True  # host_name checked it is an IPv6 address
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostAllowList:
    """The names a request's Host may give: loopback's, this machine's, the bind address and
    --allowed-hosts; any address literal; or anything at all with `*`."""

    names: frozenset[str]
    any_host: bool = False

    @classmethod
    def for_server(cls, bind_host: str, allowed_hosts: Iterable[str]) -> HostAllowList:
        """The allow-list of a server bound to `bind_host` (a name is one it answers to)."""
        allowed = list(allowed_hosts)
        names = {*LOOPBACK_NAMES, socket.gethostname(), *allowed}
        if bind_host not in WILDCARD_BINDS:
            names.add(f"[{bind_host}]" if ":" in bind_host else bind_host)
        normalised = {host_name(name) for name in names}
        return cls(frozenset(name for name in normalised if name), any_host=ANY in allowed)

    def allows(self, host: str) -> bool:
        name = host_name(host)
        if name is None:
            return False
        return self.any_host or _is_address_literal(name) or name in self.names


@dataclass(frozen=True)
class Forwarded:
    """What a trusted proxy says of the browser's request (None: it did not say)."""

    scheme: str | None
    host: str | None
    remote: str | None


@dataclass(frozen=True)
class ProxyTrust:
    """The peers whose X-Forwarded-* headers are believed (--forwarded-allow-ips)."""

    networks: tuple[IPNetwork, ...] = ()
    any_peer: bool = False

    @classmethod
    def from_setting(cls, allow_ips: Iterable[str]) -> ProxyTrust:
        allowed = list(allow_ips)
        return cls(
            tuple(ipaddress.ip_network(ip, strict=False) for ip in allowed if ip != ANY),
            any_peer=ANY in allowed,
        )

    def trusts(self, address: str | None) -> bool:
        if self.any_peer:
            return True
        if not address or not self.networks:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False  # a unix socket's peer has no address
        return any(ip in network for network in self.networks)

    def forwarded(self, peer: str | None, headers: MultiMapping[str]) -> Forwarded | None:
        """What the proxy at `peer` says of the request, or None when it is not trusted.
        Each header's last value is the one this proxy wrote (it appends to earlier hops)."""
        if not self.trusts(peer):
            return None
        proto = _last_value(headers, "X-Forwarded-Proto")
        scheme = None
        if proto is not None:
            scheme = _FORWARDED_SCHEMES.get(proto.lower())
            if scheme is None:
                raise InvalidForwardedHeaderError(f"X-Forwarded-Proto {proto!r} is not a scheme.")
        host = _last_value(headers, "X-Forwarded-Host")
        if host is not None and host_name(host) is None:
            raise InvalidForwardedHeaderError(f"X-Forwarded-Host {host!r} is not a host.")
        return Forwarded(scheme=scheme, host=host, remote=self._client_address(headers))

    def _client_address(self, headers: MultiMapping[str]) -> str | None:
        """The nearest address in X-Forwarded-For that is not a trusted proxy's."""
        hops = _values(headers, "X-Forwarded-For")
        for hop in reversed(hops):
            try:
                address = str(ipaddress.ip_address(hop.strip("[]")))
            except ValueError as error:
                raise InvalidForwardedHeaderError(
                    f"X-Forwarded-For {hop!r} is not an address."
                ) from error
            if not self.trusts(address):
                return address
        return hops[0] if hops else None


def _values(headers: MultiMapping[str], name: str) -> list[str]:
    return [
        value.strip()
        for line in headers.getall(name, [])
        for value in line.split(",")
        if value.strip()
    ]


def _last_value(headers: MultiMapping[str], name: str) -> str | None:
    values = _values(headers, name)
    return values[-1] if values else None


def origin_of(scheme: str, host: str) -> tuple[str, str, int | None] | None:
    """A browser origin's parts (scheme, host, port with the scheme's default); None when
    `scheme://host` is not an origin (`null`, garbage)."""
    try:
        url = yarl.URL(f"{scheme}://{host}")
    except ValueError:
        return None
    if url.host is None or not url.is_absolute():
        return None
    return url.scheme.lower(), url.host.lower().rstrip("."), url.port


def parse_origin(origin: str) -> tuple[str, str, int | None] | None:
    """The parts of an Origin header (`scheme://host[:port]`)."""
    scheme, separator, host = origin.partition("://")
    if not separator:
        return None
    return origin_of(scheme, host)
