"""Package uploads are held whole in memory, so the bytes of those in progress are bounded:
beyond the bound an upload is refused at once with 429 and Retry-After, before it is read."""

from __future__ import annotations

import asyncio
import io
import time
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jobs_server.app_state import UPLOAD_BUDGET_KEY
from jobs_server.settings import Settings
from tests.support.api import Client
from tests.support.openapi_contract import Contract

MAX_PACKAGE_BYTES = 1024 * 1024
# Room for one largest package and a half.
IN_FLIGHT_BYTES = MAX_PACKAGE_BYTES * 3 // 2


@pytest.fixture
def fake_settings(tmp_path: Path) -> Settings:
    return Settings(
        port=0,
        log_dir=tmp_path / "logs",
        namespace="fake",
        max_package_bytes=MAX_PACKAGE_BYTES,
        max_upload_bytes_in_flight=IN_FLIGHT_BYTES,
    )


def zip_of_size(size_bytes: int) -> bytes:
    """A zip archive of about `size_bytes` (stored, not compressed), at most that."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("data.bin", b"\0" * (size_bytes - 200))
    data = buffer.getvalue()
    assert len(data) <= size_bytes
    return data


class HeldUpload:
    """An upload whose body is sent in two halves, the second only when `release` is set: a
    client on a slow link, in the middle of its upload."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.release = asyncio.Event()

    async def body(self) -> AsyncIterator[bytes]:
        half = len(self.data) // 2
        yield self.data[:half]
        await self.release.wait()
        yield self.data[half:]


async def wait_for_in_flight(client: Client, size_bytes: int) -> None:
    budget = client.server.app[UPLOAD_BUDGET_KEY]
    deadline = time.monotonic() + 30
    while budget.in_flight_bytes != size_bytes:
        assert time.monotonic() < deadline, f"in flight: {budget.in_flight_bytes}"
        await asyncio.sleep(0.01)


def package_path(number: int) -> str:
    return f"/api/packages/gcs/_ray_pkg_{number:016x}.zip"


async def test_uploads_beyond_the_bytes_in_flight_wait_their_turn(fake_client: Client) -> None:
    contract = Contract.load()
    large = zip_of_size(MAX_PACKAGE_BYTES)
    held = HeldUpload(large)
    first = asyncio.create_task(
        fake_client.put(
            package_path(1), data=held.body(), headers={"Content-Length": str(len(large))}
        )
    )
    await wait_for_in_flight(fake_client, len(large))

    # A second large upload does not fit beside the first: refused before it is read.
    async with fake_client.put(package_path(2), data=large) as response:
        body = await response.read()
        refused = contract.check_response(
            "PUT", package_path(2), response.status, response.headers, body
        )
    assert response.status == 429, body
    assert refused["error"]["code"] == "upload_capacity_exceeded"
    assert "--max-upload-bytes-in-flight" in refused["error"]["message"]
    assert int(response.headers["Retry-After"]) >= 1
    # One without a length may be as large as the largest package: it does not fit either.
    held_chunked = HeldUpload(zip_of_size(1000))
    held_chunked.release.set()
    chunked = await fake_client.put(package_path(3), data=held_chunked.body())
    assert chunked.status == 429, await chunked.text()
    # A small one fits in what is left.
    small = zip_of_size(IN_FLIGHT_BYTES - len(large))
    assert (await fake_client.put(package_path(4), data=small)).status == 200

    held.release.set()
    assert (await first).status == 200
    await wait_for_in_flight(fake_client, 0)
    # Their turn now.
    assert (await fake_client.put(package_path(2), data=large)).status == 200
    assert (await fake_client.put(package_path(3), data=zip_of_size(1000))).status == 200
    for number in (1, 2, 3, 4):
        assert (await fake_client.get(package_path(number))).status == 200


async def test_a_refused_or_abandoned_upload_gives_its_bytes_back(fake_client: Client) -> None:
    held = HeldUpload(zip_of_size(MAX_PACKAGE_BYTES))
    upload = asyncio.create_task(
        fake_client.put(
            package_path(5), data=held.body(), headers={"Content-Length": str(len(held.data))}
        )
    )
    await wait_for_in_flight(fake_client, len(held.data))
    upload.cancel()  # the client goes away half-way
    await wait_for_in_flight(fake_client, 0)
    assert (await fake_client.put(package_path(6), data=b"not a zip")).status == 400
    await wait_for_in_flight(fake_client, 0)
    assert (await fake_client.get(package_path(5))).status == 404


def test_the_bound_holds_at_least_one_largest_package() -> None:
    with pytest.raises(ValueError, match="max_upload_bytes_in_flight"):
        Settings(max_package_bytes=1000, max_upload_bytes_in_flight=999)
    assert Settings(max_package_bytes=1000).upload_bytes_in_flight_limit == 4000
