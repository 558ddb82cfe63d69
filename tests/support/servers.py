"""`jobs-server serve` processes for the tests and benchmarks: start one, wait for its probe,
and a self-signed certificate for the TLS tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import requests

from tests.support.processes import wait_until


def self_signed_certificate(cert: Path, key: Path, *, name: str) -> None:
    """A certificate for `name` (`IP:127.0.0.1` or `DNS:localhost`) and its key, for a day."""
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            f"/CN={name.split(':', 1)[1]}",
            "-addext",
            f"subjectAltName={name}",
        ],
        check=True,
        capture_output=True,
    )


def start_jobs_server(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`python -m jobs_server serve ARGS` in a session of its own, its output appended to a file.
    Without a state dir of its own the server gets `<log_path's dir>/state`: a test never
    touches the user's history (~/.local/state/jobs-server), nor another test's. The session's
    JOBS_SERVER_STATE_DIR (conftest's net for servers started some other way), inherited in an
    env copied from ours, is not a state dir of the test's own: servers of two tests on it
    would share one history, and one lock."""
    chosen = (os.environ if env is None else env).get("JOBS_SERVER_STATE_DIR")
    inherited = os.environ.get("JOBS_SERVER_STATE_DIR")
    if "--state-dir" not in args and chosen in (None, inherited):
        args = [*args, "--state-dir", str(log_path.parent / "state")]
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "jobs_server", "serve", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for_server(
    url: str,
    process: subprocess.Popen[bytes],
    log_path: Path,
    timeout_s: float = 60,
    verify: str | bool = True,
) -> None:
    """Wait until the server answers its probe; fail with its log if it exited instead."""
    wait_until(
        lambda: is_healthy(url, verify) or process.poll() is not None, timeout_s, f"server {url}"
    )
    assert process.poll() is None, log_path.read_text()


def is_healthy(url: str, verify: str | bool = True) -> bool:
    """Whether the server at `url` answers its probe."""
    try:
        return requests.get(f"{url}/api/healthz", timeout=1, verify=verify).status_code == 200
    except requests.exceptions.RequestException:
        return False
