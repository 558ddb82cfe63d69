"""The request's own edges: which names it may reach us by (DNS rebinding), which pages may open a
websocket, and which proxies may say what the browser asked for (X-Forwarded-*).

Each test plays the attacker against the HTTP layer alone, on the in-memory fake manager
(tests/support/fakes.py): what these middlewares decide needs no Ray.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from jobs_server.app import create_app
from jobs_server.settings import Settings
from tests.support.api import Client, submit
from tests.support.fakes import FakeJobManager

AiohttpClient = Callable[..., Awaitable[Client]]

# Every kind of route: the API, the page, the probes, a stream.
ROUTES = [
    ("POST", "/api/jobs/", {"entrypoint": "echo pwned"}),
    ("GET", "/api/jobs/", None),
    ("GET", "/api/version", None),
    ("GET", "/api/healthz", None),
    ("GET", "/", None),
    ("GET", "/api/events", None),
    ("PUT", "/api/packages/gcs/_ray_pkg_0123456789abcdef.zip", None),
]


async def _app_client(
    aiohttp_client: AiohttpClient, fake_settings: Settings, fake: FakeJobManager, **update: Any
) -> Client:
    settings = fake_settings.model_copy(update=update)
    return await aiohttp_client(create_app(settings, backend=fake.backend()))


@pytest.mark.parametrize(
    "rebound_host",
    [
        "evil.example:8266",
        "evil.example",
        "EVIL.example.:8266",
        "localhost.evil.example",
        "127.0.0.1.nip.io:8266",
        "[::1].evil.example",
    ],
)
async def test_a_page_whose_name_was_rebound_to_loopback_gets_nothing(
    fake_client: Client, fake: FakeJobManager, rebound_host: str
) -> None:
    """DNS rebinding: the page's own origin, Host and Origin agree, and all name the attacker."""
    origin = f"http://{rebound_host.rstrip('.')}"
    for method, path, body in ROUTES:
        response = await fake_client.request(
            method,
            path,
            json=body,
            headers={"Host": rebound_host, "Origin": origin, "Sec-Fetch-Site": "same-origin"},
        )
        assert response.status == 400, (method, path)
        assert response.content_type == "application/json"
        error = (await response.json())["error"]
        assert error["code"] == "host_not_allowed"
        assert "--allowed-hosts" in error["message"]
    assert (await fake.list_jobs()).records == []
    assert fake.packages.kv.values == {}


async def test_a_rebound_page_cannot_open_a_websocket(
    fake_client: Client, fake: FakeJobManager
) -> None:
    job_id = await submit(fake_client, entrypoint="echo secret")
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await fake_client.ws_connect(
            f"/api/jobs/{job_id}/logs/tail",
            headers={"Host": "evil.example:8266", "Origin": "http://evil.example:8266"},
        )
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "host",
    ["localhost", "LOCALHOST", "127.0.0.1", "[::1]", "127.0.0.2", "10.1.2.3", "[fe80::1]"],
)
async def test_loopback_names_and_address_literals_are_served(
    fake_client: Client, host: str
) -> None:
    """A rebinding page always reaches us by a name: an address literal cannot be rebound."""
    port = fake_client.server.port
    for value in (host, f"{host}:{port}"):
        response = await fake_client.get("/api/jobs/", headers={"Host": value})
        assert response.status == 200, value
        posted = await fake_client.post(
            "/api/jobs/",
            json={"entrypoint": "true"},
            headers={"Host": value, "Origin": f"http://{value}"},
        )
        assert posted.status == 200, value


async def test_allowed_hosts_name_the_server_for_real(
    aiohttp_client: AiohttpClient, fake_settings: Settings, fake: FakeJobManager
) -> None:
    client = await _app_client(
        aiohttp_client, fake_settings, fake, allowed_hosts=["jobs.example.com"]
    )
    for host in ("jobs.example.com", "JOBS.example.com:8266", "jobs.example.com."):
        response = await client.get("/api/jobs/", headers={"Host": host})
        assert response.status == 200, host
    refused = await client.get("/api/jobs/", headers={"Host": "sub.jobs.example.com"})
    assert refused.status == 400


def test_allowed_hosts_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, fake_settings: Settings
) -> None:
    monkeypatch.setenv("JOBS_SERVER_ALLOWED_HOSTS", "a.example, B.example ,")
    monkeypatch.setenv("JOBS_SERVER_FORWARDED_ALLOW_IPS", "127.0.0.1,10.0.0.0/8")
    settings = Settings(state_dir=fake_settings.state_dir)
    assert settings.allowed_hosts == ["a.example", "B.example"]
    assert settings.forwarded_allow_ips == ["127.0.0.1", "10.0.0.0/8"]


@pytest.mark.parametrize("bad", ["not an ip", "300.1.1.1", "10.0.0.0/33"])
def test_a_bad_forwarded_allow_ip_is_refused_at_start(bad: str, fake_settings: Settings) -> None:
    with pytest.raises(ValueError, match="forwarded_allow_ips"):
        Settings(state_dir=fake_settings.state_dir, forwarded_allow_ips=[bad])


@pytest.mark.parametrize(
    "origin", ["https://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1"]
)
async def test_a_cross_site_page_cannot_open_a_websocket(
    fake_client: Client, fake: FakeJobManager, origin: str
) -> None:
    """A websocket upgrade is not protected by CORS: the page would read the log."""
    job_id = await submit(fake_client, entrypoint="echo secret")
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await fake_client.ws_connect(f"/api/jobs/{job_id}/logs/tail", headers={"Origin": origin})
    assert refused.value.status == 403
    # No 101: the answer is the JSON error, and the log was never sent.
    response = await fake_client.get(
        f"/api/jobs/{job_id}/logs/tail",
        headers={
            "Origin": origin,
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    )
    assert response.status == 403
    assert (await response.json())["error"]["code"] == "cross_site_request"


async def test_the_servers_own_page_and_allowed_origins_open_websockets(
    aiohttp_client: AiohttpClient, fake_settings: Settings, fake: FakeJobManager
) -> None:
    allowed = "https://ui.example"
    client = await _app_client(aiohttp_client, fake_settings, fake, cors_origins=[allowed])
    job_id = await submit(client, entrypoint="echo hello")
    own = f"http://{client.server.host}:{client.server.port}"
    for headers in ({"Origin": own}, {"Origin": allowed}, {}):
        async with client.ws_connect(f"/api/jobs/{job_id}/logs/tail", headers=headers) as websocket:
            assert not websocket.closed, headers


PROXIED = {
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Host": "jobs.example.com",
    "X-Forwarded-For": "203.0.113.7",
    "Origin": "https://jobs.example.com",
    "Sec-Fetch-Site": "same-origin",
}


async def test_a_trusted_proxys_scheme_and_host_make_the_page_same_origin(
    aiohttp_client: AiohttpClient, fake_settings: Settings, fake: FakeJobManager
) -> None:
    """Behind a TLS-terminating proxy the page's origin is https://<public name>."""
    client = await _app_client(
        aiohttp_client,
        fake_settings,
        fake,
        allowed_hosts=["jobs.example.com"],
        forwarded_allow_ips=["127.0.0.0/8"],
    )
    job_id = await submit(client, entrypoint="sleep 30")
    stopped = await client.post(f"/api/jobs/{job_id}/stop", headers=PROXIED)
    assert stopped.status == 200, await stopped.text()
    posted = await client.post("/api/jobs/", json={"entrypoint": "true"}, headers=PROXIED)
    assert posted.status == 200
    async with client.ws_connect(f"/api/jobs/{job_id}/logs/tail", headers=PROXIED) as websocket:
        assert not websocket.closed


async def test_forwarded_headers_from_an_untrusted_peer_are_ignored(
    aiohttp_client: AiohttpClient, fake_settings: Settings, fake: FakeJobManager
) -> None:
    """Without --forwarded-allow-ips (or from another address) anyone could claim https."""
    for update in ({}, {"forwarded_allow_ips": ["192.0.2.1"]}):
        client = await _app_client(
            aiohttp_client, fake_settings, fake, allowed_hosts=["jobs.example.com"], **update
        )
        refused = await client.post("/api/jobs/", json={"entrypoint": "true"}, headers=PROXIED)
        assert refused.status == 403, update
        assert (await refused.json())["error"]["code"] == "cross_site_request"
    assert (await fake.list_jobs()).records == []


async def test_a_trusted_proxy_cannot_forward_a_rebound_name(
    aiohttp_client: AiohttpClient, fake_settings: Settings, fake: FakeJobManager
) -> None:
    client = await _app_client(
        aiohttp_client, fake_settings, fake, forwarded_allow_ips=["127.0.0.1"]
    )
    response = await client.post(
        "/api/jobs/",
        json={"entrypoint": "echo pwned"},
        headers={**PROXIED, "X-Forwarded-Host": "evil.example", "Origin": "https://evil.example"},
    )
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "host_not_allowed"
    assert (await fake.list_jobs()).records == []


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Forwarded-Proto": "gopher"},
        {"X-Forwarded-Host": "a b"},
        {"X-Forwarded-Host": "jobs.example.com/../x"},
    ],
)
async def test_a_malformed_forwarded_header_is_a_400(
    aiohttp_client: AiohttpClient,
    fake_settings: Settings,
    fake: FakeJobManager,
    headers: dict[str, str],
) -> None:
    client = await _app_client(
        aiohttp_client, fake_settings, fake, forwarded_allow_ips=["127.0.0.1"]
    )
    response = await client.get("/api/jobs/", headers=headers)
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "invalid_forwarded_header"
