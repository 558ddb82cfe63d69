"""A loopback TCP proxy between a server and its PostgreSQL that, once armed, loses the answer to
one COMMIT: the COMMIT reaches the database (it commits), its answer never comes back, and both
sides of that connection are closed, as when the network breaks at the worst moment; and, if
asked, the database stays away from then on (every connection closed, new ones refused) until
`reconnect`. Threads, plain sockets, no SSL (loopback). Stopped by `close` (its context)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

_CHUNK_BYTES = 65536
# What the client sends for a commit: psycopg's `COMMIT` (a simple query, or a Parse of it).
_COMMIT = b"COMMIT"


@dataclass
class _Pair:
    client: socket.socket
    server: socket.socket
    # Armed and this connection sent the marker: its next COMMIT's answer is lost.
    marked: bool = False
    # Its COMMIT went to the database: the next bytes back are that answer, dropped.
    commit_sent: bool = False
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class CommitAnswerLoss:
    """Forwards 127.0.0.1:`port` to the database at `target_port`; `arm(marker)` makes the first
    connection that sends `marker` (e.g. a submission_id in an INSERT's parameters) lose the
    answer to its next COMMIT; `answer_lost` is set once it did."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._marker: bytes | None = None
        # After the loss: the database is away (connections closed at once) until `reconnect`.
        self._away_after_loss = False
        self._away = threading.Event()
        self._pairs: list[_Pair] = []
        self.answer_lost = threading.Event()
        self._accepting = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._accepting.start()

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def arm(self, marker: bytes, *, away_after: bool = False) -> None:
        """Lose the answer to the next COMMIT of the connection that sends `marker`; with
        `away_after`, every connection is cut then and new ones refused until `reconnect`."""
        with self._lock:
            self._marker = marker
            self._away_after_loss = away_after

    def reconnect(self) -> None:
        """The database answers again: new connections are forwarded."""
        self._away.clear()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close()

    def _go_away(self) -> None:
        self._away.set()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self._away.is_set():
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self._target_port))
            pair = _Pair(client, server)
            with self._lock:
                self._pairs.append(pair)
            for target, name in ((self._to_server, "up"), (self._to_client, "down")):
                threading.Thread(
                    target=target, args=(pair,), name=f"proxy-{name}", daemon=True
                ).start()

    def _to_server(self, pair: _Pair) -> None:
        seen = b""
        while not pair.closed.is_set():
            try:
                data = pair.client.recv(_CHUNK_BYTES)
            except OSError:
                break
            if not data:
                break
            with self._lock:
                # The tail of the last chunk too: a marker may straddle two reads.
                if self._marker is not None and self._marker in seen[-len(self._marker) :] + data:
                    pair.marked = True
                    self._marker = None
                if pair.marked and _COMMIT in data:
                    # Before it is sent: the bytes that come back after it are its answer.
                    pair.marked = False
                    pair.commit_sent = True
            seen = data
            try:
                pair.server.sendall(data)
            except OSError:
                break
        pair.close()

    def _to_client(self, pair: _Pair) -> None:
        while not pair.closed.is_set():
            try:
                data = pair.server.recv(_CHUNK_BYTES)
            except OSError:
                break
            if not data:
                break
            if pair.commit_sent:
                # The database committed and answered; the answer is lost on the way.
                if self._away_after_loss:
                    self._go_away()
                self.answer_lost.set()
                break
            try:
                pair.client.sendall(data)
            except OSError:
                break
        pair.close()


@contextlib.contextmanager
def commit_answer_loss(target_port: int) -> Iterator[CommitAnswerLoss]:
    """A `CommitAnswerLoss` proxy to the database on `target_port`, for as long as it lasts."""
    proxy = CommitAnswerLoss(target_port)
    try:
        yield proxy
    finally:
        proxy.close()
