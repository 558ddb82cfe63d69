"""`jobs-server serve`: options, environment variables, and the embedded local Ray default."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from jobs_server.cli import build_parser, load_settings
from jobs_server.settings import Settings
from tests.support.processes import free_port, stop_process_group, wait_until
from tests.support.servers import start_jobs_server, wait_for_server

# Among the longest modules: started first when tests run in parallel (tests/conftest.py).
pytestmark = pytest.mark.slow

JOBS_SERVER = str(Path(sys.executable).parent / "jobs-server")


def test_help_documents_every_option_and_its_variable() -> None:
    result = subprocess.run(
        [JOBS_SERVER, "serve", "--help"], capture_output=True, text=True, check=True
    )
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in result.stdout
        assert f"JOBS_SERVER_{name.upper()}" in result.stdout
    for required in ("--host", "--port", "--ray-address", "--log-dir", "--stop-grace-s"):
        assert required in result.stdout


def test_python_dash_m_runs_the_same_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "jobs_server", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--stop-grace-s" in result.stdout


def test_environment_supplies_settings_and_flags_override(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("JOBS_SERVER_PORT", "9999")
    monkeypatch.setenv("JOBS_SERVER_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("JOBS_SERVER_STOP_GRACE_S", "1.5")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.9:6379")
    from_env = load_settings({})
    assert (from_env.port, from_env.log_dir, from_env.stop_grace_s) == (9999, tmp_path, 1.5)
    assert from_env.ray_address == "127.0.0.9:6379"
    args = vars(build_parser().parse_args(["serve", "--port", "1234", "--ray-address", "x:1"]))
    args.pop("command")
    from_flags = load_settings(args)
    assert (from_flags.port, from_flags.ray_address) == (1234, "x:1")


def test_cors_origins_come_from_a_comma_separated_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list from the environment is split on commas, not parsed as JSON (pydantic-settings
    before 2.7 refused this value: the lowest-bounds smoke runs this test)."""
    monkeypatch.setenv("JOBS_SERVER_CORS_ORIGINS", "https://a.example,https://b.example")
    assert load_settings({}).cors_origins == ["https://a.example", "https://b.example"]


@pytest.mark.parametrize(
    "flags", [["--port", "not-a-port"], ["--port", "70000"], ["--stop-grace-s", "-1"]]
)
def test_invalid_option_exits_non_zero_saying_why(flags: list[str]) -> None:
    result = subprocess.run(
        [JOBS_SERVER, "serve", *flags], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0
    assert flags[0].lstrip("-").replace("-", "_") in result.stderr


@pytest.mark.ray
def test_serve_starts_an_embedded_ray_on_loopback_without_dashboard(tmp_path: Path) -> None:
    """`--ray-address local` (what an unset address falls back to when no cluster runs here)."""
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        "JOBS_SERVER_PORT": str(port),
        "JOBS_SERVER_LOG_DIR": str(tmp_path / "logs"),
        "JOBS_SERVER_NAMESPACE": "embedded_test",
    }
    log_path = tmp_path / "server.log"
    process = start_jobs_server(["--ray-address", "local"], log_path, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, process, log_path, timeout_s=120)
        job = requests.post(f"{url}/api/jobs/", json={"entrypoint": "echo embedded"}, timeout=10)
        assert job.status_code == 200, job.text
        job_id = job.json()["submission_id"]
        wait_until(
            lambda: (
                requests.get(f"{url}/api/jobs/{job_id}", timeout=10).json()["status"] == "SUCCEEDED"
            ),
            60,
            "the job on the embedded cluster",
        )
        logs = requests.get(f"{url}/api/jobs/{job_id}/logs", timeout=10).json()["logs"]
        assert logs == "embedded\n"
        details = requests.get(f"{url}/api/jobs/{job_id}", timeout=10).json()
        assert details["driver_info"]["node_ip_address"].startswith("127.0.0.")
        # Ray's own dashboard (and its unauthenticated jobs API) is not running.
        assert not _accepts_connections("127.0.0.2", 8265)
        assert not _accepts_connections("127.0.0.1", 8265)
    finally:
        stop_process_group(process, timeout_s=60)
    assert "starting a local Ray instance on 127.0.0.2" in log_path.read_text()


def _accepts_connections(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0
