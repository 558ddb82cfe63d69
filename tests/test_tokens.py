"""The tokens file: its checks, `jobs-server hash-token`, SIGHUP reloads on a real server
process, and the archive of jobs from before tenants."""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp.test_utils import TestClient

from jobs_server.access.key_digest import digest_of, new_api_key
from jobs_server.access.key_ring import KeyRing
from jobs_server.access.tokens import TokensFileError, load_tokens_file, parse_tokens
from jobs_server.app import create_app
from jobs_server.manager.archive.sqlite import Archive, JobQuery, archive_path
from jobs_server.manager.limits import JobLimits
from jobs_server.manager.records import JobRecord, JobSpec, now_ms
from jobs_server.manager.tenancy import DEFAULT_TENANT, Role, TenantLimits
from jobs_server.manager.webhook_events import (
    ALL_WEBHOOK_EVENTS,
    NO_WEBHOOKS,
    TenantWebhookEndpoint,
    TenantWebhooks,
    WebhookEventType,
)
from jobs_server.settings import Settings
from jobs_server.webhooks.targets import TargetPolicy
from tests.support.fakes import FakeJobManager
from tests.support.processes import wait_until
from tests.support.tenant_server import KEY_SPECS, run_tenant_server, tokens_toml

JOBS_SERVER = str(Path(sys.executable).parent / "jobs-server")
DIGEST = "sha256:" + "ab" * 32
KEY = f'[[keys]]\ndigest = "{DIGEST}"\ntenant = "team-a"\nrole = "read"\n'


def test_a_valid_file_gives_principals_and_caps() -> None:
    text = KEY.replace("[[keys]]", '[[keys]]\nname = "dash"') + (
        f'[[keys]]\ndigest = "sha256:{"cd" * 32}"\ntenant = "team-b"\nrole = "admin"\n'
        "[tenants.team-a]\nmax_running = 2\nmax_queued = 0\n[tenants.team-c]\n"
    )
    tokens = parse_tokens(text, source="t.toml")
    named = tokens.principals[DIGEST]
    assert (named.tenant, named.role, named.key_name) == ("team-a", Role.READ, "dash")
    unnamed = tokens.principals["sha256:" + "cd" * 32]
    # Shown by the start of its digest: never the key.
    assert (unnamed.role, unnamed.key_name) == (Role.ADMIN, "sha256:cdcdcdcdcdcd")
    assert tokens.limits_for("team-a") == TenantLimits(max_running=2, max_queued=0)
    assert tokens.limits_for("team-c") == TenantLimits()
    assert tokens.limits_for("nobody") == TenantLimits()
    assert tokens.tenants == {"team-a", "team-b", "team-c"}
    assert parse_tokens("", source="empty").principals == {}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[[keys]\n", "not valid TOML"),
        ("keys = 3\n", "keys: Input should be a valid list"),
        (KEY + "secret = 1\n", "keys[0].secret: unknown field"),
        ("[other]\n", "other: unknown field"),
        (KEY.replace(DIGEST, "sha256:ABC"), "keys[0].digest: expected 'sha256:' and 64"),
        (KEY.replace(DIGEST, "the-key-itself"), "keys[0].digest: expected 'sha256:' and 64"),
        (KEY.replace(DIGEST, "sha1:" + "ab" * 20), "keys[0].digest: expected 'sha256:'"),
        (KEY.replace('"read"', '"owner"'), "keys[0].role: Input should be 'admin', 'submit'"),
        (KEY.replace('"team-a"', '"team a"'), "keys[0].tenant: expected 1 to 64 letters"),
        (KEY.replace('"team-a"', '""'), "keys[0].tenant: expected 1 to 64 letters"),
        (KEY.replace('tenant = "team-a"\n', ""), "keys[0].tenant: Field required"),
        (KEY.replace(f'digest = "{DIGEST}"\n', ""), "keys[0].digest: Field required"),
        (KEY + KEY, f"keys: the digest '{DIGEST}' is given more than once"),
        ("[tenants.team-a]\nmax_running = 0\n", "tenants.team-a.max_running: Input should be"),
        ("[tenants.team-a]\nmax_queued = -1\n", "tenants.team-a.max_queued: Input should be"),
        ('[tenants.team-a]\nmax_running = "5"\n', "tenants.team-a.max_running: Input should"),
        ("[tenants.team-a]\nmax_runing = 5\n", "tenants.team-a.max_runing: unknown field"),
        ('[tenants."a b"]\n', "tenants.'a b': expected 1 to 64 letters"),
        (
            "[tenants.team-a.default_limits]\nmemory = 1073741824\n",
            "tenants.team-a.default_limits.memory: unknown field",
        ),
        (
            '[tenants.team-a.max_limits]\nmemory_bytes = "1GiB"\n',
            "tenants.team-a.max_limits.memory_bytes: Input should be a valid integer",
        ),
        (
            "[tenants.team-a.max_limits]\nmemory_bytes = 1024\n",
            "tenants.team-a.max_limits.memory_bytes: Input should be greater than or equal to",
        ),
        (
            "[tenants.team-a.default_limits]\nmax_processes = -1\n",
            "tenants.team-a.default_limits.max_processes: Input should be greater than or equal",
        ),
        (
            "[tenants.team-a.default_limits]\ncpu_cores = true\n",
            "tenants.team-a.default_limits.cpu_cores: Input should be a valid number",
        ),
        ("[tenants.team-a]\nmax_limits = 5\n", "tenants.team-a.max_limits: Input should be"),
        (
            "[tenants.team-a.default_limits]\nmemory_bytes = 2147483648\ncpu_cores = 4\n"
            "[tenants.team-a.max_limits]\nmemory_bytes = 1073741824\ncpu_cores = 4\n",
            "tenants.team-a: default_limits.memory_bytes (2147483648) is above max_limits"
            ".memory_bytes (1073741824)",
        ),
    ],
)
def test_an_invalid_file_is_refused_saying_where(text: str, error: str) -> None:
    with pytest.raises(TokensFileError) as raised:
        parse_tokens(text, source="tokens.toml")
    assert str(raised.value).startswith("tokens file tokens.toml: ")
    assert error in str(raised.value)
    # A key pasted where its digest belongs is never echoed.
    assert "the-key-itself" not in str(raised.value)


def test_a_tenants_default_and_maximum_limits_are_read() -> None:
    text = (
        "[tenants.team-a.default_limits]\nmemory_bytes = 268_435_456\ncpu_cores = 1\n"
        "[tenants.team-a.max_limits]\nmemory_bytes = 1_073_741_824\nmax_processes = 500\n"
        "[tenants.team-b.max_limits]\ncpu_cores = 0.5\n"
        "[tenants.team-c.default_limits]\n"
    )
    tokens = parse_tokens(text, source="t.toml")
    assert tokens.limits_for("team-a") == TenantLimits(
        default_limits=JobLimits(memory_bytes=1 << 28, cpu_cores=1.0),
        max_limits=JobLimits(memory_bytes=1 << 30, max_processes=500),
    )
    assert tokens.limits_for("team-b") == TenantLimits(max_limits=JobLimits(cpu_cores=0.5))
    # An empty table sets nothing.
    assert tokens.limits_for("team-c") == TenantLimits()


SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
NEXT_SECRET = "whsec_" + base64.b64encode(b"n" * 32).decode()


def test_a_tenants_webhooks_and_secrets_are_read() -> None:
    text = (
        f'[tenants.team-a]\nwebhook_secrets = ["{SECRET}", "{NEXT_SECRET}"]\nwebhooks = [\n'
        '  { url = "https://hooks.example/a", events = ["job.failed", "job.stopped"] },\n'
        f'  {{ url = "https://other.example/b", secrets = ["{NEXT_SECRET}"] }},\n]\n'
        "[tenants.team-b]\nmax_running = 1\n"
    )
    tokens = parse_tokens(text, source="t.toml", target_policy=TargetPolicy())
    assert tokens.webhooks_for("team-a") == TenantWebhooks(
        endpoints=(
            TenantWebhookEndpoint(
                url="https://hooks.example/a",
                events=(WebhookEventType.FAILED, WebhookEventType.STOPPED),
            ),
            # Every event by default; its own secrets.
            TenantWebhookEndpoint(
                url="https://other.example/b", events=ALL_WEBHOOK_EVENTS, secrets=(NEXT_SECRET,)
            ),
        ),
        secrets=(SECRET, NEXT_SECRET),
    )
    assert tokens.webhooks_for("team-b") == NO_WEBHOOKS
    assert tokens.webhooks_for("nobody") == NO_WEBHOOKS


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '[tenants.a]\nwebhook_secrets = ["the-secret-itself"]\n',
            "tenants.a.webhook_secrets[0]: expected 'whsec_' and the secret's base64",
        ),
        (
            '[tenants.a]\nwebhook_secrets = ["whsec_the-secret-itself!"]\n',
            "tenants.a.webhook_secrets[0]: expected 'whsec_' and the secret's base64",
        ),
        (
            f'[tenants.a]\nwebhook_secrets = ["whsec_{base64.b64encode(b"short").decode()}"]\n',
            "tenants.a.webhook_secrets[0]: expected a key of 24 to 64 bytes, got 5",
        ),
        (
            '[tenants.a]\nwebhooks = [{ url = "https://h.example/", secrets = ["whsec_x"] }]\n',
            "tenants.a.webhooks[0].secrets[0]: expected 'whsec_'",
        ),
        (
            '[tenants.a]\nwebhooks = [{ url = "https://h.example/" }]\n',
            "tenants.a: webhooks[0]: no secret signs it",
        ),
        (
            f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
            'webhooks = [{ url = "https://h.example/", events = ["job.done"] }]\n',
            "tenants.a.webhooks[0].events[0]: Input should be 'job.started'",
        ),
        (
            f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
            'webhooks = [{ url = "https://h.example/", events = [] }]\n',
            "tenants.a.webhooks[0].events: List should have at least 1 item",
        ),
        (
            f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
            'webhooks = [{ url = "https://h.example/", secret = "x" }]\n',
            "tenants.a.webhooks[0].secret: unknown field",
        ),
        (
            f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
            'webhooks = [{ url = "https://h.example/" }, { url = "https://h.example/" }]\n',
            "tenants.a: webhooks[1].url: the same URL as webhooks[0]",
        ),
        (
            f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
            'webhooks = [{ url = "http://h.example/" }]\n',
            "tenants.a.webhooks[0].url: expected an absolute https:// (http:// only with"
            " --webhook-allow-http) URL",
        ),
        (
            f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
            'webhooks = [{ url = "https://10.1.2.3/in" }]\n',
            "tenants.a.webhooks[0].url: 10.1.2.3 is a private address",
        ),
        (
            f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
            'webhooks = [{ url = "https://user:pw@h.example/in" }]\n',
            "tenants.a.webhooks[0].url: credentials in the URL are not allowed",
        ),
    ],
)
def test_invalid_webhooks_are_refused_naming_the_field_never_the_secret(
    text: str, error: str
) -> None:
    with pytest.raises(TokensFileError) as raised:
        parse_tokens(text, source="tokens.toml", target_policy=TargetPolicy())
    assert str(raised.value).startswith("tokens file tokens.toml: ")
    assert error in str(raised.value)
    assert "secret-itself" not in str(raised.value)
    assert "whsec_x" not in str(raised.value)


def test_the_servers_policy_decides_which_webhook_urls_load() -> None:
    text = (
        f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
        'webhooks = [{ url = "http://127.0.0.1:9/" }]\n'
    )
    with pytest.raises(TokensFileError, match="expected an absolute https://"):
        parse_tokens(text, source="t.toml", target_policy=TargetPolicy(allow_private=True))
    with pytest.raises(TokensFileError, match=r"127\.0\.0\.1 is a loopback address"):
        parse_tokens(text, source="t.toml", target_policy=TargetPolicy(allow_http=True))
    allowed = TargetPolicy(allow_http=True, allow_private=True)
    endpoints = parse_tokens(text, source="t.toml", target_policy=allowed).webhooks_for("a")
    assert [endpoint.url for endpoint in endpoints.endpoints] == ["http://127.0.0.1:9/"]


def test_a_reload_swaps_the_tenants_webhooks_and_a_refused_url_keeps_them(
    tmp_path: Path,
) -> None:
    """The planner reads `webhooks_for` at each change: a reload (SIGHUP) takes effect at once;
    a file the server's policy refuses keeps what there was."""
    tokens_file = tmp_path / "tokens.toml"
    endpoint = '[tenants.a]\nwebhook_secrets = ["{}"]\nwebhooks = [{{ url = "{}" }}]\n'
    tokens_file.write_text(endpoint.format(SECRET, "https://one.example/in"))
    ring = KeyRing(admin_token=None, tokens_file=tokens_file, target_policy=TargetPolicy())
    assert [e.url for e in ring.webhooks_for("a").endpoints] == ["https://one.example/in"]
    tokens_file.write_text(endpoint.format(NEXT_SECRET, "https://two.example/in"))
    assert ring.reload()
    assert [e.url for e in ring.webhooks_for("a").endpoints] == ["https://two.example/in"]
    assert ring.webhooks_for("a").secrets == (NEXT_SECRET,)
    tokens_file.write_text(endpoint.format(SECRET, "https://192.168.0.9/in"))
    assert not ring.reload()
    assert [e.url for e in ring.webhooks_for("a").endpoints] == ["https://two.example/in"]


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokensFileError, match="cannot read the tokens file"):
        load_tokens_file(tmp_path / "absent.toml")


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (None, "jobs-server: cannot read the tokens file"),
        (KEY.replace('"read"', '"root"'), "keys[0].role: Input should be"),
    ],
)
def test_serve_refuses_to_start_with_an_invalid_tokens_file(
    tmp_path: Path, content: str | None, error: str
) -> None:
    tokens_file = tmp_path / "tokens.toml"
    if content is not None:
        tokens_file.write_text(content)
    result = subprocess.run(
        [JOBS_SERVER, "serve", "--port", "0", "--tokens-file", str(tokens_file)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "JOBS_SERVER_STATE_DIR": str(tmp_path / "state")},
        check=False,
    )
    assert result.returncode != 0
    assert error in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flag", "content", "error"),
    [
        (
            "--tokens-file",
            f'[tenants.a]\nwebhook_secrets = ["{SECRET}"]\n'
            'webhooks = [{ url = "http://h.example/" }]\n',
            "tenants.a.webhooks[0].url: expected an absolute https://",
        ),
        ("--webhook-secret-file", "the-secret-itself\n", "line 1: expected 'whsec_'"),
    ],
)
def test_serve_refuses_bad_webhook_settings_in_one_line(
    tmp_path: Path, flag: str, content: str, error: str
) -> None:
    path = tmp_path / "file"
    path.write_text(content)
    result = subprocess.run(
        [JOBS_SERVER, "serve", "--port", "0", flag, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "JOBS_SERVER_STATE_DIR": str(tmp_path / "state")},
        check=False,
    )
    assert result.returncode != 0
    assert error in result.stderr
    assert "Traceback" not in result.stderr
    assert "secret-itself" not in result.stderr


def test_hash_token_prints_a_new_key_and_its_digest(tmp_path: Path) -> None:
    outputs = [
        subprocess.run(
            [JOBS_SERVER, "hash-token"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        for _ in range(2)
    ]
    keys = []
    for output in outputs:
        key_line, digest_line = output.splitlines()
        key = key_line.removeprefix("key: ")
        assert len(key) >= 43
        assert digest_line == f'digest = "sha256:{hashlib.sha256(key.encode()).hexdigest()}"'
        # The digest line goes into a tokens file as it is.
        text = f'[[keys]]\n{digest_line}\ntenant = "t"\nrole = "read"\n'
        assert parse_tokens(text, source="printed").principals[digest_of(key)].tenant == "t"
        keys.append(key)
    assert keys[0] != keys[1]
    from_stdin = subprocess.run(
        [JOBS_SERVER, "hash-token", "--stdin"],
        input="an-existing-key\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    expected = hashlib.sha256(b"an-existing-key").hexdigest()
    assert from_stdin.stdout == f'digest = "sha256:{expected}"\n'


def test_sighup_reloads_the_keys_and_a_broken_file_keeps_them(
    ray_connection: str, tmp_path: Path
) -> None:
    """A revoked key gets 403 after SIGHUP, the others keep working; a file that is not valid
    keeps the keys there were; a key added later works after the next SIGHUP."""
    server_run = run_tenant_server(ray_connection, tmp_path)
    server = next(server_run)
    try:

        def status_of(name: str, key: str | None = None) -> int:
            headers = server.headers(name) if key is None else {"Authorization": f"Bearer {key}"}
            return requests.get(f"{server.url}/api/jobs/", headers=headers, timeout=30).status_code

        assert {name: status_of(name) for name in KEY_SPECS} == dict.fromkeys(KEY_SPECS, 200)
        kept = {name: key for name, key in server.keys.items() if name != "a-read"}
        server.tokens_file.write_text(tokens_toml(kept, KEY_SPECS))
        os.kill(server.pid, signal.SIGHUP)
        wait_until(lambda: status_of("a-read") == 403, 30, "the revoked key refused")
        assert {name: status_of(name) for name in kept} == dict.fromkeys(kept, 200)
        assert status_of("auth-token") == 200

        server.tokens_file.write_text("[[keys]\nbroken")
        os.kill(server.pid, signal.SIGHUP)
        wait_until(
            lambda: "keeping the previous keys" in server.log_path.read_text(),
            30,
            "the broken file logged",
        )
        assert {name: status_of(name) for name in kept} == dict.fromkeys(kept, 200)
        assert status_of("a-read") == 403

        added = new_api_key()
        server.tokens_file.write_text(
            tokens_toml({**kept, "late": added}, {**KEY_SPECS, "late": ("team-c", "read")})
        )
        os.kill(server.pid, signal.SIGHUP)
        wait_until(lambda: status_of("late", added) == 200, 30, "the added key accepted")
        assert added not in server.log_path.read_text()
    finally:
        server_run.close()


async def test_jobs_archived_before_tenants_are_the_default_tenants(tmp_path: Path) -> None:
    """An archive of schema 1 (no tenant in its rows) is migrated: its jobs and their events
    belong to the default tenant, and a tenant's list finds them by its index."""
    path = archive_path(tmp_path)
    archive = Archive(path)
    await archive.open()
    await archive.insert(
        JobRecord(spec=JobSpec(entrypoint="true", submission_id="old"), start_time=now_ms())
    )
    await archive.insert(
        JobRecord(
            spec=JobSpec(entrypoint="true", submission_id="new"), start_time=now_ms(), tenant="t"
        )
    )
    await archive.close()
    db = sqlite3.connect(path)
    # Back to what a server before tenants left: NULL tenants, no record field, schema 1.
    old_record = db.execute("SELECT record FROM jobs WHERE submission_id = 'old'").fetchone()[0]
    db.executescript(
        "UPDATE jobs SET tenant = NULL, record = replace(record, ',\"tenant\":\"default\"', '')"
        " WHERE submission_id = 'old'; UPDATE events SET tenant = NULL WHERE submission_id ="
        " 'old'; DROP INDEX jobs_tenant_seq; DROP INDEX jobs_tenant_status;"
        " DROP TABLE deleted_runs; DROP TABLE leases; DROP TABLE webhook_deliveries;"
        " DROP TABLE webhook_endpoints_disabled; PRAGMA user_version = 1;"
    )
    assert (
        '"tenant"'
        not in db.execute("SELECT record FROM jobs WHERE submission_id = 'old'").fetchone()[0]
    )
    assert '"tenant"' in old_record
    db.close()

    reopened = Archive(path)
    await reopened.open()
    try:
        page, _ = await reopened.page(JobQuery(tenant=DEFAULT_TENANT))
        assert [(job.submission_id, job.tenant) for job in page] == [("old", DEFAULT_TENANT)]
        assert [job.submission_id for job in (await reopened.page(JobQuery(tenant="t")))[0]] == [
            "new"
        ]
        assert await reopened.count_by_tenant() == {
            DEFAULT_TENANT: {job.status: 1 for job in page},
            "t": {page[0].status: 1},
        }
        events = await reopened.events_after(0, 10)
        assert {(event.submission_id, event.tenant) for event in events} == {
            ("old", DEFAULT_TENANT),
            ("new", "t"),
        }
        plan = sqlite3.connect(path).execute(
            "EXPLAIN QUERY PLAN SELECT seq, record FROM jobs WHERE tenant = ? ORDER BY seq", ["t"]
        )
        assert "jobs_tenant_seq" in " ".join(str(row) for row in plan.fetchall())
    finally:
        await reopened.close()


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "unauthorized"),
        ({"Authorization": "Bearer not-a-key-of-the-file"}, 403, "forbidden"),
        # The digest itself is not a key.
        ({"Authorization": f"Bearer {digest_of('the-read-key')}"}, 403, "forbidden"),
        ({"Authorization": "Bearer the-read-key"}, 200, None),
        ({"X-Ray-Authorization": "Bearer the-read-key"}, 200, None),
    ],
)
async def test_a_tokens_file_alone_requires_one_of_its_keys(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]],
    fake_settings: Settings,
    fake: FakeJobManager,
    tmp_path: Path,
    headers: dict[str, str],
    status: int,
    code: str | None,
) -> None:
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(
        f'[[keys]]\ndigest = "{digest_of("the-read-key")}"\ntenant = "t"\nrole = "read"\n'
    )
    settings = fake_settings.model_copy(update={"tokens_file": tokens_file})
    client = await aiohttp_client(create_app(settings, backend=fake.backend()))
    response = await client.get("/api/jobs/", headers=headers)
    assert response.status == status
    body = await response.json()
    assert (body["error"]["code"] if code else body) == (code or [])
    # The web page asks for a key.
    assert 'data-auth="on"' in await (await client.get("/")).text()
