"""The job manager: everything between the HTTP routes and the Ray cluster (no aiohttp here)."""

from jobs_server.manager.api import Backend, DriverFinderApi, JobManagerApi, PackageStoreApi
from jobs_server.manager.archive.interface import JobArchive, create_archive
from jobs_server.manager.archive.sqlite import Archive, JobQuery
from jobs_server.manager.cluster.dashboard_registration import (
    DashboardRegistration,
    registration_address,
)
from jobs_server.manager.cluster.leaving import ClusterAtShutdown
from jobs_server.manager.cluster.ray_cluster import (
    ClusterHealth,
    ClusterInfo,
    RayConnection,
    connect_to_ray,
    disconnect_from_ray,
    read_cluster_info,
    watch_cluster,
)
from jobs_server.manager.job_manager import JobManager, JobPage
from jobs_server.manager.logs import LogChunk
from jobs_server.manager.packages import PackageStore, package_uri
from jobs_server.manager.records import JobErrorType, JobRecord, JobSpec, JobStatus
from jobs_server.manager.submission_ids import new_submission_id
from jobs_server.manager.supervisor.drivers import RayDriver, RayDrivers

__all__ = [
    "Archive",
    "Backend",
    "ClusterAtShutdown",
    "ClusterHealth",
    "ClusterInfo",
    "DashboardRegistration",
    "DriverFinderApi",
    "JobArchive",
    "JobErrorType",
    "JobManager",
    "JobManagerApi",
    "JobPage",
    "JobQuery",
    "JobRecord",
    "JobSpec",
    "JobStatus",
    "LogChunk",
    "PackageStore",
    "PackageStoreApi",
    "RayConnection",
    "RayDriver",
    "RayDrivers",
    "connect_to_ray",
    "create_archive",
    "disconnect_from_ray",
    "new_submission_id",
    "package_uri",
    "read_cluster_info",
    "registration_address",
    "watch_cluster",
]
