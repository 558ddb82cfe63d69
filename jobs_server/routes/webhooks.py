"""Webhooks: a job's deliveries (each event to each target, its state and its attempts), and the
endpoints a 410 Gone disabled, listed and enabled again."""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jobs_server.access.tokens import TenantName
from jobs_server.api_models import JobDeliveriesResponse, WebhookDeliveryDetails
from jobs_server.app_state import JOB_MANAGER_KEY, OUTBOX_KEY, PRINCIPAL_KEY, SETTINGS_KEY
from jobs_server.audit import audit
from jobs_server.errors import InvalidRequestError, PermissionDeniedError
from jobs_server.manager.archive.outbox import DisabledWebhookEndpoint
from jobs_server.manager.tenancy import Principal
from jobs_server.manager.webhook_events import WebhookUrl
from jobs_server.serving.middlewares import error_response
from jobs_server.serving.request_body import (
    describe_validation_error,
    json_response,
    read_json_model,
)

routes = web.RouteTableDef()

# The code of the 404 for an endpoint that is not disabled: the same whether it was never
# disabled, was enabled already, or is another tenant's.
ENDPOINT_NOT_FOUND_CODE = "webhook_endpoint_not_found"


class DisabledWebhookEndpointDetails(BaseModel):
    """Extension: an endpoint a 410 Gone disabled for a tenant; none of its deliveries is written
    until it is enabled (`POST /api/webhooks/enable`)."""

    url: str
    tenant: str
    disabled_at: int = Field(description="When its 410 was received (unix ms).")

    @classmethod
    def from_endpoint(cls, endpoint: DisabledWebhookEndpoint) -> DisabledWebhookEndpointDetails:
        return cls(url=endpoint.url, tenant=endpoint.tenant, disabled_at=endpoint.disabled_ms)


class DisabledWebhookEndpointsResponse(BaseModel):
    """Extension: `GET /api/webhooks/disabled`, by tenant then URL."""

    endpoints: list[DisabledWebhookEndpointDetails]


class EnableWebhookEndpointRequest(BaseModel):
    """Extension: `POST /api/webhooks/enable`; `tenant` (an admin's only; a tenant key may name
    its own) defaults to the key's tenant."""

    model_config = ConfigDict(extra="forbid")

    url: WebhookUrl
    tenant: TenantName | None = None

    @field_validator("url")
    @classmethod
    def _printable(cls, url: str) -> str:
        # No endpoint was ever disabled with one (and PostgreSQL's text refuses NUL).
        if any(ord(character) < 0x20 or ord(character) == 0x7F for character in url):
            raise ValueError("a URL has no control characters")
        return url


class EnableWebhookEndpointResponse(BaseModel):
    """Extension: the endpoint is enabled; its deliveries are written from the next event on."""

    enabled: Literal[True] = True
    url: str
    tenant: str


class _DisabledEndpointsQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: TenantName | None = None


@routes.get("/api/jobs/{job_id}/deliveries", name="get_job_deliveries")
async def get_job_deliveries(request: web.Request) -> web.Response:
    # The job first: an unknown id, or another tenant's job, is the same 404 as everywhere.
    record = await request.app[JOB_MANAGER_KEY].get_job(
        request.match_info["job_id"], tenant=request[PRINCIPAL_KEY].tenant_scope
    )
    outbox = request.app.get(OUTBOX_KEY)
    deliveries = [] if outbox is None else await outbox.deliveries_of(record.submission_id)
    return json_response(
        JobDeliveriesResponse(
            deliveries=[WebhookDeliveryDetails.from_delivery(delivery) for delivery in deliveries]
        )
    )


@routes.get("/api/webhooks/disabled", name="list_disabled_webhook_endpoints")
async def list_disabled_webhook_endpoints(request: web.Request) -> web.Response:
    """The caller's tenant's disabled endpoints; an admin's: every tenant's, or `?tenant=`'s."""
    query = _disabled_endpoints_query(request)
    principal = request[PRINCIPAL_KEY]
    tenant = principal.tenant_scope if query.tenant is None else _tenant_for(principal, query)
    outbox = request.app.get(OUTBOX_KEY)
    endpoints = [] if outbox is None else await outbox.disabled_webhook_endpoints(tenant)
    return json_response(
        DisabledWebhookEndpointsResponse(
            endpoints=[DisabledWebhookEndpointDetails.from_endpoint(e) for e in endpoints]
        )
    )


@routes.post("/api/webhooks/enable", name="enable_webhook_endpoint")
async def enable_webhook_endpoint(request: web.Request) -> web.Response:
    """Enable an endpoint a 410 disabled: its deliveries are written from the next event on."""
    body = await read_json_model(
        request,
        EnableWebhookEndpointRequest,
        max_bytes=request.app[SETTINGS_KEY].max_request_bytes,
    )
    principal = request[PRINCIPAL_KEY]
    tenant = principal.tenant if body.tenant is None else _tenant_for(principal, body)
    outbox = request.app.get(OUTBOX_KEY)
    if outbox is None or not await outbox.enable_webhook_endpoint(tenant, body.url):
        # Word for word the same for another tenant's endpoint: whether it exists is not told.
        return error_response(
            404,
            ENDPOINT_NOT_FOUND_CODE,
            f"The webhook endpoint {body.url} is not disabled for tenant {tenant}.",
        )
    audit(request, "enable_webhook_endpoint", body.url, endpoint_tenant=tenant)
    return json_response(EnableWebhookEndpointResponse(url=body.url, tenant=tenant))


def _disabled_endpoints_query(request: web.Request) -> _DisabledEndpointsQuery:
    for name in request.query:
        if len(request.query.getall(name)) > 1:
            raise InvalidRequestError(f"{name}: given more than once")
    try:
        return _DisabledEndpointsQuery.model_validate(dict(request.query))
    except ValidationError as error:
        raise InvalidRequestError(describe_validation_error(error)) from error


def _tenant_for(
    principal: Principal, asked: EnableWebhookEndpointRequest | _DisabledEndpointsQuery
) -> str:
    """The tenant a request names: any, for an admin; a tenant key's own only (any other is
    refused alike, whether or not it exists)."""
    assert asked.tenant is not None
    if principal.tenant_scope is not None and asked.tenant != principal.tenant_scope:
        raise PermissionDeniedError(
            f"This key ({principal.key_name}) acts on its own tenant's webhook endpoints only:"
            " naming another tenant needs an admin key."
        )
    return asked.tenant
