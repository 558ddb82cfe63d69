"""working_dir and py_modules packages, kept in the GCS where Ray's runtime env agent reads them.

A package lives in the GCS KV store in Ray's default namespace, where Ray's agent on any node
finds it, under its tenant's name for it (`tenant_package_name`): a tenant sees, uses and
uploads its own packages only, and another tenant's upload of the same name is a package of
that tenant's. A package never changes: the first upload of a name takes it (the GCS's
put-if-absent decides between two at once), the same bytes again are accepted, other bytes
are refused. Ray garbage-collects a package once no job uses it and its pin (PACKAGE_PIN_S)
has run out; until then every job of its tenant reuses it.
"""

from __future__ import annotations

import asyncio
import io
import zipfile

from jobs_server.errors import (
    ClusterUnavailableError,
    InvalidPackageError,
    InvalidRequestError,
    PackageExistsError,
    PackageNotFoundError,
    PayloadTooLargeError,
)
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.runtime_envs import GCS_SCHEME, is_package_name, tenant_package_uri

# Long enough for a job to be submitted after its package was found to exist.
PACKAGE_PIN_S = 600
# An upload that finds its name taken reads what is there; if Ray has just garbage-collected
# it, the name is free again and the upload tries to take it once more, this many times.
_UPLOAD_ATTEMPTS = 3


def package_uri(protocol: str, name: str) -> str:
    """The runtime_env URI (`gcs://_ray_pkg_<hash>.zip`) that Ray's clients derive the path from."""
    if protocol != GCS_SCHEME:
        raise InvalidRequestError(f"Unsupported package protocol {protocol!r}; use 'gcs'.")
    if not is_package_name(name):
        raise InvalidRequestError(
            f"Invalid package name {name!r}: expected _ray_pkg_<hex>.zip or a wheel file name"
            " (<name>-<version>[-<build>]-<python>-<abi>-<platform>.whl)."
        )
    return f"{protocol}://{name}"


class PackageLookup:
    """Finds uploaded packages; what a job's submit needs."""

    def __init__(self, gcs_address: str) -> None:
        self._kv = GcsKv(gcs_address, namespace=None)

    async def ensure_exists(self, uri: str, *, tenant: str) -> None:
        """Raise PackageNotFoundError unless `tenant` uploaded the package (another tenant's
        upload of it is not found); pin it so a job can use it."""
        stored_uri = tenant_package_uri(uri, tenant)
        if not await self._kv.exists(stored_uri):
            raise PackageNotFoundError(uri)
        await asyncio.to_thread(self._kv.pin_uri, stored_uri, PACKAGE_PIN_S)


class PackageStore(PackageLookup):
    """Checks and uploads packages, each tenant's under its own name."""

    def __init__(self, gcs_address: str, max_package_bytes: int) -> None:
        super().__init__(gcs_address)
        self._max_package_bytes = max_package_bytes

    async def upload(self, uri: str, data: bytes, *, tenant: str) -> None:
        """Store a whole, checked package in one write, unless `tenant` has it already: the
        same bytes are accepted, other bytes are PackageExistsError. A rejected upload leaves
        nothing behind and changes nothing."""
        if len(data) > self._max_package_bytes:
            raise PayloadTooLargeError(
                f"Package is {len(data)} bytes; the limit is {self._max_package_bytes}."
            )
        if data:
            # Ray's client uploads a 0-byte file (a wheel, a zip) as it is, and Ray's server
            # stores it: so do we; Ray's agent reports what it cannot install, as under Ray.
            await asyncio.to_thread(_check_is_zip, uri, data)
        stored_uri = tenant_package_uri(uri, tenant)
        for _ in range(_UPLOAD_ATTEMPTS):
            # Put-if-absent: of two uploads at once, exactly one takes the name.
            if await self._kv.create(stored_uri, data):
                break
            # Read back only when the name is taken (Ray's client uploads only what it did
            # not find): at most one stored package per upload in flight is held with it.
            stored = await self._kv.get(stored_uri)
            if stored is not None:
                if stored != data:
                    raise PackageExistsError(uri)
                break
        else:
            raise ClusterUnavailableError(
                f"Package {uri} was taken and collected {_UPLOAD_ATTEMPTS} times during the"
                " upload; try again."
            )
        await asyncio.to_thread(self._kv.pin_uri, stored_uri, PACKAGE_PIN_S)


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
