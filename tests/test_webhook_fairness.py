"""One tenant's slow receiver never holds the other tenants' webhooks back: a tenant's sends
fill at most its share of `--webhook-max-in-flight`, so while its receiver hangs (each send
until the timeout) the others' deliveries still go out at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from jobs_server.webhooks.sender import SenderOptions, WebhookSender
from jobs_server.webhooks.signing import WebhookSecrets
from tests.support.webhooks import (
    LOOPBACK_HTTP,
    MemoryOutbox,
    Receiver,
    eventually,
    new_secret,
)

MAX_IN_FLIGHT = 8
# Far beyond the test's wait: a slot the hog holds is held for the whole test.
HANG_TIMEOUT_S = 120.0


async def test_a_tenant_whose_receiver_hangs_leaves_slots_to_the_others(
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    secret = new_secret()
    hanging = await receivers([secret], hang=True)
    answering = await receivers([secret])
    outbox = MemoryOutbox()
    # The hog's deliveries are the oldest: a sender that takes the oldest due first would give
    # them every slot.
    for _ in range(5 * MAX_IN_FLIGHT):
        outbox.add(hanging.url, tenant="hog", created_ms=1)
    for _ in range(3):
        outbox.add(answering.url, tenant="other", created_ms=2)
    sender = WebhookSender(
        outbox,
        policy=LOOPBACK_HTTP,
        secrets=WebhookSecrets(server=(secret,)),
        options=SenderOptions(
            timeout_s=HANG_TIMEOUT_S, max_in_flight=MAX_IN_FLIGHT, retry_max_s=3600
        ),
    )
    task = asyncio.create_task(sender.run())
    try:
        await eventually(
            lambda: len(answering.received) == 3, "the other tenant's deliveries", timeout_s=20
        )
        await eventually(lambda: hanging.hanging == MAX_IN_FLIGHT // 2, "the hog's share")
        # More of the other tenant's come while the hog still hangs: they go out too.
        for _ in range(3):
            outbox.add(answering.url, tenant="other")
        sender.wake()
        await eventually(lambda: len(answering.received) == 6, "the later ones", timeout_s=20)
        assert hanging.max_hanging == MAX_IN_FLIGHT // 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
