"""The fork server's own code: a small standard-library Python process (run with `python -I -S
-c`, as the launcher, so a worker node needs nothing installed) that forks what runs each job
instead of starting an interpreter per job (fork_server.py is the supervisor's side of it).

    supervisor ─► fork server (one per supervisor, single-threaded)
              │     └┄► (clones each job's first process as its parent's child: CLONE_PARENT)
              ├─► init of the job's PID namespace ─► /bin/sh -c <entrypoint>
              └─► or a launcher (`containment.LAUNCHER_SOURCE`'s way) ─► init ─► /bin/sh -c
                  (or the shell itself, marker containment)

A job's first process is the supervisor's child, as a launcher the supervisor starts itself is:
the supervisor reaps it (and learns its exit from a pidfd), signals and finds it as its child,
and a job outlives a fork server that dies. In a PID namespace, that process is the namespace's
init itself, cloned into its namespace (CLONE_NEWPID) with no launcher between: an init cannot
end by a signal, so for a command that a signal ended it leaves the wait status in a file of the
fork server's `ends` directory, which the supervisor reads (`become_init`). On this kind of host
(a VM) each copy of this interpreter costs about 0.7 ms of CPU to fork and end, and a launcher
was one per job. Where a clone is refused (a seccomp filter, an architecture whose clone is not
listed here), a launcher forks the init, as `LAUNCHER_SOURCE` does; where even the plain clone
is, the launcher is forked twice, and the fork between exits at once so that the launcher is
re-parented to the supervisor (a child subreaper).

It reads requests on its stdin, each `<length>\\n` then NUL-separated fields: the job's number,
its containment, the shell, the log's path, the entrypoint, the files through which it joins
its attempt's cgroup (cgroups.py `join_files`, newline-separated; empty: none) and the
`NAME=value` of its environment. The job's first process joins that cgroup before it becomes
anything. It answers on its stdout, a line each:

    forked <job> <pid>       the launcher's pid (written as it is cloned, before `started`)
    forked <job> <pid> init  the init's pid: the job's namespace has no launcher
    started <job>            the command runs (its shell has exec'd)
    failed <job> <reason>    it could not start (the log would not open, no shell to exec)

It dies with the supervisor (its parent-death signal, armed then checked, and EOF on its stdin).
It is in a session of its own, which the jobs it forks share, each in a process group of its
own (a stop of a job never reaches it; containment.py says why not a session per job), at the
nice value `--jobs-nice` (argv[4]) for it and for that session's scheduling group. Like the
jobs' processes, it carries the supervisor's marker (and so do the launchers and inits it forks,
whose environment is its own): the guardian kills them all if the supervisor dies.
"""

from __future__ import annotations

from jobs_server.manager.supervisor.containment import LAUNCH_SOURCE

ZYGOTE_SOURCE = (
    LAUNCH_SOURCE
    + r"""
import errno, select

REQUESTS, REPORTS = 0, 1
# Never through a symlink at the log's name (a spool is in the shared temp dir: log_shipping.py),
# and the log is the server user's alone.
LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
supervisor = int(sys.argv[1])
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() != supervisor:
    os._exit(1)  # the supervisor died before the death signal was armed
devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
os.set_blocking(REQUESTS, False)


def lower_priority(nice):
    # The jobs run below the control plane (the server, Ray's processes): where the kernel has
    # autogroups, which share the CPU between sessions before processes, this session's group
    # gets the nice value; and every process forked from here is at least at it (Ray starts
    # its workers, the supervisor among them, at 15 unless RAY_worker_niceness says otherwise;
    # a lower value would need a privilege). Raising a nice value needs none.
    if nice > 0:
        os.nice(max(0, nice - os.nice(0)))
        try:
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(nice))
        except OSError:
            pass  # no autogroups on this kernel: the processes' nice value is what counts


lower_priority(int(sys.argv[4]))
poller = select.epoll()
poller.register(REQUESTS, select.EPOLLIN)
starting = {}  # the read end of each launch's started pipe, until its EOF: [job, error]


def report(*words):
    line = b" ".join(words).replace(b"\n", b" ") + b"\n"
    while line:
        line = line[os.write(REPORTS, line):]


def leave_the_fork_server(log):
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


def become_launcher(containment, shell, entrypoint, log, started_w, env):
    leave_the_fork_server(log)
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


CLONE_PARENT = 0x00008000
# The raw clone system call's number (its arguments but the flags are zero: a fork's copy of the
# stack, as fork(2) makes). Where it is missing or refused, the fork between.
SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)
libc.syscall.restype = ctypes.c_long
# argv[2]: "0" to fork between always (the tests of that way).
can_clone_parent = SYS_CLONE is not None and sys.argv[2] != "0"
can_clone_init = can_clone_parent
# What a clone that this host will never allow fails with (a seccomp filter, no such call);
# anything else (too many processes now) fails this job's start only.
REFUSALS = {errno.EPERM, errno.EINVAL, errno.ENOSYS}
# Where an init writes how a command that a signal ended did end (`become_init`).
ENDS_DIR = sys.argv[3]


def clone_parent(flags=0):
    # Fork a child of this process's parent (the supervisor), with the clone `flags` besides:
    # its pid here, 0 in the child; -1 if the clone was refused. The child is this
    # single-threaded interpreter's copy, as after a fork, without Python's after-fork hooks
    # (none are registered here; a launcher or an init only execs, spawns, forks and signals
    # by pid).
    global can_clone_parent, can_clone_init
    if can_clone_parent:
        # Every argument a long: the call is variadic, and a stack pointer that is not zero in
        # all of its 64 bits would be the child's stack.
        zero = ctypes.c_long(0)
        pid = libc.syscall(
            ctypes.c_long(SYS_CLONE), ctypes.c_long(CLONE_PARENT | flags), zero, zero, zero, zero
        )
        if pid >= 0:
            return pid
        if not flags and ctypes.get_errno() in REFUSALS:
            # Refused here: the fork between from now on.
            can_clone_parent = can_clone_init = False
    return -1


def become_init(shell, entrypoint, log, started_w, env, end_path):
    # The init of the job's own PID namespace, cloned as the supervisor's child: no launcher
    # between (a copy of this interpreter less per job). It ends as the command did, but an
    # init cannot end by a signal of its own (the kernel drops it): for a command that a
    # signal ended, it writes the command's wait status to `end_path` for the supervisor and
    # exits with 128 + the signal's number (what the supervisor reads without the file). A
    # stop that reached the command while it ran is said there too (" stopped"): a stop that
    # came once it had exited on its own did not end it.
    leave_the_fork_server(log)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the supervisor's death (its guardian too)
    status = run_init(shell, entrypoint, started_w, env)
    if os.WIFSIGNALED(status) or stop_reached_command:
        try:
            end = os.open(end_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.write(end, b"%d%s" % (status, b" stopped" if stop_reached_command else b""))
            os.close(end)
        except OSError:
            pass  # the exit code says 128 + the signal
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))  # and with the init, the kernel kills what is left


def wait_until_reported(reported_r, reported_w):
    # A job's first process goes on once its pid is reported ("forked"): one whose fork server
    # died between its fork and that line is known to no one, and must not run the job unseen
    # (the supervisor kills those it knows of: fork_server.py's `_died`). EOF without the byte
    # is that death.
    os.close(reported_w)
    if os.read(reported_r, 1) != b"r":
        os._exit(127)
    os.close(reported_r)


def become(started_r, started_w, reported, cgroups, what, *args):
    # In a job's first process (the launcher or the init): it never returns; what keeps it from
    # becoming `what` is the start's error.
    try:
        os.close(started_r)
        wait_until_reported(*reported)
        try:
            join_cgroups(cgroups)
        except OSError as error:
            os.write(started_w, ("cannot place the job in its cgroup: %s" % (error,)).encode())
            os._exit(125)
        what(*args)
    except BaseException as error:
        os.write(started_w, ("cannot launch the job: %r" % (error,)).encode())
        os._exit(127)


def fork_launcher(job, started_r, started_w, reported, cgroups, launcher_args):
    # In the fork between: its exit re-parents the launcher to the supervisor.
    try:
        launcher = os.fork()
        if launcher == 0:
            become(started_r, started_w, reported, cgroups, become_launcher, *launcher_args)
        os.write(REPORTS, b"forked %s %d\n" % (job, launcher))
        os.write(reported[1], b"r")
    except BaseException as error:
        os.write(started_w, ("cannot launch the job: %r" % (error,)).encode())
        os._exit(127)
    os._exit(0)


def start(frame):
    global can_clone_init
    fields = frame.split(b"\0")
    job, containment, shell, log_path, entrypoint, cgroups = fields[:6]
    cgroups = [os.fsdecode(path) for path in cgroups.split(b"\n") if path]
    env = dict(item.split(b"=", 1) for item in fields[6:])
    try:
        log = os.open(os.fsdecode(log_path), LOG_FLAGS, 0o600)
    except OSError as error:
        report(b"failed", job, str(error).encode())
        return
    started_r, started_w = os.pipe()
    reported = os.pipe()  # `wait_until_reported`
    shell, entrypoint = os.fsdecode(shell), os.fsdecode(entrypoint)
    launcher_args = (containment.decode(), shell, entrypoint, log, started_w, env)
    # Held until the job's first process has its handlers: a stop right after the start is
    # not lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    first = -1  # the job's first process: its namespace's init, else a launcher
    if containment == b"pid_namespace" and can_clone_init:
        first = clone_parent(CLONE_NEWPID)
        if first == 0:
            end_path = os.path.join(ENDS_DIR, os.fsdecode(job))
            become(started_r, started_w, reported, cgroups, become_init,
                   shell, entrypoint, log, started_w, env, end_path)
        if first < 0 and ctypes.get_errno() in REFUSALS:
            can_clone_init = False  # refused here: a launcher from now on
    is_init = first > 0
    if first < 0:
        first = clone_parent()
        if first == 0:
            become(started_r, started_w, reported, cgroups, become_launcher, *launcher_args)
    between = -1
    if first < 0:
        try:
            between = os.fork()
        except OSError as error:
            reason = str(error).encode()
        if between == 0:
            fork_launcher(job, started_r, started_w, reported, cgroups, launcher_args)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os.close(log)
    os.close(started_w)
    if first < 0 and between < 0:
        os.close(started_r)
        for end in reported:
            os.close(end)
        report(b"failed", job, reason)
        return
    if first > 0:
        report(b"forked", job, b"%d%s" % (first, b" init" if is_init else b""))
        os.write(reported[1], b"r")
    for end in reported:
        os.close(end)
    if first < 0:
        os.waitpid(between, 0)  # it exits as soon as it has forked and reported
    starting[started_r] = [job, b""]
    poller.register(started_r, select.EPOLLIN)


MAX_FRAME_BYTES = 1 << 26


def start_or_fail(frame):
    # A request it cannot parse fails that job alone: the fork server never dies of its input.
    try:
        start(frame)
    except Exception as error:
        job = frame.split(b"\0", 1)[0]
        if job.isdigit():
            report(b"failed", job, ("malformed request: %r" % (error,)).encode())


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
# and a stop need not wait for the report: the launcher's pid, written as soon as it is cloned
# (or by the fork between), is enough (early_stop.py).
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
            if not newline:
                break
            if not header.isdigit() or int(header) > MAX_FRAME_BYTES:
                pending = rest  # not a request's length: skip the line, never die of it
                continue
            if len(rest) < int(header):
                break
            start_or_fail(rest[: int(header)])
            pending = rest[int(header):]
"""
)
