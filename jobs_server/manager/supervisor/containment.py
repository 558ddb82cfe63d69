"""How a job's processes are kept together: a PID namespace per job where the host allows it,
else the marker in their environment.

In a PID namespace of its own, every process a job makes stays in it whatever it does (`setsid`,
double forks, `env -i`), and when the namespace's first process (its init) ends, the kernel
kills every other one and waits for them: nothing of a job outlives it. Slurm, Nomad and
container runtimes contain jobs the same way.

A supervisor's fork server (zygote.py, which runs the same `LAUNCH_SOURCE`) clones the init
itself into the job's new namespace, as the supervisor's child, with no launcher: the init ends
as the command did (for a command a signal ended, which no init can do itself, through a file
the supervisor reads). Without a fork server, or where that clone is refused, the command is
started through a small launcher (`LAUNCHER_SOURCE`, standard-library Python run with
`python -I -S -c`, so a worker node needs nothing installed):

    supervisor ─► launcher (this node's PID namespace; the process the supervisor awaits)
                    └─► init (pid 1 of the job's namespace)
                          └─► /bin/sh -c <entrypoint> (pid 2, a process group of its own)

- The launcher passes SIGTERM (SIGINT, SIGHUP) to the init, which sends it to every process of
  the namespace at once (`kill(-1)` from a namespace's init reaches exactly its processes): no
  shell sees its child die and runs its next command.
- SIGKILL to the launcher kills the init (its parent-death signal), and so the namespace.
- The init reaps orphans, reports the command's wait status to the launcher through a pipe, and
  exits when the command does; the launcher then ends exactly as the command did (the same exit
  code, or the same signal), so the supervisor records what the command did. Neither writes to
  the log.

One scheduling group: the jobs of a fork server (zygote.py) stay in its session, each in a
process group of its own, where a stop finds them. Where the kernel has autogroups (most desktop
and cloud kernels), the scheduler shares the CPU between sessions before processes: a session
per job made 20 busy jobs weigh 20 times the server (and Ray's processes), and every short job
preempted the server as a fresh group (`benchmarks/busy_head.py`: GET p99 73-77 ms with a
session per job, 5-7 ms in one). Like the fork server's session, none has a controlling terminal.

The job keeps the node's /proc (no mount namespace): Ray's drivers look for their node's raylet
there. So `$$` in a job is the namespace's pid, while `/proc/$$` is the node's process of that
number (`/proc/self` is right).

Where no PID namespace can be made (no privilege, an old kernel, seccomp), the command runs as
`/bin/sh -c` directly and is found by its marker (`process.py`), as before. A cgroup v2 per job
(`cgroup.kill`) would contain as well and keep the job's pids the node's, but needs a writable
cgroup tree (and cleaning up after a supervisor that died); the PID namespace needs only
`CAP_SYS_ADMIN` and the kernel cleans up.
"""

from __future__ import annotations

import enum
import logging
import subprocess
import sys

logger = logging.getLogger(__name__)

SHELL = "/bin/sh"
# The shell's pid in its job's namespace: the init (1) spawns it before anything else.
COMMAND_NAMESPACE_PID = 2
# The launcher's exit code when it cannot make the namespace (as container runtimes answer 125).
LAUNCH_FAILED_EXIT_CODE = 125
_PROBE_EXIT_CODE = 3
_PROBE_TIMEOUT_S = 10.0


class Containment(enum.StrEnum):
    """What holds a job's processes together (reported by `GET /api/version`)."""

    PID_NAMESPACE = "pid_namespace"
    MARKER = "marker"


# The launch of one command, shared by the launcher and the fork server (fork_server.py). With
# `env` None, the command gets this process's environment.
LAUNCH_SOURCE = r"""
import ctypes, os, sys
import _signal as signal  # the C module: signal.py's enums would add ~5 ms to every start

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
FORWARDED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
# Set back to their default for the command: what Python ignores (SIGPIPE: `yes | head` ends by
# it), and what the server inherited ignored (a shell starts a background command with SIGINT
# and SIGQUIT ignored): a job must not start unable to be interrupted. Signals 1-31 but the two
# that cannot be caught.
DEFAULTED = [sig for sig in range(1, 32) if sig not in (signal.SIGKILL, signal.SIGSTOP)]
libc = ctypes.CDLL(None, use_errno=True)


def fail(what, reason=None):
    reason = reason or os.strerror(ctypes.get_errno())
    os.write(2, ("jobs-server: cannot contain the job (%s): %s\n" % (what, reason)).encode())
    os._exit(125)


def join_cgroups(join_files):
    # This process moves itself into its attempt's cgroup (cgroups.py `join_files`), before
    # anything of the job runs: every process of the job is born in it. "0" is the writer, in
    # any namespace; this process is single-threaded, so its thread is all of it.
    for path in join_files:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


# Whether one of FORWARDED (a stop) came while the init's command still ran: a stop that came
# once it had exited on its own did not end it (zygote.py's init says so to the supervisor).
stop_reached_command = False


def run_init(shell, entrypoint, started_w, env):
    # The namespace's init (pid 1), with FORWARDED blocked: spawns the command, passes those
    # signals to every process of the namespace, reaps the orphans, and returns the command's
    # wait status once it has ended.
    # Spawned (vfork and exec: no copy of this interpreter, about 1 ms of CPU less per job than
    # a fork), in a process group of its own: not a session, see "One scheduling group" above.
    # Its signals start at their defaults (DEFAULTED) and its mask empty. The started pipe's
    # end closes at the exec.
    if started_w >= 0:
        os.set_inheritable(started_w, False)
    try:
        command = os.posix_spawn(
            shell, [shell, "-c", entrypoint], os.environ if env is None else env,
            setpgroup=0, setsigmask=(), setsigdef=DEFAULTED,
        )
    except OSError as error:
        os.write(2, ("jobs-server: cannot run %s: %s\n" % (shell, error)).encode())
        return 127 << 8

    def to_every_process(sig, frame):
        global stop_reached_command
        if not stop_reached_command:
            try:  # exited (not reaped yet) or running: it is this init's to reap
                exited = os.waitid(os.P_PID, command, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                exited = True  # reaped already
            stop_reached_command = exited is None
        try:
            os.kill(-1, sig)  # from a namespace's init: all of the namespace but the init
        except OSError:
            pass  # none left: a late stop must not leave a traceback in the job's log

    for sig in FORWARDED:
        signal.signal(sig, to_every_process)
    if started_w >= 0:
        os.close(started_w)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    while True:
        pid, status = os.wait()  # orphans of the namespace come back to its init
        if pid == command:
            return status


def launch_in_namespace(shell, entrypoint, started_w, env):
    # No /proc of its own (a mount namespace): Ray's drivers find their node's raylet in /proc.
    if libc.unshare(CLONE_NEWPID) != 0:
        fail("unshare")
    # Held until each process has its handlers: a stop right after the start is not lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    status_r, status_w = os.pipe()
    alive_r, alive_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        os.close(alive_w)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.set_blocking(alive_r, False)
        try:
            if os.read(alive_r, 1) == b"":
                os._exit(1)  # the launcher died before the death signal was armed
        except BlockingIOError:
            pass
        status = run_init(shell, entrypoint, started_w, env)
        os.write(status_w, b"%d" % status)
        os._exit(0)  # and with the init, the kernel kills what the command left

    os.close(status_w)
    os.close(alive_r)
    if started_w >= 0:
        os.close(started_w)

    def to_init(sig, frame):
        try:
            os.kill(init, sig)
        except OSError:
            pass  # reaped: a late stop must not leave a traceback in the job's log

    for sig in FORWARDED:
        signal.signal(sig, to_init)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    init_status = os.waitpid(init, 0)[1]
    reported = os.read(status_r, 32)
    code = os.waitstatus_to_exitcode(int(reported) if reported else init_status)
    if code >= 0:
        os._exit(code)
    # End as the command did: by its signal (without a core dump of this launcher).
    libc.prctl(PR_SET_DUMPABLE, 0)
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    os.kill(os.getpid(), -code)
    os._exit(128 - code)
"""

LAUNCHER_SOURCE = (
    LAUNCH_SOURCE
    + r"""
try:
    join_cgroups(sys.argv[4].split("\n") if len(sys.argv) > 4 and sys.argv[4] else ())
except OSError as error:
    fail("its cgroup", str(error))
launch_in_namespace(sys.argv[1], sys.argv[2], int(sys.argv[3]), None)
"""
)
# The shell's way into its cgroup where no launcher runs (marker containment, no fork server):
# it moves itself, then execs the job's shell (`$0`: the entrypoint; the arguments: the files).
_JOIN_THEN_EXEC = 'for f; do printf 0 > "$f" || exit 125; done; exec %s -c "$0"'


def detect_containment() -> Containment:
    """What this host allows, found by starting a job-less launcher (callers keep the answer).

    Blocks for one process start: call it from a thread, and before the caller becomes a child
    subreaper (it reaps what it finds exited, and would take the probe's exit code). Not cached
    here: the supervisor's code travels by value to other nodes, and a cache would carry the
    server's answer with it.
    """
    try:
        probe = subprocess.run(
            launch_argv(f"exit {_PROBE_EXIT_CODE}", Containment.PID_NAMESPACE, started_fd=None),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("jobs run without a PID namespace (marker containment): %s", error)
        return Containment.MARKER
    if probe.returncode != _PROBE_EXIT_CODE:
        logger.warning(
            "jobs run without a PID namespace (marker containment): %s",
            probe.stderr.decode(errors="replace").strip() or f"exit code {probe.returncode}",
        )
        return Containment.MARKER
    return Containment.PID_NAMESPACE


def launch_argv(
    entrypoint: str,
    containment: Containment,
    started_fd: int | None,
    cgroup_join_files: tuple[str, ...] = (),
) -> list[str]:
    """The command line that runs `entrypoint` under `containment`, in the cgroup whose join
    files are `cgroup_join_files` (cgroups.py; none: where it is). In a PID
    namespace, the launcher closes `started_fd` (a pipe's end the child inherits) once the
    command runs."""
    # By value, not identity: the enum may arrive in a copy pickled with the supervisor's code.
    if containment == Containment.PID_NAMESPACE:
        return [
            sys.executable,
            "-I",
            "-S",
            "-c",
            LAUNCHER_SOURCE,
            SHELL,
            entrypoint,
            str(-1 if started_fd is None else started_fd),
            "\n".join(cgroup_join_files),
        ]
    if cgroup_join_files:
        return [SHELL, "-c", _JOIN_THEN_EXEC % SHELL, entrypoint, *cgroup_join_files]
    return [SHELL, "-c", entrypoint]
