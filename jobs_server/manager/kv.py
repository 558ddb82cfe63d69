"""Async access to Ray's GCS key-value store.

Ray exposes no public async KV API; its own job server uses the GCS client that `ray._raylet`
provides. This module is the only place that touches it, so a Ray upgrade changes one file.
"""

from __future__ import annotations

from ray._raylet import GcsClient  # type: ignore[attr-defined]

KV_TIMEOUT_S = 30.0


class GcsKv:
    """A key-value namespace in the GCS; `namespace=None` is Ray's default namespace."""

    def __init__(self, gcs_address: str, namespace: str | None) -> None:
        self._client = GcsClient(address=gcs_address)
        self._namespace = namespace.encode() if namespace is not None else None

    async def create(self, key: str, value: bytes) -> bool:
        """Store `value` under `key` unless the key exists; return whether it was stored."""
        added = await self._client.async_internal_kv_put(
            key.encode(), value, False, self._namespace, timeout=KV_TIMEOUT_S
        )
        return bool(added)

    async def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, replacing any value."""
        await self._client.async_internal_kv_put(
            key.encode(), value, True, self._namespace, timeout=KV_TIMEOUT_S
        )

    async def get(self, key: str) -> bytes | None:
        value: bytes | None = await self._client.async_internal_kv_get(
            key.encode(), self._namespace, timeout=KV_TIMEOUT_S
        )
        return value

    async def exists(self, key: str) -> bool:
        return bool(
            await self._client.async_internal_kv_exists(
                key.encode(), self._namespace, timeout=KV_TIMEOUT_S
            )
        )

    async def delete(self, key: str) -> None:
        await self._client.async_internal_kv_del(
            key.encode(), False, self._namespace, timeout=KV_TIMEOUT_S
        )

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        keys: list[bytes] = await self._client.async_internal_kv_keys(
            prefix.encode(), self._namespace, timeout=KV_TIMEOUT_S
        )
        return [key.decode() for key in keys]

    async def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The values of those `keys` that exist."""
        if not keys:
            return {}
        values: dict[bytes, bytes] = await self._client.async_internal_kv_multi_get(
            [key.encode() for key in keys], self._namespace, timeout=KV_TIMEOUT_S
        )
        return {key.decode(): value for key, value in values.items()}

    def pin_uri(self, uri: str, expiration_s: int) -> None:
        """Keep a runtime_env package from being garbage-collected for `expiration_s` (blocking)."""
        self._client.pin_runtime_env_uri(uri, expiration_s)
