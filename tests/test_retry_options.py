"""The retry options (issue 15, item 6): the submit body's `max_retries` and
`retry_on_exit_codes` are checked at the boundary (a 400 that records nothing), and the backoff
between attempts doubles per retry up to five minutes from the server's `--retry-backoff-s`.
The retries themselves, with real Ray and real processes: tests/test_retries.py."""

from __future__ import annotations

from typing import Any

import pytest

from jobs_server.manager.queue.retries import (
    DEFAULT_RETRY_BACKOFF_S,
    MAX_RETRY_BACKOFF_S,
    retry_backoff_s,
)
from jobs_server.settings import Settings
from tests.support.api import Client
from tests.support.fakes import FakeJobManager


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_retries", -1),
        ("max_retries", 101),
        ("max_retries", 1.5),
        ("max_retries", "3"),
        ("max_retries", True),
        ("retry_on_exit_codes", []),
        ("retry_on_exit_codes", [0]),
        ("retry_on_exit_codes", [1, 0]),
        ("retry_on_exit_codes", [256]),
        ("retry_on_exit_codes", [-65]),
        ("retry_on_exit_codes", ["1"]),
        ("retry_on_exit_codes", [1.5]),
        ("retry_on_exit_codes", [True]),
        ("retry_on_exit_codes", 1),
        ("retry_on_exit_codes", {"1": 1}),
        ("retry_on_exit_codes", list(range(1, 256)) * 2),
    ],
)
async def test_an_invalid_retry_option_is_400_and_records_nothing(
    fake_client: Client, fake: FakeJobManager, field: str, value: Any
) -> None:
    response = await fake_client.post("/api/jobs/", json={"entrypoint": "true", field: value})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "invalid_request"
    assert field in error["message"]
    assert (await fake.list_jobs()).records == []


@pytest.mark.parametrize(
    ("base_s", "retry", "backoff_s"),
    [
        (10, 1, 10),
        (10, 2, 20),
        (10, 3, 40),
        (10, 5, 160),
        (10, 6, 300),  # 320, capped at 5 minutes
        (10, 100, 300),
        (0.2, 3, 0.8),
        (300, 1, 300),
        (0, 7, 0),
    ],
)
def test_the_backoff_doubles_per_retry_up_to_five_minutes(
    base_s: float, retry: int, backoff_s: float
) -> None:
    assert retry_backoff_s(base_s, retry) == pytest.approx(backoff_s)


def test_the_backoff_is_a_setting_with_a_flag_and_a_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jobs_server.cli import build_parser, load_settings

    assert Settings().retry_backoff_s == DEFAULT_RETRY_BACKOFF_S == 10
    monkeypatch.setenv("JOBS_SERVER_RETRY_BACKOFF_S", "2.5")
    assert Settings().retry_backoff_s == 2.5
    flags = vars(build_parser().parse_args(["serve", "--retry-backoff-s", "0.5"]))
    flags.pop("command")
    assert load_settings(flags).retry_backoff_s == 0.5
    for out_of_range in (-1, MAX_RETRY_BACKOFF_S + 1, float("inf")):
        with pytest.raises(ValueError, match="retry_backoff_s"):
            Settings(retry_backoff_s=out_of_range)
