"""The head node's jobs cgroup, set up once as the server starts: found (or made), its
head-wide memory ceiling written, and what dead supervisors left swept.

The ceiling keeps the server, Ray's GCS and raylet and the shared supervisors out of the OOM
killer's reach: the jobs of the head together may use at most it, and the kernel reclaims and
kills within the jobs' cgroup first. By default it is the memory available when the server
starts (/proc/meminfo's MemAvailable: what the server, Ray and everything else the host runs do
not use), plus what jobs already running on the node use (a restarted server's), less 1 GiB
of headroom for the control plane to grow into, and at least 256 MiB.
"""

from __future__ import annotations

import logging

from jobs_server.manager.supervisor.cgroups import (
    JobsCgroupTree,
    LimitsSupport,
    find_jobs_tree,
    jobs_memory_usage,
    set_memory_ceiling,
    sweep_dead_supervisors,
)

logger = logging.getLogger(__name__)

CONTROL_PLANE_HEADROOM_BYTES = 1 << 30
MIN_HEAD_JOBS_MEMORY_BYTES = 256 << 20


def default_head_jobs_memory_bytes(tree: JobsCgroupTree) -> int:
    """The default ceiling of this node's jobs, from what the node has now."""
    return head_jobs_memory_default(meminfo_bytes("MemAvailable"), jobs_memory_usage(tree))


def head_jobs_memory_default(available_bytes: int, jobs_bytes: int) -> int:
    """MemAvailable + what the node's jobs use - 1 GiB, and at least 256 MiB."""
    return max(
        MIN_HEAD_JOBS_MEMORY_BYTES, available_bytes + jobs_bytes - CONTROL_PLANE_HEADROOM_BYTES
    )


def meminfo_bytes(field: str) -> int:
    """A field of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0]) * 1024  # kB
    raise LookupError(f"/proc/meminfo has no {field}")


def set_up_head_jobs_cgroup(jobs_cgroup: str, memory_max_bytes: int | None) -> JobsCgroupTree:
    """Find the head's jobs cgroup, give it its ceiling (None: the default; 0: none) and sweep
    it. Blocking (a few file operations): call it from a thread."""
    tree = find_jobs_tree(jobs_cgroup)
    if tree.support is LimitsSupport.NONE:
        return tree
    for removed in sweep_dead_supervisors(tree):
        logger.info("removed the cgroup %s: its supervisor is gone", removed)
    if memory_max_bytes is None:
        memory_max_bytes = default_head_jobs_memory_bytes(tree)
    try:
        set_memory_ceiling(tree, memory_max_bytes or None)
    except OSError as error:
        logger.warning("the head's jobs run without a memory ceiling: %s", error)
    else:
        logger.info(
            "the head's jobs may use %s bytes of memory together", memory_max_bytes or "any"
        )
    return tree
