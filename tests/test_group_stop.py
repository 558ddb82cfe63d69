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
from tests.support.restarts import JOB_TIMEOUT_S, Server, embedded_server

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


# Each way of signalling, in this order, on one state dir.
SIGNALLED = ("whole_group", "server_alone_after_its_gcs_died")


def run_a_job(server: Server, marker: str) -> str:
    """A job left running, once its output is there."""
    job_id = server.submit(entrypoint=f"echo started; sleep 1000; : {marker}")
    server.wait_status(job_id, "RUNNING")
    wait_until(lambda: "started" in server.logs(job_id), JOB_TIMEOUT_S, "the job's output")
    return job_id


def sigterm_and_check_the_exit(
    server: Server, signalled: str, marker: str, life_starts_at: int
) -> None:
    """SIGTERM as `signalled` says; the server ends in time, with 0 and no traceback in what it
    logged in this life (from byte `life_starts_at` of its log), and neither its Ray's processes
    nor those of the job (found by `marker`) are left."""
    log_path = server.tmp_path / "server.log"
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
    this_life = log_path.read_bytes()[life_starts_at:].decode(errors="replace")
    # 0: a SIGTERM shutdown, as when the server alone is signalled with its Ray there.
    assert exit_code == 0, (signalled, this_life)
    assert "Traceback" not in this_life, (signalled, this_life)
    # Nothing of its Ray nor of the job is left: the job went with its supervisor.
    wait_until(
        lambda: group_is_gone(pgid), 30, f"the embedded Ray's processes to end ({signalled})"
    )
    wait_until(
        lambda: processes_with(marker) == [], 30, f"the job's processes to end ({signalled})"
    )


def assert_recovered(server: Server, signalled: str, job_id: str) -> None:
    """The start after the signal recorded the running job FAILED, its log kept, and lists
    nothing as running or pending."""
    ended = server.wait_status(job_id, "FAILED", "STOPPED")
    assert ended["status"] == "FAILED", (signalled, ended)
    assert "went away" in ended["message"], (signalled, ended)
    assert "started" in server.logs(job_id), signalled
    assert server.listed(status="RUNNING,PENDING") == {}, signalled


def test_sigterm_with_the_embedded_ray_gone_ends_the_server_cleanly_and_loses_nothing(
    tmp_path: Path, ray_tmpdir: Path
) -> None:
    """Both ways in turn: the start that recovers the job of the first signalled life is the
    life signalled next (3 server lives and Ray starts for both ways, not 4). Its checks of the
    recovery come before its own job is submitted, so each way is checked as if alone."""
    server = embedded_server(tmp_path, ray_tmpdir)
    log_path = tmp_path / "server.log"
    signalled_job: tuple[str, str] | None = None  # (how it was signalled, job id)
    try:
        for signalled in SIGNALLED:
            life_starts_at = log_path.stat().st_size if log_path.exists() else 0
            server.start()
            if signalled_job is not None:
                assert_recovered(server, *signalled_job)
            marker = f"group-stop-marker-{tmp_path.name}-{signalled}"
            job_id = run_a_job(server, marker)
            sigterm_and_check_the_exit(server, signalled, marker, life_starts_at)
            signalled_job = (signalled, job_id)
        server.start()
        assert signalled_job is not None
        assert_recovered(server, *signalled_job)
    finally:
        server.stop()
