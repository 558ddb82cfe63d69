"""working_dir and py_modules packages, kept in the GCS where Ray's runtime env agent reads them.

A package lives in the GCS KV store under its URI, in Ray's default namespace, exactly where
Ray's own job server puts it, so Ray's agent on any node finds it. Ray garbage-collects it once
no job uses it and its pin (PACKAGE_PIN_S) has run out; until then every job reuses it.
"""

from __future__ import annotations

import asyncio
import io
import re
import zipfile

from jobs_server.errors import (
    InvalidPackageError,
    InvalidRequestError,
    PackageNotFoundError,
    PayloadTooLargeError,
)
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


class PackageLookup:
    """Finds uploaded packages; what a job's submit needs."""

    def __init__(self, gcs_address: str) -> None:
        self._kv = GcsKv(gcs_address, namespace=None)

    async def ensure_exists(self, uri: str) -> None:
        """Raise PackageNotFoundError unless the package exists; pin it so a job can use it."""
        if not await self._kv.exists(uri):
            raise PackageNotFoundError(uri)
        await asyncio.to_thread(self._kv.pin_uri, uri, PACKAGE_PIN_S)


class PackageStore(PackageLookup):
    """Checks and uploads packages; the KV key is the package URI."""

    def __init__(self, gcs_address: str, max_package_bytes: int) -> None:
        super().__init__(gcs_address)
        self._max_package_bytes = max_package_bytes

    async def upload(self, uri: str, data: bytes) -> None:
        """Store a whole, checked package in one write: a rejected one leaves nothing behind."""
        if len(data) > self._max_package_bytes:
            raise PayloadTooLargeError(
                f"Package is {len(data)} bytes; the limit is {self._max_package_bytes}."
            )
        if data:
            # Ray's client uploads a 0-byte file (a wheel, a zip) as it is, and Ray's server
            # stores it: so do we; Ray's agent reports what it cannot install, as under Ray.
            await asyncio.to_thread(_check_is_zip, uri, data)
        await self._kv.put(uri, data)
        await asyncio.to_thread(self._kv.pin_uri, uri, PACKAGE_PIN_S)


def _check_is_zip(uri: str, data: bytes) -> None:
    """Raise InvalidPackageError unless `data` (not empty) is a zip archive (a wheel is one too).

    Reading the central directory, at the end, also catches an archive cut short; Ray's agent
    would otherwise fail every job that uses it with BadZipFile.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as error:
        raise InvalidPackageError(
            f"Package {uri} is not a zip archive ({error}); Ray's agent could not unpack it."
        ) from error
