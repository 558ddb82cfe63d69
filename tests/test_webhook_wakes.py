"""The webhook sender under a burst: the wakes that come together (an event per commit, a
wake per finished send) are one look at the outbox, not one each, so a busy server spends its
outbox reads and claims on batches of deliveries."""

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

BURST = 100


async def test_wakes_that_come_together_are_one_look_at_the_outbox(
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    secret = new_secret()
    receiver = await receivers([secret])
    outbox = MemoryOutbox()
    looks = 0
    next_due = outbox.next_delivery_due_ms

    async def counted() -> int | None:
        nonlocal looks
        looks += 1
        return await next_due()

    outbox.next_delivery_due_ms = counted  # type: ignore[method-assign]
    sender = WebhookSender(
        outbox,
        policy=LOOPBACK_HTTP,
        secrets=WebhookSecrets(server=(secret,)),
        options=SenderOptions(timeout_s=5, max_in_flight=64, retry_max_s=60),
    )
    task = asyncio.create_task(sender.run())
    try:
        await eventually(lambda: looks >= 1, "the sender's first look")
        # A burst as the archive makes one: a delivery written and a wake, a millisecond apart.
        for _ in range(BURST):
            outbox.add(receiver.url)
            sender.wake()
            await asyncio.sleep(0.001)
        await eventually(lambda: len(receiver.received) == BURST, "every delivery")
        # One look per wake (a burst's and each finished send's) would be 2 x BURST.
        assert looks <= BURST // 2, looks
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
