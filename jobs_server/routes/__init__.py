"""HTTP routes: thin handlers that parse, call the manager and serialize. No `ray` here."""

from aiohttp import web

from jobs_server.routes import events, jobs, logs, packages, service, ui, webhooks

ROUTE_TABLES: tuple[web.RouteTableDef, ...] = (
    service.routes,
    jobs.routes,
    webhooks.routes,
    logs.routes,
    events.routes,
    packages.routes,
    ui.routes,
)

__all__ = ["ROUTE_TABLES"]
