"""`working_dir` and `py_modules` uploads, the way Ray's `JobSubmissionClient` does them."""

from __future__ import annotations

from aiohttp import web

from jobs_server.api_models import PackageResponse
from jobs_server.app_state import (
    DISK_GUARD_KEY,
    PACKAGE_STORE_KEY,
    PRINCIPAL_KEY,
    SETTINGS_KEY,
    UPLOAD_BUDGET_KEY,
)
from jobs_server.audit import audit
from jobs_server.errors import PayloadTooLargeError
from jobs_server.manager import package_uri
from jobs_server.serving.request_body import json_response

routes = web.RouteTableDef()


@routes.get("/api/packages/{protocol}/{package_name}", name="get_package")
async def get_package(request: web.Request) -> web.Response:
    """200 if the caller's tenant uploaded the package (Ray's client then skips the upload),
    else 404: another tenant's is not found, and the client uploads a copy of its own."""
    uri = package_uri(request.match_info["protocol"], request.match_info["package_name"])
    await request.app[PACKAGE_STORE_KEY].ensure_exists(uri, tenant=request[PRINCIPAL_KEY].tenant)
    return json_response(PackageResponse(uri=uri))


@routes.put("/api/packages/{protocol}/{package_name}", name="upload_package")
async def upload_package(request: web.Request) -> web.Response:
    """Store the whole body as the caller's tenant's package, or nothing: it is read in full (a
    client that goes away half-way never reaches the store) and checked before one write. A
    package never changes: the same bytes again are 200, other bytes 409. Refused before any of
    it is read when the disk is nearly full (507), or when the uploads in progress already hold
    the bytes the server allows in memory (429)."""
    uri = package_uri(request.match_info["protocol"], request.match_info["package_name"])
    max_bytes = request.app[SETTINGS_KEY].max_package_bytes
    if request.content_length is not None and request.content_length > max_bytes:
        raise PayloadTooLargeError(
            f"The package is {request.content_length} bytes; the limit is {max_bytes}."
        )
    await request.app[DISK_GUARD_KEY].ensure_space("a package upload")
    # A body sent without a length (chunked) may be as large as the limit.
    size_bytes = max_bytes if request.content_length is None else request.content_length
    with request.app[UPLOAD_BUDGET_KEY].reserve(size_bytes):
        data = await request.read()
        await request.app[PACKAGE_STORE_KEY].upload(uri, data, tenant=request[PRINCIPAL_KEY].tenant)
    audit(request, "upload", uri, bytes=len(data))
    return json_response(PackageResponse(uri=uri))
