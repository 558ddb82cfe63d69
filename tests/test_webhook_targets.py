"""Safe webhook targets (issue 36, item 4): the URL policy, a 400 at submit naming the field, a
name that resolves inside refused at every send, and a redirect never followed."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.test_utils import TestServer

from jobs_server.app import create_app
from jobs_server.errors import InvalidRequestError
from jobs_server.manager.records import JobSpec
from jobs_server.manager.webhook_events import NotifyTarget, TenantWebhooks
from jobs_server.settings import Settings
from jobs_server.webhooks.notify_check import notify_validator
from jobs_server.webhooks.signing import WebhookSecrets
from jobs_server.webhooks.targets import TargetPolicy
from jobs_server.webhooks.transport import CheckedResolver, RefusedTargetError
from tests.support.api import Client, wait_for_status

STRICT = TargetPolicy()
HTTP = TargetPolicy(allow_http=True)
OPEN = TargetPolicy(allow_http=True, allow_private=True)


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


@pytest.mark.parametrize(
    ("policy", "url", "problem"),
    [
        (STRICT, "https://hooks.example.com/in", None),
        (STRICT, "https://93.184.216.34:8443/in?x=1", None),
        (STRICT, "https://[2606:4700::1111]/in", None),
        (STRICT, "http://hooks.example.com/in", "expected an absolute https:// (http:// only"),
        (HTTP, "http://hooks.example.com/in", None),
        (HTTP, "ftp://hooks.example.com/in", "expected an absolute https:// or http:// URL"),
        (STRICT, "hooks.example.com/in", "expected an absolute https://"),
        (STRICT, "https:///in", "expected a host name or address"),
        (STRICT, "https://user:pw@hooks.example.com/", "credentials in the URL are not allowed"),
        (STRICT, "https://token@hooks.example.com/", "credentials in the URL are not allowed"),
        (STRICT, "https://hooks.example.com/#x", "a fragment (#...) is not sent"),
        (STRICT, "https://localhost/in", "'localhost' is this host (loopback"),
        (STRICT, "https://LocalHost./in", "'localhost' is this host"),
        (STRICT, "https://api.localhost/in", "'api.localhost' is this host"),
        (STRICT, "https://127.0.0.1/in", "127.0.0.1 is a loopback address"),
        (STRICT, "https://127.1/in", "'127.1' is not a canonical IP address"),
        (STRICT, "https://2130706433/in", "'2130706433' is not a canonical IP address"),
        (STRICT, "https://0x7f.0.0.1/in", "'0x7f.0.0.1' is not a canonical IP address"),
        (STRICT, "https://[::1]/in", "::1 is a loopback address"),
        (STRICT, "https://[::ffff:127.0.0.1]/in", "::ffff:7f00:1 (127.0.0.1) is a loopback"),
        (STRICT, "https://[::ffff:100.64.0.1]/in", "(100.64.0.1) is a non-global address"),
        (STRICT, "https://10.0.0.8/in", "10.0.0.8 is a private address"),
        (STRICT, "https://172.16.5.4/in", "172.16.5.4 is a private address"),
        (STRICT, "https://192.168.1.1/in", "192.168.1.1 is a private address"),
        (STRICT, "https://[fd00::1]/in", "fd00::1 is a private address"),
        (STRICT, "https://169.254.169.254/latest", "169.254.169.254 is a link-local address"),
        (STRICT, "https://[fe80::1]/in", "fe80::1 is a link-local address"),
        (STRICT, "https://0.0.0.0/in", "0.0.0.0 is an unspecified address"),
        (STRICT, "https://224.0.0.1/in", "224.0.0.1 is a multicast address"),
        (STRICT, "https://240.0.0.1/in", "240.0.0.1 is a private address"),
        (STRICT, "https://100.64.0.1/in", "100.64.0.1 is a non-global address"),
        (OPEN, "http://127.0.0.1:8080/in", None),
        (OPEN, "http://localhost:8080/in", None),
        (OPEN, "http://10.0.0.8/in", None),
    ],
)
def test_the_url_policy(policy: TargetPolicy, url: str, problem: str | None) -> None:
    found = policy.url_problem(url)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


def test_a_refused_address_says_which_setting_allows_it() -> None:
    assert STRICT.address_problem(ipaddress.ip_address("10.1.1.1")) == (
        "10.1.1.1 is a private address (allowed by --webhook-allow-private)"
    )
    assert STRICT.address_problem(ipaddress.ip_address("8.8.8.8")) is None


class FixedResolver(AbstractResolver):
    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return [
            ResolveResult(hostname=host, host=address, port=port, family=family, proto=0, flags=0)
            for address in self.addresses
        ]

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("addresses", "refused"),
    [
        (("93.184.216.34",), None),
        (("127.0.0.1",), "refused: hooks.example resolves to 127.0.0.1 is a loopback address"),
        # One address inside is enough: the connector could pick it.
        (("93.184.216.34", "10.0.0.1"), "10.0.0.1 is a private address"),
        (("2606:4700::1111", "::ffff:169.254.169.254"), "is a link-local address"),
    ],
)
async def test_the_resolver_answers_only_checked_addresses(
    addresses: tuple[str, ...], refused: str | None
) -> None:
    resolver = CheckedResolver(STRICT, FixedResolver(*addresses))
    if refused is None:
        results = await resolver.resolve("hooks.example", 443)
        assert [result["host"] for result in results] == list(addresses)
    else:
        with pytest.raises(RefusedTargetError) as raised:
            await resolver.resolve("hooks.example", 443)
        assert refused in str(raised.value)


def spec_with(*urls: str) -> JobSpec:
    return JobSpec(
        submission_id="j", entrypoint="true", notify=tuple(NotifyTarget(url=url) for url in urls)
    )


def test_the_submits_check_names_the_field_and_wants_a_secret() -> None:
    secret = new_secret()
    signed = WebhookSecrets(server=(secret,))
    validate = notify_validator(STRICT, signed)
    validate(spec_with(), "t")
    validate(spec_with("https://hooks.example/a", "https://hooks.example/b"), "t")
    with pytest.raises(InvalidRequestError, match=r"^notify\[1\]\.url: 127\.0\.0\.1 is a loop"):
        validate(spec_with("https://hooks.example/a", "https://127.0.0.1/b"), "t")
    # Without the server's secret: only a tenant with secrets of its own may use notify.
    unsigned = WebhookSecrets(
        server=(),
        webhooks_for=lambda tenant: TenantWebhooks(secrets=(secret,) if tenant == "a" else ()),
    )
    notify_validator(STRICT, unsigned)(spec_with("https://hooks.example/a"), "a")
    with pytest.raises(InvalidRequestError, match="notify: no webhook secret signs"):
        notify_validator(STRICT, unsigned)(spec_with("https://hooks.example/a"), "b")
    # And no secret is needed for a job without notify.
    notify_validator(STRICT, unsigned)(spec_with(), "b")


# -- on a server (in process, the session's Ray) -----------------------------------------------


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "webhook-secret"
    path.write_text(f"# rotated on the 1st\n{new_secret()}\n")
    return path


async def test_a_refused_target_is_a_400_at_submit_naming_the_field(
    aiohttp_client: Callable[..., Awaitable[Client]], settings: Settings, secret_file: Path
) -> None:
    client = await aiohttp_client(
        create_app(settings.model_copy(update={"webhook_secret_file": secret_file}))
    )
    for url, problem in [
        ("http://hooks.example/in", "notify[1].url: expected an absolute https://"),
        ("https://localhost:9/in", "notify[1].url: 'localhost' is this host"),
        ("https://10.2.3.4/in", "notify[1].url: 10.2.3.4 is a private address"),
    ]:
        response = await client.post(
            "/api/jobs/",
            json={
                "entrypoint": "true",
                "notify": [{"url": "https://hooks.example/ok"}, {"url": url}],
            },
        )
        assert response.status == 400, await response.text()
        error = (await response.json())["error"]
        assert error["code"] == "invalid_request"
        assert error["message"].startswith(problem), error
    listed = await client.get("/api/jobs/")
    assert await listed.json() == []


async def test_notify_without_any_secret_is_a_400(
    aiohttp_client: Callable[..., Awaitable[Client]], settings: Settings
) -> None:
    client = await aiohttp_client(create_app(settings))
    response = await client.post(
        "/api/jobs/",
        json={"entrypoint": "true", "notify": [{"url": "https://hooks.example/in"}]},
    )
    assert response.status == 400, await response.text()
    assert "notify: no webhook secret signs" in (await response.json())["error"]["message"]


@pytest.fixture
async def hook_server() -> AsyncIterator[tuple[list[str], Callable[..., Awaitable[str]]]]:
    """Receivers on 127.0.0.1: `start(answer)` serves `answer(request)` at /hook; every path
    any of them was asked for is in the list."""
    seen: list[str] = []
    servers: list[TestServer] = []

    async def start(answer: Callable[[web.Request], web.Response]) -> str:
        async def handle(request: web.Request) -> web.Response:
            seen.append(f"{request.host}{request.path}")
            return answer(request)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return f"127.0.0.1:{server.port}"

    yield seen, start
    for server in servers:
        await server.close()


async def deliveries_when(
    client: Client, job_id: str, done: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 60
    while True:
        response = await client.get(f"/api/jobs/{job_id}/deliveries")
        rows: list[dict[str, Any]] = (await response.json())["deliveries"]
        if rows and done(rows):
            return rows
        assert time.monotonic() < deadline, rows
        await asyncio.sleep(0.05)


async def test_a_name_that_resolves_to_loopback_is_refused_at_send(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    secret_file: Path,
    hook_server: tuple[list[str], Callable[..., Awaitable[str]]],
) -> None:
    """This host's own name passes the submit's check (a name, not `localhost`), but it
    resolves to a loopback address: each send resolves it and refuses."""
    name = socket.gethostname()
    resolved = {info[4][0] for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)}
    if not all(ipaddress.ip_address(address).is_loopback for address in resolved):
        pytest.skip(f"{name} does not resolve to loopback here: {resolved}")
    seen, start = hook_server
    address = await start(lambda request: web.Response(status=200))
    port = address.split(":")[1]
    client = await aiohttp_client(
        create_app(
            settings.model_copy(
                update={"webhook_secret_file": secret_file, "webhook_allow_http": True}
            )
        )
    )
    response = await client.post(
        "/api/jobs/",
        json={
            "entrypoint": "true",
            "notify": [{"url": f"http://{name}:{port}/hook", "events": ["job.succeeded"]}],
        },
    )
    assert response.status == 200, await response.text()
    job_id = (await response.json())["submission_id"]
    await wait_for_status(client, job_id)
    rows = await deliveries_when(client, job_id, lambda rows: rows[0]["attempts"] >= 2)
    assert rows[0]["state"] == "pending"
    assert rows[0]["last_status_code"] is None
    assert f"refused: {name} resolves to 127." in rows[0]["last_error"]
    assert "is a loopback address" in rows[0]["last_error"]
    assert seen == []


async def test_a_redirect_is_never_followed(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    secret_file: Path,
    hook_server: tuple[list[str], Callable[..., Awaitable[str]]],
) -> None:
    seen, start = hook_server
    inside = await start(lambda request: web.Response(status=200))
    redirecting = await start(
        lambda request: web.Response(status=307, headers={"Location": f"http://{inside}/x"})
    )
    client = await aiohttp_client(
        create_app(
            settings.model_copy(
                update={
                    "webhook_secret_file": secret_file,
                    "webhook_allow_http": True,
                    "webhook_allow_private": True,
                }
            )
        )
    )
    response = await client.post(
        "/api/jobs/",
        json={
            "entrypoint": "true",
            "notify": [{"url": f"http://{redirecting}/hook", "events": ["job.succeeded"]}],
        },
    )
    assert response.status == 200, await response.text()
    job_id = (await response.json())["submission_id"]
    await wait_for_status(client, job_id)
    rows = await deliveries_when(client, job_id, lambda rows: rows[0]["attempts"] >= 1)
    assert rows[0]["state"] == "pending"
    assert rows[0]["last_status_code"] == 307
    assert rows[0]["last_error"] == "HTTP 307: redirects are not followed"
    assert f"{inside}/x" not in seen
    assert f"{redirecting}/hook" in seen
