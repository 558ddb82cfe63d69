"""A `jobs-server serve` process with a short shutdown timeout, for the shutdown tests."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

from tests.support.processes import free_port, stop_process_group
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server

# Room for the cleanup after the streams ended (the manager, leaving Ray) on a loaded machine;
# far below aiohttp's own 60 s.
EXIT_MARGIN_S = 20.0


class Server:
    """A `jobs-server serve` process on a free port; stopped (and its actors killed) at the end."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.namespace = f"test_shutdown_{uuid.uuid4().hex[:8]}"
        self.log_path = tmp_path / "server.log"
        self.process = start_jobs_server(
            [
                "--port",
                str(self.port),
                "--log-dir",
                str(tmp_path / "logs"),
                "--state-dir",
                str(tmp_path / "state"),
                "--namespace",
                self.namespace,
                "--shutdown-timeout-s",
                str(SHUTDOWN_TIMEOUT_S),
                *args,
            ],
            self.log_path,
            env=None if env is None else {**os.environ, **env},
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def exit_code_after(self, signal_number: int, timeout_s: float) -> int:
        """Send the signal to the server process alone (as systemd's main-process mode and
        Kubernetes do) and wait for it to exit."""
        self.process.send_signal(signal_number)
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            assert time.monotonic() < deadline, f"still running {timeout_s}s after the signal"
            await asyncio.sleep(0.1)
        return self.process.returncode

    def stop(self) -> None:
        stop_process_group(self.process)
        kill_actors_in_namespace(self.namespace)


SHUTDOWN_TIMEOUT_S = 5.0
