"""Hands queued jobs to their supervisors as slots free, and stops jobs that have not started.

A queued job is an archive row that was never handed over: no KV record, no supervisor. When a
slot frees (a watcher saw its job's end) or a job is queued, `fill` takes the next jobs in the
queue's order (job_queue.py), each holding its slot from that moment, and hands each over in a
task of its own: its KV record, its supervisor, its watcher.

A job submitted while a slot is free is handed over the same way, at once (`hand_over_now`):
one path, so a stop meets the same hand-over whichever way the job came. They differ only in
what a hand-over that Ray refuses does (`LaunchFailure`): a submit is withdrawn and its error
is the client's answer; a queued job, accepted long ago, ends FAILED.

A stop of a queued job takes it out of the queue and archives it STOPPED: its command never
runs. A stop that meets the job while it is being handed over calls the hand-over off before the
supervisor is asked to run it (or, if that was already asked, lets the usual stop do its work).

A job that depends on others (`depends_on`) waits before the queue (dependency_waits.py),
holding no slot and no place in the queue: it is registered in the waits first, then the
statuses of the jobs it waits for are read (so an end between the two is learnt either way), and
each end or deletion after that comes from the archive's events (`dependency_ended`). Once every
condition holds it is admitted as a job submitted then would be (a free slot, else a place in
the queue), its `dependencies_met_time` archived; if there is neither, it is archived *ready*
(every condition recorded held, its message saying what it waits for) and stays in the waits
until a slot or a place frees (`fill`), the ready ones in the order they were met. Once one
condition can no longer hold, it is archived FAILED (DEPENDENCY_NEVER_SATISFIED) as a stopped
queued job is, and its own end event decides its dependents in turn. A write that fails puts it
back in the waits, and its statuses are read again after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import NoReturn

import ray

from jobs_server.disk_guard import is_disk_full
from jobs_server.errors import (
    InsufficientStorageError,
    InvalidJobOptionsError,
    LeaderUnavailableError,
)
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.outage import is_database_unavailable
from jobs_server.manager.launcher import Launcher
from jobs_server.manager.live.deferred_ends import DeferredEnds
from jobs_server.manager.live.history import JobHistory
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.live.watcher import JobWatchers
from jobs_server.manager.logs import set_aside_orphaned_log
from jobs_server.manager.queue.admission import Admission, JobQueue
from jobs_server.manager.queue.dependency_waits import (
    READY_MESSAGE,
    DependencyWaits,
    Outcome,
    Resolution,
)
from jobs_server.manager.records import JobErrorType, JobRecord, JobStatus, now_ms
from jobs_server.manager.supervisor.job_run import NEVER_STARTED_MESSAGE
from jobs_server.manager.supervisors import Supervisors, is_dedicated

logger = logging.getLogger(__name__)

PENDING_MESSAGE = "Job is pending."

# A waiting job whose statuses could not be read, or whose resolution could not be written
# (the database away), is tried again after this long, doubled up to the most.
DEPENDENCY_RETRY_INITIAL_S = 0.5
DEPENDENCY_RETRY_MAX_S = 30.0

# The statuses now of the jobs a waiting job depends on, by id (None: not there, or another
# tenant's).
DependencyStatuses = Callable[[JobRecord], Awaitable[dict[str, JobStatus | None]]]


async def _no_dependency_statuses(record: JobRecord) -> dict[str, JobStatus | None]:
    return {}


async def _always_leading() -> None:
    """One server (SQLite): it always leads."""


class HandOver(Enum):
    """How a hand-over ended."""

    STARTED = "started"
    CALLED_OFF = "called off"
    FAILED = "failed"


class LaunchFailure(Enum):
    """What a hand-over that Ray refused (or a KV that did not take the record) does."""

    WITHDRAW = "withdraw"
    """A submit's: the job is withdrawn (as if never submitted) and the error is raised."""
    FAIL = "fail"
    """A queued job's (its submit was answered long ago): it ends FAILED."""


class Dispatcher:
    """Moves jobs from the queue to their supervisors; owns the hand-over tasks."""

    def __init__(
        self,
        *,
        queue: JobQueue,
        store: JobStore,
        history: JobHistory,
        archive: JobArchive,
        ends: DeferredEnds,
        launcher: Launcher,
        watchers: JobWatchers,
        supervisors: Supervisors,
        confirm_lead: Callable[[], Awaitable[None]] = _always_leading,
        waits: DependencyWaits | None = None,
        dependency_statuses: DependencyStatuses = _no_dependency_statuses,
    ) -> None:
        self._queue = queue
        self._waits = DependencyWaits() if waits is None else waits
        self._dependency_statuses = dependency_statuses
        # The waiting jobs' reads and resolutions; and, by job, the resolution being written
        # (a stop waits for it, then finds the job queued or ended).
        self._dependency_tasks: set[asyncio.Task[None]] = set()
        self._resolving: dict[str, asyncio.Event] = {}
        # Awaited before each step that cannot be undone (leadership.py): a replica that lost
        # the lead while frozen never hands a job over that the new leader hands over too.
        self._confirm_lead = confirm_lead
        self._supervisors = supervisors
        self._store = store
        self._history = history
        self._archive = archive
        self._ends = ends
        self._launcher = launcher
        self._watchers = watchers
        self._handing_over: dict[str, asyncio.Task[HandOver]] = {}
        self._called_off: set[str] = set()
        self._started = False
        self._closed = False

    def start(self) -> None:
        """Begin dispatching (after recovery has adopted the running jobs and re-queued the
        others: until then a free slot may not be free); again after a `close`, when a replica
        that stepped down leads again."""
        self._started = True
        self._closed = False
        self.fill()

    async def close(self) -> None:
        """Stop dispatching; a hand-over cut short is finished by the next server's recovery
        (a KV record without a supervisor is started; a row without one is queued again)."""
        self._closed = True
        tasks = [*self._handing_over.values(), *self._dependency_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def run_ended(self, record: JobRecord) -> None:
        """A watched run has ended (its end archived): its slot goes to the next in line."""
        if self._queue.free(record):
            self.fill()

    def fill(self) -> None:
        """Hand over queued jobs while there are free slots (no await: the slots are taken
        here, at once)."""
        if not self._started or self._closed:
            return
        while (record := self._queue.next_to_dispatch()) is not None:
            self._begin_hand_over(record, LaunchFailure.FAIL)
        self._admit_ready()

    # -- jobs waiting for others -----------------------------------------------------------

    def wait(self, record: JobRecord) -> None:
        """Hold a recorded job that waits for others (no slot, no place in the queue), and
        decide at once what the statuses of those already tell."""
        self._waits.add(record)
        self._spawn(self._settle(record), record)

    def wait_recovered(self, record: JobRecord) -> None:
        """Recovery's: a job accepted by an earlier server that still waits (or was met and
        waited for a place: its record lists every condition held)."""
        self.wait(record)

    def _admit_ready(self) -> None:
        """Admit the ready jobs (met, waiting for room) that now have a slot or a place, in
        the order they were met (no await: each takes its room here, at once)."""
        if not self._started or self._closed:
            return
        for record in self._waits.ready():
            admission = self._queue.try_admit(record)
            if admission is None:
                continue  # its tenant's caps; another tenant's may have room
            self._waits.remove(record.submission_id)
            self._spawn(self._settle(record, Resolution(record, Outcome.MET), admission), record)

    def dependency_ended(self, submission_id: str, status: JobStatus | None) -> None:
        """The job `submission_id` ended `status` (None: it was deleted): decide the jobs that
        wait for it (no await: each decided job leaves the waits here, once)."""
        for resolution in self._waits.learn(submission_id, status):
            self._spawn(self._settle(resolution.record, resolution), resolution.record)

    async def keep_held_dependencies(self, deleted: JobRecord) -> None:
        """Before the ended job `deleted` is deleted: archive, in each job still waiting whose
        condition on it held, that it held (a recovery then reads it gone, not failed)."""
        for record in self._waits.held_before_deletion(deleted):
            await self._archive.update(record)

    def recheck_dependencies(self) -> None:
        """Read again the statuses of what every waiting job waits for (ends may have been
        missed: the events fell behind the archive's window)."""
        for submission_id in self._waits.waiting_ids():
            record = self._waits.record(submission_id)
            if record is not None:
                self._spawn(self._settle(record), record)

    def _spawn(self, work: Awaitable[None], record: JobRecord) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(f"dependencies-{record.run_id}")
        self._dependency_tasks.add(task)
        task.add_done_callback(self._dependency_tasks.discard)

    async def _settle(
        self,
        record: JobRecord,
        resolution: Resolution | None = None,
        admission: Admission | None = None,
    ) -> None:
        """Carry `resolution` out (a met one with its room taken already: `admission`), or
        (None) read the statuses of what `record` waits for and carry out what they decide; on
        a failure, wait and read them again."""
        delay_s = DEPENDENCY_RETRY_INITIAL_S
        while True:
            try:
                if resolution is None:
                    statuses = await self._dependency_statuses(record)
                    resolution = self._waits.learn_statuses(record.submission_id, statuses)
                    if resolution is None:
                        return  # it waits on (or was decided or stopped meanwhile)
                await self._resolve(resolution, admission)
                return
            except LeaderUnavailableError:
                return  # no longer the leader: the new one's recovery decides the job
            except Exception as error:
                logger.warning(
                    "job %s's dependencies: %s; again in %.1f s",
                    record.submission_id,
                    error,
                    delay_s,
                    exc_info=not is_database_unavailable(error),
                )
            resolution, admission = None, None  # `_resolve` put it back in the waits
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, DEPENDENCY_RETRY_MAX_S)
            if record.submission_id not in self._waits:
                return  # stopped meanwhile

    async def _resolve(self, resolution: Resolution, admission: Admission | None = None) -> None:
        """Archive what was decided of a waiting job (taken out of the waits): it is handed
        over or enters the queue (with `admission`, its room taken already), is ready (no
        room), or ends FAILED."""
        record = resolution.record
        done = self._resolving[record.submission_id] = asyncio.Event()
        try:
            await self._confirm_lead()
            if resolution.outcome is Outcome.MET:
                if admission is None:
                    admission = self._admit_met(record)
                if admission is None:
                    await self._make_ready(record)
                    return
                met = record.with_changes(dependencies_met_time=now_ms(), message=PENDING_MESSAGE)
                stored = await self._archive.update(met)
                if stored is None or stored.status.is_terminal():
                    self._queue.cancel(record, admission)  # it ended otherwise meanwhile
                    self.fill()
                    return
                if admission is Admission.START:
                    self._begin_hand_over(met, LaunchFailure.FAIL)
                else:
                    self._queue.enqueue(met)
                    self.fill()
                return
            logger.info("job %s fails: %s", record.submission_id, resolution.reason)
            await self._archive_stop_of_queued(
                record.with_changes(
                    status=JobStatus.FAILED,
                    end_time=now_ms(),
                    error_type=JobErrorType.DEPENDENCY_NEVER_SATISFIED,
                    message=resolution.reason,
                )
            )
        except BaseException:
            # Still waiting, as its row says (before a stop that waits for this goes on); its
            # room is given back.
            if admission is not None:
                self._queue.cancel(record, admission)
                self.fill()
            self._waits.add(record)
            raise
        finally:
            del self._resolving[record.submission_id]
            done.set()

    def _admit_met(self, record: JobRecord) -> Admission | None:
        """A slot or a place in the queue for a job just met, as for a submit now; None while
        ready jobs met before it wait for room (it goes after them), before the dispatcher
        starts (recovery has not counted the slots yet), or if there is none."""
        if not self._started or self._closed or self._waits.has_ready():
            return None
        return self._queue.try_admit(record)

    async def _make_ready(self, record: JobRecord) -> None:
        """A met job without room waits on, ready: archived with every condition held (a
        recovery then admits it at once, even if one was deleted since) and a message that
        says why. Before the dispatcher starts it is only held (`start` admits it)."""
        if not self._started:
            self._waits.park(record)  # `start` admits it
            return
        ready = record.with_changes(
            dependencies_held=tuple(
                dependency.submission_id for dependency in record.spec.depends_on
            ),
            message=READY_MESSAGE,
        )
        stored = await self._archive.update(ready)
        if stored is None or stored.status.is_terminal():
            return  # it ended otherwise meanwhile
        self._waits.park(ready)
        self._admit_ready()

    async def hand_over_now(self, record: JobRecord) -> HandOver:
        """Hand over a job just submitted and admitted (its slot taken, its row archived);
        if Ray refuses it, it is withdrawn and the error raised (InvalidJobOptionsError for
        options Ray rejects)."""
        return await self._begin_hand_over(record, LaunchFailure.WITHDRAW)

    def _begin_hand_over(
        self, record: JobRecord, on_failure: LaunchFailure
    ) -> asyncio.Task[HandOver]:
        # Registered before any await: a stop from now on finds the hand-over and waits for it.
        task = asyncio.create_task(
            self._hand_over(record, on_failure), name=f"dispatch-{record.run_id}"
        )
        self._handing_over[record.submission_id] = task
        task.add_done_callback(functools.partial(self._done, record.submission_id))
        return task

    def _done(self, submission_id: str, _: asyncio.Task[HandOver]) -> None:
        self._handing_over.pop(submission_id, None)
        self._called_off.discard(submission_id)

    async def _hand_over(self, queued: JobRecord, on_failure: LaunchFailure) -> HandOver:
        """Create the run's KV record and supervisor and start it, unless a stop called it off
        first (it is then archived STOPPED); a called-off or failed run frees its slot."""
        # A shared supervisor of this server's version (the row may be an earlier server's).
        name = queued.supervisor_name or ""
        if not is_dedicated(name):
            name = self._supervisors.name_for(queued.spec, queued.run_id)
        record = queued.with_changes(
            message=PENDING_MESSAGE,
            supervisor_name=name,
            handed_over_time=now_ms(),
            log_dir_id=self._launcher.log_dir_id,
        )
        try:
            await self._confirm_lead()
            await asyncio.to_thread(set_aside_orphaned_log, self._launcher.log_path(record))
            await self._store.create(record)
            supervisor = None
            if record.submission_id not in self._called_off:
                supervisor = await self._launcher.supervisor_for(record)
            if record.submission_id in self._called_off:
                await self._end_called_off(record, supervisor)
                return HandOver.CALLED_OFF
            assert supervisor is not None
            await self._confirm_lead()
            launch = self._launcher.start(record, supervisor)
        except (asyncio.CancelledError, LeaderUnavailableError):
            # No longer the leader (a test's; a real one has exited): it writes nothing more,
            # and the new leader's recovery hands the job over.
            raise
        except Exception as error:
            if on_failure is LaunchFailure.WITHDRAW:
                await self._withdraw(record, error)  # raises the error for the client
            await self._fail(record, error)
            return HandOver.FAILED
        # The start timeout (--job-start-timeout-s) counts from the hand-over, recorded in the
        # KV (a server that adopts the job after a restart counts from it too).
        self._watchers.watch(record, launch)
        return HandOver.STARTED

    async def _withdraw(self, record: JobRecord, error: Exception) -> NoReturn:
        """A submit's hand-over failed: the job is withdrawn (its row deleted, as if it had
        never been submitted; its slot freed) and the error raised for the client. On a full
        disk it cannot be: it is recorded FAILED instead, and the client told so (507)."""
        logger.info("submit of job %s withdrawn: %s", record.submission_id, error)
        try:
            # The row first: while the KV still has the run, a failure here can end it there.
            try:
                await self._archive.delete(record.submission_id, record.run_id)
            except Exception as delete_error:
                if not is_disk_full(delete_error):
                    raise
                await self._record_failure(record, error)
                raise InsufficientStorageError(
                    f"The job's supervisor could not be started: {error}. The server's disk is "
                    "full, so the job could not be withdrawn: it is recorded FAILED (delete it "
                    "once space is freed to submit its id again)."
                ) from error
            with contextlib.suppress(Exception):
                await self._store.delete(record)
        finally:
            self.run_ended(record)
        if isinstance(error, ValueError | TypeError | ArithmeticError):
            raise InvalidJobOptionsError(f"Invalid job options: {error}") from error
        raise error

    async def _end_called_off(self, record: JobRecord, supervisor: object | None) -> None:
        try:
            ended = await self._store.update(
                record.submission_id,
                record.run_id,
                status=JobStatus.STOPPED,
                message=NEVER_STARTED_MESSAGE,
            )
            if await self._ends.archive(ended):
                await self._history.forget(ended)
            if supervisor is not None and is_dedicated(record.supervisor_name or ""):
                await asyncio.to_thread(ray.kill, supervisor, no_restart=True)
        finally:
            self.run_ended(record)

    async def _fail(self, record: JobRecord, error: Exception) -> None:
        """The hand-over failed (Ray refused the supervisor): the job fails, its slot frees."""
        try:
            await self._record_failure(record, error)
        finally:
            self.run_ended(record)

    async def _record_failure(self, record: JobRecord, error: Exception) -> None:
        """End the run FAILED: in the KV first (where a restart finds it if the disk is full),
        then in the archive (once the disk takes it)."""
        logger.warning("handing job %s over failed: %s", record.submission_id, error)
        changes = {
            "status": JobStatus.FAILED,
            "error_type": JobErrorType.JOB_SUPERVISOR_ACTOR_START_FAILURE,
            "message": f"The job's supervisor could not be started: {error}",
        }
        try:
            failed = await self._store.update(record.submission_id, record.run_id, **changes)
        except Exception:
            # The KV did not take its record (that may be what failed): the archive only.
            logger.warning("the KV did not take job %s's end", record.submission_id, exc_info=True)
            failed = record.with_changes(end_time=now_ms(), **changes)
        if await self._ends.archive(failed):
            await self._history.forget(failed)

    async def _archive_stop_of_queued(self, stopped: JobRecord) -> None:
        """Archive the end of a queued job; on a full disk (or with the database away) the KV
        holds it (read at once, and by a restart's recovery, which archives it) until the
        archive takes it."""
        try:
            await self._history.archive_end(stopped)
        except Exception as error:
            if not is_disk_full(error) and not is_database_unavailable(error):
                raise
            await self._store.create(stopped)
            await self._ends.archive(stopped)

    async def stop_before_start(self, record: JobRecord) -> bool | None:
        """Stop the run `record` if it has not been handed to a supervisor: True once it is
        archived STOPPED (its command never runs), False if its hand-over failed (it ended
        FAILED); None if it was handed over (or never queued): the usual stop applies, to the
        record as it is now. A job waiting for others is stopped as a queued one is."""
        resolving = self._resolving.get(record.submission_id)
        if resolving is not None:
            await resolving.wait()  # it is queued now, or ended
        waiting = self._waits.remove(record.submission_id, record.run_id)
        if waiting is not None:
            try:
                await self._archive_stop_of_queued(
                    waiting.with_changes(
                        status=JobStatus.STOPPED, end_time=now_ms(), message=NEVER_STARTED_MESSAGE
                    )
                )
            except BaseException:
                self.wait(waiting)  # still waiting, as its row says
                raise
            return True
        withdrawn = self._queue.withdraw(record.submission_id, record.run_id)
        if withdrawn is not None:
            stopped = withdrawn.with_changes(
                status=JobStatus.STOPPED, end_time=now_ms(), message=NEVER_STARTED_MESSAGE
            )
            try:
                await self._archive_stop_of_queued(stopped)
            except BaseException:
                self._queue.requeue(withdrawn)  # still queued, as its row says
                raise
            self._admit_ready()  # its place is free
            return True
        task = self._handing_over.get(record.submission_id)
        if task is None:
            return None
        self._called_off.add(record.submission_id)
        try:
            outcome = await asyncio.shield(task)
        except Exception:
            # A submit's hand-over that failed: the job was withdrawn (the usual stop finds no
            # job), or it could not be (it is recorded as it ended).
            return None
        if outcome is HandOver.STARTED:
            return None
        return outcome is HandOver.CALLED_OFF
