"""The fork server's own code: a small standard-library Python process (run with `python -I -S
-c`, as the launcher, so a worker node needs nothing installed) that forks one launcher per job
instead of starting an interpreter per job (fork_server.py is the supervisor's side of it).

    supervisor ─► fork server (one per supervisor, single-threaded)
                    └─► launcher (one per job: what `containment.LAUNCHER_SOURCE` does)
                          └─► init ─► /bin/sh -c <entrypoint>   (or the shell itself: marker)

It reads requests on its stdin, each `<length>\\n` then NUL-separated fields: the job's number,
its containment, the shell, the log's path, the entrypoint and the `NAME=value` of its
environment. It answers on its stdout, a line each:

    started <job> <pid>          the command runs (its shell has exec'd); pid is the launcher's
    failed <job> <reason>        it could not start (the log would not open, no shell to exec)
    exited <job> <wait status>   the launcher ended (always after `started`)

Lifetimes: it dies with the supervisor (its parent-death signal, and EOF on its stdin); each
launcher dies with it (a parent-death signal, armed then checked), and so each namespace with
its launcher. It is in a session of its own (a stop of a job never reaches it).
"""

from __future__ import annotations

from jobs_server.manager.containment import LAUNCH_SOURCE

ZYGOTE_SOURCE = (
    LAUNCH_SOURCE
    + r"""
import select

REQUESTS, REPORTS = 0, 1
LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
supervisor, zygote = int(sys.argv[1]), os.getpid()
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() != supervisor:
    os._exit(1)  # the supervisor died before the death signal was armed
devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_r, False)
os.set_blocking(wake_w, False)
signal.signal(signal.SIGCHLD, lambda sig, frame: None)
signal.set_wakeup_fd(wake_w)  # a SIGCHLD wakes the poll below
os.set_blocking(REQUESTS, False)
poller = select.epoll()
poller.register(REQUESTS, select.EPOLLIN)
poller.register(wake_r, select.EPOLLIN)


class Launch:
    __slots__ = ("job", "pid", "error", "status", "starting")

    def __init__(self, job, pid):
        self.job, self.pid, self.error, self.status, self.starting = job, pid, b"", None, True


by_started_fd = {}  # the read end of each launch's started pipe, until its EOF
by_pid = {}  # each launcher until it is reaped


def report(*words):
    line = b" ".join(words).replace(b"\n", b" ") + b"\n"
    while line:
        line = line[os.write(REPORTS, line):]


def become_launcher(containment, shell, entrypoint, log, started_w, env):
    # In the forked launcher: it dies with the fork server, and keeps nothing of it.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote:
        os._exit(1)  # the fork server died before the death signal was armed
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (wake_r, wake_w, poller.fileno(), *by_started_fd):
        os.close(fd)
    os.setsid()
    os.dup2(devnull, 0)  # over the request pipe
    os.dup2(log, 1)  # over the report pipe
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    if containment == "pid_namespace":
        launch_in_namespace(shell, entrypoint, started_w, env)  # never returns
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    try:
        os.execve(shell, [shell, "-c", entrypoint], env)  # closes started_w
    except OSError as error:
        os.write(started_w, str(error).encode())
        os._exit(127)


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
        pid = os.fork()
    except OSError as error:
        pid, reason = -1, str(error).encode()
    if pid == 0:
        try:
            become_launcher(containment.decode(), os.fsdecode(shell), os.fsdecode(entrypoint), log,
                   started_w, env)
        except BaseException as error:
            os.write(2, ("jobs-server: cannot launch the job: %r\n" % (error,)).encode())
        os._exit(127)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os.close(log)
    os.close(started_w)
    if pid < 0:
        os.close(started_r)
        report(b"failed", job, reason)
        return
    by_pid[pid] = by_started_fd[started_r] = Launch(job, pid)
    poller.register(started_r, select.EPOLLIN)


def on_started_pipe(fd):
    launch = by_started_fd[fd]
    data = os.read(fd, 4096)
    if data:
        launch.error += data  # the shell could not be exec'd (marker containment)
        return
    # EOF: the shell has exec'd (every write end closes at an exec), or nothing runs.
    poller.unregister(fd)
    os.close(fd)
    del by_started_fd[fd]
    launch.starting = False
    if launch.error:
        report(b"failed", launch.job, launch.error)
        return
    report(b"started", launch.job, b"%d" % launch.pid)
    if launch.status is not None:
        report(b"exited", launch.job, b"%d" % launch.status)


def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        launch = by_pid.pop(pid, None)
        if launch is None:
            continue
        if launch.starting:
            launch.status = status  # reported after its start
        elif not launch.error:
            report(b"exited", launch.job, b"%d" % status)


pending = b""
while True:
    for fd, _ in poller.poll():
        if fd == REQUESTS:
            data = os.read(REQUESTS, 1 << 16)
            if not data:
                os._exit(0)  # the supervisor is gone; the launchers' death signal follows
            pending += data
            while True:
                header, newline, rest = pending.partition(b"\n")
                if not newline or len(rest) < int(header):
                    break
                start(rest[: int(header)])
                pending = rest[int(header):]
        elif fd == wake_r:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            reap()
        else:
            on_started_pipe(fd)
"""
)
