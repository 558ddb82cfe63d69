"""One place for a job's fields: an option declared in the request model and in `JobSpec`
reaches the spec, the job's details and its supervisor without being copied by hand."""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from jobs_server import api_models
from jobs_server.api_models import JobDetails, SubmitJobRequest
from jobs_server.manager import JobRecord, JobSpec
from jobs_server.manager.launcher import Launcher
from jobs_server.manager.runtime_envs import runtime_env_for_ray
from jobs_server.manager.supervisor.job_run import SupervisedJob
from jobs_server.manager.supervisors import Supervisors

# What the request sets that no option of the spec is: the id has a conversion of its own.
NOT_OPTIONS = {"submission_id", "job_id"}


def sample_of(annotation: Any, name: str) -> Any:
    """A value of type `annotation` that no field's default is (a new option's type that this
    does not know fails the test, naming it: teach it the type)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return sample_of(next(arg for arg in args if arg is not type(None)), name)
    if origin is typing.Annotated:
        sample = sample_of(args[0], name)
        # At least a lower bound it declares (a memory limit's 1 MiB).
        for constraint in args[1:]:
            for rule in getattr(constraint, "metadata", [constraint]):
                lowest = getattr(rule, "ge", None)
                if lowest is not None and sample < lowest:
                    sample = lowest
        return sample
    if annotation is str:
        return f"sample-{name}"
    if annotation is bool:
        return True
    if annotation is int:
        return 3
    if annotation is float:
        return 2.5
    if annotation is Any:
        return f"sample-{name}"
    if origin is dict:
        return {"sample": sample_of(args[1], name)}
    if origin in (tuple, list):
        return [sample_of(args[0], name)]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return list(annotation)[-1].value  # the last: never the first, a default's usual place
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        # A nested option (`limits`): each of its fields sampled in turn.
        return {
            field: sample_of(info.annotation, f"{name}.{field}")
            for field, info in annotation.model_fields.items()
        }
    raise AssertionError(f"no sample of {annotation!r} for {name}: add one to sample_of")


def shared_options(source: type[BaseModel], target: type[BaseModel]) -> list[str]:
    return [name for name in target.model_fields if name in source.model_fields]


def sample_request(**more: Any) -> dict[str, Any]:
    """A submit body that sets every option the request and the spec share to a value that is
    not the spec's default."""
    body: dict[str, Any] = {"entrypoint": "echo sample", "submission_id": "sample-job"}
    for name in shared_options(SubmitJobRequest, JobSpec):
        if name in body or name in NOT_OPTIONS:
            continue
        body[name] = sample_of(JobSpec.model_fields[name].annotation, name)
        assert body[name] != JobSpec.model_fields[name].get_default(call_default_factory=True)
    return {**body, **more}


def test_every_option_the_request_and_the_spec_share_reaches_the_spec() -> None:
    body = sample_request()
    spec = SubmitJobRequest.model_validate(body).to_spec(lambda: "unused")
    dumped = spec.model_dump(mode="json")
    assert {name: dumped[name] for name in body} == body


def test_an_option_left_out_or_null_is_the_specs_default() -> None:
    body = {"entrypoint": "true", "submission_id": "defaults"}
    nulls = {
        name: None
        for name, field in SubmitJobRequest.model_fields.items()
        if name not in body and not field.is_required() and field.default is None
    }
    expected = JobSpec(entrypoint="true", submission_id="defaults")
    assert SubmitJobRequest.model_validate(body).to_spec(lambda: "unused") == expected
    assert SubmitJobRequest.model_validate(body | nulls).to_spec(lambda: "unused") == expected
    # Without an id, the server names the job; `job_id` is Ray's older name for it.
    assert SubmitJobRequest(entrypoint="true").to_spec(lambda: "named").submission_id == "named"
    assert SubmitJobRequest(entrypoint="true", job_id="old").to_spec(lambda: "x").submission_id == (
        "old"
    )


def test_every_option_of_the_spec_the_details_declare_reaches_the_details() -> None:
    spec = SubmitJobRequest.model_validate(sample_request()).to_spec(lambda: "unused")
    details = JobDetails.from_record(JobRecord(spec=spec, run_id="r1")).model_dump(mode="json")
    declared = shared_options(JobSpec, JobDetails)
    assert "priority" in declared
    assert "entrypoint_label_selector" not in declared  # Ray's details have no such field
    dumped = spec.model_dump(mode="json")
    # A dependency's details add whether it is met now (null: not asked here).
    for dependency in details["depends_on"]:
        assert dependency.pop("met") is None
    assert {name: details[name] for name in declared} == {name: dumped[name] for name in declared}


class SpecWithOption(JobSpec):
    new_option: int = 0


class RequestWithOption(SubmitJobRequest):
    new_option: int | None = None


class DetailsWithOption(JobDetails):
    new_option: int


def test_a_new_option_needs_only_its_declarations(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if `new_option` were added to the request model, the spec and the details, and to
    # nothing else: it reaches the spec from the request, and the details from the spec.
    monkeypatch.setattr(api_models, "JobSpec", SpecWithOption)
    spec = RequestWithOption(entrypoint="true", submission_id="new", new_option=7).to_spec(str)
    assert isinstance(spec, SpecWithOption)
    assert spec.new_option == 7
    details = DetailsWithOption.from_record(JobRecord(spec=spec, run_id="r1"))
    assert details.new_option == 7
    # A null is the spec's default, as for every option.
    assert RequestWithOption(entrypoint="true", new_option=None).to_spec(str) == SpecWithOption(
        entrypoint="true", submission_id=""
    )


def test_the_supervised_job_carries_the_spec_not_copies_of_its_fields() -> None:
    copies = set(SupervisedJob.model_fields) & set(JobSpec.model_fields)
    assert not copies, f"SupervisedJob copies the spec's {sorted(copies)}: read them from .spec"
    assert SupervisedJob.model_fields["spec"].annotation is JobSpec


def test_the_launcher_hands_the_supervisor_the_records_spec(tmp_path: Path) -> None:
    launcher = Launcher(
        supervisors=Supervisors(
            namespace="fields", kv_namespace="fields", shared_count=1, head_node_id="0" * 56
        ),
        log_dir=tmp_path,
        stop_grace_s=4.0,
        head_node_id="0" * 56,
    )
    # An uploaded package is given to Ray as the tenant's copy; the spec keeps what was sent.
    body = sample_request(runtime_env={"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"})
    spec = SubmitJobRequest.model_validate(body).to_spec(lambda: "unused")
    record = JobRecord(spec=spec, run_id="r1", tenant="team-a")
    job = SupervisedJob.model_validate(launcher.supervised_job(record))
    assert job.spec == record.spec
    assert job.ray_runtime_env == runtime_env_for_ray(spec.runtime_env, "team-a")
    assert job.ray_runtime_env != spec.runtime_env
    assert (job.run_id, job.stop_grace_s, job.log_path.parent) == ("r1", 4.0, tmp_path)
    # Without packages the runtime env is the spec's: it crosses to the actor once.
    plain = record.model_copy(update={"spec": spec.model_copy(update={"runtime_env": {}})})
    assert SupervisedJob.model_validate(launcher.supervised_job(plain)).ray_runtime_env is None
