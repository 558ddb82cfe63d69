"""A `jobs-server serve` process with a tokens file of two tenants and three roles, for the
tenant tests (tests/test_tenants.py, tests/test_tenant_clients.py)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import ClientSession

from jobs_server.access.key_digest import digest_of, new_api_key
from tests.support.api import TERMINAL_STATUSES
from tests.support.processes import free_port, stop_process_group
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server

# Key name -> (tenant, role). `ops-admin` is an admin of a tenant of its own.
KEY_SPECS: dict[str, tuple[str, str]] = {
    "ops-admin": ("ops", "admin"),
    "a-submit": ("team-a", "submit"),
    "a-read": ("team-a", "read"),
    "b-submit": ("team-b", "submit"),
    "b-read": ("team-b", "read"),
}
# JOBS_SERVER_AUTH_TOKEN beside the file: an admin key of the default tenant.
AUTH_TOKEN = "tenant-tests-auth-token"


DEFAULT_LIMITS_TOML = "\n[tenants.team-a]\nmax_running = 10\nmax_queued = 100\n"


def tokens_toml(
    keys: dict[str, str], specs: dict[str, tuple[str, str]], limits: str = DEFAULT_LIMITS_TOML
) -> str:
    """A tokens file with the digests of `keys` (by name), their tenants and roles, and the
    tenants' caps `limits` (TOML)."""
    entries = [
        f'[[keys]]\nname = "{name}"\ndigest = "{digest_of(key)}"\n'
        f'tenant = "{specs[name][0]}"\nrole = "{specs[name][1]}"\n'
        for name, key in keys.items()
    ]
    return "\n".join(entries) + limits


@dataclass
class TenantServer:
    url: str
    keys: dict[str, str]
    """Key by name."""
    tokens_file: Path
    log_path: Path
    pid: int

    def headers(self, name: str) -> dict[str, str]:
        key = AUTH_TOKEN if name == "auth-token" else self.keys[name]
        return {"Authorization": f"Bearer {key}"}


def run_tenant_server(
    ray_address: str,
    workdir: Path,
    limits: str = DEFAULT_LIMITS_TOML,
    extra_args: Sequence[str] = (),
) -> Iterator[TenantServer]:
    """Start a server with a fresh tokens file in `workdir` (and `extra_args` on its command
    line); stop it (and its actors) after."""
    keys = {name: new_api_key() for name in KEY_SPECS}
    tokens_file = workdir / "tokens.toml"
    tokens_file.write_text(tokens_toml(keys, KEY_SPECS, limits))
    port = free_port()
    namespace = f"test_tenants_{uuid.uuid4().hex[:8]}"
    log_path = workdir / "server.log"
    process = start_jobs_server(
        [
            "--port",
            str(port),
            "--ray-address",
            ray_address,
            "--state-dir",
            str(workdir / "state"),
            "--namespace",
            namespace,
            "--stop-grace-s",
            "1",
            "--tokens-file",
            str(tokens_file),
            *extra_args,
        ],
        log_path,
        env={**os.environ, "JOBS_SERVER_AUTH_TOKEN": AUTH_TOKEN},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, process, log_path)
        yield TenantServer(url, keys, tokens_file, log_path, process.pid)
    finally:
        stop_process_group(process)
        kill_actors_in_namespace(namespace)


async def submit_as(session: ClientSession, server: TenantServer, name: str, **body: Any) -> str:
    response = await session.post("/api/jobs/", json=body, headers=server.headers(name))
    assert response.status == 200, await response.text()
    return str((await response.json())["submission_id"])


async def wait_until_terminal(
    session: ClientSession, server: TenantServer, job_id: str, timeout_s: float = 60
) -> dict[str, Any]:
    """Poll the job as an admin until it has ended; its details."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await session.get(f"/api/jobs/{job_id}", headers=server.headers("ops-admin"))
        job: dict[str, Any] = await response.json()
        if job["status"] in TERMINAL_STATUSES:
            return job
        assert time.monotonic() < deadline, f"{job_id} did not end: {job}"
        await asyncio.sleep(0.05)
