"""Reading a JSON request body into a pydantic model, with errors a client can act on."""

from __future__ import annotations

import json
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from jobs_server.errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError

ModelT = TypeVar("ModelT", bound=BaseModel)

_JSON_MEDIA_TYPES = frozenset({"application/json"})
# Deeper than any real runtime_env; bounds the work of validating and storing a body.
MAX_JSON_DEPTH = 32


def _nesting_depth(value: object) -> int:
    """How deeply lists and objects nest in `value` (iteratively: no recursion to exhaust)."""
    deepest = 0
    pending: list[tuple[object, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest


async def read_json_model(request: web.Request, model: type[ModelT], *, max_bytes: int) -> ModelT:
    """Parse the body as `model`."""
    parsed = await read_optional_json_model(request, model, max_bytes=max_bytes)
    if parsed is None:
        raise InvalidRequestError("The request body is empty; expected a JSON object.")
    return parsed


async def read_optional_json_model(
    request: web.Request, model: type[ModelT], *, max_bytes: int
) -> ModelT | None:
    """Parse the body as `model`; None if there is no body."""
    body = await _read_limited(request, max_bytes)
    if not body.strip():
        return None
    # A missing Content-Type is accepted for old clients; a form or text body is not JSON, and
    # refusing it also stops browsers' cross-site "simple" requests.
    if request.content_type not in _JSON_MEDIA_TYPES and "Content-Type" in request.headers:
        raise UnsupportedMediaTypeError(
            f"Content-Type {request.content_type!r} is not supported; send application/json."
        )
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InvalidRequestError(f"The request body is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    if _nesting_depth(data) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise InvalidRequestError(describe_validation_error(error)) from error


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the field: `entrypoint: Field required`."""
    problems = []
    for detail in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in detail["loc"]) or "body"
        message = detail["msg"]
        if detail["type"] == "extra_forbidden":
            message = "unknown field"
        problems.append(f"{where}: {message}")
    return "Invalid request: " + "; ".join(problems)


async def _read_limited(request: web.Request, max_bytes: int) -> bytes:
    length = request.content_length
    if length is not None:
        if length > max_bytes:
            raise PayloadTooLargeError(
                f"The request body is {length} bytes; the limit is {max_bytes}."
            )
        # The parser delivers no more than Content-Length: read it whole (a submit's body is
        # in one chunk; reading it chunk by chunk cost 7 % of a burst's event loop).
        return await request.read()
    # Chunked: no length announced, so the limit is checked as the body arrives.
    body = bytearray()
    async for block in request.content.iter_chunked(64 * 1024):
        body += block
        if len(body) > max_bytes:
            raise PayloadTooLargeError(f"The request body exceeds the limit of {max_bytes} bytes.")
    return bytes(body)


def json_response(model: BaseModel, *, status: int = 200) -> web.Response:
    """Serialize a response model as JSON."""
    return web.Response(
        text=model.model_dump_json(), status=status, content_type="application/json"
    )
