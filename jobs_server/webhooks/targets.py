"""Where a webhook may go: `https://` only (unless --webhook-allow-http), no credentials in the
URL, and never to a loopback, link-local, private, unspecified, multicast or reserved address
(unless --webhook-allow-private). A URL is checked at submit and at load of the tokens file
(its syntax, scheme, literal addresses and `localhost`); its name's addresses are checked at
every send, after resolution (transport.py), so a DNS answer cannot send a delivery inside."""

from __future__ import annotations

import ipaddress
import string
from dataclasses import dataclass

from yarl import URL

from jobs_server.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Names that always mean this host (RFC 6761), whatever a resolver says.
_LOCAL_NAMES = ("localhost", "localhost.localdomain")
# A host of only these is meant as a number: the legacy forms (127.1, 2130706433, 0x7f.1) that
# the C library maps onto an address are refused rather than read as a name.
_NUMERIC_HOST_CHARS = frozenset(string.hexdigits + ".xX")


@dataclass(frozen=True)
class TargetPolicy:
    """The server's rules on webhook targets."""

    allow_http: bool = False
    allow_private: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> TargetPolicy:
        return cls(
            allow_http=settings.webhook_allow_http, allow_private=settings.webhook_allow_private
        )

    def url_problem(self, url: str) -> str | None:
        """Why `url` is refused before any name is resolved (None: it may be tried)."""
        try:
            parsed = URL(url)
        except (ValueError, TypeError) as error:
            return f"not a valid URL ({error})"
        schemes = ("https", "http") if self.allow_http else ("https",)
        if parsed.scheme not in schemes:
            allowed = "https:// or http://" if self.allow_http else "https:// (http:// only"
            allowed += "" if self.allow_http else " with --webhook-allow-http)"
            return f"expected an absolute {allowed} URL"
        if not parsed.host:
            return "expected a host name or address"
        if parsed.user is not None or parsed.password is not None:
            return "credentials in the URL are not allowed (sign with the webhook secret)"
        if parsed.fragment:
            return "a fragment (#...) is not sent, and not allowed"
        return self.host_problem(parsed.host)

    def host_problem(self, host: str) -> str | None:
        """Why a URL's host is refused as written (a literal address, a local name)."""
        host = host.rstrip(".").lower()
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            if set(host) <= _NUMERIC_HOST_CHARS and host[:1].isdigit():
                return f"{host!r} is not a canonical IP address"
            if self.allow_private:
                return None
            if host in _LOCAL_NAMES or host.endswith(".localhost"):
                return f"{host!r} is this host (loopback; allowed by --webhook-allow-private)"
            return None
        return self.address_problem(address)

    def address_problem(self, address: IPAddress) -> str | None:
        """Why a target's address is refused (None: a public address, or private ones allowed)."""
        if self.allow_private:
            return None
        kind = address_kind(address)
        if kind is None:
            return None
        article = "an" if kind[0] in "aeiou" else "a"
        # An IPv4-mapped address prints in hex (::ffff:6440:1): name the IPv4 it was judged as.
        mapped = getattr(address, "ipv4_mapped", None)
        named = f"{address} ({mapped})" if mapped is not None else str(address)
        return f"{named} is {article} {kind} address (allowed by --webhook-allow-private)"


def address_kind(address: IPAddress) -> str | None:
    """What makes `address` internal (None: a global address, to which webhooks may go)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for kind, test in (
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("unspecified", address.is_unspecified),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
    ):
        if test:
            return kind
    # Shared (100.64/10), documentation and the like: not anyone's public address.
    return None if address.is_global else "non-global"
