"""HTTP routes: thin handlers that parse, call the manager and serialize. No `ray` here."""

from aiohttp import web

from jobs_server.routes import health, jobs, logs, packages

ROUTE_TABLES: tuple[web.RouteTableDef, ...] = (
    health.routes,
    jobs.routes,
    logs.routes,
    packages.routes,
)

__all__ = ["ROUTE_TABLES"]
