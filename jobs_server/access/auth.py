"""Who may call the API: the bearer token, where it comes from, and when a bind is safe."""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

from jobs_server.serving.request_origin import HostAllowList, ProxyTrust
from jobs_server.settings import Settings

# Ray's SDK sends its token in one of these (Ray's own `Authorization: Bearer`, or its own
# header when a proxy needs `Authorization` for itself).
TOKEN_HEADERS = ("Authorization", "X-Ray-Authorization")
BEARER_PREFIX = "bearer "


class TokenSourceError(Exception):
    """The configured token could not be read."""


def resolve_auth_token(settings: Settings) -> str | None:
    """The admin token from JOBS_SERVER_AUTH_TOKEN, else --auth-token-file, else Ray's own token
    when the cluster uses one (RAY_AUTH_MODE=token) and there is no tokens file; None: none.

    Every job under RAY_AUTH_MODE=token is handed Ray's token (its `ray.init()` needs it): where
    a tokens file says who may do what, Ray's token is a key only if the file lists its digest,
    and then it speaks for that entry (the key ring looks it up like any other key)."""
    if settings.auth_token is not None:
        token = settings.auth_token.get_secret_value().strip()
    elif settings.auth_token_file is not None:
        try:
            lines = settings.auth_token_file.read_text().splitlines()
        except OSError as error:
            raise TokenSourceError(f"cannot read --auth-token-file: {error}") from error
        token = lines[0].strip() if lines else ""
    elif settings.tokens_file is None and os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        from jobs_server.manager.cluster.ray_cluster import ray_auth_token

        token = ray_auth_token() or ""
        if not token:
            raise TokenSourceError("RAY_AUTH_MODE=token, but Ray has no token to share")
    else:
        return None
    if not token:
        raise TokenSourceError("the configured auth token is empty")
    return token


def token_from_headers(headers: Mapping[str, str]) -> str | None:
    """The token a request carries, with or without the `Bearer ` prefix."""
    for name in TOKEN_HEADERS:
        value = headers.get(name)
        if value:
            value = str(value).strip()
            if value.lower().startswith(BEARER_PREFIX):
                value = value[len(BEARER_PREFIX) :].strip()
            return value
    return None


def token_matches(given: str, expected: str) -> bool:
    """Compare in constant time, so the answer's timing reveals nothing of the token."""
    # aiohttp decodes header bytes that are not UTF-8 as surrogates: encode them back to the
    # bytes that were sent (they never match) instead of failing on them.
    return hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape")
    )


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


@dataclass(frozen=True)
class AccessPolicy:
    """What the middlewares enforce beyond keys (those are the `KeyRing`'s): the names a
    request may reach us by, the proxies believed about it, and the browser origins allowed
    to call cross-site."""

    cors_origins: frozenset[str]
    allowed_hosts: HostAllowList
    proxy_trust: ProxyTrust

    @classmethod
    def from_settings(cls, settings: Settings) -> AccessPolicy:
        return cls(
            cors_origins=frozenset(settings.cors_origins),
            allowed_hosts=HostAllowList.for_server(settings.host, settings.allowed_hosts),
            proxy_trust=ProxyTrust.from_setting(settings.forwarded_allow_ips),
        )
