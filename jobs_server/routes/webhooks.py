"""A job's webhook deliveries: each event to each target, its state and its attempts."""

from __future__ import annotations

from aiohttp import web

from jobs_server.api_models import JobDeliveriesResponse, WebhookDeliveryDetails
from jobs_server.app_state import JOB_MANAGER_KEY, OUTBOX_KEY, PRINCIPAL_KEY
from jobs_server.serving.request_body import json_response

routes = web.RouteTableDef()


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
