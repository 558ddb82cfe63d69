"""A follower replica sends job writes on to the leader (serving/leader_forwarding.py): checked
here first (the key), sent with the client's key and body, answered with the leader's answer;
headers of the hop and a client's X-Forwarded-* are not passed on; a write that was already
forwarded is never forwarded again; a leader that cannot be reached, or that drops its answer,
is a 503 `leader_unavailable` saying whether the write may have been done. Real apps on loopback
ports, on the in-memory manager (no Ray: what is under test is the HTTP hop)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from jobs_server.app import create_app
from jobs_server.manager.archive.leadership import FORWARDED_BY_HEADER
from jobs_server.serving.leader_forwarding import LEADER_CHECK_INTERVAL_S
from jobs_server.settings import Settings
from tests.support.fakes import FakeJobManager
from tests.support.processes import free_port

Client = TestClient[Any, Any]
KEY = "forwarding-test-key-0123456789"


class FollowerManager(FakeJobManager):
    """A follower's manager: every job write goes to `leader`, which leads while `leads`."""

    def __init__(self, log_dir: Path, leader: str) -> None:
        super().__init__(log_dir, max_package_bytes=1024)
        self.leader = leader
        self.leads = True

    async def leader_url(self) -> str | None:
        return self.leader

    async def leads_at(self, url: str) -> bool:
        return self.leads and url == self.leader


def _settings(tmp_path: Path, name: str, **options: Any) -> Settings:
    token_file = tmp_path / "token"
    token_file.write_text(KEY)
    token_file.chmod(0o600)
    return Settings(
        port=0,
        state_dir=tmp_path / name / "state",
        log_dir=tmp_path / name / "logs",
        namespace="fake",
        auth_token_file=token_file,
        **options,
    )


@pytest.fixture
async def leader(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> tuple[Client, FakeJobManager]:
    settings = _settings(tmp_path, "leader")
    manager = FakeJobManager(settings.log_dir, max_package_bytes=1024)
    return await aiohttp_client(create_app(settings, backend=manager.backend())), manager


async def _follower(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path, leader_url: str
) -> tuple[Client, FollowerManager]:
    settings = _settings(tmp_path, "follower")
    manager = FollowerManager(settings.log_dir, leader_url.rstrip("/"))
    return await aiohttp_client(create_app(settings, backend=manager.backend())), manager


AUTH = {"Authorization": f"Bearer {KEY}"}


async def test_job_writes_on_a_follower_are_done_by_the_leader(
    aiohttp_client: Callable[..., Awaitable[Client]],
    tmp_path: Path,
    leader: tuple[Client, FakeJobManager],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="jobs_server.audit")
    leader_client, leader_manager = leader
    follower, follower_manager = await _follower(
        aiohttp_client, tmp_path, str(leader_client.make_url("/"))
    )

    submitted = await follower.post(
        "/api/jobs/", json={"entrypoint": "echo hi", "submission_id": "one"}, headers=AUTH
    )
    assert submitted.status == 200, await submitted.text()
    assert (await submitted.json())["submission_id"] == "one"
    assert "one" in leader_manager._records
    assert "one" not in follower_manager._records  # reads are the follower's own
    # The leader sees the follower as its peer: the follower's audit line names the client.
    forwards = [r.getMessage() for r in caplog.records if r.getMessage().startswith("forward ")]
    assert forwards[0].startswith("forward /api/jobs/ remote=127.0.0.1 authenticated=True")
    assert "status=200" in forwards[0]
    duplicate = await follower.post(
        "/api/jobs/", json={"entrypoint": "echo hi", "submission_id": "one"}, headers=AUTH
    )
    assert duplicate.status == 409
    assert (await duplicate.json())["error"]["code"] == "duplicate_submission_id"

    stopped = await follower.post("/api/jobs/one/stop", headers=AUTH)
    assert stopped.status == 200, await stopped.text()
    assert leader_manager._records["one"].status.is_terminal()
    deleted = await follower.delete("/api/jobs/one", headers=AUTH)
    assert deleted.status == 200, await deleted.text()
    assert "one" not in leader_manager._records
    missing = await follower.delete("/api/jobs/one", headers=AUTH)
    assert missing.status == 404
    assert (await missing.json())["error"]["code"] == "job_not_found"


async def test_a_follower_refuses_a_request_without_a_key_before_the_leader_sees_it(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    seen: list[web.Request] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request)
        return web.json_response({})

    echo = web.Application()
    echo.router.add_route("*", "/{tail:.*}", record)
    async with TestServer(echo, host="127.0.0.1") as server:
        follower, _ = await _follower(aiohttp_client, tmp_path, str(server.make_url("/")))
        refused = await follower.post("/api/jobs/", json={"entrypoint": "true"})
        assert refused.status == 401
        wrong = await follower.post(
            "/api/jobs/", json={"entrypoint": "true"}, headers={"Authorization": "Bearer no"}
        )
        assert wrong.status == 403
    assert seen == []


async def test_the_leader_gets_the_client_s_request_without_the_hop_s_headers(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.method, request.path_qs, dict(request.headers), await request.read()))
        return web.json_response(
            {"stopped": True}, status=202, headers={"Retry-After": "7", "X-From": "leader"}
        )

    echo = web.Application()
    echo.router.add_route("*", "/{tail:.*}", record)
    async with TestServer(echo, host="127.0.0.1") as server:
        follower, _ = await _follower(aiohttp_client, tmp_path, str(server.make_url("/")))
        answer = await follower.post(
            "/api/jobs/a%20b/stop?x=1",
            data=b'{"grace_period_s": 1}',
            headers={
                **AUTH,
                "Content-Type": "application/json",
                "X-Forwarded-For": "203.0.113.9",
                "Forwarded": "for=203.0.113.9",
                "X-Custom": "kept",
            },
        )
        assert answer.status == 202
        assert await answer.json() == {"stopped": True}
        assert answer.headers["Retry-After"] == "7"
        assert answer.headers["X-From"] == "leader"
    [(method, path_qs, headers, body)] = seen
    assert (method, path_qs, body) == ("POST", "/api/jobs/a%20b/stop?x=1", b'{"grace_period_s": 1}')
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert headers["X-Custom"] == "kept"
    assert headers[FORWARDED_BY_HEADER] == "1"
    assert headers["Host"] == follower.make_url("/").raw_authority  # the client's, checked again
    # The client's X-Forwarded-* are not passed on; the follower's own view is.
    assert headers["X-Forwarded-For"] == "127.0.0.1"
    assert headers["X-Forwarded-Proto"] == "http"
    assert headers["X-Forwarded-Host"] == headers["Host"]
    assert "Forwarded" not in headers


async def test_reads_are_answered_by_the_follower_itself(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    # A leader that cannot be reached: a read that went there would fail.
    follower, _ = await _follower(aiohttp_client, tmp_path, f"http://127.0.0.1:{free_port()}")
    listed = await follower.get("/api/jobs/", headers=AUTH)
    assert listed.status == 200
    assert await listed.json() == []


async def test_a_write_forwarded_once_is_never_forwarded_again(
    aiohttp_client: Callable[..., Awaitable[Client]],
    tmp_path: Path,
    leader: tuple[Client, FakeJobManager],
) -> None:
    leader_client, leader_manager = leader
    follower, _ = await _follower(aiohttp_client, tmp_path, str(leader_client.make_url("/")))
    answer = await follower.post(
        "/api/jobs/", json={"entrypoint": "true"}, headers={**AUTH, FORWARDED_BY_HEADER: "1"}
    )
    assert answer.status == 503
    assert (await answer.json())["error"]["code"] == "leader_unavailable"
    assert answer.headers["Retry-After"] == "2"
    assert leader_manager._records == {}


async def test_a_leader_that_cannot_be_reached_is_a_503_that_says_nothing_was_done(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    follower, _ = await _follower(aiohttp_client, tmp_path, f"http://127.0.0.1:{free_port()}")
    answer = await follower.post("/api/jobs/", json={"entrypoint": "true"}, headers=AUTH)
    assert answer.status == 503
    error = (await answer.json())["error"]
    assert error["code"] == "leader_unavailable"
    assert "nothing was done" in error["message"]
    assert answer.headers["Retry-After"] == "2"


async def test_a_leader_that_drops_its_answer_is_a_503_that_says_it_may_have_been_done(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    taken = asyncio.Event()

    async def drop(request: web.Request) -> web.Response:
        await request.read()
        taken.set()
        assert request.transport is not None
        request.transport.close()  # the leader died after taking the write
        return web.json_response({})

    echo = web.Application()
    echo.router.add_route("*", "/{tail:.*}", drop)
    async with TestServer(echo, host="127.0.0.1") as server:
        follower, _ = await _follower(aiohttp_client, tmp_path, str(server.make_url("/")))
        answer = await follower.post("/api/jobs/", json={"entrypoint": "true"}, headers=AUTH)
        assert taken.is_set()
        assert answer.status == 503
        error = (await answer.json())["error"]
        assert error["code"] == "leader_unavailable"
        assert "may have been done" in error["message"]


async def _held_leader(
    answer_after_s: float | None,
) -> tuple[web.Application, asyncio.Event]:
    """A leader that takes a write and answers after `answer_after_s` (None: never, as one
    frozen by SIGSTOP, whose socket still accepts)."""
    taken = asyncio.Event()

    async def hold(request: web.Request) -> web.Response:
        await request.read()
        taken.set()
        await asyncio.sleep(3600 if answer_after_s is None else answer_after_s)
        return web.json_response({"submission_id": "slow"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hold)
    return app, taken


async def test_a_write_held_by_a_leader_that_lost_the_lead_is_answered_503_in_doubt(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    frozen, taken = await _held_leader(None)
    async with TestServer(frozen, host="127.0.0.1") as server:
        follower, manager = await _follower(aiohttp_client, tmp_path, str(server.make_url("/")))
        answering = asyncio.ensure_future(
            follower.post("/api/jobs/", json={"entrypoint": "true"}, headers=AUTH)
        )
        await taken.wait()
        manager.leads = False  # another replica took the lease of the frozen one
        answer = await asyncio.wait_for(answering, LEADER_CHECK_INTERVAL_S * 5)
        assert answer.status == 503
        error = (await answer.json())["error"]
        assert error["code"] == "leader_unavailable"
        assert "may have been done" in error["message"]


async def test_a_slow_answer_of_a_leader_that_still_leads_is_waited_for(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    slow, _ = await _held_leader(LEADER_CHECK_INTERVAL_S * 2.5)
    async with TestServer(slow, host="127.0.0.1") as server:
        follower, _ = await _follower(aiohttp_client, tmp_path, str(server.make_url("/")))
        answer = await follower.post("/api/jobs/", json={"entrypoint": "true"}, headers=AUTH)
        assert answer.status == 200
        assert await answer.json() == {"submission_id": "slow"}


async def test_a_page_behind_a_tls_proxy_writes_through_a_follower(
    aiohttp_client: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    """Behind a TLS-terminating proxy (trusted by both replicas, as the replicas trust each
    other), the page's origin is `https://jobs.example`: the follower checks it as the proxy
    says, and so must the leader, to which the follower says what it resolved. Before, the
    leader saw plain `http` and refused the page's submit as cross-site (403)."""
    behind_proxy = {"forwarded_allow_ips": ["127.0.0.1"], "allowed_hosts": ["jobs.example"]}
    leader_settings = _settings(tmp_path, "leader", **behind_proxy)
    leader_manager = FakeJobManager(leader_settings.log_dir, max_package_bytes=1024)
    leader_client = await aiohttp_client(
        create_app(leader_settings, backend=leader_manager.backend())
    )
    follower_settings = _settings(tmp_path, "follower", **behind_proxy)
    follower_manager = FollowerManager(
        follower_settings.log_dir, str(leader_client.make_url("/")).rstrip("/")
    )
    follower = await aiohttp_client(
        create_app(follower_settings, backend=follower_manager.backend())
    )
    page = {
        **AUTH,
        "Origin": "https://jobs.example",
        "Sec-Fetch-Site": "same-origin",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "jobs.example",
        "X-Forwarded-For": "198.51.100.7",
    }
    answer = await follower.post(
        "/api/jobs/", json={"entrypoint": "true", "submission_id": "from-the-page"}, headers=page
    )
    assert answer.status == 200, await answer.text()
    assert "from-the-page" in leader_manager._records
    # A page on another site is still refused, by the follower and by the leader.
    other_site = {**page, "Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
    refused = await follower.post("/api/jobs/", json={"entrypoint": "true"}, headers=other_site)
    assert refused.status == 403
    assert (await refused.json())["error"]["code"] == "cross_site_request"
