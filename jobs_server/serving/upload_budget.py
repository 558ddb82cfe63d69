"""A bound on the bytes of package uploads held in memory at once.

An upload is read whole before it is checked and stored (Ray's GCS stores a package as one
value), so each one costs its size in memory until it is stored: without a bound, a few
concurrent uploads of the largest package size could exhaust the server's memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jobs_server.errors import UploadCapacityError


class UploadBudget:
    """Bytes reserved by the uploads in progress, at most `limit_bytes` in all.

    Used on the event loop only: a check and its reservation happen with no await between
    them, so two uploads cannot both take the last bytes.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.in_flight_bytes = 0

    @contextlib.contextmanager
    def reserve(self, size_bytes: int) -> Iterator[None]:
        """Hold `size_bytes` while the block runs; UploadCapacityError (429) if they would
        exceed the bound."""
        if self.in_flight_bytes + size_bytes > self.limit_bytes:
            raise UploadCapacityError(
                f"Uploads in progress hold {self.in_flight_bytes} bytes; this one of up to "
                f"{size_bytes} bytes would exceed the server's bound of {self.limit_bytes} "
                "(--max-upload-bytes-in-flight). Try again shortly."
            )
        self.in_flight_bytes += size_bytes
        try:
            yield
        finally:
            self.in_flight_bytes -= size_bytes
