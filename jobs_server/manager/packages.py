"""working_dir and py_modules packages, kept in the GCS where Ray's runtime env agent reads them."""

from __future__ import annotations

import asyncio
import re

from jobs_server.errors import InvalidRequestError, PackageNotFoundError, PayloadTooLargeError
from jobs_server.manager.kv import GcsKv

# Long enough for a job to be submitted after its package was found to exist.
PACKAGE_PIN_S = 600
_PACKAGE_PROTOCOLS = frozenset({"gcs"})
# The names Ray's client gives what it uploads: a directory's zip named by its content hash,
# or a wheel (py_modules) by its file name.
_PACKAGE_NAME = re.compile(
    r"^(_ray_pkg_[0-9a-f]{1,64}\.zip|[A-Za-z0-9][A-Za-z0-9_.+-]{0,200}\.whl)$"
)


def package_uri(protocol: str, name: str) -> str:
    """The runtime_env URI (`gcs://_ray_pkg_<hash>.zip`) that Ray's clients derive the path from."""
    if protocol not in _PACKAGE_PROTOCOLS:
        raise InvalidRequestError(f"Unsupported package protocol {protocol!r}; use 'gcs'.")
    if not _PACKAGE_NAME.match(name):
        raise InvalidRequestError(
            f"Invalid package name {name!r}: expected _ray_pkg_<hex>.zip or a wheel file name."
        )
    return f"{protocol}://{name}"


class PackageStore:
    """Checks and uploads packages; the KV key is the package URI, in Ray's default namespace."""

    def __init__(self, gcs_address: str, max_package_bytes: int) -> None:
        self._kv = GcsKv(gcs_address, namespace=None)
        self._max_package_bytes = max_package_bytes

    async def ensure_exists(self, uri: str) -> None:
        """Raise PackageNotFoundError unless the package exists; pin it so a job can use it."""
        if not await self._kv.exists(uri):
            raise PackageNotFoundError(uri)
        await asyncio.to_thread(self._kv.pin_uri, uri, PACKAGE_PIN_S)

    async def upload(self, uri: str, data: bytes) -> None:
        if len(data) > self._max_package_bytes:
            raise PayloadTooLargeError(
                f"Package is {len(data)} bytes; the limit is {self._max_package_bytes}."
            )
        if not data:
            raise InvalidRequestError("Package upload is empty.")
        await self._kv.put(uri, data)
        await asyncio.to_thread(self._kv.pin_uri, uri, PACKAGE_PIN_S)
