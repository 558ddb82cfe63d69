"""The cluster as a shutdown finds it (manager/cluster/leaving.py), without Ray: once a call or
the cluster watch finds the GCS gone, no later call is made, and one warning says so."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import cast

import pytest

from jobs_server.errors import ClusterUnavailableError
from jobs_server.manager.cluster.leaving import ClusterAtShutdown
from jobs_server.manager.cluster.ray_cluster import ClusterHealth


@dataclass
class FakeHealth:
    """What ClusterAtShutdown reads of the cluster watch: its view, and its probe."""

    answers: bool = True
    unavailable_reason: str | None = None
    probes: list[str] = field(default_factory=list)

    async def probe(self) -> None:
        self.probes.append("probe")
        if not self.answers:
            raise ClusterUnavailableError("Ray's GCS did not answer (get): timed out")


def at_shutdown(health: FakeHealth) -> ClusterAtShutdown:
    return ClusterAtShutdown(cast(ClusterHealth, health))


def gone_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "gone during shutdown" in record.getMessage()
    ]


async def test_a_cluster_that_answers_is_asked_each_time(caplog: pytest.LogCaptureFixture) -> None:
    health = FakeHealth()
    cluster = at_shutdown(health)
    assert await cluster.answers()
    assert await cluster.answers()

    async def read() -> str:
        return "value"

    assert await cluster.call("reading", read) == "value"
    assert health.probes == ["probe", "probe"]
    assert not cluster.gone
    assert gone_warnings(caplog) == []


async def test_once_a_call_finds_the_cluster_gone_no_call_follows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health = FakeHealth()
    cluster = at_shutdown(health)
    made: list[str] = []

    async def unregister() -> None:
        made.append("unregister")
        raise ClusterUnavailableError("Ray's GCS did not answer (delete): timed out")

    async def record_stop() -> None:
        made.append("record_stop")

    with pytest.raises(ClusterUnavailableError):
        await cluster.call("removing the registration", unregister)
    with pytest.raises(ClusterUnavailableError):
        await cluster.call("recording a stop", record_stop)
    assert not await cluster.answers()
    assert made == ["unregister"]
    assert health.probes == []
    assert cluster.gone
    (warning,) = gone_warnings(caplog)
    assert "removing the registration" in warning


async def test_a_probe_that_finds_the_gcs_gone_is_the_last(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health = FakeHealth(answers=False)
    cluster = at_shutdown(health)
    assert not await cluster.answers()
    assert not await cluster.answers()
    assert health.probes == ["probe"]
    assert len(gone_warnings(caplog)) == 1


async def test_what_the_watch_found_is_not_asked_again(caplog: pytest.LogCaptureFixture) -> None:
    health = FakeHealth(unavailable_reason="Ray's GCS at 127.0.0.1:1 does not answer.")
    cluster = at_shutdown(health)
    assert not await cluster.answers()
    assert health.probes == []
    (warning,) = gone_warnings(caplog)
    assert "127.0.0.1:1 does not answer" in warning


async def test_an_error_that_is_not_the_gcs_is_raised_and_the_cluster_is_not_gone() -> None:
    cluster = at_shutdown(FakeHealth())

    async def broken() -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        await cluster.call("reading", broken)
    assert not cluster.gone
