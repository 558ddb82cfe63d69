"""What tests of a database that does not answer check: the 503 a client can act on, and the
archive's own row."""

from __future__ import annotations

from typing import Any

import psycopg
import requests


def assert_database_unavailable(response: requests.Response) -> dict[str, Any]:
    """The 503 a client can act on: JSON in the server's error shape, code
    database_unavailable, and when to retry."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["Content-Type"].startswith("application/json")
    assert int(response.headers["Retry-After"]) > 0
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "database_unavailable", error
    assert "Traceback" not in error["message"]
    return error


def archived_status(database_url: str, submission_id: str) -> str | None:
    """The job's status in the archive's own row (not a live overlay): what the history says."""
    with psycopg.connect(database_url) as db:
        row = db.execute(
            "SELECT status FROM jobs WHERE submission_id = %s", (submission_id,)
        ).fetchone()
    return None if row is None else str(row[0])
