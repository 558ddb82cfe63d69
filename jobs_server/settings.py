"""Typed server configuration, read once from `JOBS_SERVER_*` variables and CLI flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_PORT = 8266
DEFAULT_LOG_DIR = Path.home() / ".local" / "state" / "jobs-server" / "logs"


class Settings(BaseSettings):
    """Everything the server can be told; each field is a `--flag` and a `JOBS_SERVER_*` var."""

    model_config = SettingsConfigDict(env_prefix="JOBS_SERVER_", frozen=True, extra="forbid")

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
    log_dir: Path = Field(DEFAULT_LOG_DIR, description="Directory that holds the jobs' log files.")
    stop_grace_s: float = Field(
        5.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds between SIGTERM and SIGKILL when a job is stopped.",
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
    shared_supervisors: int = Field(
        1,
        ge=0,
        le=64,
        description=(
            "Warm supervisor actors shared by the jobs that need no runtime env or resources of"
            " their own (0: every job gets its own supervisor)."
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
    log_level: str = Field("INFO", description="Server log level (DEBUG, INFO, WARNING, ...).")
