"""SIGTERM to an embedded server's whole process group (issue 33, item 6): a shell's
`kill -- -PGID`, systemd's default `KillMode=control-group`, a container runtime that signals
every process. Ray's processes under the server get the signal too and the cluster is gone before
the server's cleanup runs; the server still ends promptly and cleanly, and loses nothing: the
next start recovers the running job as after any lost cluster. The same when the embedded GCS
died first and the server alone gets the signal; then the server ends what is left of its Ray.
Real server, real Ray, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.support.processes import wait_until
from tests.support.restarts import JOB_TIMEOUT_S, embedded_server

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# tests/support/restarts.Server starts every server with --stop-grace-s 1.
STOP_GRACE_S = 1.0
# What the server may take beyond the stop grace, on a loaded machine: far below the minute
# that Ray's own reconnection timeouts took when each cleanup call waited them out.
EXIT_MARGIN_S = 15.0


def processes_with(word: str) -> list[int]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(word in part for part in process.info["cmdline"] or []):
                found.append(process.pid)
    return found


def group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("signalled", ["whole_group", "server_alone_after_its_gcs_died"])
def test_sigterm_with_the_embedded_ray_gone_ends_the_server_cleanly_and_loses_nothing(
    tmp_path: Path, ray_tmpdir: Path, signalled: str
) -> None:
    server = embedded_server(tmp_path, ray_tmpdir)
    log_path = tmp_path / "server.log"
    marker = f"group-stop-marker-{tmp_path.name}"
    server.start()
    try:
        job_id = server.submit(entrypoint=f"echo started; sleep 1000; : {marker}")
        server.wait_status(job_id, "RUNNING")
        wait_until(lambda: "started" in server.logs(job_id), JOB_TIMEOUT_S, "the job's output")
        assert server.process is not None
        pgid = server.process.pid
        if signalled == "whole_group":
            os.killpg(pgid, signal.SIGTERM)
        else:
            (gcs,) = [p for p in psutil.Process(pgid).children() if p.name() == "gcs_server"]
            gcs.kill()  # a zombie until the server reaps it: not waited for here
            server.process.send_signal(signal.SIGTERM)
        try:
            exit_code = server.process.wait(timeout=STOP_GRACE_S + EXIT_MARGIN_S)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            server.process.wait()
            pytest.fail(
                f"still running {STOP_GRACE_S + EXIT_MARGIN_S} s after SIGTERM ({signalled}):\n"
                + log_path.read_text(errors="replace")
            )
        first_run = log_path.read_text(errors="replace")
        # 0: a SIGTERM shutdown, as when the server alone is signalled with its Ray there.
        assert exit_code == 0, first_run
        assert "Traceback" not in first_run, first_run
        # Nothing of its Ray nor of the job is left: the job went with its supervisor.
        wait_until(lambda: group_is_gone(pgid), 30, "the embedded Ray's processes to end")
        wait_until(lambda: processes_with(marker) == [], 30, "the job's processes to end")

        server.start()
        ended = server.wait_status(job_id, "FAILED", "STOPPED")
        assert ended["status"] == "FAILED", ended
        assert "went away" in ended["message"], ended
        assert "started" in server.logs(job_id)
        assert server.listed(status="RUNNING,PENDING") == {}
    finally:
        server.stop()
