"""The keys the server accepts, as one ring: the tokens file's keys (re-read on SIGHUP) and the
single admin key of JOBS_SERVER_AUTH_TOKEN / --auth-token-file / Ray's token (Ray's only
without a tokens file: beside one, it is a key only where the file lists its digest).

The middleware asks it who a key speaks for (`principal_for`); the queue asks it for a tenant's
caps (`limits_for`); the webhooks for a tenant's endpoints and secrets (`webhooks_for`). With
no key configured at all, every caller is `ANONYMOUS_ADMIN`.

A key is checked once per request, but a stream can last for hours: each open stream holds its
key (`hold`), and a reload that takes the key away (removes it, moves it to another tenant, or
takes away an admin's view of every tenant) revokes the hold, which ends the stream. The single
admin key is read once at the start and is never revoked by a reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from aiohttp import web

from jobs_server.access.auth import token_matches
from jobs_server.access.key_digest import digest_of
from jobs_server.access.tokens import TokensFile, load_tokens_file
from jobs_server.manager.tenancy import DEFAULT_TENANT, Principal, Role, TenantLimits
from jobs_server.manager.webhook_events import TenantWebhooks
from jobs_server.webhooks.targets import TargetPolicy

logger = logging.getLogger(__name__)

# How the single admin key (JOBS_SERVER_AUTH_TOKEN and friends) is named in audit lines.
ADMIN_TOKEN_KEY_NAME = "auth-token"
ADMIN_TOKEN_PRINCIPAL = Principal(
    tenant=DEFAULT_TENANT, role=Role.ADMIN, key_name=ADMIN_TOKEN_KEY_NAME
)
_NO_KEYS = TokensFile(principals={}, limits={})


class KeyHold:
    """An open stream's hold on the key it was opened with, and who the key spoke for then.
    `revoked` says why the key may no longer read what the stream shows (None: it still may);
    `on_revoke` is called once, on the event loop, when it is revoked."""

    def __init__(self, key: str, principal: Principal) -> None:
        self.key = key
        self.principal = principal
        self.revoked: str | None = None
        self.on_revoke: Callable[[], None] | None = None

    def revoke(self, reason: str) -> None:
        if self.revoked is not None:
            return
        self.revoked = reason
        if self.on_revoke is not None:
            self.on_revoke()


def lost_access(before: Principal, now: Principal | None) -> str | None:
    """Why a stream opened as `before` must end now that its key speaks for `now` (None: it
    may go on). A role that still reads what it read before keeps it: another role of the same
    tenant, unless an admin (who read every tenant) is one no more."""
    if now is None:
        return "the key was revoked"
    if now.tenant != before.tenant:
        return "the key was moved to another tenant"
    if before.tenant_scope is None and now.tenant_scope is not None:
        return "the key is no longer an admin's"
    return None


class KeyRing:
    """Every key the server accepts now. `reload()` swaps in the tokens file as it is on disk,
    or keeps the keys it has when the file is not valid."""

    def __init__(
        self,
        *,
        admin_token: str | None,
        tokens_file: Path | None,
        target_policy: TargetPolicy | None = None,
    ) -> None:
        """Reads the tokens file, if there is one: TokensFileError if it is not valid (its
        webhooks' URLs checked by `target_policy`, by default https:// to public addresses)."""
        self._admin_token = admin_token
        self.tokens_file = tokens_file
        self._target_policy = target_policy or TargetPolicy()
        self._keys = _NO_KEYS if tokens_file is None else self._load(tokens_file)
        self._reload_listeners: list[Callable[[], None]] = []
        self._holds: set[KeyHold] = set()

    def add_reload_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on the event loop) after each reload that took: the queue hands
        over what tenants' new caps allow."""
        self._reload_listeners.append(listener)

    @contextlib.contextmanager
    def hold(self, hold: KeyHold) -> Iterator[KeyHold]:
        """Keep `hold` for the block: the reloads meanwhile revoke it if they take its key
        away. Checked at once too: a reload between the request's check and now counts."""
        self._revoke_if_lost(hold)
        self._holds.add(hold)
        try:
            yield hold
        finally:
            self._holds.discard(hold)

    def _revoke_if_lost(self, hold: KeyHold) -> None:
        reason = lost_access(hold.principal, self.principal_for(hold.key))
        if reason is not None:
            logger.info("ending a stream of the key %s: %s", hold.principal.key_name or "?", reason)
            hold.revoke(reason)

    def _reloaded(self, reload: asyncio.Task[bool]) -> None:
        if reload.cancelled() or reload.exception() is not None or not reload.result():
            return
        # Streams first: every reload is an event for the streams open now (one digest each).
        for hold in list(self._holds):
            self._revoke_if_lost(hold)
        for listener in self._reload_listeners:
            try:
                listener()
            except Exception:
                logger.exception("a listener of the tokens file's reload failed")

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

    def webhooks_for(self, tenant: str) -> TenantWebhooks:
        """The tenant's webhooks in the tokens file as it is now. Reads memory only (one
        attribute, swapped whole by a reload): the archive's writing thread calls it."""
        return self._keys.webhooks_for(tenant)

    def _load(self, tokens_file: Path) -> TokensFile:
        return load_tokens_file(tokens_file, target_policy=self._target_policy)

    @property
    def tenants(self) -> frozenset[str]:
        """The tenants the keys name, and the default tenant."""
        return self._keys.tenants | {DEFAULT_TENANT}

    def reload(self) -> bool:
        """Read the tokens file again; on an error keep the keys there are (and log why)."""
        if self.tokens_file is None:
            return False
        try:
            keys = self._load(self.tokens_file)
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
            task.add_done_callback(ring._reloaded)

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
