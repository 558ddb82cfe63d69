"""The one place where errors become HTTP responses: always JSON, never a traceback."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import hdrs, web

from jobs_server.access.auth import token_from_headers
from jobs_server.api_models import ErrorDetail, ErrorResponse
from jobs_server.app_state import (
    ACCESS_POLICY_KEY,
    AUTHENTICATED_KEY,
    CLUSTER_HEALTH_KEY,
    KEY_RING_KEY,
    METRICS_KEY,
    PRINCIPAL_KEY,
)
from jobs_server.errors import (
    AuthenticationRequiredError,
    ClusterUnavailableError,
    ConflictError,
    CrossSiteRequestError,
    DatabaseUnavailableError,
    HostNotAllowedError,
    InsufficientStorageError,
    InvalidRequestError,
    InvalidTokenError,
    JobNotFoundError,
    JobsServerError,
    LeaderUnavailableError,
    LogUnavailableError,
    PackageNotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    QueueFullError,
    TooManyRequestsError,
    UnsupportedMediaTypeError,
)
from jobs_server.manager.archive.outage import (
    UNAVAILABLE_MESSAGE,
    first_line,
    is_database_unavailable,
)
from jobs_server.manager.tenancy import ANONYMOUS_ADMIN
from jobs_server.metrics import CANCELLED_REQUEST_STATUS, route_name
from jobs_server.serving.request_origin import origin_of, parse_origin

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STATUS_BY_ERROR: dict[type[JobsServerError], int] = {
    InvalidRequestError: 400,
    AuthenticationRequiredError: 401,
    InvalidTokenError: 403,
    PermissionDeniedError: 403,
    CrossSiteRequestError: 403,
    JobNotFoundError: 404,
    PackageNotFoundError: 404,
    ConflictError: 409,
    PayloadTooLargeError: 413,
    UnsupportedMediaTypeError: 415,
    TooManyRequestsError: 429,
    ClusterUnavailableError: 503,
    DatabaseUnavailableError: 503,
    LeaderUnavailableError: 503,
    LogUnavailableError: 503,
    InsufficientStorageError: 507,
}


def status_for(error: JobsServerError) -> int:
    for error_class in type(error).__mro__:
        if error_class in _STATUS_BY_ERROR:
            return _STATUS_BY_ERROR[error_class]
    return 500


def error_response(status: int, code: str, message: str) -> web.Response:
    body = ErrorResponse(error=ErrorDetail(code=code, message=message))
    return web.Response(text=body.model_dump_json(), status=status, content_type="application/json")


# aiohttp's own rejections get the codes our errors use for the same status.
_CODE_BY_HTTP_STATUS = {413: PayloadTooLargeError.code, 416: "range_not_satisfiable"}


def _code_for_http_status(status: int) -> str:
    if status in _CODE_BY_HTTP_STATUS:
        return _CODE_BY_HTTP_STATUS[status]
    return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except JobsServerError as error:
        if isinstance(error, QueueFullError):
            request.app[METRICS_KEY].observe_queue_full(request[PRINCIPAL_KEY].tenant)
        return _domain_error_response(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = error.text if error.text and error.text != error.reason else error.reason
        if error.status == 404:
            message = f"No route for {request.method} {request.path}."
        elif error.status == 405:
            message = f"Method {request.method} is not allowed for {request.path}."
        response = error_response(error.status, _code_for_http_status(error.status), message)
        for header in ("Allow", "Content-Range"):
            if header in error.headers:
                response.headers[header] = error.headers[header]
        return response
    except Exception as error:
        if isinstance(error, ConnectionError) and _client_left(request):
            # The client left while its body was read or the answer written (the server does
            # not cancel handlers, so a read or write meets it): not a server error, and nobody
            # is left to answer. The status is what the metrics count; aiohttp's write of it
            # fails quietly on the closed connection.
            logger.debug("%s %s: the client went away", request.method, request.path)
            return web.Response(status=CANCELLED_REQUEST_STATUS)
        if is_database_unavailable(error):
            # Any read or write of the archive may meet it: a line, not a traceback per request.
            logger.warning(
                "%s %s: the database does not answer: %s",
                request.method,
                request.path,
                first_line(error),
            )
            return _domain_error_response(DatabaseUnavailableError(UNAVAILABLE_MESSAGE))
        logger.exception("unexpected error handling %s %s", request.method, request.path)
        return error_response(500, "internal_error", "The server failed to handle the request.")


def _domain_error_response(error: JobsServerError) -> web.Response:
    response = error_response(status_for(error), error.code, error.message)
    response.headers.update(error.response_headers())
    return response


def _client_left(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


# Probes must answer without credentials; nothing they say is secret. The web page and its
# files are public too: the page asks for the key, and every API call it makes carries it.
UNAUTHENTICATED_PATHS = frozenset({"/api/healthz", "/"})
UNAUTHENTICATED_PREFIXES = ("/ui/",)
# Methods that change something: what a cross-site browser request must not do.
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who calls: 401 without a key, 403 with one the server does not know, 403 for a `read`
    key that would change something. The key itself is never logged."""
    keys = request.app[KEY_RING_KEY]
    request[AUTHENTICATED_KEY] = False
    # A CORS preflight carries no credentials by design; it only asks what is allowed.
    exempt = (
        request.path in UNAUTHENTICATED_PATHS
        or request.path.startswith(UNAUTHENTICATED_PREFIXES)
        or request.method == "OPTIONS"
    )
    if not keys.requires_key:
        request[PRINCIPAL_KEY] = ANONYMOUS_ADMIN
    elif not exempt:
        given = token_from_headers(request.headers)
        if given is None:
            raise AuthenticationRequiredError(
                "This server requires a token: send `Authorization: Bearer <token>`."
            )
        principal = keys.principal_for(given)
        if principal is None:
            raise InvalidTokenError("The token is not valid for this server.")
        request[AUTHENTICATED_KEY] = True
        request[PRINCIPAL_KEY] = principal
        # Decided by the method of a route that exists, before the body is read: a read key
        # changes nothing, and learns nothing of whether the job it names exists.
        changes = request.method in UNSAFE_METHODS and request.match_info.http_exception is None
        if changes and not principal.role.may_change_jobs():
            raise PermissionDeniedError(
                f"This key ({principal.key_name}) may only read: submit, stop, delete and"
                " package uploads need a key with the `submit` or `admin` role."
            )
    return await handler(request)


@web.middleware
async def request_origin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The name the request reached us by must be one we answer to (DNS rebinding: see
    serving/request_origin.py); behind a trusted proxy, the scheme, name and client are those the
    browser used, as the proxy says."""
    policy = request.app[ACCESS_POLICY_KEY]
    forwarded = policy.proxy_trust.forwarded(request.remote, request.headers)
    host = forwarded.host if forwarded is not None and forwarded.host else None
    checked_host = host if host is not None else request.headers.get(hdrs.HOST)
    # No Host at all: not a browser (every browser sends it), so nothing to rebind.
    if checked_host is not None and not policy.allowed_hosts.allows(checked_host):
        raise HostNotAllowedError(
            f"This server does not answer to the name {checked_host!r}, so that a page whose"
            " name points at it (DNS rebinding) cannot use it. If that is its name, start it"
            " with --allowed-hosts (JOBS_SERVER_ALLOWED_HOSTS)."
        )
    if forwarded is None:
        return await handler(request)
    return await handler(
        request.clone(
            scheme=forwarded.scheme or request.scheme,
            host=host or request.host,
            remote=forwarded.remote or request.remote or "",
        )
    )


# A websocket is not protected by CORS: a page on any site may open one and read what it sends.
_WEBSOCKET_UPGRADE = "websocket"


@web.middleware
async def cross_site_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A browser on another site cannot submit, stop, upload or delete, nor open a websocket,
    unless the operator allowed its origin. Clients that are not browsers send neither header
    and pass."""
    upgrade = request.headers.get(hdrs.UPGRADE, "").lower() == _WEBSOCKET_UPGRADE
    if request.method in UNSAFE_METHODS or upgrade:
        origin = request.headers.get(hdrs.ORIGIN)
        fetch_site = request.headers.get("Sec-Fetch-Site", "").lower()
        allowed = request.app[ACCESS_POLICY_KEY].cors_origins
        if origin is not None and origin not in allowed and not _is_own_origin(request, origin):
            raise CrossSiteRequestError(f"Requests from origin {origin!r} are not allowed.")
        if origin is None and fetch_site in {"cross-site", "same-site"}:
            raise CrossSiteRequestError("Cross-site requests are not allowed.")
    return await handler(request)


def _is_own_origin(request: web.Request, origin: str) -> bool:
    """Whether `origin` is this server's own, as the browser reached it (a default port
    written or not)."""
    own = origin_of(request.scheme, request.host)
    return own is not None and parse_origin(origin) == own


# What reads or writes the GCS (the live records, Ray's package store; /metrics counts the
# live jobs by their KV status). Logs are files here and events come from the archive: those
# are served while the GCS is away.
ROUTES_THAT_NEED_THE_GCS = frozenset(
    {
        "submit_job",
        "list_jobs",
        "get_job",
        "stop_job",
        "delete_job",
        "get_package",
        "upload_package",
        "metrics",
    }
)


@web.middleware
async def cluster_health_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """While the cluster watch knows Ray's GCS is away, what needs it is answered 503 at once,
    not after its own GCS call has timed out (and a list not with the statuses last known)."""
    health = request.app.get(CLUSTER_HEALTH_KEY)
    if health is not None and request.match_info.route.name in ROUTES_THAT_NEED_THE_GCS:
        health.check()
    return await handler(request)


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count and time every answer, errors included (it sits outside the error middleware)."""
    started_s = time.monotonic()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    except asyncio.CancelledError:
        # The client left (with aiohttp's handler cancellation) or the shutdown timeout ended
        # the request: not a server error.
        status = CANCELLED_REQUEST_STATUS
        raise
    finally:
        request.app[METRICS_KEY].observe_request(
            route_name(request), request.method, status, time.monotonic() - started_s
        )
