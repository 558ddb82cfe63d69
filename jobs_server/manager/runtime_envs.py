"""Submit-time checks of a runtime env and its code packages: `working_dir` and `py_modules`.

What Ray would only find out on a node, minutes later or never (a path that exists only on the
server, a package that was never uploaded), is a 400 here that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ray.runtime_env import RuntimeEnv

from jobs_server.errors import InvalidRuntimeEnvError, PackageNotFoundError

if TYPE_CHECKING:  # not at run time: the supervisor imports this module, and needs no GCS KV
    from jobs_server.manager.packages import PackageLookup

# Where Ray's runtime-env agent reads a package uploaded through /api/packages.
GCS_SCHEME = "gcs"


@dataclass(frozen=True)
class PackageRef:
    """One code package a runtime env names: `field` is e.g. `py_modules[1]`."""

    field: str
    uri: str

    @property
    def is_uploaded(self) -> bool:
        return urlparse(self.uri).scheme == GCS_SCHEME


async def validate_runtime_env(runtime_env: dict[str, Any], packages: PackageLookup) -> None:
    """A 400 for what Ray would reject, and for code packages no node could fetch."""
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
                await packages.ensure_exists(ref.uri)
            except PackageNotFoundError:
                raise InvalidRuntimeEnvError(
                    f"runtime_env.{ref.field}: package {ref.uri} was never uploaded to this "
                    "cluster, or has expired (Ray's clients upload a local directory first)."
                ) from None


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
