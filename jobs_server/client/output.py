"""What the client prints: a job list as a table, one job's details, times, sizes and CPU
seconds people read."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, TextIO

ENTRYPOINT_WIDTH = 60
BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def print_json(value: Any, out: TextIO) -> None:
    out.write(json.dumps(value, indent=2) + "\n")


def print_job_table(jobs: Sequence[dict[str, Any]], out: TextIO) -> None:
    """One line per job, oldest first, as the server lists them."""
    rows = [("SUBMISSION_ID", "STATUS", "STARTED", "DURATION", "PEAK_MEMORY", "CPU", "ENTRYPOINT")]
    now_ms = int(time.time() * 1000)
    for job in jobs:
        rows.append(
            (
                str(job.get("submission_id")),
                str(job.get("status")),
                format_time(job.get("start_time")),
                format_duration(job.get("start_time"), job.get("end_time"), now_ms),
                format_bytes(job.get("peak_memory_bytes")),
                format_cpu_seconds(cpu_total_s(job)),
                shorten(str(job.get("entrypoint", "")), ENTRYPOINT_WIDTH),
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        out.write("  ".join([*cells, row[-1]]).rstrip() + "\n")


def print_job(
    job: dict[str, Any], out: TextIO, *, deliveries: Sequence[dict[str, Any]] | None = None
) -> None:
    """One job's details, a field a line (an attempt of its command, a dependency, a webhook
    delivery a line); the message last (it may be long)."""
    fields = [
        ("submission_id", job.get("submission_id")),
        ("status", job.get("status")),
        ("exit_code", job.get("driver_exit_code")),
        ("entrypoint", job.get("entrypoint")),
        ("started", format_time(job.get("start_time"))),
        ("ended", format_time(job.get("end_time"))),
        ("error_type", job.get("error_type")),
    ]
    fields += [(f"metadata.{key}", value) for key, value in (job.get("metadata") or {}).items()]
    fields += [("priority", job.get("priority")), ("max_retries", job.get("max_retries"))]
    if job.get("retry_on_exit_codes"):
        fields.append(("retry_on", ", ".join(map(str, job["retry_on_exit_codes"]))))
    fields.append(("limits", describe_limits(job.get("limits"))))
    fields.append(("peak_memory", format_bytes(job.get("peak_memory_bytes"))))
    if (total_s := cpu_total_s(job)) is not None:
        user, system = (format_cpu_seconds(job.get(f"cpu_{kind}_s")) for kind in ("user", "system"))
        fields.append(("cpu_time", f"{format_cpu_seconds(total_s)} (user {user}, system {system})"))
    fields += [
        (f"attempt.{number}", describe_attempt(attempt))
        for number, attempt in enumerate(job.get("attempts") or [], start=1)
    ]
    fields += [
        (f"dependency.{number}", describe_dependency(dependency, job))
        for number, dependency in enumerate(job.get("depends_on") or [], start=1)
    ]
    fields += [
        (f"notify.{number}", f"{target.get('url')} ({', '.join(target.get('events') or [])})")
        for number, target in enumerate(job.get("notify") or [], start=1)
    ]
    fields += [
        (f"delivery.{number}", describe_delivery(delivery))
        for number, delivery in enumerate(deliveries or [], start=1)
    ]
    fields.append(("message", job.get("message")))
    for name, value in fields:
        if value not in (None, "", "-"):
            out.write(f"{name + ':':15}{value}\n")


def describe_attempt(attempt: dict[str, Any]) -> str:
    """One attempt of the command on a line: when it ran, how it ended, where its log begins,
    and what it used where that was measured."""
    started = format_time(attempt.get("start_time"))
    if attempt.get("end_time") is None:
        ran = f"{started}, running"
    else:
        exit_code = attempt.get("exit_code")
        ended = "no exit code" if exit_code is None else f"exit code {exit_code}"
        ran = f"{started} to {format_time(attempt['end_time'])}, {ended}"
    used = [f"{ran}, log from byte {attempt.get('log_offset')}"]
    if attempt.get("peak_memory_bytes") is not None:
        used.append(f"peak memory {format_bytes(attempt['peak_memory_bytes'])}")
    if cpu_total_s(attempt) is not None:
        used.append(
            f"CPU user {format_cpu_seconds(attempt.get('cpu_user_s'))}"
            f" system {format_cpu_seconds(attempt.get('cpu_system_s'))}"
        )
    if attempt.get("cpu_throttled_s") is not None:
        used.append(f"throttled {format_cpu_seconds(attempt['cpu_throttled_s'])}")
    return ", ".join(used)


NEVER_SATISFIED = "DEPENDENCY_NEVER_SATISFIED"


def describe_dependency(dependency: dict[str, Any], job: dict[str, Any] | None = None) -> str:
    """A job this one waits for, and whether that is met, as the web page says it: "met";
    "never" for the one `job` ended DEPENDENCY_NEVER_SATISFIED for (its message names it);
    "not yet" for one not met (still possible, as far as the job's details tell); "not known"."""
    job_id = dependency.get("submission_id")
    met = dependency.get("met")
    if met is True:
        met_text = "met"
    elif job is not None and never_ran_for(job) == job_id:
        met_text = "never"
    else:
        met_text = "not known" if met is None else "not yet"
    return f"after {job_id} {dependency.get('condition')}: {met_text}"


def never_ran_for(job: dict[str, Any]) -> str | None:
    """The id of the dependency a job ended DEPENDENCY_NEVER_SATISFIED for: its message
    begins with it ("prep ended FAILED; ...", "prep was deleted; ..."); None for another job."""
    message = job.get("message") or ""
    if job.get("error_type") != NEVER_SATISFIED:
        return None
    for dependency in job.get("depends_on") or []:
        job_id = dependency.get("submission_id")
        if message.startswith((f"{job_id} ended ", f"{job_id} was deleted;")):
            return str(job_id)
    return None


def describe_delivery(delivery: dict[str, Any]) -> str:
    """A webhook delivery on a line: its event, its target, its state and its last attempt."""
    attempts = delivery.get("attempts") or 0
    parts = [
        f"{delivery.get('event_type')} to {delivery.get('url')}: {delivery.get('state')}",
        f"{attempts} {'attempt' if attempts == 1 else 'attempts'}",
    ]
    if delivery.get("last_status_code") is not None:
        parts.append(f"last HTTP {delivery['last_status_code']}")
    if delivery.get("last_error"):
        parts.append(f"last error: {delivery['last_error']}")
    if delivery.get("next_attempt_at") is not None:
        parts.append(f"next at {format_time(delivery['next_attempt_at'])}")
    return ", ".join(parts)


def describe_limits(limits: dict[str, Any] | None) -> str | None:
    """A job's limits on a line ("memory 1.0 GiB, 0.5 CPU cores, 64 processes"); None: none."""
    if not limits:
        return None
    parts = []
    if limits.get("memory_bytes") is not None:
        parts.append(f"memory {format_bytes(limits['memory_bytes'])}")
    if (cores := limits.get("cpu_cores")) is not None:
        parts.append(f"{cores:g} CPU {'core' if cores == 1 else 'cores'}")
    if (processes := limits.get("max_processes")) is not None:
        parts.append(f"{processes} {'process' if processes == 1 else 'processes'}")
    return ", ".join(parts) or None


def cpu_total_s(usage: dict[str, Any]) -> float | None:
    """User and system CPU seconds of a job or an attempt together; None: not measured."""
    measured = [usage.get(name) for name in ("cpu_user_s", "cpu_system_s")]
    present = [seconds for seconds in measured if isinstance(seconds, int | float)]
    return sum(present) if present else None


def format_bytes(size: Any) -> str:
    """A size in binary units people read: 512 B, 1.5 MiB, 200.0 MiB, 4.0 GiB; `-` for none."""
    if not isinstance(size, int):
        return "-"
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in BINARY_UNITS:
        value /= 1024
        if value < 1024 or unit == BINARY_UNITS[-1]:
            break
    return f"{value:.1f} {unit}"


def format_cpu_seconds(seconds: Any) -> str:
    """CPU time to the hundredth of a second: 0.42s, 1m01.25s, 2h05m09s; `-` for none."""
    if not isinstance(seconds, int | float):
        return "-"
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)}m{rest:05.2f}s"
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}h{minutes:02d}m{int(rest):02d}s"


def format_time(epoch_ms: Any) -> str:
    if not isinstance(epoch_ms, int) or epoch_ms <= 0:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_ms / 1000))


def format_duration(start_ms: Any, end_ms: Any, now_ms: int) -> str:
    if not isinstance(start_ms, int) or start_ms <= 0:
        return "-"
    seconds = ((end_ms if isinstance(end_ms, int) and end_ms > 0 else now_ms) - start_ms) / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
