"""The webhook sender: a worker that claims the outbox's due deliveries (archive/outbox.py),
sends each signed (at most `max_in_flight` at once, each bounded by `timeout_s` end to end) and
writes back each attempt's outcome. A 2xx delivers; a 410 disables the endpoint; anything else
(a status, a timeout, a connection refused, an address refused after resolution) is tried again
after an exponential backoff with full jitter, until `retry_max_s` after the event (then FAILED).

It runs on every replica: a claim hides a delivery from the others for longer than an attempt
may take, so two senders never send it at once, and one that dies mid-send leaves it to the
others once its claim expires (at least once). Everything waits here, never in a request: a
slow receiver holds a slot of this worker, not the API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp

from jobs_server.api_models import JobDetails, WebhookPayload
from jobs_server.manager.archive.outbox import DeliveryState, Outbox, WebhookDelivery
from jobs_server.manager.records import RecordParser, now_ms, parse_record
from jobs_server.metrics import ServerMetrics
from jobs_server.settings import Settings
from jobs_server.webhooks.signing import WebhookSecrets, signed_headers
from jobs_server.webhooks.targets import TargetPolicy
from jobs_server.webhooks.transport import webhook_session

logger = logging.getLogger(__name__)

# Without an event to wake it (a delivery written by a replica whose events were missed, a
# claim of a dead replica expiring), the worker looks at the outbox this often.
FALLBACK_POLL_S = 5.0
# A claim outlasts an attempt by this much: the attempt's outcome is written after it.
CLAIM_MARGIN_S = 10.0
# The first retry within this, doubling at each attempt up to the backoff's cap: an hour, or a
# tenth of --webhook-retry-max-s if that is less (a short window still has ten or so attempts).
RETRY_BASE_S = 1.0
RETRY_CAP_S = 3600.0
RETRY_WINDOW_FRACTION = 0.1
# After an outbox call failed (the database away), the worker waits this long.
OUTBOX_ERROR_PAUSE_S = 1.0
# A woken worker waits this long before it looks, so that the wakes of a burst (one per
# commit of the archive, one per finished send) are one read and one claim of a batch, not one
# each: a burst of 100 deliveries was 299 looks at the outbox, each a read and a claim, whose
# writes queued behind the API's own. A delivery waits this much more: well within its 1 s.
WAKE_COALESCE_S = 0.02
# A tenant's sends fill at most this share of --webhook-max-in-flight: a tenant whose receiver
# hangs (each send until the timeout) leaves the rest to the others.
TENANT_SHARE = 0.5
# Due deliveries another sender claimed first: looked at again after this.
CLAIM_RACE_PAUSE_S = 0.05
# The pending gauge of /metrics is counted at most this often (a count of the outbox).
PENDING_COUNT_INTERVAL_S = 10.0
# A receiver's error text kept for GET .../deliveries.
MAX_ERROR_CHARS = 500


def retry_delay_s(attempts: int, cap_s: float, uniform: Callable[[], float]) -> float:
    """Full jitter: uniformly up to `RETRY_BASE_S * 2**(attempts - 1)`, at most `cap_s`."""
    ceiling = min(cap_s, RETRY_BASE_S * 2.0 ** min(attempts - 1, 60))
    return ceiling * uniform()


@dataclass(frozen=True)
class AttemptResult:
    """What one POST came to."""

    status_code: int | None = None
    error: str | None = None
    refused: bool = False
    """The delivery may never be sent as it is (a refused URL, no secret): given up at once."""


@dataclass(frozen=True)
class SenderOptions:
    timeout_s: float
    max_in_flight: int
    retry_max_s: float

    @property
    def claim_ms(self) -> int:
        return int((self.timeout_s + CLAIM_MARGIN_S) * 1000)

    @property
    def tenant_max_in_flight(self) -> int:
        return max(1, int(self.max_in_flight * TENANT_SHARE))

    @property
    def backoff_cap_s(self) -> float:
        return min(RETRY_CAP_S, self.retry_max_s * RETRY_WINDOW_FRACTION)

    @classmethod
    def from_settings(cls, settings: Settings) -> SenderOptions:
        return cls(
            timeout_s=settings.webhook_timeout_s,
            max_in_flight=settings.webhook_max_in_flight,
            retry_max_s=settings.webhook_retry_max_s,
        )


class WebhookSender:
    """The worker; `run()` is its one task (its owner cancels and awaits it)."""

    def __init__(
        self,
        outbox: Outbox,
        *,
        policy: TargetPolicy,
        secrets: WebhookSecrets,
        options: SenderOptions,
        metrics: ServerMetrics | None = None,
        parse: RecordParser = parse_record,
        uniform: Callable[[], float] = random.random,
    ) -> None:
        self._outbox = outbox
        self._policy = policy
        self._secrets = secrets
        self._options = options
        self._metrics = metrics
        self._parse = parse
        self._uniform = uniform
        self._wake = asyncio.Event()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._in_flight_by_tenant: Counter[str] = Counter()
        self._pending_counted_at = -PENDING_COUNT_INTERVAL_S

    def wake(self) -> None:
        """Look at the outbox now (deliveries were written). Safe to call often."""
        self._wake.set()

    async def run(self) -> None:
        """Send until cancelled; the sends in flight are cancelled with it (their claims
        expire, and they are sent again)."""
        session = webhook_session(self._policy, max_in_flight=self._options.max_in_flight)
        try:
            while True:
                self._wake.clear()
                wait_s = await self._claim_and_start(session)
                if wait_s > 0:
                    # Not wait_for: on 3.11 it can swallow a cancellation that comes as the
                    # wake does (a busy sender is woken all the time), and never stop.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait_s):
                            await self._wake.wait()
                            await asyncio.sleep(WAKE_COALESCE_S)
        finally:
            for task in self._in_flight:
                task.cancel()
            await asyncio.gather(*self._in_flight, return_exceptions=True)
            await session.close()

    async def _claim_and_start(self, session: aiohttp.ClientSession) -> float:
        """Start what is due within the free slots; how long to wait before looking again (a
        woken worker looks at once). A read first: a claim is a write, made only for what is
        due."""
        try:
            await self._count_pending()
            free = self._options.max_in_flight - len(self._in_flight)
            if free <= 0:
                return FALLBACK_POLL_S  # a send that ends wakes it
            due_ms = await self._outbox.next_delivery_due_ms()
            now = now_ms()
            if due_ms is None:
                return FALLBACK_POLL_S
            if due_ms > now:
                return min(FALLBACK_POLL_S, (due_ms - now) / 1000)
            full, limit = self._tenant_room()
            claimed = await self._outbox.claim_due_deliveries(
                now, min(free, limit), self._options.claim_ms, skip_tenants=full
            )
        except Exception as error:
            logger.warning("webhooks: the outbox did not answer (%s); trying again", error)
            return OUTBOX_ERROR_PAUSE_S
        for delivery in claimed:
            self._start(session, delivery)
        if claimed:
            return 0.0  # more may be due at once
        # None claimed: another sender took them (look again soon), or what is due is the full
        # tenants' (a send that ends, or a new delivery, wakes it).
        return FALLBACK_POLL_S if full else CLAIM_RACE_PAUSE_S

    def _tenant_room(self) -> tuple[list[str], int]:
        """The tenants whose sends fill their share (skipped), and how many one claim may take
        so that none of the others overfills its share."""
        share = self._options.tenant_max_in_flight
        full = [tenant for tenant, sending in self._in_flight_by_tenant.items() if sending >= share]
        busiest = max(
            (sending for sending in self._in_flight_by_tenant.values() if sending < share),
            default=0,
        )
        return full, share - busiest

    def _start(self, session: aiohttp.ClientSession, delivery: WebhookDelivery) -> None:
        task = asyncio.create_task(self._deliver(session, delivery), name=f"webhook-{delivery.id}")
        self._in_flight.add(task)
        tenant = delivery.tenant
        self._in_flight_by_tenant[tenant] += 1

        def done(finished: asyncio.Task[None]) -> None:
            self._in_flight.discard(finished)
            self._in_flight_by_tenant[tenant] -= 1
            if self._in_flight_by_tenant[tenant] <= 0:
                del self._in_flight_by_tenant[tenant]
            self._wake.set()  # a slot is free

        task.add_done_callback(done)

    async def _count_pending(self) -> None:
        if self._metrics is None:
            return
        moment = time.monotonic()
        if moment - self._pending_counted_at < PENDING_COUNT_INTERVAL_S:
            return
        self._pending_counted_at = moment
        counts = await self._outbox.count_deliveries()
        self._metrics.webhook_pending.set(counts.get(DeliveryState.PENDING, 0))

    async def _deliver(self, session: aiohttp.ClientSession, delivery: WebhookDelivery) -> None:
        started = time.monotonic()
        at_ms = now_ms()
        try:
            result = await self._attempt(session, delivery)
        except Exception as error:  # a bug, not the receiver: kept, and tried again later
            logger.exception("webhooks: the delivery %s could not be made", delivery.id)
            result = AttemptResult(error=f"internal error: {type(error).__name__}")
        if self._metrics is not None:
            self._metrics.webhook_attempt_duration.observe(time.monotonic() - started)
        try:
            await self._record(delivery, at_ms, result)
        except Exception as error:
            # Its claim expires and it is sent again: at least once.
            logger.warning("webhooks: the outcome of %s was not written (%s)", delivery.id, error)

    async def _attempt(
        self, session: aiohttp.ClientSession, delivery: WebhookDelivery
    ) -> AttemptResult:
        problem = self._policy.url_problem(delivery.url)
        if problem is not None:
            return AttemptResult(error=f"refused: {problem}", refused=True)
        secrets = self._secrets.for_delivery(delivery.tenant, delivery.url, delivery.source)
        if not secrets:
            return AttemptResult(error="refused: no webhook secret signs it now", refused=True)
        body = payload_of(delivery, self._parse)
        headers = signed_headers(delivery.id, datetime.now(UTC), body, secrets)
        timeout = aiohttp.ClientTimeout(total=self._options.timeout_s)
        try:
            async with session.post(
                delivery.url, data=body, headers=headers, allow_redirects=False, timeout=timeout
            ) as response:
                status = response.status
        except TimeoutError:
            return AttemptResult(error=f"timed out after {self._options.timeout_s:g} s")
        except aiohttp.ClientError as error:
            return AttemptResult(error=_error_text(error))
        if 200 <= status < 300:
            return AttemptResult(status_code=status)
        if 300 <= status < 400:
            return AttemptResult(
                status_code=status, error=f"HTTP {status}: redirects are not followed"
            )
        return AttemptResult(status_code=status, error=f"HTTP {status}")

    async def _record(self, delivery: WebhookDelivery, at_ms: int, result: AttemptResult) -> None:
        outbox = self._outbox
        status = result.status_code
        next_attempt_ms = None
        if status is not None and 200 <= status < 300:
            state, outcome = DeliveryState.DELIVERED, "delivered"
        elif status == 410:
            state, outcome = DeliveryState.DISABLED, "disabled"
        elif result.refused:
            state, outcome = DeliveryState.FAILED, "failed"
        else:
            delay_s = retry_delay_s(
                delivery.attempts + 1, self._options.backoff_cap_s, self._uniform
            )
            next_attempt_ms = at_ms + int(delay_s * 1000)
            if next_attempt_ms > delivery.created_ms + int(self._options.retry_max_s * 1000):
                state, outcome, next_attempt_ms = DeliveryState.FAILED, "failed", None
            else:
                state, outcome = DeliveryState.PENDING, "retried"
        recorded = await outbox.record_delivery_attempt(
            delivery.id,
            state=state,
            at_ms=at_ms,
            next_attempt_ms=next_attempt_ms,
            status_code=status,
            error=result.error,
        )
        disabled = 0
        if state is DeliveryState.DISABLED:
            disabled = await outbox.disable_webhook_endpoint(delivery.tenant, delivery.url, at_ms)
            logger.info(
                "webhooks: %s answered 410 Gone: endpoint disabled for tenant %s",
                delivery.url,
                delivery.tenant,
            )
        if self._metrics is not None:
            if recorded:
                self._metrics.webhook_deliveries.labels(outcome).inc()
            if disabled:
                self._metrics.webhook_deliveries.labels("disabled").inc(disabled)
        if state is DeliveryState.FAILED and recorded:
            logger.warning(
                "webhooks: gave up %s to %s after %d attempts: %s",
                delivery.id,
                delivery.url,
                delivery.attempts + 1,
                result.error,
            )


def payload_of(delivery: WebhookDelivery, parse: RecordParser = parse_record) -> bytes:
    """The body of a delivery: the job's details as they were at the event, in the envelope
    (the same bytes at every attempt)."""
    record = parse(delivery.record)
    payload = WebhookPayload(
        type=delivery.event_type,
        timestamp=datetime.fromtimestamp(delivery.created_ms / 1000, UTC).isoformat(
            timespec="milliseconds"
        ),
        event_id=delivery.event_id,
        data=JobDetails.from_record(record),
    )
    return payload.model_dump_json().encode()


def _error_text(error: aiohttp.ClientError) -> str:
    if isinstance(error, aiohttp.ClientConnectorError) and str(error.os_error).startswith(
        "refused:"
    ):
        return str(error.os_error)[:MAX_ERROR_CHARS]
    return (str(error) or type(error).__name__)[:MAX_ERROR_CHARS]
