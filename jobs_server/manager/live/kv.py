"""Async access to Ray's GCS key-value store.

Ray exposes no public async KV API; its own job server uses the GCS client that `ray._raylet`
provides. This module is the only place that touches it, so a Ray upgrade changes one file.
It is also the one place where the GCS being away (killed, restarting, its node gone) becomes
`ClusterUnavailableError`, which the HTTP layer answers with 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray._raylet import GcsClient  # type: ignore[attr-defined]
from ray.exceptions import GetTimeoutError, RaySystemError, RpcError

from jobs_server.errors import ClusterUnavailableError

logger = logging.getLogger(__name__)

# A request waits at most this long for one KV call. Ray's own default is 30 s, far longer than
# a client (or a load balancer) waits; a GCS that does not answer within this is away, and the
# request gets a 503 it can retry. Loaded clusters answer KV calls in milliseconds.
KV_TIMEOUT_S = 5.0
# A large value (an uploaded package, up to 100 MiB) gets longer, at this slowest expected rate.
KV_MIN_THROUGHPUT_BYTES_PER_S = 10 * 1024 * 1024
# A writer that must not lose its write (a supervisor recording how its job ended) retries for
# this long while the GCS is away: with GCS fault tolerance the GCS comes back within Ray's own
# reconnect timeout (60 s by default), after which Ray's processes give up anyway.
GCS_OUTAGE_RETRY_S = 120.0
_OUTAGE_RETRY_INTERVAL_S = 1.0

# What Ray's GCS client raises when the GCS does not answer: an RPC that failed or timed out.
GCS_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    RpcError,
    GetTimeoutError,
    RaySystemError,
    TimeoutError,
    ConnectionError,
)

# What a caller may try again: the GCS did not answer (this module's error, or Ray's own from a
# call that does not go through it: a named actor's lookup).
RETRYABLE_GCS_ERRORS: tuple[type[BaseException], ...] = (
    ClusterUnavailableError,
    *GCS_UNAVAILABLE_ERRORS,
)

_T = TypeVar("_T")


async def retried(
    what: str,
    call: Callable[[], Awaitable[_T]],
    *,
    attempts: int,
    initial_delay_s: float,
    max_delay_s: float = 10.0,
) -> _T:
    """`call()`, tried again while the GCS does not answer (after `initial_delay_s`, doubled
    after each further failure up to `max_delay_s`), at most `attempts` times in all. Each
    failure is logged with `what` was being done; the last one is raised, as is any other
    error at once."""
    delay_s = initial_delay_s
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except RETRYABLE_GCS_ERRORS as error:
            if attempt == attempts:
                logger.warning(
                    "%s failed %d times; giving up: %s", what, attempts, _first_line(error)
                )
                raise
            logger.warning(
                "%s failed (%s); trying again in %.1f s", what, _first_line(error), delay_s
            )
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, max_delay_s)
    raise ValueError(f"attempts must be at least 1, not {attempts}")


class GcsKv:
    """A key-value namespace in the GCS; `namespace=None` is Ray's default namespace.

    Every call fails with ClusterUnavailableError after `timeout_s` when the GCS does not
    answer; with `outage_retry_s`, it is tried again until that much time has passed.
    """

    def __init__(
        self,
        gcs_address: str,
        namespace: str | None,
        *,
        timeout_s: float = KV_TIMEOUT_S,
        outage_retry_s: float = 0.0,
    ) -> None:
        self._client = GcsClient(address=gcs_address)
        self._namespace = namespace.encode() if namespace is not None else None
        self._timeout_s = timeout_s
        self._outage_retry_s = outage_retry_s

    def _put_timeout_s(self, value: bytes) -> float:
        return self._timeout_s + len(value) / KV_MIN_THROUGHPUT_BYTES_PER_S

    async def _call(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """`call()`, with the GCS's failures mapped to ClusterUnavailableError (and retried
        for `outage_retry_s`)."""
        deadline = time.monotonic() + self._outage_retry_s
        while True:
            try:
                return await call()
            except GCS_UNAVAILABLE_ERRORS as error:
                if time.monotonic() >= deadline:
                    raise ClusterUnavailableError(
                        f"Ray's GCS did not answer ({what}): {_first_line(error)}"
                    ) from error
                logger.warning("Ray's GCS did not answer (%s); trying again", what)
                await asyncio.sleep(_OUTAGE_RETRY_INTERVAL_S)

    async def create(self, key: str, value: bytes) -> bool:
        """Store `value` under `key` unless the key exists; return whether it was stored."""
        added = await self._call(
            "create",
            lambda: self._client.async_internal_kv_put(
                key.encode(), value, False, self._namespace, timeout=self._put_timeout_s(value)
            ),
        )
        return bool(added)

    async def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, replacing any value."""
        await self._call(
            "put",
            lambda: self._client.async_internal_kv_put(
                key.encode(), value, True, self._namespace, timeout=self._put_timeout_s(value)
            ),
        )

    async def get(self, key: str) -> bytes | None:
        value: bytes | None = await self._call(
            "get",
            lambda: self._client.async_internal_kv_get(
                key.encode(), self._namespace, timeout=self._timeout_s
            ),
        )
        return value

    async def exists(self, key: str) -> bool:
        return bool(
            await self._call(
                "exists",
                lambda: self._client.async_internal_kv_exists(
                    key.encode(), self._namespace, timeout=self._timeout_s
                ),
            )
        )

    async def delete(self, key: str) -> None:
        await self._call(
            "delete",
            lambda: self._client.async_internal_kv_del(
                key.encode(), False, self._namespace, timeout=self._timeout_s
            ),
        )

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        keys: list[bytes] = await self._call(
            "keys",
            lambda: self._client.async_internal_kv_keys(
                prefix.encode(), self._namespace, timeout=self._timeout_s
            ),
        )
        return [key.decode() for key in keys]

    async def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The values of those `keys` that exist."""
        if not keys:
            return {}
        values: dict[bytes, bytes] = await self._call(
            "multi_get",
            lambda: self._client.async_internal_kv_multi_get(
                [key.encode() for key in keys], self._namespace, timeout=self._timeout_s
            ),
        )
        return {key.decode(): value for key, value in values.items()}

    def pin_uri(self, uri: str, expiration_s: int) -> None:
        """Keep a runtime_env package from being garbage-collected for `expiration_s` (blocking)."""
        try:
            self._client.pin_runtime_env_uri(uri, expiration_s)
        except GCS_UNAVAILABLE_ERRORS as error:
            raise ClusterUnavailableError(
                f"Ray's GCS did not answer (pin_uri): {_first_line(error)}"
            ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
