"""The keys the server accepts, as one ring: the tokens file's keys (re-read on SIGHUP) and the
single admin key of JOBS_SERVER_AUTH_TOKEN / --auth-token-file / Ray's token.

The middleware asks it who a key speaks for (`principal_for`); the queue asks it for a tenant's
caps (`limits_for`). With no key configured at all, every caller is `ANONYMOUS_ADMIN`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from jobs_server.auth import token_matches
from jobs_server.key_digest import digest_of
from jobs_server.manager.tenancy import DEFAULT_TENANT, Principal, Role, TenantLimits
from jobs_server.tokens import TokensFile, load_tokens_file

logger = logging.getLogger(__name__)

# How the single admin key (JOBS_SERVER_AUTH_TOKEN and friends) is named in audit lines.
ADMIN_TOKEN_KEY_NAME = "auth-token"
ADMIN_TOKEN_PRINCIPAL = Principal(
    tenant=DEFAULT_TENANT, role=Role.ADMIN, key_name=ADMIN_TOKEN_KEY_NAME
)
_NO_KEYS = TokensFile(principals={}, limits={})


class KeyRing:
    """Every key the server accepts now. `reload()` swaps in the tokens file as it is on disk,
    or keeps the keys it has when the file is not valid."""

    def __init__(self, *, admin_token: str | None, tokens_file: Path | None) -> None:
        """Reads the tokens file, if there is one: TokensFileError if it is not valid."""
        self._admin_token = admin_token
        self.tokens_file = tokens_file
        self._keys = _NO_KEYS if tokens_file is None else load_tokens_file(tokens_file)

    @property
    def requires_key(self) -> bool:
        """Whether a caller must present a key (False: no authentication, all are admins)."""
        return self._admin_token is not None or self.tokens_file is not None

    def principal_for(self, key: str) -> Principal | None:
        """Who `key` speaks for; None for a key the server does not know."""
        if self._admin_token is not None and token_matches(key, self._admin_token):
            return ADMIN_TOKEN_PRINCIPAL
        # A lookup by digest: its timing can tell at most something of a digest, and a digest
        # of a random key tells nothing of the key.
        return self._keys.principals.get(digest_of(key))

    def limits_for(self, tenant: str) -> TenantLimits:
        """The tenant's caps from the tokens file as it is now (no caps of its own: NO_LIMITS)."""
        return self._keys.limits_for(tenant)

    @property
    def tenants(self) -> frozenset[str]:
        """The tenants the keys name, and the default tenant."""
        return self._keys.tenants | {DEFAULT_TENANT}

    def reload(self) -> bool:
        """Read the tokens file again; on an error keep the keys there are (and log why)."""
        if self.tokens_file is None:
            return False
        try:
            keys = load_tokens_file(self.tokens_file)
        except Exception as error:
            logger.error("keeping the previous keys: %s", error)
            return False
        self._keys = keys
        logger.info(
            "reloaded %s: %d keys, %d tenants with caps",
            self.tokens_file,
            len(keys.principals),
            len(keys.limits),
        )
        return True


def reload_keys_on_sighup(
    key: web.AppKey[KeyRing],
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context: while the app serves, SIGHUP re-reads the tokens file (in a thread),
    so a key is revoked without a restart."""

    async def reload_on_sighup(app: web.Application) -> AsyncIterator[None]:
        ring = app[key]
        if ring.tokens_file is None:
            yield
            return
        loop = asyncio.get_running_loop()
        reloads: set[asyncio.Task[bool]] = set()

        def on_sighup() -> None:
            task = loop.create_task(asyncio.to_thread(ring.reload), name="reload-tokens")
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        try:
            loop.add_signal_handler(signal.SIGHUP, on_sighup)
        except (RuntimeError, ValueError):  # not the main thread (an embedding's own loop)
            logger.warning("SIGHUP cannot reload %s in this thread", ring.tokens_file)
            yield
            return
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
            for task in list(reloads):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    return reload_on_sighup
