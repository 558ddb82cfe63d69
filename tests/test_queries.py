"""Queries over the history (issue 14, item 5): served from the archive, against real Ray."""

from __future__ import annotations

from tests.support.api import Client, submit, wait_for_status


async def ids(client: Client, query: str) -> list[str]:
    response = await client.get(f"/api/jobs/?{query}")
    assert response.status == 200, await response.text()
    return [job["submission_id"] for job in await response.json()]


async def test_metadata_status_time_and_order_filters_combine(client: Client) -> None:
    jobs = []
    for index, (team, entrypoint) in enumerate(
        [("x", "true"), ("y", "exit 1"), ("x", "exit 1"), ("x", "true")]
    ):
        job_id = await submit(
            client,
            entrypoint=entrypoint,
            submission_id=f"query-{index}",
            metadata={"team": team, "n": str(index)},
        )
        jobs.append(await wait_for_status(client, job_id))
    assert await ids(client, "metadata.team=x") == ["query-0", "query-2", "query-3"]
    assert await ids(client, "metadata.team=x&metadata.n=2") == ["query-2"]
    assert await ids(client, "status=FAILED&metadata.team=x") == ["query-2"]
    assert await ids(client, "order=desc") == ["query-3", "query-2", "query-1", "query-0"]
    assert await ids(client, "order=desc&limit=2&after=query-2") == ["query-1", "query-0"]
    second = jobs[1]["start_time"]
    assert await ids(client, f"submitted_after={second}") == ["query-2", "query-3"]
    assert await ids(client, f"submitted_before={second}") == ["query-0"]
    assert await ids(client, "submitted_after=1970-01-01T00:00:00Z&metadata.team=y") == ["query-1"]
    assert await ids(client, "submitted_after=2999-01-01T00:00:00%2B02:00") == []


async def test_a_page_names_the_next_and_the_unpaginated_list_is_streamed(
    client: Client,
) -> None:
    for index in range(3):
        await submit(client, entrypoint="true", submission_id=f"page-{index}")
    response = await client.get("/api/jobs/?limit=2")
    assert "after=page-1" in response.headers["Link"]
    whole = await client.get("/api/jobs/")
    # Streamed: no Content-Length, chunked as the archive is read.
    assert "Content-Length" not in whole.headers
    assert [job["submission_id"] for job in await whole.json()] == [
        "page-0",
        "page-1",
        "page-2",
    ]


async def test_bad_query_values_are_clear_400s(client: Client) -> None:
    for query in (
        "submitted_after=yesterday",
        "submitted_before=2026-01-01T00:00:00",  # no offset: ambiguous
        "order=up",
        "after=nope",
        "limit=2&limit=3",
    ):
        response = await client.get(f"/api/jobs/?{query}")
        assert response.status == 400, query
        assert (await response.json())["error"]["code"] == "invalid_request"
