"""Job records as the KV stores them, read by code of another server version."""

from __future__ import annotations

from jobs_server.manager import JobRecord, JobSpec
from jobs_server.manager.records import JobStatus, caching_record_parser


def test_a_record_with_fields_a_newer_server_added_is_still_read() -> None:
    # A supervisor runs the code of the server that created it; a newer server may rewrite
    # its job's record with spec fields that code does not know (the boundary refuses unknown
    # fields; a stored record must not).
    stored = JobRecord(spec=JobSpec(entrypoint="true", submission_id="job-1"), run_id="r1")
    dumped = stored.model_dump()
    dumped["spec"]["added_by_a_newer_server"] = {"any": "value"}
    read = JobRecord.model_validate(dumped)
    assert read.spec == stored.spec
    assert read == stored


def test_a_caching_parser_parses_a_text_once_whether_it_comes_as_str_or_bytes() -> None:
    record = JobRecord(spec=JobSpec(entrypoint="true", submission_id="cached"), run_id="r1")
    text = record.model_dump_json()
    parse = caching_record_parser(kept=2)
    first = parse(text)
    assert first == record
    assert parse(text.encode()) is first  # the KV's bytes and the archive's str of one record
    changed = record.with_changes(status=JobStatus.RUNNING)
    assert parse(changed.model_dump_json()).status is JobStatus.RUNNING
    # Bounded: past `kept` other texts, the first is parsed again (an equal, new object).
    parse(record.with_changes(status=JobStatus.SUCCEEDED).model_dump_json())
    again = parse(text)
    assert again == record
    assert again is not first
    # Each owner has its own: a parser made elsewhere shares nothing with this one.
    assert caching_record_parser()(text) is not again
