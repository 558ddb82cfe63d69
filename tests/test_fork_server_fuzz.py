"""The fork server never dies of one request's input (issue 32, item 4): a request it cannot parse
fails that job alone, and the jobs it had forked run on. Against a real fork server process."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from jobs_server.manager.supervisor.containment import Containment
from tests.support.fork_servers import is_alive, job_env, subreaper_fork_server

_NO_EQUALS = b"7\0marker\0/bin/sh\0/tmp/x\0true\0NOEQUALS"
MALFORMED_FRAMES = [
    b"x\n",
    b"-5\n",
    b"3\nabc",
    b"11\n1\0marker\0sh",
    b"99999999999999999999999999\n",
    b"%d\n%s" % (len(_NO_EQUALS), _NO_EQUALS),
    b"\xff\xfe\n\n",
]


@pytest.mark.parametrize("frame", MALFORMED_FRAMES)
async def test_a_malformed_request_leaves_the_fork_server_and_its_jobs_running(
    tmp_path: Path, frame: bytes
) -> None:
    async with subreaper_fork_server() as server:
        env = job_env(uuid.uuid4().hex)
        sleeper = await server.spawn(
            "sleep 60", log_path=tmp_path / "a.log", env=env, containment=Containment.MARKER
        )
        pid = server.pid
        with pytest.raises(OSError, match="env var name"):
            await server.spawn(
                "true",
                log_path=tmp_path / "b.log",
                env={**env, "A": "x\0y"},
                containment=Containment.MARKER,
            )
        server._send(frame)  # the attacker writes the wire itself
        good = await server.spawn(
            "echo ok", log_path=tmp_path / "c.log", env=env, containment=Containment.MARKER
        )
        assert await good.wait() == 0
        assert (tmp_path / "c.log").read_text() == "ok\n"
        assert server.pid == pid
        assert is_alive(sleeper.pid)
        os.kill(sleeper.pid, signal.SIGKILL)
        await sleeper.wait()
