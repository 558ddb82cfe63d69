"""Server-Sent Events from a byte stream, as the HTML standard's parser reads them.

An event is dispatched only at the blank line that ends it, so an event cut by a dropped
connection is never seen: the last event seen is the last one whole, and its id is where a
reconnect resumes.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    """One event: its type (`message` unless named), data lines joined by `\\n`, and id."""

    event: str
    data: str
    id: str | None


async def read_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[Event]:
    """The events of a stream of byte chunks split anywhere (even inside a character or CRLF)."""
    pending = b""
    fields = _EventFields()
    async for chunk in chunks:
        pending += chunk
        lines = pending.split(b"\n")
        pending = lines.pop()  # the unfinished line waits for the next chunk
        for raw in lines:
            event = fields.take_line(raw.removesuffix(b"\r").decode("utf-8", errors="replace"))
            if event is not None:
                yield event


def parse_events(text: str) -> list[Event]:
    """The whole events of a text (a body read so far): an event not yet ended is left out."""
    fields = _EventFields()
    events = []
    for line in text.split("\n")[:-1]:  # the last line is unfinished (or empty)
        event = fields.take_line(line.removesuffix("\r"))
        if event is not None:
            events.append(event)
    return events


class _EventFields:
    """The fields of the event being read."""

    def __init__(self) -> None:
        self.event = ""
        self.data: list[str] = []
        # The id outlives its event, as the standard's "last event ID buffer" does.
        self.id: str | None = None

    def _reset(self) -> None:
        self.event, self.data = "", []

    def take_line(self, line: str) -> Event | None:
        if not line:
            if not self.data and not self.event:
                self._reset()
                return None
            event = Event(self.event or "message", "\n".join(self.data), self.id)
            self._reset()
            return event
        if line.startswith(":"):  # a comment: the heartbeat
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self.data.append(value)
        elif name == "event":
            self.event = value
        elif name == "id":
            self.id = value
        return None
