"""Typed server configuration, read once from `JOBS_SERVER_*` variables and CLI flags."""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobs_server.manager.archive.interface import is_postgres_url

DEFAULT_PORT = 8266
DEFAULT_STATE_DIR = Path.home() / ".local" / "state" / "jobs-server"
LOG_DIR_NAME = "logs"
# Where the `auth_token` field is read from (pydantic-settings: prefix + name, any case).
AUTH_TOKEN_ENV_VAR = "JOBS_SERVER_AUTH_TOKEN"
# The variables whose values are secrets: read into Settings, then gone from the environment.
SECRET_ENV_VARS = frozenset({AUTH_TOKEN_ENV_VAR, "JOBS_SERVER_DATABASE_URL"})
RETENTION_MAX_AGE_S = 30 * 24 * 3600
# Jobs waiting for a slot, by default: each is held in memory (about 2 KiB) besides its archive
# row, and it stays a tenth of the default retention (live jobs count there, and are never
# deleted); beyond it a client is better told 429 and when to come back than queued for hours.
DEFAULT_MAX_QUEUED_JOBS = 10_000
# The jobs' nice value (zygote.py's `lower_priority`). Under load the server and Ray's processes,
# the control plane, get about three times the jobs' share of the CPU (weights 1024 against
# 335): in the queue's burst, POST p50 35-39 ms against 49-62 ms (docs/operations.md: CPU
# priority).
DEFAULT_JOBS_NICE = 5
# Uploads of the largest package size that may be in memory at once, by default.
UPLOADS_IN_FLIGHT_PER_PACKAGE = 4


class Settings(BaseSettings):
    """Everything the server can be told; each field is a `--flag` and a `JOBS_SERVER_*` var."""

    model_config = SettingsConfigDict(
        env_prefix="JOBS_SERVER_", frozen=True, extra="forbid", enable_decoding=False
    )

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port to listen on.")
    ray_address: str | None = Field(
        None,
        validation_alias=AliasChoices("ray_address", "JOBS_SERVER_RAY_ADDRESS", "RAY_ADDRESS"),
        description=(
            "Ray cluster to join (also read from RAY_ADDRESS). Unset: the cluster running on this"
            " machine, or else a new local Ray instance; 'local': always a new local instance."
        ),
    )
    state_dir: Path = Field(
        DEFAULT_STATE_DIR,
        description=(
            "Directory of the server's state: the job history (jobs.db, SQLite) and, unless"
            " --log-dir says otherwise, the jobs' logs (<state-dir>/logs). Made 0700, and locked"
            " while the server runs: a second server on it exits 1."
        ),
    )
    log_dir: Path = Field(
        DEFAULT_STATE_DIR / LOG_DIR_NAME,
        description="Directory that holds the jobs' log files (default: <state-dir>/logs).",
    )
    database_url: SecretStr | None = Field(
        None,
        description=(
            "The job history in PostgreSQL: postgresql://USER[:PASSWORD]@HOST:PORT/DATABASE"
            " (with a password, set it in the environment, which the server clears at start:"
            " a flag shows in ps). Unset: SQLite at <state-dir>/jobs.db. Its schema is"
            " migrated at start."
        ),
    )
    advertise_url: str | None = Field(
        None,
        description=(
            "With --database-url: where the other replicas reach this one, to forward job"
            " writes to it while it leads (http[s]://HOST:PORT). Default: this server's --host"
            " and --port (a wildcard --host gives this machine's name)."
        ),
    )
    database_timeout_s: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "With --database-url: seconds each call of the history (its wait for a connection"
            " included) may take before its request answers 503 database_unavailable, so that a"
            " database that accepts connections and never answers (frozen, a lock held forever,"
            " a stalled disk) is an outage, not a hang; also PostgreSQL's statement_timeout."
        ),
    )
    cluster_lost_exit_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Seconds Ray's GCS may be away before the server gives the cluster up and exits with"
            " status 69, so that systemd or Kubernetes starts it again on a working cluster. With"
            " GCS fault tolerance keep it below Ray's own reconnect timeout (60 s)."
        ),
    )
    stop_grace_s: float = Field(
        5.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds between SIGTERM and SIGKILL when a job is stopped.",
    )
    max_stop_grace_s: float = Field(
        300.0,
        ge=0,
        allow_inf_nan=False,
        description=(
            "Longest grace period a stop request may ask for (a longer one is refused with 400),"
            " so that every job can be ended."
        ),
    )
    job_start_timeout_s: float = Field(
        900.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Seconds a job may stay PENDING (waiting for resources or its runtime env) before it"
            " fails."
        ),
    )
    retry_backoff_s: float = Field(
        10.0,
        ge=0,
        le=300,
        allow_inf_nan=False,
        description=(
            "Seconds before a failed job's first retry (its max_retries); each further retry"
            " waits twice as long as the one before, at most 300 s."
        ),
    )
    shared_supervisors: int = Field(
        1,
        ge=0,
        le=64,
        description=(
            "Warm supervisor actors shared by the jobs that need no runtime env or resources of"
            " their own, handed jobs in turn; one's death ends all the jobs it holds (0: every"
            " job gets its own supervisor, and starts in about a second instead of milliseconds)."
        ),
    )
    jobs_nice: int = Field(
        DEFAULT_JOBS_NICE,
        ge=0,
        le=19,
        description=(
            "The jobs' nice value: of their processes and, where the kernel has autogroups, of"
            " their scheduling group, so that under load the server and Ray's processes keep"
            " their share of the CPU (0: the jobs at the server's priority)."
        ),
    )
    job_memory_max_bytes: int | None = Field(
        None,
        ge=1 << 20,
        le=2**62,
        description=(
            "The memory limit of a job that gives none and whose tenant has no default (its"
            " processes together, enforced by a cgroup: GET /api/version's `limits`). Default:"
            " none."
        ),
    )
    job_cpu_max_cores: float | None = Field(
        None,
        ge=0.01,
        le=4096,
        allow_inf_nan=False,
        description="The CPU limit (cores) of a job that gives none, as --job-memory-max-bytes.",
    )
    job_max_processes: int | None = Field(
        None,
        ge=1,
        le=1 << 22,
        description="The process limit of a job that gives none, as --job-memory-max-bytes.",
    )
    enforce_entrypoint_memory: bool = Field(
        False,
        description=(
            "A job's entrypoint_memory (which Ray only reserves) is also its memory limit when"
            " it gives none in `limits`."
        ),
    )
    jobs_cgroup: str = Field(
        "jobs-server",
        pattern=r"^/?[A-Za-z0-9_.@-]+(/[A-Za-z0-9_.@-]+)*$",
        description=(
            "The cgroup each node's jobs run under (a cgroup per job attempt in it): relative to"
            " the server's own cgroup (the supervisors use the same path on every node), or"
            " absolute (a subtree delegated to the server's user)."
        ),
    )
    no_job_cgroups: bool = Field(
        False,
        description=(
            "Run jobs without a cgroup each: no limits enforced, no head-wide ceiling; what a"
            " job used is measured from its reaped processes (GET /api/version: limits none)."
        ),
    )
    head_jobs_memory_max_bytes: int | None = Field(
        None,
        ge=0,
        le=2**62,
        description=(
            "The memory ceiling of all the jobs on the head node together, which keeps the"
            " server, Ray's GCS and the shared supervisors out of the OOM killer's reach. Default:"
            " the memory available when the server starts, less 1 GiB (README); 0: none."
        ),
    )
    webhook_secret_file: Path | None = Field(
        None,
        description=(
            "A file holding the `whsec_...` secret (one per line while one is rotated) that"
            " signs the webhooks of jobs whose tenant has none of its own. Without it (and"
            " without a tenant secret) a job's `notify` is refused."
        ),
    )
    webhook_allow_http: bool = Field(
        False, description="Webhook URLs may be http:// (default: https:// only)."
    )
    webhook_allow_private: bool = Field(
        False,
        description=(
            "Webhooks may go to loopback, link-local and private addresses (default: refused,"
            " at submit and at each send, whatever a name resolves to then)."
        ),
    )
    webhook_retry_max_s: float = Field(
        86_400.0,
        gt=0,
        description=(
            "How long a webhook delivery is retried (exponential backoff with jitter) after"
            " its event before it is given up (FAILED)."
        ),
    )
    webhook_timeout_s: float = Field(
        10.0, gt=0, le=300, description="The most one webhook attempt may take, end to end."
    )
    webhook_max_in_flight: int = Field(
        64,
        ge=1,
        le=10_000,
        description="Webhook deliveries sent at once (one tenant's: at most half of them).",
    )
    max_running_jobs: int | None = Field(
        None,
        ge=1,
        description=(
            "Jobs running at once (handed to a supervisor, not yet ended; one that waits for"
            " Ray's resources counts); more wait PENDING in the queue. Default: unlimited."
        ),
    )
    max_queued_jobs: int = Field(
        DEFAULT_MAX_QUEUED_JOBS,
        ge=0,
        description=(
            "Jobs waiting in the queue at once (over --max-running-jobs or a tenant's cap);"
            " beyond it a submit is refused with 429 and Retry-After."
        ),
    )
    namespace: str = Field(
        "jobs_server",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Ray namespace for supervisor actors and job records; one per server.",
    )
    embedded_ray_node_ip: str = Field(
        "127.0.0.2",
        description=(
            "Node address of the embedded local Ray instance (a 127.0.0.x address keeps Ray on"
            " loopback; Ray replaces a plain 127.0.0.1 with the machine's address)."
        ),
    )
    max_request_bytes: int = Field(
        1024 * 1024, gt=0, description="Largest JSON request body accepted, in bytes."
    )
    max_package_bytes: int = Field(
        100 * 1024 * 1024, gt=0, description="Largest working_dir package upload, in bytes."
    )
    shutdown_timeout_s: float = Field(
        5.0,
        ge=0,
        allow_inf_nan=False,
        description=(
            "Seconds that requests in progress get to finish at shutdown (SIGTERM, SIGINT) before"
            " they are cancelled; log followers are ended at once (websockets with 1001)."
        ),
    )
    retention_max_age_s: float = Field(
        RETENTION_MAX_AGE_S,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Seconds a finished job is kept after it ended; older ones are deleted (record, log)"
            " in the background."
        ),
    )
    retention_max_jobs: int = Field(
        100_000,
        ge=1,
        description=(
            "Jobs kept (live ones count, and are never deleted); the oldest finished ones beyond"
            " it are deleted in the background."
        ),
    )
    retention_interval_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between two retention sweeps.",
    )
    min_free_disk_bytes: int = Field(
        1024**3,
        ge=0,
        description=(
            "Free bytes the disk of the state and log directories keeps: below it, submits and"
            " package uploads are refused with 507 (running jobs go on)."
        ),
    )
    max_upload_bytes_in_flight: int | None = Field(
        None,
        gt=0,
        description=(
            "Bytes of package uploads held in memory at once (each is read whole); beyond it an"
            " upload is refused with 429 and Retry-After. Default: 4 x max_package_bytes."
        ),
    )
    log_level: str = Field("INFO", description="Server log level (DEBUG, INFO, WARNING, ...).")
    auth_token: SecretStr | None = Field(
        None,
        description=(
            "Bearer token every request must carry (environment only: a flag would show in ps)."
        ),
        json_schema_extra={"cli": False},
    )
    auth_token_file: Path | None = Field(
        None, description="File holding the bearer token (its first line)."
    )
    tokens_file: Path | None = Field(
        None,
        description=(
            "TOML file of API keys (by sha256 digest), each with a tenant and a role (admin,"
            " submit, read), and per-tenant caps; re-read on SIGHUP. The auth token, if any,"
            " stays an admin key beside them."
        ),
    )
    insecure_no_auth: bool = Field(
        False,
        description="Allow a non-loopback bind without a token: anyone who reaches it runs code.",
    )
    tls_cert: Path | None = Field(None, description="TLS certificate chain (PEM) to serve HTTPS.")
    tls_key: Path | None = Field(None, description="TLS private key (PEM) for --tls-cert.")
    cors_origins: list[str] = Field(
        default_factory=list,
        description=(
            "Browser origins (scheme://host[:port]) allowed to call the API cross-site,"
            " comma-separated; none by default."
        ),
    )

    allowed_hosts: list[str] = Field(
        default_factory=list,
        description=(
            "Host names this server is reached by (its public name, behind a proxy the name"
            " the browser uses), comma-separated; a request whose Host names anything else is"
            " refused with 400, so that a page whose name was rebound to this address (DNS"
            " rebinding) reaches nothing. Always allowed: localhost, address literals, this"
            " machine's hostname and the bind address. '*': any name."
        ),
    )
    forwarded_allow_ips: list[str] = Field(
        default_factory=list,
        description=(
            "Addresses or networks of the proxies whose X-Forwarded-Proto, -Host and -For"
            " are believed (a TLS-terminating proxy: the browser's https origin), comma-"
            "separated; from any other peer they are ignored. '*': every peer. Default: none."
        ),
    )

    jobs_user: str | None = Field(
        None,
        description=(
            "The Unix user every job's command runs as (a tenant's run_as in the tokens file"
            " wins for its jobs); the server must be able to change user (root or"
            " CAP_SETUID). Default: the server's own user."
        ),
    )

    @field_validator("cors_origins", "allowed_hosts", "forwarded_allow_ips", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not is_postgres_url(value.get_secret_value()):
            raise ValueError("must start with postgresql:// (or postgres://)")
        return value

    @field_validator("advertise_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urllib.parse.urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("must name a server (scheme, host, port), without a path")
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def replica_url(self) -> str | None:
        """Where the other replicas forward job writes while this one leads: --advertise-url,
        or this server's own address (None on port 0, chosen only when it listens)."""
        if self.advertise_url is not None:
            return self.advertise_url
        if self.port == 0:
            return None
        host = socket.getfqdn() if self.host in ("", "0.0.0.0", "::") else self.host
        if ":" in host:
            host = f"[{host}]"
        scheme = "http" if self.tls_cert is None else "https"
        return f"{scheme}://{host}:{self.port}"

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses_or_networks(cls, value: list[str]) -> list[str]:
        for item in value:
            if item != "*":
                try:
                    ipaddress.ip_network(item, strict=False)
                except ValueError as error:
                    raise ValueError(f"{item!r} is not an address or a network") from error
        return value

    @model_validator(mode="before")
    @classmethod
    def _logs_in_the_state_dir(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("log_dir") is None:
            state_dir = data.get("state_dir")
            if state_dir is not None:
                return {**data, "log_dir": Path(state_dir) / LOG_DIR_NAME}
        return data

    @model_validator(mode="after")
    def _stop_grace_within_its_ceiling(self) -> Settings:
        if self.stop_grace_s > self.max_stop_grace_s:
            raise ValueError(
                f"stop_grace_s ({self.stop_grace_s:g}) must not exceed max_stop_grace_s"
                f" ({self.max_stop_grace_s:g})"
            )
        return self

    @property
    def upload_bytes_in_flight_limit(self) -> int:
        if self.max_upload_bytes_in_flight is None:
            return UPLOADS_IN_FLIGHT_PER_PACKAGE * self.max_package_bytes
        return self.max_upload_bytes_in_flight

    @model_validator(mode="after")
    def _largest_package_fits_in_flight(self) -> Settings:
        if self.upload_bytes_in_flight_limit < self.max_package_bytes:
            raise ValueError(
                f"max_upload_bytes_in_flight ({self.upload_bytes_in_flight_limit}) must be at"
                f" least max_package_bytes ({self.max_package_bytes})"
            )
        return self

    @model_validator(mode="after")
    def _tls_needs_both(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self
