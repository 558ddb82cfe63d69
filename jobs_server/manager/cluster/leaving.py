"""The Ray cluster as a shutdown finds it: asked once (a bounded probe) before the shutdown's
calls to it, and never again once found gone.

A SIGTERM to an embedded server's whole process group (a shell's `kill -- -PGID`, systemd's
default `KillMode=control-group`, a container runtime that signals every process) ends the
embedded Ray's processes as the server begins to shut down. Ray does not fail fast when its GCS
is gone: each KV call waits out its timeout, and `ray.shutdown()` waits on the GCS before it lets
go. One call after the other, that shutdown took up to a minute.

No GCS call is cancelled here: a call cancelled while Ray waits for the answer fails an assertion
in Ray's callback when the answer (or its timeout) comes, and Ray's exception hook then reports
it to the GCS, blocking Ray's client thread on a GCS that is gone: at the process's exit, that
thread was what kept it alive for a minute and then crashed it (SIGSEGV). Every call is bounded by
its own timeout instead (the probe's: GCS_PROBE_TIMEOUT_S).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from jobs_server.errors import ClusterUnavailableError
from jobs_server.manager.cluster.ray_cluster import ClusterHealth
from jobs_server.manager.live.kv import RETRYABLE_GCS_ERRORS
from jobs_server.manager.supervisor_calls import first_line

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class ClusterAtShutdown:
    """Whether the cluster still answers, as the shutdown found it (one per server)."""

    def __init__(
        self, health: ClusterHealth | None = None, *, ends_with_the_server: bool = False
    ) -> None:
        # The cluster watch's view, and its probe: a GCS it found away is not asked again.
        self._health = health
        self._gone_reason: str | None = None
        # An embedded Ray: it stops with the server, and what it holds with it.
        self.ends_with_the_server = ends_with_the_server

    @property
    def gone(self) -> bool:
        """Whether the cluster was found gone (by a call of the shutdown, or by the watch)."""
        watched = None if self._health is None else self._health.unavailable_reason
        if self._gone_reason is None and watched is not None:
            self.note_gone(watched)
        return self._gone_reason is not None

    def note_gone(self, reason: str) -> None:
        """The cluster does not answer: say so, once; the calls after this are skipped."""
        if self._gone_reason is not None:
            return
        self._gone_reason = reason
        logger.warning(
            "the Ray cluster was gone during shutdown (%s): the server shuts down without it; "
            "the next start's recovery settles the jobs it could not stop or record",
            reason,
        )

    async def call(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """`call()` (bounded by its own timeout); ClusterUnavailableError without a call if the
        cluster was found gone, or when this call finds it so (then the calls after it are
        skipped)."""
        if self.gone:
            raise ClusterUnavailableError(f"{what}: skipped, the Ray cluster is gone")
        try:
            return await call()
        except RETRYABLE_GCS_ERRORS as error:
            self.note_gone(f"{what}: {first_line(error)}")
            raise ClusterUnavailableError(f"{what}: {first_line(error)}") from error

    async def answers(self) -> bool:
        """Whether the cluster answers: its GCS asked once (a KV read, at most
        GCS_PROBE_TIMEOUT_S) unless it was found gone already."""
        if self._health is None:
            return not self.gone
        try:
            await self.call("asking Ray's GCS whether it is there", self._health.probe)
        except ClusterUnavailableError:
            return False
        return True
