"""Nothing of a job outlives it, not even a process that dropped its marker and left its session
(real Ray, real processes).

Each escaping process sleeps for a duration of its own (`sleep 1000.<n>`), so the test finds it
in /proc by its command line, whatever its pid or namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jobs_server.manager.supervisor.containment import Containment, detect_containment, launch_argv
from tests.support.api import Client, job_logs, submit, wait_for_status


def unique_sleep() -> str:
    """A sleep that runs long and that no other process has on its command line."""
    return f"sleep 1000.{secrets.randbelow(10**9):09d}"


def processes_running(command: str) -> list[int]:
    """The pids of every live process (any namespace) whose command line is `command`."""
    wanted = command.split()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as cmdline:
                arguments = cmdline.read().decode(errors="replace").split("\0")[:-1]
            with open(f"/proc/{name}/stat", "rb") as stat:
                state = stat.read().rpartition(b")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if arguments == wanted and state != b"Z":
            found.append(int(name))
    return found


async def wait_for_processes(command: str, timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := processes_running(command):
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no process runs {command!r}")


async def assert_none_left(*commands: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(processes_running(command) for command in commands):
            return
        await asyncio.sleep(0.05)
    left = {command: processes_running(command) for command in commands}
    for pids in left.values():
        for pid in pids:  # do not leave them behind for the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes of the job outlived it: {left}")


def escapes(*sleeps: str) -> str:
    """Shell that starts each sleep without the job's marker, in a session of its own, and (the
    second way) as a daemon whose parent exits at once."""
    started = []
    for index, sleep in enumerate(sleeps):
        if index % 2:
            started.append(f"env -i setsid sh -c '{sleep} & :' &")
        else:
            started.append(f"env -i setsid sh -c '{sleep}' &")
    return " ".join(started)


async def test_an_escaped_process_ends_with_the_stopped_job(client: Client) -> None:
    sleeps = (unique_sleep(), unique_sleep())
    job_id = await submit(client, entrypoint=f"{escapes(*sleeps)} sleep 1000")
    for sleep in sleeps:
        await wait_for_processes(sleep)
    await wait_for_status(client, job_id, {"RUNNING"})
    assert await (await client.post(f"/api/jobs/{job_id}/stop")).json() == {"stopped": True}
    assert (await wait_for_status(client, job_id))["status"] == "STOPPED"
    await assert_none_left(*sleeps)


async def test_an_escaped_process_ends_with_the_job_that_finished(
    client: Client, tmp_path: Path
) -> None:
    sleeps = (unique_sleep(), unique_sleep())
    go = tmp_path / "go"
    job_id = await submit(
        client, entrypoint=f"{escapes(*sleeps)} while [ ! -e {go} ]; do sleep 0.05; done"
    )
    for sleep in sleeps:
        await wait_for_processes(sleep)
    go.touch()  # the job ends once its escapes run
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"
    await assert_none_left(*sleeps)


async def test_an_escaped_process_ends_when_the_supervisor_is_killed(client: Client) -> None:
    sleeps = (unique_sleep(), unique_sleep())
    job_id = await submit(client, entrypoint=f"{escapes(*sleeps)} sleep 1000")
    for sleep in sleeps:
        await wait_for_processes(sleep)
    job = await wait_for_status(client, job_id, {"RUNNING"})
    supervisor_pid = psutil.Process(int(job["driver_info"]["pid"])).ppid()
    assert "ray::" in " ".join(psutil.Process(supervisor_pid).cmdline())
    os.kill(supervisor_pid, signal.SIGKILL)
    assert (await wait_for_status(client, job_id))["status"] == "FAILED"
    await assert_none_left(*sleeps)


async def test_the_version_says_truly_which_containment_is_in_force(client: Client) -> None:
    body = await (await client.get("/api/version")).json()
    assert body["containment"] in {"pid_namespace", "cgroup", "marker"}
    job_id = await submit(client, entrypoint="readlink /proc/self/ns/pid; echo $$")
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"
    job_namespace, job_pid = (await job_logs(client, job_id)).split()
    in_a_namespace_of_its_own = job_namespace != os.readlink("/proc/self/ns/pid")
    assert in_a_namespace_of_its_own == (body["containment"] == "pid_namespace")
    if in_a_namespace_of_its_own:
        assert job_pid == "2"  # the namespace's init is 1, the job's shell the first it starts


# The command, and what the job must report: its exit code and its log, byte for byte.
EXITS = [
    ("printf 'a\\0b\\r\\n\\377'", 0, b"a\0b\r\n\xff"),
    ("echo out; echo err >&2; exit 3", 3, b"out\nerr\n"),
    ("exit 255", 255, b""),
    ("kill -TERM $$", -15, b""),
    ("kill -SEGV $$", -11, b""),
    ("kill -KILL $$", -9, b""),
    ("exec sleep 0.1 & wait; exit 130", 130, b""),
]


@pytest.mark.parametrize(("entrypoint", "exit_code", "log"), EXITS)
async def test_exit_codes_and_logs_are_exactly_the_commands(
    client: Client, entrypoint: str, exit_code: int, log: bytes
) -> None:
    job_id = await submit(client, entrypoint=entrypoint)
    job = await wait_for_status(client, job_id)
    assert job["driver_exit_code"] == exit_code
    assert job["status"] == ("SUCCEEDED" if exit_code == 0 else "FAILED")
    response = await client.get(f"/api/jobs/{job_id}/logs?format=text")
    assert await response.read() == log


def test_a_host_that_forbids_namespaces_falls_back_to_the_marker() -> None:
    """Without CAP_SYS_ADMIN (what an unprivileged container has), the probe says so."""
    if os.geteuid() != 0:
        pytest.skip("dropping a capability needs root here")
    probe = subprocess.run(
        [
            "setpriv",
            "--inh-caps=-sys_admin",
            "--bounding-set=-sys_admin",
            sys.executable,
            "-c",
            "from jobs_server.manager.supervisor.containment import detect_containment;"
            "print(detect_containment())",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert probe.stdout.strip() == Containment.MARKER
    assert detect_containment() is Containment.PID_NAMESPACE  # this host allows it


def test_a_stop_as_the_command_ends_leaves_no_trace_in_its_log() -> None:
    """A SIGTERM that reaches the launcher as the command exits (the namespace already empty)
    must not write a traceback into the log or change the exit code (5 in 200 did before)."""
    if detect_containment() != Containment.PID_NAMESPACE:
        pytest.skip("this host allows no PID namespace")
    wrong = []
    for attempt in range(200):
        launcher = subprocess.Popen(
            launch_argv("exit 3", Containment.PID_NAMESPACE, None),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        time.sleep(0.012 + (attempt % 20) * 0.002)  # around the moment the command ends
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher.pid, signal.SIGTERM)
        output = launcher.communicate(timeout=30)[0]
        if output or launcher.returncode not in (3, -signal.SIGTERM):
            wrong.append((launcher.returncode, output))
    assert wrong == []
