"""Submit-time checks of a runtime env and its code packages: `working_dir` and `py_modules`.

What Ray would only find out on a node, minutes later or never (a path that exists only on the
server, a package that was never uploaded), is a 400 here that names the field.

An uploaded package (`gcs://<name>`) is its tenant's: each tenant's upload of a name is stored
under a name of its own (`tenant_package_name`), which the runtime env given to Ray names
(`runtime_env_for_ray`); the job's record keeps the name its client gave. So no tenant's upload
reaches another tenant's jobs, nor another tenant's unpacked copy on a node (Ray's agent keeps
a package's files under its name).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ray.runtime_env import RuntimeEnv

from jobs_server.errors import InvalidRuntimeEnvError, PackageNotFoundError

if TYPE_CHECKING:  # not at run time: the supervisor imports this module, and needs no GCS KV
    from jobs_server.manager.packages import PackageLookup

# Where Ray's runtime-env agent reads a package uploaded through /api/packages.
GCS_SCHEME = "gcs"
GCS_PREFIX = f"{GCS_SCHEME}://"
# The names Ray's client gives what it uploads: a directory's zip named by its content hash,
# or a wheel (py_modules) by its file name (PEP 427: pip reads name, version and tags from it).
_ZIP_NAME = re.compile(r"^(_ray_pkg_[0-9a-f]{1,64})\.zip$")
_WHEEL_NAME = re.compile(
    r"^(?=.{1,201}\.whl$)"
    r"(?P<distribution>[A-Za-z0-9_.]+)-(?P<version>[A-Za-z0-9_.!+]+)"
    r"(?:-(?P<build>[0-9][A-Za-z0-9_.]*))?"
    r"-(?P<tags>[A-Za-z0-9_.]+-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+)\.whl$"
)
# A tenant's mark in its packages' stored names: 96 bits of its name's SHA-256, so that two
# tenants' names never meet, and a wheel's name stays within a file name's 255 bytes.
_TENANT_MARK_HEX_CHARS = 24


def is_package_name(name: str) -> bool:
    """Whether `name` is one Ray's client gives an upload: `_ray_pkg_<hex>.zip` or a wheel's."""
    return bool(_ZIP_NAME.match(name) or _WHEEL_NAME.match(name))


def tenant_package_name(tenant: str, name: str) -> str:
    """The name `tenant`'s upload of the package `name` is stored (and fetched by Ray) under.

    Distinct for distinct (tenant, name) pairs, and never a name a client can upload, so no
    client's upload lands on another tenant's package. A zip's gets the tenant's mark after
    its hash; a wheel's gets it as its build tag (the one part of a wheel's name pip does not
    check against its metadata; a build tag of its own is kept in front of the mark).
    """
    mark = hashlib.sha256(tenant.encode()).hexdigest()[:_TENANT_MARK_HEX_CHARS]
    zip_name = _ZIP_NAME.match(name)
    if zip_name:
        return f"{zip_name[1]}_{mark}.zip"
    wheel = _WHEEL_NAME.match(name)
    if wheel:
        # A build tag starts with a digit: "1" in front keeps that, with or without one.
        build = f"1{wheel['build'] or ''}_{mark}"
        return f"{wheel['distribution']}-{wheel['version']}-{build}-{wheel['tags']}.whl"
    raise ValueError(f"not a package name: {name!r}")


@dataclass(frozen=True)
class PackageRef:
    """One code package a runtime env names: `field` is e.g. `py_modules[1]`."""

    field: str
    uri: str

    @property
    def is_uploaded(self) -> bool:
        return urlparse(self.uri).scheme == GCS_SCHEME


async def validate_runtime_env(
    runtime_env: dict[str, Any], packages: PackageLookup, *, tenant: str
) -> None:
    """A 400 for what Ray would reject, and for code packages no node could fetch, or that
    `tenant` did not upload."""
    if not runtime_env:
        return  # most jobs: nothing to check, and Ray's own check costs a share of a submit
    refs = package_refs(runtime_env)
    try:
        RuntimeEnv(**runtime_env)
    except Exception as error:  # Ray raises ValueError, TypeError or its own errors
        raise InvalidRuntimeEnvError(f"Invalid runtime_env: {error}") from error
    for ref in refs:
        if ref.is_uploaded:
            try:
                await packages.ensure_exists(ref.uri, tenant=tenant)
            except PackageNotFoundError:
                raise InvalidRuntimeEnvError(
                    f"runtime_env.{ref.field}: package {ref.uri} was never uploaded to this "
                    "cluster with a key of this tenant, or has expired (Ray's clients upload "
                    "a local directory first)."
                ) from None


def runtime_env_for_ray(runtime_env: dict[str, Any], tenant: str) -> dict[str, Any]:
    """`runtime_env` as Ray is given it: each uploaded package names `tenant`'s copy."""
    if not runtime_env.get("working_dir") and not runtime_env.get("py_modules"):
        return runtime_env
    for_ray = dict(runtime_env)
    if isinstance(for_ray.get("working_dir"), str):
        for_ray["working_dir"] = _tenant_uri(for_ray["working_dir"], tenant)
    if isinstance(for_ray.get("py_modules"), list):
        for_ray["py_modules"] = [
            _tenant_uri(module, tenant) if isinstance(module, str) else module
            for module in for_ray["py_modules"]
        ]
    return for_ray


def tenant_package_uri(uri: str, tenant: str) -> str:
    """The URI of `tenant`'s copy of the uploaded package `uri` (`gcs://<name>`)."""
    name = uri.removeprefix(GCS_PREFIX)
    if not uri.startswith(GCS_PREFIX) or not is_package_name(name):
        # Never a package of the tenant's: nothing to find under it (a 400 at the submit).
        raise PackageNotFoundError(uri)
    return GCS_PREFIX + tenant_package_name(tenant, name)


def _tenant_uri(uri: str, tenant: str) -> str:
    if urlparse(uri).scheme != GCS_SCHEME:
        return uri
    try:
        return tenant_package_uri(uri, tenant)
    except PackageNotFoundError:
        # Refused at the submit; a record of an older server names what it named.
        return uri


def package_refs(runtime_env: dict[str, Any]) -> list[PackageRef]:
    """The runtime env's packages, each a URI Ray can fetch on any node, else a 400 naming it."""
    refs = []
    if runtime_env.get("working_dir") is not None:
        refs.append(_checked_ref("working_dir", runtime_env["working_dir"], "working_dir"))
    py_modules = runtime_env.get("py_modules")
    if py_modules is not None:
        if not isinstance(py_modules, list):
            raise InvalidRuntimeEnvError(
                f"runtime_env.py_modules: must be a list of URIs, got {type(py_modules).__name__}."
            )
        refs += [
            _checked_ref(f"py_modules[{index}]", module, "py_modules")
            for index, module in enumerate(py_modules)
        ]
    return refs


def _checked_ref(field: str, value: object, ray_field: str) -> PackageRef:
    if not isinstance(value, str):
        raise InvalidRuntimeEnvError(
            f"runtime_env.{field}: must be a URI string, got {type(value).__name__}."
        )
    if not urlparse(value).scheme:
        # Ray's own validation accepts a path that happens to exist here, and Ray would then
        # upload the server's own directory: never what a remote client meant.
        raise InvalidRuntimeEnvError(
            f"runtime_env.{field}: {value!r} is a local path; the server does not read its own "
            "files. Give a URI every node can fetch (https://..., s3://..., or gcs://... as "
            "uploaded by Ray's JobSubmissionClient and `ray job submit`, which upload a local "
            "directory for you)."
        )
    try:
        # Ray's own check of one entry: protocol and archive extension.
        RuntimeEnv(**{ray_field: [value] if ray_field == "py_modules" else value})
    except Exception as error:  # Ray raises ValueError, TypeError or its own errors
        raise InvalidRuntimeEnvError(f"runtime_env.{field}: {error}") from error
    return PackageRef(field=field, uri=value)
