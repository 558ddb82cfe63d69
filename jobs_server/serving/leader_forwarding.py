"""Job writes on a follower go to the leader (manager/archive/leadership.py).

Several replicas share one database; one of them, the leader, runs the queue and watches the
jobs, so a submit, a stop or a delete is decided there, with the queue's caps and order exact.
A follower checks the request as any replica does (its Host, its origin, its key: a request
refused here never reaches the leader), then sends it on as it came, with the client's key, and
answers with the leader's answer. The leader checks it again, with the same settings and the
same tokens file as every replica.

Headers that describe this hop (Connection, Content-Length, ...) are not forwarded, nor the
client's `X-Forwarded-*`/`Forwarded`, which the leader would read as the follower's word. The
follower says instead what it resolved (`X-Forwarded-Proto`/`-Host`/`-For`: the scheme, name
and client it checked, as a trusted proxy in front told it), and the leader believes it only if
the follower is one of its `--forwarded-allow-ips`: behind a TLS-terminating proxy, the page's
`https://` origin is then checked the same on both. Otherwise the leader sees the follower as
the peer; the follower writes the audit line that names the client (`forward`, with the
leader's answer). A forwarded write carries
FORWARDED_BY_HEADER, so a replica that gets one and does not lead (it lost the lead while the
write was on its way) answers 503 instead of forwarding it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from jobs_server.app_state import FORWARDING_SESSION_KEY, JOB_MANAGER_KEY
from jobs_server.audit import audit
from jobs_server.errors import LeaderUnavailableError
from jobs_server.manager.archive.leadership import FORWARDED_BY_HEADER
from jobs_server.serving.middlewares import Handler

logger = logging.getLogger(__name__)

# The routes that change jobs: decided by the leader.
WRITE_ROUTES = frozenset({"submit_job", "stop_job", "delete_job"})
# A leader that does not accept a connection within this is taken as gone (the follower
# answers 503 and the client retries, by then perhaps to a new leader). Its answer may take
# long (a submit whose supervisor needs a runtime env): no bound on that but the client's.
CONNECT_TIMEOUT_S = 5.0
# While a forwarded write waits for the leader's answer, how often the follower checks that the
# leader still leads.
LEADER_CHECK_INTERVAL_S = 1.0
# Headers of this hop only (RFC 9110 7.6.1), and the client's address as a proxy tells it.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        FORWARDED_BY_HEADER.lower(),
    }
)
_NOT_ANSWERED = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
)
_NOT_SENT_MESSAGE = (
    "The replica that leads the jobs ({url}) could not be reached: nothing was done; retry"
    " shortly (another replica takes the lead over within seconds)."
)
_IN_DOUBT_MESSAGE = (
    "The replica that leads the jobs ({url}) took the request but its answer was lost: it may"
    " have been done. Retry it: a submit retried with the same submission_id answers 409 if it"
    " was recorded, a stop or delete answers as the job is now."
)


async def forwarding_session(app: web.Application) -> AsyncIterator[None]:
    """The client that forwards job writes to the leader, for the app's life."""
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
        auto_decompress=False,
    )
    app[FORWARDING_SESSION_KEY] = session
    try:
        yield
    finally:
        await session.close()


@web.middleware
async def leader_forwarding_middleware(
    request: web.Request, handler: Handler
) -> web.StreamResponse:
    """Send a job write on to the leader, unless this replica leads."""
    if request.match_info.route.name not in WRITE_ROUTES:
        return await handler(request)
    leader_url = await request.app[JOB_MANAGER_KEY].leader_url()
    if leader_url is None:
        return await handler(request)
    if FORWARDED_BY_HEADER in request.headers:
        raise LeaderUnavailableError(
            "This replica does not lead the jobs now (the lead changed while the request was"
            " forwarded); retry shortly."
        )
    return await _forward(request, leader_url)


@dataclass(frozen=True)
class _Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


async def _forward(request: web.Request, leader_url: str) -> web.Response:
    body = await request.read()
    headers = {
        name: value for name, value in request.headers.items() if name.lower() not in _NOT_FORWARDED
    }
    headers[FORWARDED_BY_HEADER] = "1"
    # As this follower resolved them (request_origin_middleware), for a leader that trusts it.
    headers["X-Forwarded-Proto"] = request.scheme
    headers["X-Forwarded-Host"] = request.host
    if request.remote:
        headers["X-Forwarded-For"] = request.remote
    sending = asyncio.ensure_future(_send(request, leader_url, headers, body))
    try:
        answer = await _while_it_leads(request, leader_url, sending)
    except aiohttp.ClientConnectorError as error:
        audit(request, "forward", request.path, leader=leader_url, status="unreachable")
        logger.warning("the leader at %s does not answer: %s", leader_url, error)
        raise LeaderUnavailableError(_NOT_SENT_MESSAGE.format(url=leader_url)) from error
    except (TimeoutError, aiohttp.ClientError, _LeadChanged) as error:
        audit(request, "forward", request.path, leader=leader_url, status="answer lost")
        logger.warning("the leader at %s took a write and did not answer: %s", leader_url, error)
        raise LeaderUnavailableError(_IN_DOUBT_MESSAGE.format(url=leader_url)) from error
    finally:
        sending.cancel()
    audit(request, "forward", request.path, leader=leader_url, status=answer.status)
    response = web.Response(body=answer.body, status=answer.status)
    for name, value in answer.headers:
        if name.lower() not in _NOT_ANSWERED:
            response.headers.add(name, value)
    return response


async def _send(
    request: web.Request, leader_url: str, headers: dict[str, str], body: bytes
) -> _Answer:
    async with request.app[FORWARDING_SESSION_KEY].request(
        request.method,
        leader_url + request.rel_url.raw_path_qs,
        data=body,
        headers=headers,
        allow_redirects=False,
    ) as answer:
        return _Answer(answer.status, list(answer.headers.items()), await answer.read())


class _LeadChanged(Exception):
    """The replica a write was forwarded to no longer leads, and has not answered."""


async def _while_it_leads(
    request: web.Request, leader_url: str, sending: asyncio.Future[_Answer]
) -> _Answer:
    """The leader's answer, however long it takes while it still leads. A leader that stops
    leading meanwhile (frozen: its socket still accepts, and holds the write until it wakes;
    or dead behind a connection nobody closes) is given up on once another replica holds the
    lease: the client hears 503 then (the write may have been done), not when it wakes."""
    manager = request.app[JOB_MANAGER_KEY]
    while True:
        done, _ = await asyncio.wait({sending}, timeout=LEADER_CHECK_INTERVAL_S)
        if done:
            return sending.result()
        try:
            still_leads = await manager.leads_at(leader_url)
        except Exception:  # the database away: it cannot say; the leader may still answer
            continue
        if not still_leads:
            raise _LeadChanged(f"{leader_url} no longer leads the jobs")
