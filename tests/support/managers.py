"""A real JobManager on the session's Ray and an archive on disk, for the tests that drive the
manager without a server in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from jobs_server.manager import JobManager
from jobs_server.manager.archive.event_feed import EventFeed
from jobs_server.manager.archive.sqlite import Archive, archive_path


@asynccontextmanager
async def running_manager(
    gcs_address: str, namespace: str, state_dir: Path, **options: Any
) -> AsyncIterator[tuple[JobManager, Archive]]:
    """A started manager (and its archive, in `state_dir`), closed after; `options` go to
    JobManager (caps, tenants' limits, ...)."""
    archive = Archive(archive_path(state_dir), on_events=lambda events: event_feed.publish(events))
    event_feed = EventFeed(archive)
    await archive.open()
    manager = JobManager(
        gcs_address=gcs_address,
        namespace=namespace,
        archive=archive,
        event_feed=event_feed,
        log_dir=state_dir / "logs",
        stop_grace_s=0.5,
        **{"job_start_timeout_s": 60, **options},
    )
    await manager.start()
    try:
        yield manager, archive
    finally:
        await manager.close()
        await archive.close()
