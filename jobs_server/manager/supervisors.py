"""Where jobs run: warm shared supervisors, and a supervisor of its own for a job that needs one.

A shared supervisor is created when the server starts and lives on between jobs, so a job that
needs no runtime env or resources of its own starts without waiting for a Ray worker process. A
job with a runtime env (working_dir, pip, ...) or resources gets a dedicated supervisor whose
actor carries them, killed when the job ends.

As in Ray's server, a job that asks for no resources runs on the head node (the server's); one
that does may run on whichever node has them, and its log is pulled to the head.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RuntimeEnvSetupError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from jobs_server.manager.cluster.ray_metrics import SUPERVISOR_ENV_VARS
from jobs_server.manager.records import JobSpec
from jobs_server.manager.supervisor.actor import JobSupervisor
from jobs_server.manager.supervisor_calls import first_line

logger = logging.getLogger(__name__)

_DEDICATED_PREFIX = "jobs_server_supervisor:"
# A shared supervisor found dead when the server starts is created again, this often at most.
WARM_ATTEMPTS = 10
WARM_RETRY_S = 0.5
_SHARED_PREFIX = "jobs_server_shared_supervisor:"
# Calls a shared supervisor serves at once. Each job it runs holds two or three for its whole
# life (its run, its watcher's wait); Ray's default for an async actor (1,000) would leave a
# stop, or the start of the next job, waiting behind a few hundred running jobs.
SHARED_MAX_CONCURRENCY = 100_000


def _code_fingerprint() -> str:
    """A digest of the server's code: a server never hands jobs to a warm supervisor that an
    older version of it created (the actor's code was fixed when it was created). Every module
    of the package counts, in every subpackage: the supervisor's code is pickled by value from
    wherever it lives, so a module that moves changes the digest too."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


_SHARED_NAME_PREFIX = f"{_SHARED_PREFIX}{_code_fingerprint()}:"


def is_dedicated(supervisor_name: str) -> bool:
    return supervisor_name.startswith(_DEDICATED_PREFIX)


@dataclass(frozen=True)
class SupervisorOccupancy:
    """How many jobs the supervisors hold (handed over, not yet ended): what one supervisor's
    death would end."""

    shared: dict[str, int]
    """By shared supervisor's name: this server's own at 0 too, another's (adopted from an older
    version or another `--jobs-nice`, retired once idle) only while it holds jobs."""
    own: int
    """Jobs on a supervisor of their own: one job each, named for the run, so counted together."""


class Supervisors:
    """Creates and finds supervisor actors by name, in the server's namespace."""

    def __init__(
        self,
        *,
        namespace: str,
        kv_namespace: str,
        shared_count: int,
        head_node_id: str,
        jobs_nice: int = 0,
    ) -> None:
        self._namespace = namespace
        # The jobs' nice value, for each supervisor created here. A supervisor keeps the value
        # it was created with, so the value is part of a shared supervisor's name: a server
        # started with another one makes its own, and retires the others once they are idle.
        self._jobs_nice = jobs_nice
        self._on_head_node = NodeAffinitySchedulingStrategy(node_id=head_node_id, soft=False)
        self._kv_namespace = kv_namespace
        self._shared_names = [
            f"{_SHARED_NAME_PREFIX}nice{jobs_nice}:{index}" for index in range(shared_count)
        ]
        self._shared_handles: dict[str, Any] = {}
        self._round_robin = itertools.cycle(self._shared_names)
        # Whether shared supervisors are created with Ray's metrics off (ray_metrics.py).
        self._metrics_off = True

    async def start(self) -> None:
        """Create (or find, after a restart) the shared supervisors and wait until they answer."""
        await asyncio.gather(*(self._warm(name) for name in self._shared_names))

    async def _warm(self, name: str) -> None:
        for attempt in range(1, WARM_ATTEMPTS + 1):
            try:
                await self._shared(name).ping.remote()
                return
            except RuntimeEnvSetupError as error:
                if not self._metrics_off:
                    raise
                # Its environment (Ray's metrics off) goes through Ray's runtime env agent:
                # without one that works, the supervisors run with the cluster's setting.
                logger.warning(
                    "Ray could not set up the shared supervisors' environment; they keep "
                    "Ray's metrics on: %s",
                    first_line(error),
                )
                self._metrics_off = False
                self.forget(name)
            except ActorDiedError:
                # Found under its name as it died (killed while no server ran): its name is
                # released soon, and the next attempt creates a new one.
                self.forget(name)
                if attempt == WARM_ATTEMPTS:
                    raise
                await asyncio.sleep(WARM_RETRY_S)

    def name_for(self, spec: JobSpec, run_id: str) -> str:
        """A shared supervisor's name, or a new one for a supervisor of the job's own: that name
        carries the run, since a killed actor's name is freed only some time after `ray.kill`
        (a deleted id submitted again at once gets another name)."""
        if spec.needs_own_supervisor() or not self._shared_names:
            return f"{_DEDICATED_PREFIX}{spec.submission_id}:{run_id}"
        return next(self._round_robin)

    def create(self, name: str, spec: JobSpec) -> Any:
        """The supervisor named `name` for `spec`: a new dedicated actor, or a shared one
        (blocking: a named actor is registered with the GCS before this returns)."""
        if not is_dedicated(name):
            return self._shared(name)
        options: dict[str, Any] = {
            "name": name,
            "namespace": self._namespace,
            "lifetime": "detached",
            "max_restarts": 0,
            # With no resources requested the supervisor needs no CPU, as in Ray's server.
            "num_cpus": spec.entrypoint_num_cpus or 0,
            "runtime_env": spec.runtime_env or None,
        }
        if spec.entrypoint_num_gpus:
            options["num_gpus"] = spec.entrypoint_num_gpus
        if spec.entrypoint_memory:
            options["memory"] = spec.entrypoint_memory
        if spec.entrypoint_resources:
            options["resources"] = spec.entrypoint_resources
        if spec.entrypoint_label_selector:
            options["label_selector"] = spec.entrypoint_label_selector
        if not spec.requested_resources() and not spec.entrypoint_label_selector:
            options["scheduling_strategy"] = self._on_head_node
        return (
            ray.remote(JobSupervisor).options(**options).remote(self._kv_namespace, self._jobs_nice)
        )

    def known_shared(self, name: str) -> Any | None:
        """The handle of the shared supervisor `name` if this server holds one (no I/O)."""
        return self._shared_handles.get(name)

    def find(self, name: str) -> Any | None:
        """The live actor named `name`, or None (blocking: asks the GCS)."""
        if name in self._shared_handles:
            return self._shared_handles[name]
        try:
            return ray.get_actor(name, namespace=self._namespace)
        except ValueError:
            return None

    def live_names(self) -> set[str]:
        """The names of every live supervisor in the namespace (blocking: one GCS call)."""
        return {
            actor["name"]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["namespace"] == self._namespace
        }

    def stale_shared_names(self, live_names: set[str]) -> list[str]:
        """Shared supervisors among `live_names` that another version of the server created, or
        a server with another `--jobs-nice`."""
        return sorted(
            name
            for name in live_names
            if name.startswith(_SHARED_PREFIX) and name not in self._shared_names
        )

    def occupancy(self, held_by: Iterable[str]) -> SupervisorOccupancy:
        """Count `held_by`, the supervisor name of each job held (no I/O)."""
        shared = dict.fromkeys(self._shared_names, 0)
        own = 0
        for name in held_by:
            if is_dedicated(name):
                own += 1
            elif name:
                shared[name] = shared.get(name, 0) + 1
        return SupervisorOccupancy(shared=shared, own=own)

    def kill(self, name: str) -> None:
        """Kill the supervisor named `name`, if it is still there (blocking)."""
        supervisor = self.find(name)
        if supervisor is not None:
            ray.kill(supervisor, no_restart=True)

    def forget(self, name: str) -> None:
        """A shared supervisor died: the next job sent to its name gets a new one."""
        if self._shared_handles.pop(name, None) is not None:
            logger.warning("shared supervisor %s died; it will be replaced", name)

    def _shared(self, name: str) -> Any:
        handle = self._shared_handles.get(name)
        if handle is None:
            handle = (
                ray.remote(JobSupervisor)
                .options(
                    name=name,
                    namespace=self._namespace,
                    lifetime="detached",
                    get_if_exists=True,
                    max_restarts=0,
                    num_cpus=0,
                    scheduling_strategy=self._on_head_node,
                    max_concurrency=SHARED_MAX_CONCURRENCY,
                    # Its calls (several per job) are plumbing, not work: recording each in
                    # Ray's task history loads the GCS and buries real tasks in the
                    # dashboard. Measured: 1,000 sleepers RUNNING 10% sooner.
                    enable_task_events=False,
                    # For the same reason, no Ray metrics of its own (ray_metrics.py).
                    runtime_env={"env_vars": SUPERVISOR_ENV_VARS} if self._metrics_off else None,
                )
                .remote(self._kv_namespace, self._jobs_nice)
            )
            self._shared_handles[name] = handle
        return handle
