"""The one place where errors become HTTP responses: always JSON, never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web

from jobs_server.api_models import ErrorDetail, ErrorResponse
from jobs_server.errors import (
    ClusterUnavailableError,
    ConflictError,
    InvalidRequestError,
    JobNotFoundError,
    JobsServerError,
    PackageNotFoundError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STATUS_BY_ERROR: dict[type[JobsServerError], int] = {
    InvalidRequestError: 400,
    JobNotFoundError: 404,
    PackageNotFoundError: 404,
    ConflictError: 409,
    PayloadTooLargeError: 413,
    UnsupportedMediaTypeError: 415,
    ClusterUnavailableError: 503,
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
        return error_response(status_for(error), error.code, error.message)
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
    except Exception:
        logger.exception("unexpected error handling %s %s", request.method, request.path)
        return error_response(500, "internal_error", "The server failed to handle the request.")
