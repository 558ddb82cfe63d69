"""Env var names and values that no process environment can hold are refused at the API (issue 32,
item 4): a NUL in a name or value, `=` in a name, an empty name. They used to reach the shared fork
server, whose request parsing raised and took every job it had forked with it."""

from __future__ import annotations

import pytest

from tests.support.api import Client
from tests.support.fakes import FakeJobManager


@pytest.mark.parametrize(
    ("env_vars", "field"),
    [
        ({"A": "x\x00y"}, "runtime_env.env_vars.A"),
        ({"A\x00B": "x"}, "runtime_env.env_vars"),
        ({"A=B": "x"}, "runtime_env.env_vars"),
        ({"": "x"}, "runtime_env.env_vars"),
    ],
)
async def test_an_env_var_no_environment_can_hold_is_400_naming_it(
    fake_client: Client, fake: FakeJobManager, env_vars: dict[str, str], field: str
) -> None:
    body = {"entrypoint": "true", "runtime_env": {"env_vars": env_vars}}
    response = await fake_client.post("/api/jobs/", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert field in error["message"]
    assert (await fake.list_jobs()).records == []


@pytest.mark.parametrize(
    "env_vars",
    [{"A": ""}, {"A": "x=y"}, {"PATH_1": "a b\tc\n"}, {"ü": "é"}, {}],
)
async def test_every_env_var_ray_clients_send_is_accepted(
    fake_client: Client, env_vars: dict[str, str]
) -> None:
    body = {"entrypoint": "true", "runtime_env": {"env_vars": env_vars}}
    response = await fake_client.post("/api/jobs/", json=body)
    assert response.status == 200, await response.text()
