"""A loopback TCP proxy between a server and its PostgreSQL that, once armed, loses the answer to
one COMMIT: the COMMIT reaches the database (it commits), its answer never comes back, and both
sides of that connection are closed, as when the network breaks at the worst moment; and, if
asked, the database stays away from then on (every connection closed, new ones refused) until
`reconnect`. Or, armed with a delay, it holds that COMMIT back that long and then forwards it
and its answer (a slow link: the database commits after its client gave up). Threads, plain
sockets, no SSL (loopback). Stopped by `close` (its context)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
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
    # Hold its next COMMIT back this long, then forward it and its answer (None: lose the answer).
    commit_delay_s: float | None = None
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
        self._commit_delay_s: float | None = None
        self._away = threading.Event()
        self._pairs: list[_Pair] = []
        self.answer_lost = threading.Event()
        # Armed with a delay: set once the COMMIT held back was forwarded to the database.
        self.commit_forwarded = threading.Event()
        self._accepting = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._accepting.start()

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def arm(
        self, marker: bytes, *, away_after: bool = False, commit_delay_s: float | None = None
    ) -> None:
        """Lose the answer to the next COMMIT of the connection that sends `marker`; with
        `away_after`, every connection is cut then and new ones refused until `reconnect`. With
        `commit_delay_s`, that COMMIT is held back that long instead, then forwarded (its answer
        too); the connection's other bytes, and every other connection, are not delayed."""
        with self._lock:
            self._marker = marker
            self._away_after_loss = away_after
            self._commit_delay_s = commit_delay_s

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
                    pair.commit_delay_s = self._commit_delay_s
                    self._marker = None
                delay_s = None
                if pair.marked and _COMMIT in data:
                    pair.marked = False
                    if pair.commit_delay_s is None:
                        # Before it is sent: the bytes that come back after it are its answer.
                        pair.commit_sent = True
                    else:
                        delay_s = pair.commit_delay_s
            seen = data
            if delay_s is not None:
                time.sleep(delay_s)  # this connection's thread: the others go on
            try:
                pair.server.sendall(data)
            except OSError:
                break
            if delay_s is not None:
                self.commit_forwarded.set()
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
