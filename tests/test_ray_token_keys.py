"""Ray's token is no key of this server beside a tokens file (issue 32, item 7, first bullet).

A job started under RAY_AUTH_MODE=token is handed Ray's token (its own `ray.init()` needs it),
so where a tokens file says who may do what, Ray's token is a key only if the file lists its
digest, and then speaks for that entry's tenant and role, not as an admin. A real server
process with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in its environment, joined to the session's
cluster.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from jobs_server.access.key_digest import new_api_key
from tests.support.processes import free_port, stop_process_group, wait_until
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server
from tests.support.tenant_server import tokens_toml

RAY_TOKEN = "ray-cluster-token-" + uuid.uuid4().hex
EXPLICIT_TOKEN = "explicit-admin-token-" + uuid.uuid4().hex
SPECS = {"a-submit": ("team-a", "submit"), "ray": ("team-b", "read")}


@dataclass
class RayTokenServer:
    url: str
    keys: dict[str, str]
    tokens_file: Path
    pid: int
    admin_token: str | None
    """The explicit admin key (--auth-token-file), if the server was given one."""


@pytest.fixture(params=["ray-token-only", "with-auth-token-file"])
def server(
    request: pytest.FixtureRequest, ray_connection: str, tmp_path: Path
) -> Iterator[RayTokenServer]:
    """A server whose environment says RAY_AUTH_MODE=token, with a tokens file that lists a
    team-a key only (and an --auth-token-file beside it, in the second case)."""
    keys = {"a-submit": new_api_key()}
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(tokens_toml(keys, SPECS))
    admin_args: list[str] = []
    admin_token = None
    if request.param == "with-auth-token-file":
        admin_token = EXPLICIT_TOKEN
        (tmp_path / "admin-token").write_text(admin_token + "\n")
        admin_args = ["--auth-token-file", str(tmp_path / "admin-token")]
    port = free_port()
    namespace = f"test_ray_token_{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "server.log"
    env = {
        **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": RAY_TOKEN,
    }
    process = start_jobs_server(
        [
            "--port",
            str(port),
            "--ray-address",
            ray_connection,
            "--state-dir",
            str(tmp_path / "state"),
            "--namespace",
            namespace,
            "--tokens-file",
            str(tokens_file),
            *admin_args,
        ],
        log_path,
        env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, process, log_path)
        yield RayTokenServer(url, keys, tokens_file, process.pid, admin_token)
    finally:
        stop_process_group(process)
        kill_actors_in_namespace(namespace)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_rays_token_is_no_key_unless_the_tokens_file_lists_it(server: RayTokenServer) -> None:
    jobs = f"{server.url}/api/jobs/"
    # Ray's token, as a job under RAY_AUTH_MODE=token has it: no admin, no key at all.
    for headers in (bearer(RAY_TOKEN), {"X-Ray-Authorization": f"Bearer {RAY_TOKEN}"}):
        listed = requests.get(jobs, headers=headers, timeout=30)
        assert listed.status_code == 403, listed.text
        assert listed.json()["error"]["code"] == "forbidden"
        submitted = requests.post(jobs, json={"entrypoint": "true"}, headers=headers, timeout=30)
        assert submitted.status_code == 403, submitted.text
    # The file's key and an explicit admin token work as before.
    team_a = requests.post(
        jobs, json={"entrypoint": "echo a"}, headers=bearer(server.keys["a-submit"]), timeout=60
    )
    assert team_a.status_code == 200, team_a.text
    job_a = team_a.json()["submission_id"]
    if server.admin_token is not None:
        admin = requests.get(jobs, headers=bearer(server.admin_token), timeout=30)
        assert admin.status_code == 200, admin.text
        assert [job["submission_id"] for job in admin.json()] == [job_a]
    assert requests.get(jobs, timeout=30).status_code == 401

    # Listed in the file (a team-b read key): Ray's token speaks for that entry, no more.
    server.tokens_file.write_text(tokens_toml({**server.keys, "ray": RAY_TOKEN}, SPECS))
    os.kill(server.pid, signal.SIGHUP)
    wait_until(
        lambda: requests.get(jobs, headers=bearer(RAY_TOKEN), timeout=30).status_code == 200,
        30,
        "Ray's token accepted once the file lists it",
    )
    listed = requests.get(jobs, headers=bearer(RAY_TOKEN), timeout=30)
    assert listed.json() == []  # team-b's jobs: team-a's is not seen
    hidden = requests.get(f"{jobs}{job_a}", headers=bearer(RAY_TOKEN), timeout=30)
    assert hidden.status_code == 404, hidden.text
    refused = requests.post(
        jobs, json={"entrypoint": "true"}, headers=bearer(RAY_TOKEN), timeout=30
    )
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "permission_denied"
    own = requests.get(jobs, headers=bearer(server.keys["a-submit"]), timeout=30)
    assert [job["submission_id"] for job in own.json()] == [job_a]
