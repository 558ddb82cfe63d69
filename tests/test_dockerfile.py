"""The Dockerfile, parsed (no Docker engine runs on these machines)."""

from __future__ import annotations

from pathlib import Path

import dockerfile

DOCKERFILE = Path(__file__).resolve().parent.parent / "Dockerfile"


def _instructions() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def _all(cmd: str) -> list[dockerfile.Command]:
    return [instruction for instruction in _instructions() if instruction.cmd == cmd]


def test_official_python_base_image() -> None:
    (base,) = _all("FROM")
    assert base.value[0].startswith("python:3.1")


def test_runs_as_a_non_root_user() -> None:
    users = _all("USER")
    assert users
    assert users[-1].value[0] not in {"root", "0"}
    assert _instructions().index(users[-1]) > _instructions().index(_all("RUN")[-1])


def test_healthcheck_probes_healthz() -> None:
    (healthcheck,) = _all("HEALTHCHECK")
    assert "/api/healthz" in " ".join(healthcheck.value)


def test_starts_the_server_listening_beyond_the_container() -> None:
    (entrypoint,) = _all("ENTRYPOINT")
    (cmd,) = _all("CMD")
    assert [*entrypoint.value, *cmd.value] == ["jobs-server", "serve"]
    env = dict(zip(_all("ENV")[0].value[::2], _all("ENV")[0].value[1::2], strict=True))
    assert env["JOBS_SERVER_HOST"] == "0.0.0.0"
    assert env["JOBS_SERVER_PORT"] == "8266"
    assert "8266" in _all("EXPOSE")[0].value


def test_copies_only_what_the_install_needs() -> None:
    copied = {source for instruction in _all("COPY") for source in instruction.value[:-1]}
    assert copied == {"pyproject.toml", "README.md", "openapi.yaml", "jobs_server"}


def test_ray_version_is_a_build_argument() -> None:
    """The image's Ray must be the cluster's: any release of the declared range, chosen at build."""
    (argument,) = _all("ARG")
    assert argument.value[0].startswith("RAY_VERSION")
    (install,) = [run for run in _all("RUN") if "pip install" in " ".join(run.value)]
    assert '"ray[default]==${RAY_VERSION}"' in " ".join(install.value)
