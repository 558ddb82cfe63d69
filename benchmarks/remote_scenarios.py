"""Losing a worker node: is the log of a job that ran there still readable, and how soon does the
job show FAILED?

Unlike the other scenarios, this one starts and kills Ray processes: a throwaway worker node per
server, joined to the benchmark's cluster, whose raylet it SIGKILLs while a job runs there.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import psutil

from benchmarks.client import is_terminal, watch_statuses
from benchmarks.log_readers import logs_path, ray_json_log
from benchmarks.log_scenarios import python_entrypoint
from benchmarks.processes import (
    kill_survivors,
    start_ray_worker,
    stop_ray_worker,
    surviving_processes,
)
from benchmarks.report import Better, Figure, Metric, Server, Unit, answer
from benchmarks.scenarios import (
    ON_WORKER,
    REQUEST_ERRORS,
    RunContext,
    Scenario,
    note_if_ran_elsewhere,
    poll_until,
    stop_and_wait,
)
from tests.support.ray_nodes import RayNode

logger = logging.getLogger(__name__)

# One throwaway node per server (each is lost for good), on addresses of their own.
LOST_NODE_IPS = {Server.RAY: "127.0.0.32", Server.OURS: "127.0.0.33"}
LOST_NODE_RESOURCE = "bench_lost_node"
LOST_NODE_CPUS = 1
# The job prints one known line and sleeps; its argument (the job id) lets the benchmark find
# its process afterwards.
LOST_JOB_SCRIPT = (
    "import sys, time\nprint('still here', sys.argv[1], flush=True)\ntime.sleep(600)\n"
)
LINE_TIMEOUT_S = 120.0
LINE_POLL_INTERVAL_S = 0.1
LOSS_TIMEOUT_S = 120.0
LOSS_POLL_INTERVAL_S = 0.1
LOG_GET_TIMEOUT_S = 30.0
# How long after the job's verdict its process may take to go.
JOB_PROCESS_GRACE_S = 10.0
ERROR_BODY_CHARS = 200


class NodeLoss(Scenario):
    """A job on a throwaway worker node prints a line; the node's raylet is SIGKILLed; then: how
    long until the job shows FAILED, and does GET /logs still give the line?"""

    group = ON_WORKER.group
    title = "a job on a worker node that is lost"

    def metrics(self) -> list[Metric]:
        return [
            Metric(
                "node_loss_log",
                "job on a lost worker node: its log line still readable (GET /logs after the loss)",
                Unit.ANSWER,
                Better.HIGHER,
            ),
            Metric(
                "node_loss_failed",
                f"job on a lost worker node: raylet SIGKILL → job FAILED "
                f"(waited at most {LOSS_TIMEOUT_S:.0f} s)",
                Unit.SECONDS,
                Better.LOWER,
            ),
        ]

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        try:
            node = await asyncio.to_thread(
                start_ray_worker,
                ctx.head,
                name=f"lost-{ctx.server.name.lower()}",
                ip=LOST_NODE_IPS[ctx.server],
                resources={LOST_NODE_RESOURCE: 1},
                num_cpus=LOST_NODE_CPUS,
            )
        except AssertionError as error:
            ctx.note(f"the throwaway worker node did not start: {error}")
            return {}
        [job_id] = ctx.job_ids("lost", 1)
        try:
            return await self._lose_node_under_job(ctx, node, job_id)
        finally:
            await asyncio.to_thread(stop_ray_worker, node)
            for pid, cmdline in await asyncio.to_thread(kill_survivors, job_id):
                logger.info("    killed the lost job's process %d: %s", pid, cmdline)
            await self._stop_if_going(ctx, job_id)

    async def _lose_node_under_job(
        self, ctx: RunContext, node: RayNode, job_id: str
    ) -> dict[str, Figure]:
        line = f"still here {job_id}"
        await ctx.api.submit(
            python_entrypoint(LOST_JOB_SCRIPT, job_id),
            job_id,
            resources={LOST_NODE_RESOURCE: 1},
        )
        if not await self._wait_for_line(ctx, job_id, line):
            return {}
        await note_if_ran_elsewhere(ctx, job_id, node.ip)
        try:
            raylet = node.raylet()
        except (AssertionError, psutil.Error) as error:
            ctx.note(f"the throwaway worker node had no raylet to kill: {error!r}")
            return {}
        raylet.kill()
        killed_at_s = time.monotonic()
        logger.info("    killed the raylet of %s; waiting for the job to end", node.ip)
        figures = {"node_loss_failed": await self._time_to_failed(ctx, job_id, killed_at_s)}
        status, text = await get_log(ctx, job_id)
        if status == 200 and line in text:
            figures["node_loss_log"] = answer("yes (HTTP 200)")
        else:
            figures["node_loss_log"] = answer(f"no ({'HTTP ' + str(status) if status else text})")
            ctx.note(
                f"GET /logs after the loss: {status or 'no answer'}, {text[:ERROR_BODY_CHARS]!r}"
            )
        await self._note_if_job_outlives(ctx, job_id, killed_at_s)
        return figures

    async def _note_if_job_outlives(self, ctx: RunContext, job_id: str, killed_at_s: float) -> None:
        """Note the job's process if it still runs a while after the job's verdict (the
        benchmark kills it afterwards)."""

        async def gone() -> bool:
            return not await asyncio.to_thread(surviving_processes, job_id)

        if await poll_until(gone, timeout_s=JOB_PROCESS_GRACE_S, interval_s=LOSS_POLL_INTERVAL_S):
            return
        survivors = await asyncio.to_thread(surviving_processes, job_id) or [(0, "(gone now)")]
        ctx.note(
            f"the job's process was still running {time.monotonic() - killed_at_s:.0f} s after "
            f"its node's raylet was killed (the benchmark killed it): {survivors[0][1]!r:.120}"
        )

    async def _time_to_failed(self, ctx: RunContext, job_id: str, killed_at_s: float) -> Figure:
        """Seconds from the kill to the first poll that shows the job FAILED; a note with the
        job's message."""
        watch = await watch_statuses(
            ctx.api,
            [job_id],
            is_terminal,
            interval_s=LOSS_POLL_INTERVAL_S,
            timeout_s=LOSS_TIMEOUT_S,
        )
        job = await ctx.api.job(job_id)
        status = job.get("status")
        seen_at_s = watch.seen_at_s.get(job_id)
        message = str(job.get("message") or "")[:ERROR_BODY_CHARS]
        if seen_at_s is None:
            ctx.note(f"the lost job was still {status} {LOSS_TIMEOUT_S:.0f} s after: {message!r}")
            return Figure(None, f"> {LOSS_TIMEOUT_S:.0f} s (still {status})")
        took_s = seen_at_s - killed_at_s
        ctx.note(f"the lost job ended {status} {took_s:.1f} s after the kill: {message!r}")
        if status != "FAILED":
            return Figure(None, f"{status} after {took_s:.1f} s")
        return Figure(took_s)

    async def _wait_for_line(self, ctx: RunContext, job_id: str, line: str) -> bool:
        """Poll GET /logs until it holds `line`; note it if it never does."""

        async def shows_line() -> bool:
            status, text = await get_log(ctx, job_id)
            return status == 200 and line in text

        if await poll_until(shows_line, timeout_s=LINE_TIMEOUT_S, interval_s=LINE_POLL_INTERVAL_S):
            return True
        status, text = await get_log(ctx, job_id)
        ctx.note(
            f"the job on the throwaway node never showed its line in {LINE_TIMEOUT_S:.0f} s "
            f"(last GET /logs: {status}, {text[:ERROR_BODY_CHARS]!r})"
        )
        return False

    async def _stop_if_going(self, ctx: RunContext, job_id: str) -> None:
        """Stop the job if its server still has it going (Ray's may, long after the loss)."""
        try:
            status = await ctx.api.status(job_id)
        except REQUEST_ERRORS as error:
            ctx.note(f"the lost job's status after the scenario: {error}")
            return
        if not is_terminal(status):
            await stop_and_wait(ctx, [job_id], what="lost-node")


async def get_log(ctx: RunContext, job_id: str) -> tuple[int | None, str]:
    """GET /logs (JSON): the HTTP status and the log, or the error body; no status if the server
    did not answer."""
    try:
        async with ctx.api.session.get(
            ctx.api.url(logs_path(job_id)), timeout=aiohttp.ClientTimeout(total=LOG_GET_TIMEOUT_S)
        ) as response:
            body = await response.read()
            if response.status != 200:
                return response.status, body.decode(errors="replace")
            return 200, ray_json_log(body)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as error:
        return None, f"{type(error).__name__}: {error}"
