"""The tokens file (`--tokens-file`): API keys by digest, each with a tenant and a role, and
optional caps and job limits per tenant. TOML, read with the standard library; checked whole
before use.

    [[keys]]
    name = "ci-team-a"            # optional: shown in audit lines instead of the key
    digest = "sha256:<64 hex>"    # `jobs-server hash-token` makes a key and its digest
    tenant = "team-a"
    role = "submit"               # admin | submit | read

    [tenants.team-a]              # optional caps of the tenant's queue
    max_running = 10
    max_queued = 100
    max_jobs = 5000               # and of its history (retention), within the server's
    max_age_s = 86400
    run_as = "team-a-jobs"        # optional: the Unix user its jobs run as (needs root)

    [tenants.team-a.default_limits]   # optional: the limits of its jobs that give none
    memory_bytes = 1_073_741_824      #   (each of memory_bytes, cpu_cores, max_processes)
    cpu_cores = 1
    [tenants.team-a.max_limits]       # optional: the most a job of it may ask for (a 400
    memory_bytes = 8_589_934_592      #   above); a ceiling without a default is the default
    max_processes = 1000

    [tenants.team-b]
    webhook_secrets = ["whsec_..."]   # optional: signs its webhooks and its jobs' `notify`
                                      #   (two while one is rotated: two signatures)
    webhooks = [                      # optional: every job's events of the tenant go there
      { url = "https://hooks.example/jobs", events = ["job.failed"] },  # events: default all
      { url = "https://other.example/in", secrets = ["whsec_..."] },   # its own secrets
    ]
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from jobs_server.access.key_digest import DIGEST_PATTERN
from jobs_server.manager.limits import LIMIT_FIELDS, JobLimits
from jobs_server.manager.tenancy import NO_LIMITS, Principal, Role, RunAs, TenantLimits
from jobs_server.manager.webhook_events import (
    ALL_WEBHOOK_EVENTS,
    MAX_NOTIFY_TARGETS,
    NO_WEBHOOKS,
    TenantWebhookEndpoint,
    TenantWebhooks,
    WebhookEventType,
    WebhookUrl,
)
from jobs_server.webhooks.signing import secret_problem
from jobs_server.webhooks.targets import TargetPolicy

TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
KEY_NAME_PATTERN = r"^[A-Za-z0-9_.:@-]{1,64}$"
# A key without a name is shown in the audit log by the start of its digest (never the key).
UNNAMED_KEY_DIGEST_CHARS = 12

TenantName = Annotated[str, Field(pattern=TENANT_PATTERN)]
# Secrets at once: the one in use and the next while it is rotated, with room to spare.
MAX_WEBHOOK_SECRETS = 4


class TokensFileError(Exception):
    """The tokens file cannot be read or is not valid; the message says where and why."""


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=KEY_NAME_PATTERN)] | None = None
    digest: Annotated[str, Field(pattern=DIGEST_PATTERN.pattern)]
    tenant: TenantName
    role: Role


class _LimitsEntry(JobLimits):
    """A tenant's `default_limits` or `max_limits`: JobLimits' fields and bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def limits(self) -> JobLimits | None:
        """As the manager takes them; None if the table sets nothing."""
        return None if self.is_empty() else JobLimits.model_validate(self.model_dump())


def _checked_secret(secret: str) -> str:
    problem = secret_problem(secret)
    if problem is not None:
        raise ValueError(problem)
    return secret


WebhookSecret = Annotated[str, Field(strict=True), AfterValidator(_checked_secret)]
WebhookSecrets = Annotated[list[WebhookSecret], Field(max_length=MAX_WEBHOOK_SECRETS)]


class _WebhookEntry(BaseModel):
    """One endpoint of a tenant's `webhooks`: every job's events of the tenant it asks for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: WebhookUrl
    events: Annotated[list[WebhookEventType], Field(min_length=1)] = Field(
        default_factory=lambda: list(ALL_WEBHOOK_EVENTS)
    )
    secrets: WebhookSecrets = Field(default_factory=list)


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_running: Annotated[int, Field(ge=1, strict=True)] | None = None
    max_queued: Annotated[int, Field(ge=0, strict=True)] | None = None
    # A value above the server's --retention-max-jobs / --retention-max-age-s is taken (the
    # server's may be raised without editing this file) and bounded by the server's where used.
    max_jobs: Annotated[int, Field(ge=1, strict=True)] | None = None
    max_age_s: Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)] | None = None
    run_as: Annotated[str, Field(min_length=1, max_length=64, strict=True)] | None = None
    default_limits: _LimitsEntry | None = None
    max_limits: _LimitsEntry | None = None
    webhook_secrets: WebhookSecrets = Field(default_factory=list)
    webhooks: Annotated[list[_WebhookEntry], Field(max_length=MAX_NOTIFY_TARGETS)] = Field(
        default_factory=list
    )

    @model_validator(mode="after")
    def _webhooks_signed_once_each(self) -> _TenantEntry:
        urls = [webhook.url for webhook in self.webhooks]
        for index, webhook in enumerate(self.webhooks):
            if urls.index(webhook.url) != index:
                raise ValueError(
                    f"webhooks[{index}].url: the same URL as webhooks[{urls.index(webhook.url)}]"
                )
            if not webhook.secrets and not self.webhook_secrets:
                raise ValueError(
                    f"webhooks[{index}]: no secret signs it (its own secrets, or the tenant's"
                    " webhook_secrets)"
                )
        return self

    def tenant_webhooks(self) -> TenantWebhooks:
        return TenantWebhooks(
            endpoints=tuple(
                TenantWebhookEndpoint(
                    url=webhook.url, events=tuple(webhook.events), secrets=tuple(webhook.secrets)
                )
                for webhook in self.webhooks
            ),
            secrets=tuple(self.webhook_secrets),
        )

    @model_validator(mode="after")
    def _defaults_within_ceilings(self) -> _TenantEntry:
        if self.default_limits is None or self.max_limits is None:
            return self
        for name in LIMIT_FIELDS:
            default = getattr(self.default_limits, name)
            ceiling = getattr(self.max_limits, name)
            if default is not None and ceiling is not None and default > ceiling:
                raise ValueError(
                    f"default_limits.{name} ({default}) is above max_limits.{name} ({ceiling})"
                )
        return self


class _TokensDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[_KeyEntry] = Field(default_factory=list)
    tenants: dict[TenantName, _TenantEntry] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique(self) -> _TokensDocument:
        for what, values in (
            ("digest", [key.digest for key in self.keys]),
            ("name", [key.name for key in self.keys if key.name is not None]),
        ):
            repeated = sorted({value for value in values if values.count(value) > 1})
            if repeated:
                raise ValueError(f"keys: the {what} {repeated[0]!r} is given more than once")
        return self


@dataclass(frozen=True)
class TokensFile:
    """A valid tokens file: who each digest speaks for, each tenant's caps and webhooks."""

    principals: Mapping[str, Principal]
    """By digest (`sha256:<hex>`)."""
    limits: Mapping[str, TenantLimits]
    webhooks: Mapping[str, TenantWebhooks] = field(default_factory=dict)
    """Of the tenants that have any (endpoints or secrets)."""

    def limits_for(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, NO_LIMITS)

    def webhooks_for(self, tenant: str) -> TenantWebhooks:
        return self.webhooks.get(tenant, NO_WEBHOOKS)

    @property
    def tenants(self) -> frozenset[str]:
        """Every tenant the file names (of a key or with caps)."""
        return frozenset(p.tenant for p in self.principals.values()) | frozenset(self.limits)


def load_tokens_file(path: Path, *, target_policy: TargetPolicy | None = None) -> TokensFile:
    """Read and check the whole file; TokensFileError says what is wrong (never a key)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TokensFileError(f"cannot read the tokens file {path}: {error}") from error
    return parse_tokens(text, source=str(path), target_policy=target_policy)


def parse_tokens(
    text: str, *, source: str, target_policy: TargetPolicy | None = None
) -> TokensFile:
    """The tokens file's content, checked (its webhooks' URLs by `target_policy`, the server's;
    without one only their form); TokensFileError names `source` and the problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TokensFileError(f"tokens file {source}: not valid TOML: {error}") from error
    try:
        document = _TokensDocument.model_validate(data)
    except ValidationError as error:
        raise TokensFileError(f"tokens file {source}: {_describe(error)}") from error
    principals = {
        key.digest: Principal(
            tenant=key.tenant,
            role=key.role,
            key_name=key.name or key.digest[: len("sha256:") + UNNAMED_KEY_DIGEST_CHARS],
        )
        for key in document.keys
    }
    for tenant, entry in document.tenants.items():
        for index, webhook in enumerate(entry.webhooks):
            if target_policy is None:
                break
            problem = target_policy.url_problem(webhook.url)
            if problem is not None:
                raise TokensFileError(
                    f"tokens file {source}: tenants.{tenant}.webhooks[{index}].url: {problem}"
                )
    users: dict[str, RunAs] = {}
    for tenant, entry in document.tenants.items():
        if entry.run_as is not None:
            try:
                users[tenant] = RunAs.of(entry.run_as)
            except ValueError as error:
                raise TokensFileError(
                    f"tokens file {source}: tenants.{tenant!r}.run_as: {error}"
                ) from None
    limits = {
        tenant: TenantLimits(
            max_running=entry.max_running,
            max_queued=entry.max_queued,
            max_jobs=entry.max_jobs,
            max_age_s=entry.max_age_s,
            run_as=users.get(tenant),
            default_limits=None if entry.default_limits is None else entry.default_limits.limits(),
            max_limits=None if entry.max_limits is None else entry.max_limits.limits(),
        )
        for tenant, entry in document.tenants.items()
    }
    webhooks = {
        tenant: entry.tenant_webhooks()
        for tenant, entry in document.tenants.items()
        if entry.webhooks or entry.webhook_secrets
    }
    return TokensFile(principals=principals, limits=limits, webhooks=webhooks)


# Clearer words than a regular expression for the fields people get wrong.
_PATTERN_HINTS = {
    "digest": "expected 'sha256:' and 64 lowercase hex digits (see `jobs-server hash-token`)",
    "tenant": "expected 1 to 64 letters, digits, '_', '.' or '-'",
    "name": "expected 1 to 64 letters, digits, '_', '.', ':', '@' or '-'",
}


def _describe(error: ValidationError) -> str:
    """One clause per problem, each naming where it is (`keys[1].role: ...`); never the value
    (a key pasted where its digest belongs must not reach a log)."""
    problems = []
    for detail in error.errors(include_url=False, include_input=False):
        where = ""
        loc = detail["loc"]
        if "[key]" in loc:  # a bad table name: the problem is the name itself
            loc = (*loc[: loc.index("[key]") - 1], repr(loc[loc.index("[key]") - 1]))
        for part in loc:
            where += f"[{part}]" if isinstance(part, int) else f"{'.' if where else ''}{part}"
        message = detail["msg"]
        if detail["type"] == "extra_forbidden":
            message = "unknown field"
        elif detail["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        elif detail["type"] == "string_pattern_mismatch":
            message = _PATTERN_HINTS.get(str(detail["loc"][-1]), message)
            if detail["loc"][:1] == ("tenants",):
                message = _PATTERN_HINTS["tenant"]
        problems.append(f"{where or 'file'}: {message}")
    return "; ".join(problems)
