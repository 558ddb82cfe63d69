"""The log scenarios: how late a followed line arrives, how soon the first one does, and how fast
(and with how much server memory) a large log is read by each reader a server offers.

The tail latency and the large log run on the head node (group `logs`) and again with the job on
a worker node (group `remote`): a `Placement` says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
import sys
import time
from collections.abc import Awaitable

from benchmarks.client import is_terminal, watch_statuses
from benchmarks.log_readers import (
    LogReadError,
    StreamRead,
    connect_tail,
    fetch_body,
    logs_path,
    ray_json_log,
    read_sse_log,
    read_whole_tail,
    tail_frames,
)
from benchmarks.report import Better, Figure, Metric, OursAtMost, Server, Target, Unit
from benchmarks.scenarios import (
    ON_HEAD,
    REQUEST_ERRORS,
    Placement,
    RunContext,
    Scenario,
    note_if_ran_elsewhere,
    p50,
    settle,
)
from benchmarks.stats import PeakRssGrowth, percentile

logger = logging.getLogger(__name__)

TICK_INTERVAL_S = 0.05
TICK_PREFIX = "tick "
# The job prints `tick <n> <time.time()>` lines; flushing anyway, though both servers set
# PYTHONUNBUFFERED.
TICKER_SCRIPT = (
    "import time\n"
    "for n in range({lines}):\n"
    "    print(f'" + TICK_PREFIX + "{{n}} {{time.time():.6f}}', flush=True)\n"
    "    time.sleep({interval_s})\n"
)
TAIL_TIMEOUT_S = 120.0
FIRST_LINE_ENTRYPOINT = "echo first; sleep 2"
FIRST_LINE_MARKER = "first"
FIRST_LINE_TIMEOUT_S = 60.0
JOB_END_POLL_INTERVAL_S = 0.1
JOB_END_TIMEOUT_S = 120.0
BIG_LOG_LINE_CHARS = 120
BASE64_TEXT = re.compile(rb"[A-Za-z0-9+/=\n]*")
BIG_LOG_JOB_TIMEOUT_S = 300.0
LOG_READ_TIMEOUT_S = 600.0
RSS_SAMPLE_INTERVAL_S = 0.02
OUR_RSS_LIMIT_BYTES = 32 * 2**20
NO_SUCH_ENDPOINT = "no such endpoint"


def python_entrypoint(script: str, *args: str) -> str:
    """A shell command running `script` with this interpreter (every node runs on this machine),
    with `args` in `sys.argv[1:]`."""
    return shlex.join([sys.executable, "-c", script, *args])


def is_base64_line(line: bytes) -> bool:
    """Whether `line` (without its newline) looks like a line of the large log job's output."""
    return len(line) == BIG_LOG_LINE_CHARS and BASE64_TEXT.fullmatch(line) is not None


class TickLatencies:
    """Print → receive latency of each `tick` line, from frames that may hold several lines or
    part of one."""

    def __init__(self) -> None:
        self._partial = ""
        self.latencies_s: list[float] = []

    def feed(self, text: str, received_at_s: float) -> None:
        """Take one frame, received at `received_at_s` (wall clock, as the job prints it)."""
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if not line.startswith(TICK_PREFIX):
                continue
            with contextlib.suppress(ValueError, IndexError):
                self.latencies_s.append(received_at_s - float(line.split()[2]))


class LogTailLatency(Scenario):
    """A job prints a timestamped line every 50 ms; the websocket tail's lag per line."""

    def __init__(self, lines: int, placement: Placement = ON_HEAD) -> None:
        self.lines = lines
        self.placement = placement
        self.group = placement.group
        self.title = placement.label(f"log tail latency ({lines} lines, one every 50 ms)")

    def metrics(self) -> list[Metric]:
        what = f"{self.lines} lines every {TICK_INTERVAL_S * 1000:.0f} ms"
        return self.placement.rows(
            [
                Metric(
                    "tail_latency_p50",
                    f"log line print → websocket tail p50 ({what})",
                    Unit.SECONDS,
                    Better.LOWER,
                    Target("≤ 1/20 of Ray's", 0.05),
                ),
                Metric(
                    "tail_latency_p99",
                    f"log line print → websocket tail p99 ({what})",
                    Unit.SECONDS,
                    Better.LOWER,
                ),
            ]
        )

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        script = TICKER_SCRIPT.format(lines=self.lines, interval_s=TICK_INTERVAL_S)
        [job_id] = ctx.job_ids(self.placement.key("tick"), 1)
        job = await ctx.api.submit(
            python_entrypoint(script), job_id, resources=self.placement.resources
        )
        try:
            ticks = await self._follow(ctx, job.submission_id)
        finally:
            await settle(ctx, [job.submission_id], what="ticker", timeout_s=JOB_END_TIMEOUT_S)
        await note_if_ran_elsewhere(ctx, job.submission_id, self.placement.node_ip)
        if len(ticks.latencies_s) != self.lines:
            ctx.note(f"the tail delivered {len(ticks.latencies_s)} of {self.lines} tick lines")
        if not ticks.latencies_s:
            return {}
        return self.placement.figures(
            {
                "tail_latency_p50": Figure(percentile(ticks.latencies_s, 50)),
                "tail_latency_p99": Figure(percentile(ticks.latencies_s, 99)),
            }
        )

    async def _follow(self, ctx: RunContext, submission_id: str) -> TickLatencies:
        ticks = TickLatencies()
        deadline_s = time.monotonic() + TAIL_TIMEOUT_S
        websocket = await connect_tail(ctx.api, submission_id, timeout_s=TAIL_TIMEOUT_S)
        async with (
            websocket,
            contextlib.aclosing(tail_frames(websocket, deadline_s=deadline_s)) as frames,
        ):
            async for text in frames:
                ticks.feed(text, time.time())
        return ticks


class TimeToFirstLine(Scenario):
    """`echo first; sleep 2`, tailed from right after the POST: POST sent → "first" received."""

    group = "logs"

    def __init__(self, runs: int) -> None:
        self.runs = runs
        self.title = f"submit → first log line ({runs} jobs, one at a time)"

    def metrics(self) -> list[Metric]:
        return [
            Metric(
                "first_line_p50",
                f"submit → first log line on the websocket tail p50 ({self.runs} jobs)",
                Unit.SECONDS,
                Better.LOWER,
            ),
        ]

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        took_s: list[float] = []
        for job_id in ctx.job_ids("first", self.runs):
            job = await ctx.api.submit(FIRST_LINE_ENTRYPOINT, job_id)
            try:
                took_s.append(await self._first_line_s(ctx, job.submission_id, job.sent_at_s))
            except LogReadError as error:
                ctx.note(f"first-line job {job.submission_id}: {error}")
            finally:
                # One job at a time: the next one does not share the machine with this one.
                await settle(
                    ctx, [job.submission_id], what="first-line", timeout_s=JOB_END_TIMEOUT_S
                )
        return {"first_line_p50": p50(took_s)}

    async def _first_line_s(self, ctx: RunContext, submission_id: str, sent_at_s: float) -> float:
        received = ""
        websocket = await connect_tail(ctx.api, submission_id, timeout_s=FIRST_LINE_TIMEOUT_S)
        frames = tail_frames(websocket, deadline_s=sent_at_s + FIRST_LINE_TIMEOUT_S)
        async with websocket, contextlib.aclosing(frames):
            async for text in frames:
                received += text
                if FIRST_LINE_MARKER in received:
                    return time.monotonic() - sent_at_s
        raise LogReadError(f"the tail closed without {FIRST_LINE_MARKER!r}; got {received!r:.200}")


class BigLog(Scenario):
    """A job writes N bytes of base64 text; then the whole log is read by each reader."""

    def __init__(self, size_bytes: int, placement: Placement = ON_HEAD) -> None:
        self.size_bytes = size_bytes
        self.size_text = f"{size_bytes / 2**20:.0f} MiB"
        self.placement = placement
        self.group = placement.group
        self.title = placement.label(f"a {self.size_text} log, read whole")

    def metrics(self) -> list[Metric]:
        log = f"{self.size_text} log"
        return self.placement.rows(
            [
                Metric(
                    "big_json_per_s",
                    f"GET /logs (JSON) of a finished {log}: throughput",
                    Unit.BYTES_PER_SECOND,
                    Better.HIGHER,
                    Target("≥ 4 times Ray's", 4.0),
                ),
                Metric(
                    "big_json_first_byte",
                    f"GET /logs (JSON) of a finished {log}: time to first byte",
                    Unit.SECONDS,
                    Better.LOWER,
                ),
                Metric(
                    "big_json_rss_growth",
                    f"GET /logs (JSON) of a finished {log}: server's peak RSS growth",
                    Unit.BYTES,
                    Better.LOWER,
                    OursAtMost("ours ≤ 32 MiB", OUR_RSS_LIMIT_BYTES),
                ),
                Metric(
                    "big_tail_per_s",
                    f"websocket tail of a finished {log}: throughput",
                    Unit.BYTES_PER_SECOND,
                    Better.HIGHER,
                    Target("≥ 10 times Ray's", 10.0),
                ),
                Metric(
                    "big_sse_per_s",
                    f"SSE /logs/stream of a finished {log}: throughput",
                    Unit.BYTES_PER_SECOND,
                    Better.HIGHER,
                ),
                Metric(
                    "big_text_per_s",
                    f"GET /logs?format=text of a finished {log}: throughput",
                    Unit.BYTES_PER_SECOND,
                    Better.HIGHER,
                ),
                Metric(
                    "big_readable",
                    f"submit → all of a {log} readable (the job seen ended)",
                    Unit.SECONDS,
                    Better.LOWER,
                ),
            ]
        )

    def entrypoint(self) -> str:
        """Exactly `size_bytes` printable bytes: base64 lines of random bytes, cut to size.

        The last `head` exits early; its writers' complaints about the broken pipe (if SIGPIPE is
        ignored) must not reach the log.
        """
        n = self.size_bytes
        return (
            f"head -c {n} /dev/urandom 2>/dev/null"
            f" | base64 -w {BIG_LOG_LINE_CHARS} 2>/dev/null | head -c {n}"
        )

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        [job_id] = ctx.job_ids(self.placement.key("biglog"), 1)
        job = await ctx.api.submit(self.entrypoint(), job_id, resources=self.placement.resources)
        try:
            status, ended_at_s = await self._wait_for_end(ctx, job.submission_id)
            if status != "SUCCEEDED" or ended_at_s is None:
                ctx.note(f"the {self.size_text} log job ended {status}")
                return {}
            await note_if_ran_elsewhere(ctx, job.submission_id, self.placement.node_ip)
            figures = await self._read_all_ways(ctx, job.submission_id)
            # The first read after the end returned every byte (else it is an error figure).
            whole = figures.get("big_json_per_s", Figure(None)).value is not None
            figures["big_readable"] = (
                Figure(ended_at_s - job.sent_at_s) if whole else Figure(None, "error")
            )
            return self.placement.figures(figures)
        finally:
            await settle(ctx, [job.submission_id], what="big-log", timeout_s=0)
            try:
                await ctx.api.delete(job.submission_id)
            except REQUEST_ERRORS as error:
                ctx.note(f"deleting the {self.size_text} log job failed: {error}")

    async def _wait_for_end(self, ctx: RunContext, submission_id: str) -> tuple[str, float | None]:
        """The job's terminal status and when it was first seen (monotonic)."""
        watch = await watch_statuses(
            ctx.api,
            [submission_id],
            is_terminal,
            interval_s=JOB_END_POLL_INTERVAL_S,
            timeout_s=BIG_LOG_JOB_TIMEOUT_S,
        )
        status = watch.status.get(submission_id, f"not done after {BIG_LOG_JOB_TIMEOUT_S:.0f} s")
        return status, watch.seen_at_s.get(submission_id)

    async def _read_all_ways(self, ctx: RunContext, submission_id: str) -> dict[str, Figure]:
        figures, log_bytes = await self._json_fetch(ctx, submission_id)
        # The other readers must return the same whole log, the server's preamble included.
        log_bytes = self.size_bytes if log_bytes is None else log_bytes
        figures["big_tail_per_s"] = await self._reader(
            ctx,
            "websocket tail",
            log_bytes,
            read_whole_tail(ctx.api, submission_id, timeout_s=LOG_READ_TIMEOUT_S),
        )
        if ctx.server is Server.RAY:
            missing = Figure(None, NO_SUCH_ENDPOINT)
            return figures | {"big_sse_per_s": missing, "big_text_per_s": missing}
        figures["big_sse_per_s"] = await self._reader(
            ctx,
            "SSE stream",
            log_bytes,
            read_sse_log(ctx.api, submission_id, timeout_s=LOG_READ_TIMEOUT_S),
        )
        figures["big_text_per_s"] = await self._reader(
            ctx, "text GET", log_bytes, self._text_fetch(ctx, submission_id)
        )
        return figures

    async def _json_fetch(
        self, ctx: RunContext, submission_id: str
    ) -> tuple[dict[str, Figure], int | None]:
        """The JSON GET's figures, and the log's length in bytes if it holds the job's output."""
        processes = await asyncio.to_thread(ctx.log_processes)
        logger.info("    watching the RSS of %d %s processes", len(processes), ctx.server)
        try:
            with PeakRssGrowth(
                processes, interval_s=RSS_SAMPLE_INTERVAL_S, max_duration_s=LOG_READ_TIMEOUT_S
            ) as rss:
                body = await fetch_body(
                    ctx.api, logs_path(submission_id), timeout_s=LOG_READ_TIMEOUT_S
                )
            log = ray_json_log(body.data).encode()
        except (*REQUEST_ERRORS, ValueError, KeyError, TypeError) as error:
            ctx.note(
                f"JSON GET of the {self.size_text} log failed: {type(error).__name__}: {error}"
            )
            return {}, None
        figures = {
            "big_json_first_byte": Figure(body.first_byte_s),
            "big_json_rss_growth": Figure(rss.growth_bytes),
        }
        preamble_bytes = len(log) - self.size_bytes
        if not self._ends_with_job_output(log):
            ctx.note(
                f"JSON GET of the {self.size_text} log gave {len(log)} bytes that do not end with "
                f"the job's {self.size_bytes} bytes of output"
            )
            figures["big_json_per_s"] = Figure(None, f"error: {len(log)} B, wrong content")
            return figures, None
        if preamble_bytes:
            first_line = log[: log.index(b"\n")].decode(errors="replace")
            ctx.note(
                f"the log holds {preamble_bytes} bytes the server wrote before the job's output "
                f"(first line: {first_line!r:.120}); every reader must return them too"
            )
        figures["big_json_per_s"] = Figure(len(log) / body.total_s)
        return figures, len(log)

    def _ends_with_job_output(self, log: bytes) -> bool:
        """Whether `log` is whole lines of the server's own (none of them like the job's), then
        exactly the job's output: base64 lines of BIG_LOG_LINE_CHARS, cut at `size_bytes`."""
        preamble_bytes = len(log) - self.size_bytes
        if preamble_bytes < 0:
            return False
        preamble, output = log[:preamble_bytes], log[preamble_bytes:]
        if preamble and (
            not preamble.endswith(b"\n") or is_base64_line(preamble[:-1].rsplit(b"\n", 1)[-1])
        ):
            return False
        return (
            BASE64_TEXT.fullmatch(output) is not None
            and output.count(b"\n") == self.size_bytes // (BIG_LOG_LINE_CHARS + 1)
            and (len(output) <= BIG_LOG_LINE_CHARS or output[BIG_LOG_LINE_CHARS] == ord("\n"))
        )

    async def _text_fetch(self, ctx: RunContext, submission_id: str) -> StreamRead:
        body = await fetch_body(
            ctx.api, logs_path(submission_id) + "?format=text", timeout_s=LOG_READ_TIMEOUT_S
        )
        return StreamRead(len(body.data), body.total_s)

    async def _reader(
        self, ctx: RunContext, what: str, log_bytes: int, read: Awaitable[StreamRead]
    ) -> Figure:
        """The reader's throughput, or an error figure if it failed or missed some of the log."""
        try:
            result = await read
        except REQUEST_ERRORS as error:
            ctx.note(f"{what} of the {self.size_text} log failed: {type(error).__name__}: {error}")
            return Figure(None, "error")
        if result.log_bytes != log_bytes:
            ctx.note(
                f"{what} of the {self.size_text} log gave {result.log_bytes} bytes, not {log_bytes}"
            )
            return Figure(None, f"error: {result.log_bytes} of {log_bytes} B")
        return Figure(result.log_bytes / result.total_s)
