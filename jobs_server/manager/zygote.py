"""The fork server's own code: a small standard-library Python process (run with `python -I -S
-c`, as the launcher, so a worker node needs nothing installed) that forks one launcher per job
instead of starting an interpreter per job (fork_server.py is the supervisor's side of it).

    supervisor ─► fork server (one per supervisor, single-threaded)
              │     └─► (a fork that forks the launcher and exits at once)
              └─► launcher (one per job: what `containment.LAUNCHER_SOURCE` does)
                    └─► init ─► /bin/sh -c <entrypoint>   (or the shell itself: marker)

The launcher is forked twice so that it is re-parented to the supervisor (a child subreaper),
as a launcher the supervisor starts itself is: the supervisor reaps it (and learns its exit
from a pidfd), signals and finds it as its child, and a job outlives a fork server that dies.

It reads requests on its stdin, each `<length>\\n` then NUL-separated fields: the job's number,
its containment, the shell, the log's path, the entrypoint and the `NAME=value` of its
environment. It answers on its stdout, a line each:

    forked <job> <pid>       the launcher's pid (written by the fork between, before `started`)
    started <job>            the command runs (its shell has exec'd)
    failed <job> <reason>    it could not start (the log would not open, no shell to exec)

It dies with the supervisor (its parent-death signal, armed then checked, and EOF on its stdin).
It is in a session of its own, which the jobs it forks share, each in a process group of its
own (a stop of a job never reaches it; containment.py says why not a session per job). Like the
jobs' processes, it carries the supervisor's marker (and so do the launchers it forks, whose
environment is its own): the guardian kills them all if the supervisor dies.
"""

from __future__ import annotations

from jobs_server.manager.containment import LAUNCH_SOURCE

ZYGOTE_SOURCE = (
    LAUNCH_SOURCE
    + r"""
import select

REQUESTS, REPORTS = 0, 1
LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
supervisor = int(sys.argv[1])
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() != supervisor:
    os._exit(1)  # the supervisor died before the death signal was armed
devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
os.set_blocking(REQUESTS, False)
poller = select.epoll()
poller.register(REQUESTS, select.EPOLLIN)
starting = {}  # the read end of each launch's started pipe, until its EOF: [job, error]


def report(*words):
    line = b" ".join(words).replace(b"\n", b" ") + b"\n"
    while line:
        line = line[os.write(REPORTS, line):]


def become_launcher(containment, shell, entrypoint, log, started_w, env):
    # Keeps nothing of the fork server.
    for fd in (poller.fileno(), *starting):
        os.close(fd)
    # A process group of its own (a stop signals it), in this session: a session per job is a
    # scheduling group per job where the kernel has autogroups (see containment.py).
    os.setpgid(0, 0)
    os.dup2(devnull, 0)  # over the request pipe
    os.dup2(log, 1)  # over the report pipe
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    if containment == "pid_namespace":
        launch_in_namespace(shell, entrypoint, started_w, env)  # never returns
    for sig in DEFAULTED:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    try:
        os.execve(shell, [shell, "-c", entrypoint], env)  # closes started_w
    except OSError as error:
        os.write(started_w, str(error).encode())
        os._exit(127)


def fork_launcher(job, containment, shell, entrypoint, log, started_r, started_w, env):
    # In the fork between: its exit re-parents the launcher to the supervisor.
    try:
        launcher = os.fork()
        if launcher == 0:
            os.close(started_r)
            become_launcher(containment, shell, entrypoint, log, started_w, env)
        os.write(REPORTS, b"forked %s %d\n" % (job, launcher))
    except BaseException as error:
        os.write(started_w, ("cannot launch the job: %r" % (error,)).encode())
        os._exit(127)
    os._exit(0)


def start(frame):
    fields = frame.split(b"\0")
    job, containment, shell, log_path, entrypoint = fields[:5]
    env = dict(item.split(b"=", 1) for item in fields[5:])
    try:
        log = os.open(os.fsdecode(log_path), LOG_FLAGS, 0o666)
    except OSError as error:
        report(b"failed", job, str(error).encode())
        return
    started_r, started_w = os.pipe()
    # Held until the launcher has its handlers: a stop right after the start is not lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        between = os.fork()
    except OSError as error:
        between, reason = -1, str(error).encode()
    if between == 0:
        fork_launcher(job, containment.decode(), os.fsdecode(shell), os.fsdecode(entrypoint),
                      log, started_r, started_w, env)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os.close(log)
    os.close(started_w)
    if between < 0:
        os.close(started_r)
        report(b"failed", job, reason)
        return
    os.waitpid(between, 0)  # it exits as soon as it has forked
    starting[started_r] = [job, b""]
    poller.register(started_r, select.EPOLLIN)


def on_started_pipe(fd):
    data = os.read(fd, 4096)
    if data:
        starting[fd][1] += data  # it could not start
        return
    # EOF: the shell has exec'd (every write end closes at an exec), or nothing runs.
    poller.unregister(fd)
    os.close(fd)
    job, error = starting.pop(fd)
    if error:
        report(b"failed", job, error)
    else:
        report(b"started", job)


# A whole read of requests is forked before the started pipes are looked at: a batch's starts
# are reported together, late for its first ones (a second under load). Reporting each as it runs
# took 1,000 sleepers twice as long to all be RUNNING (the supervisor's work comes in pieces),
# and a stop need not wait for the report: the launcher's pid, written by the fork between at
# once, is enough (early_stop.py).
pending = b""
while True:
    for fd, _ in poller.poll():
        if fd != REQUESTS:
            on_started_pipe(fd)
            continue
        data = os.read(REQUESTS, 1 << 16)
        if not data:
            os._exit(0)  # the supervisor is gone
        pending += data
        while True:
            header, newline, rest = pending.partition(b"\n")
            if not newline or len(rest) < int(header):
                break
            start(rest[: int(header)])
            pending = rest[int(header):]
"""
)
