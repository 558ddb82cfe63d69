"""Fixtures: one real Ray cluster per test session, on loopback; apps and servers on it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import ray
from aiohttp import ClientSession

from jobs_server.app import create_app
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.postgres import PostgresArchive
from jobs_server.manager.archive.sqlite import Archive, archive_path
from jobs_server.settings import Settings
from tests.support.api import Client
from tests.support.disks import SMALL_DISK_BYTES
from tests.support.fakes import FakeJobManager
from tests.support.gcs import REDIS_SERVER
from tests.support.postgres import (  # noqa: F401 (fixtures)
    ArchiveFactory,
    postgres_server,
    postgres_url,
)
from tests.support.processes import (
    accepts_connections,
    free_port,
    stop_process_group,
    stop_ray_node,
    wait_until,
)
from tests.support.ray_nodes import (
    RAY_BIN,
    RAY_NODE_IP,
    S3_CREDENTIALS,
    SUITE_CLUSTER_ADDRESSES,
    isolate_environment,
    kill_actors_in_namespace,
)
from tests.support.servers import start_jobs_server, wait_for_server
from tests.support.tenant_server import TenantServer
from tests.support.web_page import browser  # noqa: F401 (a fixture: the browser tests' Chromium)
from tests.support.webhooks import receivers  # noqa: F401 (a fixture)

isolate_environment()

# A test that uses one of these needs real Ray: it is marked `ray` at collection, so a new test
# is sorted out of the fast loop without anyone having to remember to mark it.
RAY_FIXTURES = frozenset(
    {
        "ray_cluster",
        "ray_connection",
        "own_cluster",
        "ray_tmpdir",
        "server_url",
        "settings",
        "client",
    }
)
# A test that starts its own Ray nodes or a browser is marked in its module; these need Ray too.
MARKS_THAT_NEED_RAY = ("multinode", "gcs")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        needs_ray = not RAY_FIXTURES.isdisjoint(item.fixturenames) or any(
            item.get_closest_marker(mark) for mark in MARKS_THAT_NEED_RAY
        )
        if needs_ray and item.get_closest_marker("ray") is None:
            item.add_marker(pytest.mark.ray)
        if "browser" in item.fixturenames and item.get_closest_marker("browser") is None:
            item.add_marker(pytest.mark.browser)
    # Under pytest-xdist (scripts/check) each module runs whole on one worker, and the workers
    # take modules in this order (scripts/check passes --no-loadscope-reorder: by default xdist
    # would order them by their number of tests, which puts the few long tests that start a Ray
    # of their own last, each then running alone on one worker at the end). Longest first, by an
    # estimate: a module moves as one, so its module-scoped fixtures are still set up once.
    weights: dict[Any, float] = defaultdict(float)
    for item in items:
        weights[item.module] += _estimated_weight(item)
    items.sort(key=lambda item: -weights[item.module])


# Seconds, about: a test that starts a Ray of its own (or kills and restarts one) takes about
# 30 s; one that starts replicas (several servers) about 10; one in a module marked slow or
# browser a few; any other a fraction of one.
OWN_RAY_WEIGHT = 30.0
REPLICAS_WEIGHT = 10.0
SLOW_WEIGHT = 3.0
PLAIN_WEIGHT = 0.25


def _estimated_weight(item: pytest.Item) -> float:
    if "ray_tmpdir" in item.fixturenames or any(
        item.get_closest_marker(mark) for mark in ("multinode", "gcs")
    ):
        return OWN_RAY_WEIGHT
    if item.get_closest_marker("replicas"):
        return REPLICAS_WEIGHT
    if any(item.get_closest_marker(mark) for mark in ("slow", "browser")):
        return SLOW_WEIGHT
    return PLAIN_WEIGHT


@pytest.fixture
def shared_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's shared /tmp (sticky, world-writable) as `tempfile` sees it: where every
    supervisor of the user makes its ends directory and a worker's spool root."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return shared


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible server (moto) on a loopback port, in a thread of this process."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


# Where `ray start` and `ray.init` record the last cluster started on this machine; a later
# `ray.init("auto")` (or a `jobs-server serve` without an address) follows it.
RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")


@pytest.fixture(scope="session", autouse=True)
def ray_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every Ray instance of the suite (its clusters, the servers' embedded ones) keeps its
    session files and its address file in a temp dir of the suite's, not in /tmp/ray; at the end no
    process of them is left, and /tmp/ray/ray_current_cluster does not name a dead test cluster.

    Fails the session (after cleaning up) when a process was left, so a leak is seen.
    """
    # Short, and outside pytest's temp dir: under pytest-xdist that dir is one level deeper
    # (popen-gwN/), which took Ray's socket paths past their 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    previous = os.environ.get("RAY_TMPDIR")
    # Ray's temp dir is $RAY_TMPDIR/ray.
    os.environ["RAY_TMPDIR"] = str(path)
    # A server a test starts without --state-dir must not write the history in the home dir.
    os.environ.setdefault(
        "JOBS_SERVER_STATE_DIR", str(tmp_path_factory.getbasetemp() / "default-state")
    )
    address_before = _read_text(RAY_ADDRESS_FILE)
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
    leftovers = _end_processes_mentioning(str(path))
    suite_addresses = SUITE_CLUSTER_ADDRESSES | {
        (_read_text(path / "ray" / RAY_ADDRESS_FILE.name) or "").strip()
    }
    stale_address = _restore_address_file(address_before, suite_addresses - {""})
    shutil.rmtree(path, ignore_errors=True)
    assert not leftovers, f"processes of the suite's Ray instances were left: {leftovers}"
    assert stale_address is None, (
        f"{RAY_ADDRESS_FILE} named {stale_address}, a test cluster that is gone (restored)"
    )


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _end_processes_mentioning(text: str) -> list[str]:
    """Kill every process whose command line mentions `text`; describe those there were."""
    found = []
    for process in psutil.process_iter(["pid", "name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and any(
                text in part for part in process.info["cmdline"] or []
            ):
                found.append(f"{process.pid} {process.info['name']}")
                process.kill()
    return found


def _restore_address_file(before: str | None, suite_addresses: set[str]) -> str | None:
    """If the address file names one of the suite's clusters (all gone now), put back what was
    there before (or remove it); return that address. Other programs' entries stay."""
    after = _read_text(RAY_ADDRESS_FILE)
    if after is None or after.strip() not in suite_addresses:
        return None
    if before is None:
        RAY_ADDRESS_FILE.unlink(missing_ok=True)
    else:
        RAY_ADDRESS_FILE.write_text(before)
    return after.strip()


@pytest.fixture(scope="session")
def ray_cluster(
    tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str, ray_temp_dir: Path
) -> Iterator[str]:
    """A Ray head node of its own, in its own process group; yields its GCS address.

    Ray's runtime-env agent downloads `s3://` packages with the AWS variables of the node's
    environment, as on a real cluster: here they point at the test's S3 server.
    """
    port = free_port(RAY_NODE_IP)
    s3_environment = {
        **S3_CREDENTIALS,
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    log = (tmp_path_factory.mktemp("ray") / "ray-start.log").open("wb")
    process = subprocess.Popen(
        [
            str(RAY_BIN),
            "start",
            "--head",
            "--block",
            f"--node-ip-address={RAY_NODE_IP}",
            f"--port={port}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--num-cpus=4",
        ],
        # Ray's agent sets up a runtime env up to 3 times: a failure the tests provoke (a pip
        # package that does not exist: a virtualenv and pip each time) is as well seen once.
        env={**os.environ, **s3_environment, "RUNTIME_ENV_RETRY_TIMES": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"{RAY_NODE_IP}:{port}"
    SUITE_CLUSTER_ADDRESSES.add(address)
    try:
        wait_until(lambda: accepts_connections(RAY_NODE_IP, port), 60, "the Ray head node")
        yield address
    finally:
        stop_ray_node(process)
        log.close()


@pytest.fixture(scope="session")
def ray_connection(ray_cluster: str) -> Iterator[str]:
    """This test process, connected to the session's cluster as a Ray driver."""
    ray.init(address=ray_cluster, logging_level="WARNING", log_to_driver=False)
    try:
        yield ray_cluster
    finally:
        ray.shutdown()


@pytest.fixture
def settings(tmp_path: Path, ray_connection: str) -> Iterator[Settings]:
    """Settings for one test's server: its own namespace, so no two tests see each other's jobs."""
    settings = Settings(
        port=0,
        ray_address=ray_connection,
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        namespace=f"test_{uuid.uuid4().hex[:12]}",
        stop_grace_s=2.0,
    )
    yield settings
    kill_actors_in_namespace(settings.namespace)


@pytest.fixture
async def client(
    aiohttp_client: Callable[..., Awaitable[Client]], settings: Settings
) -> AsyncIterator[Client]:
    """The app on a loopback port, wired to real Ray."""
    return await aiohttp_client(create_app(settings))


@pytest.fixture
def fake_settings(tmp_path: Path) -> Settings:
    """Settings for an app on fakes: no Ray cluster behind it."""
    return Settings(
        port=0, state_dir=tmp_path / "state", log_dir=tmp_path / "logs", namespace="fake"
    )


@pytest.fixture
def fake(fake_settings: Settings) -> FakeJobManager:
    """An in-memory job manager (tests/support/fakes.py) for tests that never need a job to run."""
    return FakeJobManager(fake_settings.log_dir, max_package_bytes=fake_settings.max_package_bytes)


@pytest.fixture
async def fake_client(
    aiohttp_client: Callable[..., Awaitable[Client]],
    fake_settings: Settings,
    fake: FakeJobManager,
) -> Client:
    """The app on a loopback port, on `fake`: no Ray is touched."""
    return await aiohttp_client(create_app(fake_settings, backend=fake.backend()))


@pytest.fixture
async def session(server: TenantServer) -> AsyncIterator[ClientSession]:
    """A client of the test module's tenant server (its own `server` fixture)."""
    async with ClientSession(
        base_url=server.url, timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        yield session


@pytest.fixture(scope="session")
def server_url(ray_connection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `jobs-server serve` process on a loopback port, for Ray's synchronous clients."""
    port = free_port()
    namespace = f"test_server_{uuid.uuid4().hex[:8]}"
    workdir = tmp_path_factory.mktemp("server")
    log_path = workdir / "server.log"
    process = start_jobs_server(
        [
            "--port",
            str(port),
            "--ray-address",
            ray_connection,
            "--log-dir",
            str(workdir / "logs"),
            "--state-dir",
            str(workdir / "state"),
            "--namespace",
            namespace,
            "--stop-grace-s",
            "2",
        ],
        log_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, process, log_path)
        yield url
    finally:
        stop_process_group(process)
        kill_actors_in_namespace(namespace)


@pytest.fixture
def ray_tmpdir() -> Iterator[Path]:
    """A short temp dir of its own for the Ray instances one test starts (Ray's socket paths)."""
    path = Path(tempfile.mkdtemp(prefix="rrs", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of its own (the tests run as root, here and in CI)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_BYTES}", "tmpfs", str(mount_point)],
        check=True,
    )
    try:
        yield mount_point
    finally:
        # Lazy: a supervisor may still hold a log file open; the memory goes when it lets go.
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


@pytest.fixture(scope="module")
def redis_address() -> Iterator[str]:
    """A Redis server on a loopback port (no persistence), in its own process group."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed: run scripts/install-system-packages")
    port = free_port()
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: accepts_connections("127.0.0.1", port), 30, "redis-server")
        yield f"127.0.0.1:{port}"
    finally:
        stop_process_group(process)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def archive_factory(request: pytest.FixtureRequest, tmp_path: Path) -> ArchiveFactory:
    """Archives of one history, on each store in turn: SQLite in the test's own state dir, and
    a fresh database of the session's PostgreSQL. Keywords go to the store's constructor."""
    if request.param == "sqlite":
        return lambda **options: Archive(archive_path(tmp_path / "state"), **options)
    url = request.getfixturevalue("postgres_url")
    return lambda **options: PostgresArchive(url, **options)


@pytest.fixture
async def two_archives(archive_factory: ArchiveFactory) -> AsyncIterator[list[JobArchive]]:
    """Two replicas' archives of one history, open (on each store in turn); closed at the end."""
    archives = [archive_factory(), archive_factory()]
    for archive in archives:
        await archive.open()
    yield archives
    for archive in archives:
        await archive.close()


@pytest.fixture
async def archive(archive_factory: ArchiveFactory) -> AsyncIterator[JobArchive]:
    """An open archive (the job history, on each store in turn); closed at the end."""
    archive = archive_factory()
    await archive.open()
    yield archive
    await archive.close()
