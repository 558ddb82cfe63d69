"""The terminal client (`python -m jobs_server ...`) as the tests run it."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

CLIENT = [sys.executable, "-m", "jobs_server"]


class Cli:
    """One `jobs-server ...` process: its output read as it comes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.stdout = b""

    async def read_until(self, expected: bytes, timeout_s: float = 30) -> None:
        """Read stdout until it holds `expected` (fails with what it holds after `timeout_s`)."""
        assert self.process.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                while expected not in self.stdout:
                    chunk = await self.process.stdout.read(65536)
                    assert chunk, f"stdout ended before {expected!r}: {self.stdout!r}"
                    self.stdout += chunk
        except TimeoutError:
            raise AssertionError(f"no {expected!r} on stdout: {self.stdout!r}") from None

    async def finish(self, timeout_s: float = 60) -> tuple[int, bytes, str]:
        """Its exit code, all of stdout and stderr."""
        stdout, stderr = await asyncio.wait_for(self.process.communicate(), timeout_s)
        assert self.process.returncode is not None
        return self.process.returncode, self.stdout + (stdout or b""), (stderr or b"").decode()


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, bytes, str]:
    """Run `jobs-server ARGS` to its end: its exit code, stdout and stderr."""
    return await (await start_cli(*args, env=env)).finish()


async def start_cli(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> Cli:
    """Start `jobs-server ARGS` with this checkout on its path and no server or token of the
    caller's environment (`env` may set them)."""
    environment = {**os.environ, "PYTHONPATH": os.getcwd(), **(env or {})}
    environment.pop("JOBS_SERVER_URL", None)
    environment.pop("JOBS_SERVER_AUTH_TOKEN", None)
    environment.update(env or {})
    kwargs.setdefault("stdin", asyncio.subprocess.DEVNULL)
    kwargs.setdefault("stdout", asyncio.subprocess.PIPE)
    kwargs.setdefault("stderr", asyncio.subprocess.PIPE)
    process = await asyncio.create_subprocess_exec(*CLIENT, *args, env=environment, **kwargs)
    return Cli(process)
