"""Domain errors. Each has a stable `code`; the HTTP layer maps each class to a status once.

JobsServerError
├── InvalidRequestError        the request is malformed or fails validation
│   ├── InvalidRuntimeEnvError the runtime_env is rejected by Ray, or names a missing package
│   ├── InvalidPackageError    an uploaded package that is not a zip
│   ├── HostNotAllowedError    the Host names something this server does not answer to
│   ├── InvalidForwardedHeaderError  a trusted proxy's X-Forwarded-* that says nothing valid
│   └── InvalidJobOptionsError Ray rejects the job's resources or options
├── JobNotFoundError           no job with that id
├── PackageNotFoundError       no uploaded package with that URI
├── ConflictError              the request conflicts with the job's state
│   ├── DuplicateJobError      the submission_id is taken
│   ├── PackageExistsError     the package name is taken by other bytes (immutable)
│   └── JobNotTerminalError    deleting a job that has not ended
├── AuthenticationRequiredError  no token (401)
├── InvalidTokenError          a wrong token (403)
├── PermissionDeniedError      the key's role may not do that: a `read` key that changes (403)
├── CrossSiteRequestError      a browser request from another site (403)
├── PayloadTooLargeError       a body over the configured limit
├── TooManyRequestsError       over a bound on work in progress; try again later (429)
│   ├── UploadCapacityError    the bytes of package uploads in flight are at their bound
│   └── QueueFullError         the queue of jobs waiting for a slot is full (global or tenant)
├── InsufficientStorageError   the state directory's disk is (nearly) full (507)
├── UnsupportedMediaTypeError  a body that is not JSON
├── DatabaseUnavailableError   the archive's database (PostgreSQL) does not answer now (503)
├── LeaderUnavailableError     no replica leads the jobs now (a takeover under way): retry (503)
├── LogUnavailableError        the job's log is in a log directory this server does not see (503)
└── ClusterUnavailableError    Ray could not be reached
    └── SupervisorUnreachableError  a job's supervisor cannot be reached (its node may be failing)
"""

from __future__ import annotations

from typing import ClassVar


class JobsServerError(Exception):
    """Base class of every error the server reports to a client."""

    code = "internal_error"
    # Headers the answer must carry (e.g. WWW-Authenticate with a 401).
    headers: ClassVar[dict[str, str]] = {}

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def response_headers(self) -> dict[str, str]:
        """The headers of this error's answer (its class's, or its own)."""
        return dict(self.headers)


class InvalidRequestError(JobsServerError):
    code = "invalid_request"


class InvalidRuntimeEnvError(InvalidRequestError):
    code = "invalid_runtime_env"


class InvalidPackageError(InvalidRequestError):
    code = "invalid_package"


class HostNotAllowedError(InvalidRequestError):
    code = "host_not_allowed"


class InvalidForwardedHeaderError(InvalidRequestError):
    code = "invalid_forwarded_header"


class InvalidJobOptionsError(InvalidRequestError):
    code = "invalid_job_options"


class JobNotFoundError(JobsServerError):
    code = "job_not_found"

    def __init__(self, job_id: str) -> None:
        # Ray's words, unquoted: scripts match "<id> does not exist".
        super().__init__(f"Job {job_id} does not exist")
        self.job_id = job_id


class PackageNotFoundError(JobsServerError):
    code = "package_not_found"

    def __init__(self, uri: str) -> None:
        super().__init__(f"Package {uri!r} does not exist.")


class ConflictError(JobsServerError):
    code = "conflict"


class DuplicateJobError(ConflictError):
    code = "duplicate_submission_id"

    def __init__(self, submission_id: str) -> None:
        # Ray's words: KubeRay, for one, takes "already exists" for "already submitted".
        super().__init__(
            f"Job with submission_id {submission_id} already exists. "
            "Please use a different submission_id."
        )


class PackageExistsError(ConflictError):
    code = "package_exists"

    def __init__(self, uri: str) -> None:
        super().__init__(
            f"Package {uri!r} was already uploaded with other content; a package never changes."
            " Upload the new content under its own name (Ray's clients name a package by its"
            " content, so a changed directory gets a new name)."
        )


class JobNotTerminalError(ConflictError):
    code = "job_not_terminal"

    def __init__(self, submission_id: str, status: str) -> None:
        # Ray's words, with the status the job is in.
        super().__init__(
            f"Attempted to delete job '{submission_id}', but it is in a non-terminal state "
            f"{status}."
        )


class PayloadTooLargeError(JobsServerError):
    code = "payload_too_large"


# How long a client is asked to wait before it tries again after a 503: about what a restarting
# GCS (with fault tolerance) takes to answer again.
CLUSTER_RETRY_AFTER_S = 5


# How long a client is asked to wait after a 429 for uploads in flight: about what an upload of
# a large package takes on a fast link, after which others have ended.
UPLOAD_RETRY_AFTER_S = 2


class TooManyRequestsError(JobsServerError):
    """A bound on the work in progress is reached; the same request may succeed later."""

    code = "too_many_requests"


class UploadCapacityError(TooManyRequestsError):
    code = "upload_capacity_exceeded"
    headers: ClassVar[dict[str, str]] = {"Retry-After": str(UPLOAD_RETRY_AFTER_S)}


class QueueFullError(TooManyRequestsError):
    """A submit over a cap of running jobs finds the queue (the server's, or its tenant's)
    full; nothing was recorded. `retry_after_s`: when a place likely frees."""

    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def response_headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class InsufficientStorageError(JobsServerError):
    """The disk that holds the jobs' records and logs has too little free space for new work."""

    code = "insufficient_storage"


# How long a client is asked to wait after a 503 for a database that does not answer: about what
# PostgreSQL takes to restart (its crash recovery included), and the pool to reconnect.
DATABASE_RETRY_AFTER_S = 5


class DatabaseUnavailableError(JobsServerError):
    """The archive's database does not answer now (down, restarting, unreachable); the request
    may be retried. Nothing was recorded by the request that got it, unless it says so."""

    code = "database_unavailable"
    headers: ClassVar[dict[str, str]] = {"Retry-After": str(DATABASE_RETRY_AFTER_S)}


# How long a client is asked to wait after a 503 for a job write while no replica leads: a
# takeover comes when the dead leader's lease expires (leases.py: at most 5 s after its death);
# a leader's graceful stop is taken over within a second.
LEADER_RETRY_AFTER_S = 2


class LeaderUnavailableError(JobsServerError):
    """No replica leads the jobs now (one died and another is taking its work over, within
    seconds), or this one lost the lead: a job write is not taken; retry it shortly."""

    code = "leader_unavailable"
    headers: ClassVar[dict[str, str]] = {"Retry-After": str(LEADER_RETRY_AFTER_S)}


class LogUnavailableError(JobsServerError):
    """The job's log was written to a log directory this server does not see (a replica on
    another machine without the shared log volume, a lost disk, another --log-dir): answering
    an empty log would say the job printed nothing."""

    code = "log_unavailable"

    def __init__(self, submission_id: str) -> None:
        super().__init__(
            f"The log of job {submission_id} is in a log directory this server does not see:"
            " it was written to another server's --log-dir. Read it from a server on that log"
            " directory, or give every replica the same shared log volume as its --log-dir."
        )


class ClusterUnavailableError(JobsServerError):
    """Ray (its GCS, or a supervisor) does not answer now; the request may be retried."""

    code = "cluster_unavailable"
    headers: ClassVar[dict[str, str]] = {"Retry-After": str(CLUSTER_RETRY_AFTER_S)}


class SupervisorUnreachableError(ClusterUnavailableError):
    code = "supervisor_unreachable"


class UnsupportedMediaTypeError(JobsServerError):
    code = "unsupported_media_type"


class AuthenticationRequiredError(JobsServerError):
    code = "unauthorized"
    headers: ClassVar[dict[str, str]] = {"WWW-Authenticate": 'Bearer realm="jobs-server"'}


class InvalidTokenError(JobsServerError):
    code = "forbidden"


class PermissionDeniedError(JobsServerError):
    code = "permission_denied"


class CrossSiteRequestError(JobsServerError):
    code = "cross_site_request"
