"""Tenants and roles: whom a key speaks for, what it may do, and what its tenant may queue.

Shared by the authentication layer (which maps a key to a `Principal`) and the manager (which
scopes every job to a tenant and caps each tenant's queue). No HTTP here.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from enum import StrEnum

from jobs_server.manager.limits import JobLimits

# The tenant of jobs submitted without tenants configured (no key, or the single admin key of
# JOBS_SERVER_AUTH_TOKEN), and of jobs archived before tenants existed (tenant NULL).
DEFAULT_TENANT = "default"


class Role(StrEnum):
    """What a key may do."""

    ADMIN = "admin"
    """Every action on every tenant's jobs."""
    SUBMIT = "submit"
    """Submit, stop and delete its tenant's jobs, upload packages, and read them."""
    READ = "read"
    """Read its tenant's jobs, logs and events; nothing that changes anything."""

    def may_change_jobs(self) -> bool:
        """Submit, stop, delete and upload: every role but `read`."""
        return self is not Role.READ


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key's tenant and role (and the key's name, for the audit log)."""

    tenant: str
    role: Role
    key_name: str | None = None

    @property
    def tenant_scope(self) -> str | None:
        """The one tenant whose jobs this caller sees; None: every tenant (an admin)."""
        return None if self.role is Role.ADMIN else self.tenant


# Who calls when the server has no authentication at all: an admin of the default tenant.
ANONYMOUS_ADMIN = Principal(tenant=DEFAULT_TENANT, role=Role.ADMIN)


@dataclass(frozen=True)
class RunAs:
    """A Unix user that jobs run as (`--jobs-user`, a tenant's `run_as`), resolved once where
    it is named: the job's start changes to these numbers without looking anything up."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def of(cls, name: str) -> RunAs:
        """The user `name`; ValueError if there is no such user."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise ValueError(f"no such user: {name!r}") from None
        groups = tuple(os.getgrouplist(name, entry.pw_gid))
        return cls(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's caps (None: no cap of its own; the server-wide caps still apply), and its
    jobs' default and maximum resource limits. The
    retention caps are bounded by the server's (--retention-max-jobs, --retention-max-age-s):
    a larger value keeps nothing longer than the server does."""

    max_running: int | None = None
    max_queued: int | None = None
    max_jobs: int | None = None
    """Jobs of the tenant kept (live ones count, and are never deleted)."""
    max_age_s: float | None = None
    """Seconds a finished job of the tenant is kept after it ended."""
    run_as: RunAs | None = None
    """The user the tenant's jobs run as (over `--jobs-user`); None: the server's default."""
    default_limits: JobLimits | None = None
    """Per kind, the limit of its jobs that give none (over the server's defaults,
    `--job-memory-max-bytes`, ...)."""
    max_limits: JobLimits | None = None
    """Its ceilings: a job asking more is refused; one that gives none and has no default gets
    the ceiling (limits.py `effective_limits`)."""


NO_LIMITS = TenantLimits()
