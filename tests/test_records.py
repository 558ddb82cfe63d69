"""Job records as the KV stores them, read by code of another server version."""

from __future__ import annotations

from jobs_server.manager import JobRecord, JobSpec


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
