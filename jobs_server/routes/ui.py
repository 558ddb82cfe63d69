"""The web page: `GET /` and its files under `/ui/`, with headers that forbid inline script
and style, framing and MIME sniffing. Both are public (the page asks for a key; the API checks it).
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Final

from aiohttp import web

from jobs_server.app_state import KEY_RING_KEY

routes = web.RouteTableDef()

# The page's files and their types: only these are served (no path from the request reaches
# the file system).
ASSET_CONTENT_TYPES: Final = {
    "app.js": "text/javascript",
    "api.js": "text/javascript",
    "deliveries.js": "text/javascript",
    "dependencies.js": "text/javascript",
    "dom.js": "text/javascript",
    "events.js": "text/javascript",
    "job.js": "text/javascript",
    "list.js": "text/javascript",
    "sse.js": "text/javascript",
    "submit.js": "text/javascript",
    "style.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
PAGE_FILE = "index.html"
# Everything comes from this origin; nothing inline, nothing framed, nothing from elsewhere.
CONTENT_SECURITY_POLICY: Final = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Small files that change with the server: revalidate instead of running a stale page.
    "Cache-Control": "no-cache",
}
# The page tells its script whether to ask for a key before calling the API.
_AUTH_MARKER = b'data-auth="off"'


@routes.get("/", name="web_page")
async def web_page(request: web.Request) -> web.Response:
    """The page: the job list, a job's page and the submit form (routed in the page)."""
    body = await asyncio.to_thread(_read_static, PAGE_FILE)
    if request.app[KEY_RING_KEY].requires_key:
        body = body.replace(_AUTH_MARKER, b'data-auth="on"', 1)
    return _static_response(body, "text/html")


@routes.get("/ui/{file_name}", name="web_asset")
async def web_asset(request: web.Request) -> web.Response:
    """One of the page's scripts or its style sheet."""
    file_name = request.match_info["file_name"]
    content_type = ASSET_CONTENT_TYPES.get(file_name)
    if content_type is None:
        raise web.HTTPNotFound()
    return _static_response(await asyncio.to_thread(_read_static, file_name), content_type)


def _static_response(body: bytes, content_type: str) -> web.Response:
    return web.Response(
        body=body, headers={**SECURITY_HEADERS, "Content-Type": f"{content_type}; charset=utf-8"}
    )


def _read_static(file_name: str) -> bytes:
    return (resources.files("jobs_server.web") / "static" / file_name).read_bytes()
