"""The HTTP calls of the terminal client, and the server's JSON errors as exceptions."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import aiohttp

from jobs_server.client.sse import Event, read_events

DEFAULT_URL = "http://127.0.0.1:8266"
URL_ENV_VAR = "JOBS_SERVER_URL"
TOKEN_ENV_VAR = "JOBS_SERVER_AUTH_TOKEN"
CONNECT_TIMEOUT_S = 10.0
# A followed log gets a heartbeat every 15 s: three missed ones mean the connection is dead
# even when no FIN ever arrives (a proxy or a network that vanished).
STREAM_READ_TIMEOUT_S = 45.0
REQUEST_TIMEOUT_S = 60.0


class ClientError(Exception):
    """Something the user is told about in one line; the command exits 1."""


class UsageError(ClientError):
    """The command line asks for something impossible; the command exits 2."""


class ServerError(ClientError):
    """The server answered with an error (its JSON `{"error": {"code", "message"}}`)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} (HTTP {status}, {code})")
        self.status, self.code, self.message = status, code, message

    @property
    def is_transient(self) -> bool:
        """A proxy or a server that is starting or briefly without Ray: worth trying again."""
        return self.status in {502, 503, 504}


class UnreachableError(ClientError):
    """No answer from the server's address."""


@dataclass(frozen=True)
class Connection:
    """Where the server is and the key to show it."""

    url: str
    token: str | None

    @classmethod
    def from_options(cls, url: str | None, token_file: Path | None) -> Connection:
        """`--url`, else JOBS_SERVER_URL, else the default; `--token-file`, else
        JOBS_SERVER_AUTH_TOKEN, else no key."""
        url = url or os.environ.get(URL_ENV_VAR) or DEFAULT_URL
        if "://" not in url:
            raise UsageError(f"--url: expected http://HOST:PORT or https://..., got {url!r}")
        token = os.environ.get(TOKEN_ENV_VAR)
        if token_file is not None:
            try:
                lines = token_file.read_text().splitlines()
            except OSError as error:
                raise UsageError(f"--token-file: {error}") from error
            token = lines[0] if lines else ""
        token = token.strip() if token is not None else None
        return cls(url=url.rstrip("/"), token=token or None)


def job_path(job_id: str, suffix: str = "") -> str:
    return f"/api/jobs/{quote(job_id, safe='')}{suffix}"


class JobsClient:
    """One aiohttp session to one server; every method raises ClientError subclasses only."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        headers = {"User-Agent": "jobs-server-cli"}
        if connection.token:
            headers["Authorization"] = f"Bearer {connection.token}"
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=REQUEST_TIMEOUT_S
            ),
        )

    async def __aenter__(self) -> JobsClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._session.close()

    async def submit_job(self, body: Mapping[str, Any]) -> str:
        answer = await self._json("POST", "/api/jobs/", json=body)
        return str(answer["submission_id"])

    async def get_job(self, job_id: str) -> dict[str, Any]:
        answer: dict[str, Any] = await self._json("GET", job_path(job_id))
        return answer

    async def get_deliveries(self, job_id: str) -> list[dict[str, Any]] | None:
        """The job's webhook deliveries, oldest first; None from a server without them (404:
        older than webhooks, as the job itself was just read)."""
        try:
            answer = await self._json("GET", job_path(job_id, "/deliveries"))
        except ServerError as error:
            if error.status == 404:
                return None
            raise
        deliveries: list[dict[str, Any]] = answer["deliveries"]
        return deliveries

    async def list_jobs(self, *, status: str | None, limit: int | None) -> list[dict[str, Any]]:
        params = {}
        if status:
            params["status"] = status
        if limit is not None:
            params["limit"] = str(limit)
        answer: list[dict[str, Any]] = await self._json("GET", "/api/jobs/", params=params)
        return answer

    async def stop_job(self, job_id: str, grace_period_s: float | None = None) -> bool:
        body = {} if grace_period_s is None else {"grace_period_s": grace_period_s}
        answer = await self._json("POST", job_path(job_id, "/stop"), json=body)
        return bool(answer["stopped"])

    async def delete_job(self, job_id: str) -> None:
        await self._json("DELETE", job_path(job_id))

    async def list_disabled_webhooks(self, *, tenant: str | None) -> list[dict[str, Any]]:
        """The webhook endpoints a 410 disabled (the key's tenant's; an admin's: every
        tenant's, or `tenant`'s)."""
        params = {} if tenant is None else {"tenant": tenant}
        answer = await self._json("GET", "/api/webhooks/disabled", params=params)
        endpoints: list[dict[str, Any]] = answer["endpoints"]
        return endpoints

    async def enable_webhook(self, url: str, *, tenant: str | None) -> dict[str, Any]:
        """Enable an endpoint a 410 disabled; the server's answer (its url and tenant)."""
        body = {"url": url} if tenant is None else {"url": url, "tenant": tenant}
        answer: dict[str, Any] = await self._json("POST", "/api/webhooks/enable", json=body)
        return answer

    async def write_log(self, job_id: str, out: BinaryIO) -> None:
        """The log's exact bytes as they are now, copied to `out` as they arrive."""
        async with self._request("GET", job_path(job_id, "/logs"), params={"format": "text"}) as (
            response
        ):
            try:
                async for data in response.content.iter_any():
                    out.write(data)
                    out.flush()
            except (aiohttp.ClientError, TimeoutError) as error:
                raise UnreachableError(f"the log stopped arriving: {describe(error)}") from error

    async def log_events(self, job_id: str, offset: int) -> AsyncIterator[Event]:
        """The SSE log stream from byte `offset` (sent as `Last-Event-ID`, as a browser resumes).

        Connection faults are raised as aiohttp's own exceptions (or TimeoutError), so a
        follower can tell a dropped connection from an answer."""
        headers = {"Accept": "text/event-stream"}
        if offset:
            headers["Last-Event-ID"] = str(offset)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=STREAM_READ_TIMEOUT_S
        )
        url = self.connection.url + job_path(job_id, "/logs/stream")
        async with self._session.get(url, headers=headers, timeout=timeout) as response:
            await raise_for_error(response)
            async for event in read_events(response.content.iter_any()):
                yield event

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        async with self._request(method, path, **kwargs) as response:
            try:
                return await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError) as error:
                raise UnreachableError(f"the answer did not arrive: {describe(error)}") from error
            except ValueError as error:
                raise ClientError(f"the server's answer is not JSON: {error}") from error

    def _request(self, method: str, path: str, **kwargs: Any) -> _Request:
        return _Request(self, method, path, kwargs)


class _Request:
    """`async with` a request whose error answers are raised as ServerError."""

    def __init__(self, client: JobsClient, method: str, path: str, kwargs: dict[str, Any]):
        self._client, self._method, self._path, self._kwargs = client, method, path, kwargs
        self._response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        url = self._client.connection.url + self._path
        try:
            self._response = await self._client._session.request(self._method, url, **self._kwargs)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise UnreachableError(
                f"cannot reach {self._client.connection.url}: {describe(error)}"
                f" (is `jobs-server serve` running there? set {URL_ENV_VAR} or --url)"
            ) from error
        try:
            await raise_for_error(self._response)
        except BaseException:
            self._response.release()
            raise
        return self._response

    async def __aexit__(self, *_: object) -> None:
        if self._response is not None:
            self._response.release()


async def raise_for_error(response: aiohttp.ClientResponse) -> None:
    """The server's `{"error": {"code", "message"}}` as a ServerError (its text if not JSON)."""
    if response.status < 400:
        return
    text = await response.text(errors="replace")
    code, message = "http_error", text.strip() or response.reason or "no message"
    try:
        error = json.loads(text)["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        pass
    raise ServerError(response.status, code, message)


def describe(error: BaseException) -> str:
    """An exception in a few words: aiohttp's own messages are often empty."""
    return str(error) or type(error).__name__
