"""The background writer: staged arrays to durable shards, the commit, and the retention after it.

A save, from the moment its call has been checked on every rank:

1. :meth:`Writer.submit` copies this process's arrays into staging buffers reused from
   save to save, within the host memory budget, and queues the write (the training loop is
   blocked for the copy, and, for a state past the budget, until the writer is done reading
   the arrays that were not copied: :mod:`~tiered_ckpt.engine.staging`);
2. the writer thread agrees with the other ranks which of them writes each replicated
   array of a state of DTensors (:mod:`~tiered_ckpt.dist.replicas`, a collective, run only
   when the call's check found such arrays on some rank), writes each shard (temp file,
   hashed as it streams, fsync, rename), the ranks exchange their shard records (a
   collective), and every process commits the manifest in its local tier once every rank's
   shard is durable; the processes then agree that every one of them committed (a
   collective: the commit itself is agreed), and each records that agreement in its step
   (:meth:`~tiered_ckpt.tiers.local.LocalTier.mark_agreed`);
3. the committed step goes to the queue of each :class:`~tiered_ckpt.engine.replication.Replicator`
   whose cadence takes it (the next stages: one per later tier fed), and the save's handle
   resolves;
4. local retention runs on a thread of its own, off the write path and alongside the next
   save. It deletes only steps older than one committed on every rank (the step whose
   commit the processes agreed on), never on this process's own commit: a rank killed
   before its commit leaves the older step restorable everywhere. Nor does it delete the
   step being written.

A failure is recorded in the shared :class:`~tiered_ckpt.engine.background.ErrorBox` as
:class:`SaveError` (cause chained), and what the failed save left is removed.

A step the disk's cadence skips (``local.every``) and a partner's memory takes is kept in
memory only: step 2 serializes its shards to bytes (in memory within the host memory
budget, past it to unlinked files) and agrees on their records, and the step goes to the
replicators of the tiers each process holds a part of; it is committed once they committed
it. Their failures are logged, never raised by the manager.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from tiered_ckpt.dist.coordination import Attempt, Coordinator, Done, gather
from tiered_ckpt.dist.replicas import choose_writers
from tiered_ckpt.engine.background import ErrorBox, ReportedFuture
from tiered_ckpt.engine.incremental import Baseline
from tiered_ckpt.engine.memory_budget import spilled_text, throttled_text
from tiered_ckpt.engine.replication import Replicator
from tiered_ckpt.engine.save_handle import SaveHandle, not_replicated
from tiered_ckpt.engine.saving import SavePlan
from tiered_ckpt.engine.sending import MemoryStep
from tiered_ckpt.engine.shards import Borrowed, ShardBuffer, build_manifest, serialize_shards, write_shards
from tiered_ckpt.engine.staging import Staged, StagingBuffers
from tiered_ckpt.engine.stale import StaleCheck
from tiered_ckpt.errors import CheckpointError, SaveError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.metrics import Metrics
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.io.gc_pause import cyclic_gc_paused
from tiered_ckpt.io.off_host import OffHost
from tiered_ckpt.tiers import pruning
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Writer"]

logger = logging.getLogger("tiered_ckpt")

BACKGROUND_NICENESS = 10


def _background_thread(cpus: frozenset[int] | None) -> None:
    """Let the training loop's threads win the CPU over the background writer, and keep the
    writer on ``cpus`` if given.

    On Linux the nice value and the CPU affinity are per thread, and threads the writer
    starts (the pools that write shards) inherit both.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        logger.debug("could not lower the background writer's priority", exc_info=True)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # 0: this thread (checked by RuntimeOptions)


def _staged(state: FlatState, arrays: dict[str, np.ndarray]) -> FlatState:
    """``state`` with its staged ``arrays``; an array still on a device (past the memory budget) is
    no replicated array: the ranks' copies are compared by their bytes, which it has not here."""
    on_device = {name for name, array in arrays.items() if isinstance(array, OffHost)}
    return dataclasses.replace(state, arrays=arrays, replicated=state.replicated - on_device)


def _copy_outcome(done: Future[ShardManifest | None], into: Future[ShardManifest | None]) -> None:
    error = done.exception()
    if error is None:
        into.set_result(done.result())
    else:
        into.set_exception(error)


@dataclass(frozen=True)
class _Written:
    """One process's durable shards of a step, and (the leader's is used) the time of the commit."""

    shards: tuple[Mapping[str, Any], ...]
    time: float
    compared: Mapping[str, Any] = field(default_factory=dict)  # engine/stale.py's Comparison


class Writer:
    """The writer and retention threads of one manager (see the module doc).

    ``ranks`` are this process's ranks of ``world_size``; the steps divisible by
    ``local_every`` are written to disk, and each step goes to the ``replicators`` whose
    cadence takes it (see :meth:`tiers_of`); failures go to ``errors``; both threads (and the ones
    they start) run at a lower priority, on ``cpus`` if given (see :class:`~tiered_ckpt.RuntimeOptions`).
    """

    def __init__(
        self,
        store: TieredStore,
        coordinator: Coordinator,
        *,
        world_size: int,
        errors: ErrorBox,
        replicators: Sequence[Replicator] = (),
        max_workers: int | None = None,
        cpus: frozenset[int] | None = None,
        local_every: int = 1,
        host_memory_bytes: int | None = None,
        stale: StaleCheck | None = None,
        incremental: bool = False,
    ) -> None:
        self._store = store
        self._stale = stale or StaleCheck()
        # unchanged arrays referenced, not written again, where every tier keeps referenced files
        self._baseline = Baseline(store) if incremental and store.keeps_references else None
        self._coordinator = coordinator
        self._ranks = tuple(coordinator.local_ranks)
        self._world_size = world_size
        self._errors = errors
        self._replicators = tuple(replicators)
        self._max_workers = max_workers
        self._local_every = local_every
        self._staging = StagingBuffers(host_memory_bytes)
        self._throttle_told = False  # the WARNING that saves wait for the budget is logged once
        self._spill_told = False  # and the one that memory-only steps go to the disk past it
        # A step kept in memory only is serialized here: the previous one's copies ended before this one's began.
        self._in_memory = {rank: ShardBuffer() for rank in self._ranks}
        self._last_save: Future[ShardManifest | None] | None = None
        self._last_retention: Future[None] | None = None
        self._last_job: Future[None] | None = None
        self._writer = ThreadPoolExecutor(1, "tiered-ckpt-writer", initializer=_background_thread, initargs=(cpus,))
        self._janitor = ThreadPoolExecutor(1, "tiered-ckpt-retention", initializer=_background_thread, initargs=(cpus,))

    def restore_room(self, release: bool = False) -> int | None:
        """What the host memory budget leaves beside the buffers saves keep from save to save
        (the staging buffers, a memory-only step's shards); None: no budget. ``release``: the
        staging buffers are let go first (the next save allocates them again), for a restore,
        which waits for the saves before it (:meth:`settle`). A restore into CUDA tensors
        pins its host buffers within it."""
        budget = self._staging.budget
        if budget is None:
            return None
        if release:
            self.settle(retention=False)
            self._staging.release()
        held = self._staging.nbytes + sum(buffer.capacity for buffer in self._in_memory.values())
        return max(0, budget - held)

    def tiers_of(self, step: int, *, every_tier: bool = False) -> tuple[bool, list[Replicator]]:
        """Whether ``step`` goes to the local disk, and the replicators it goes to (their tiers'
        cadence; ``every_tier``: all of them, as a preemption's step does). A step the disk skips
        goes only to the tiers each process holds a part of (a partner's memory), never to one
        copied from the disk (the bucket)."""
        to_disk = every_tier or step % self._local_every == 0
        chosen = [each for each in self._replicators if every_tier or each.takes(step)]
        return to_disk, [each for each in chosen if to_disk or not each.target.capabilities.shared]

    def submit(
        self,
        step: int,
        plan: SavePlan,
        *,
        every_tier: bool = False,
        blocking: bool = False,
        started: float | None = None,
    ) -> SaveHandle:
        """Stage the states of ``plan`` (this process's ranks, checked on every rank) and queue
        their write as ``step``, to the tiers :meth:`tiers_of` names (the caller checked there
        is one), with the plan's sharded keys and metrics. A plan whose ``replicated`` is False
        (every process's is the same): no rank's state holds an array another rank may hold a
        copy of, so the ranks skip agreeing who writes each.

        Waits first for the previous save's write (not its retention): its staging buffers are
        the ones reused here, and overwriting them under a running write would save this step's
        arrays as that one's. Returns once the arrays past the host memory budget are written
        (:mod:`~tiered_ckpt.engine.staging`), and, if ``blocking``, once the step is committed;
        the handle's ``blocked_seconds`` count from ``started`` (a ``time.monotonic()``; default:
        this call's start).
        """
        started = time.monotonic() if started is None else started
        states, keys, numels, replicated = plan.states, plan.sharded_keys, list(plan.numels), plan.replicated
        if self._last_save is not None:
            self._last_save.exception()
        to_disk, replicators = self.tiers_of(step, every_tier=every_tier)
        arrays = self._staging.stage([state.arrays for state in states])
        staged = [_staged(state, each) for each, state in zip(arrays.states, states, strict=True)]
        borrowed = None
        if arrays.direct_bytes:
            tails = dict(zip(self._ranks, arrays.tails, strict=True))
            borrowed = Borrowed(dict(zip(self._ranks, arrays.direct, strict=True)), tails)
        committed: Future[ShardManifest | None] = ReportedFuture(self._errors)
        outcomes = self._outcomes(step, to_disk, replicators)
        write = partial(self._write, every_tier=every_tier) if to_disk else self._write_to_memory
        write = partial(write, borrowed=borrowed, metrics=plan.metrics)
        job = self._writer.submit(write, step, staged, keys, numels, replicators, replicated)
        job.add_done_callback(lambda done: _copy_outcome(done, committed))
        self._last_save = committed
        waited = 0.0
        if borrowed is not None:  # the arrays past the budget are written from the caller's memory: wait for them
            job.add_done_callback(lambda _done: borrowed.release())  # a job that never ran releases it too
            waiting = time.monotonic()
            try:
                borrowed.wait()
            except BaseException:  # an interrupt: the writer still reads the caller's arrays until released
                borrowed.wait()
                raise
            waited = time.monotonic() - waiting
            self._tell_throttled(step, arrays, waited)
        bucket = self._bucket()
        handle = SaveHandle(step, committed, outcomes.get(bucket) if bucket is not None else None, outcomes)
        handle.staged_bytes = arrays.staged_bytes
        handle.throttled_bytes = arrays.direct_bytes
        handle.throttled_seconds = waited
        if blocking:
            committed.result()
        handle.blocked_seconds = time.monotonic() - started
        return handle

    def _tell_throttled(self, step: int, arrays: Staged, waited: float) -> None:
        """Log once per manager (WARNING) that saves wait for the host memory budget, and by how much."""
        if not self._throttle_told:
            self._throttle_told = True
            logger.warning(throttled_text(step, arrays.staged_bytes, arrays.direct_bytes, waited, self._staging.budget))

    def _tell_spilled(self, step: int, rank: int, size: int) -> None:
        """Log once per manager (WARNING) that a step kept in memory only went to the local disk."""
        if not self._spill_told:
            self._spill_told = True
            logger.warning(spilled_text(step, rank, size, self._staging.budget, self._store.local.root))

    def skipped(self, step: int) -> SaveHandle:
        """The handle of a save of ``step`` that no tier's cadence takes (see :meth:`SaveHandle.skipped`)."""
        return SaveHandle.skipped(step, later=[each.target.name for each in self._replicators], bucket=self._bucket())

    def _bucket(self) -> str | None:
        """The bucket's name: the first later tier with receipts (None without one)."""
        return next((tier.name for tier in self._store.later if tier.capabilities.receipts), None)

    def _outcomes(self, step: int, to_disk: bool, replicators: Sequence[Replicator]) -> dict[str, Future[None]]:
        """The future of ``step``'s commit in each later tier a replicator feeds, by the tier's name."""
        bucket, outcomes = self._bucket(), dict[str, Future[None]]()
        for replicator in self._replicators:
            name = replicator.target.name
            if replicator in replicators:
                outcomes[name] = replicator.outcome(step)
                continue
            cadence = "the bucket's cadence (remote.every)" if name == bucket else f"the {name} tier's cadence"
            why = f"{cadence} skips it"
            if not to_disk:
                why = f"it is kept in a partner's memory only, and the {name} tier gets disk steps"
            outcomes[name] = not_replicated(step, name, bucket, why)
        return outcomes

    def run_after(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (which raises nothing) on the writer's thread, after the queued write and
        before any later one; :meth:`settle` and :meth:`close` wait for it (a restore's refill)."""
        self._last_job = self._writer.submit(job)

    def settle(self, *, retention: bool = True) -> None:
        """Wait for the previous save's write and job (:meth:`run_after`) and, unless
        ``retention=False``, the retention after the write.

        Their errors stay in the box. The next save need not wait for retention: it deletes
        only committed steps older than the newest, never the directory being written.
        """
        if self._last_save is not None:
            self._last_save.exception()
        if self._last_job is not None:
            failed = self._last_job.exception()  # a job raises nothing (see run_after); a bug is logged once
            if failed is not None:
                logger.error("a background job of the writer failed", exc_info=failed)
            self._last_job = None
        if retention and self._last_retention is not None:
            self._last_retention.result()

    def close(self) -> None:
        """Finish the queued write and retention, then stop both threads."""
        self._writer.shutdown(wait=True)
        self._janitor.shutdown(wait=True)

    def _records(self, step: int, parts: list[_Written], keys: tuple[str, ...], metrics: Metrics) -> ShardManifest:
        with cyclic_gc_paused():  # a record per rank, all alive until returned: see io/gc_pause.py
            return build_manifest(
                step,
                [ShardRecord.from_dict(shard) for part in parts for shard in part.shards],
                world_size=self._world_size,
                sharded_keys=keys,
                wall_clock_seconds=parts[0].time,  # the leader's clock
                metrics=metrics,
                source=f"the shard records of step {step}",
            )

    def _replicas(self, staged: list[FlatState], replicated: bool) -> dict[int, dict[str, int]]:
        """Per rank, the arrays its shard leaves to another rank's (a collective, if ``replicated``)."""
        return choose_writers(self._coordinator, staged) if replicated else {}

    def _write_to_memory(
        self,
        step: int,
        staged: list[FlatState],
        keys: tuple[str, ...],
        numels: list[int],
        to: list[Replicator],
        replicated: bool = True,
        *,
        borrowed: Borrowed | None = None,
        metrics: Metrics = (),
    ) -> ShardManifest | None:
        """Writer thread: serialize this process's shards of a step the disk skips, agree on its
        manifest, and hand it to the replicators of the tiers that take it (a partner's memory);
        the step is committed once each of them committed it. A failure is logged (WARNING),
        never raised: the step is simply kept nowhere, and None is returned. ``borrowed``: the
        caller's arrays the shards read, released once read (or on failure).

        The shards are held in memory (buffers reused from save to save) as far as the host
        memory budget goes beside the staging buffers; the rest are serialized to unlinked
        files in the local tier's directory, which the copies read a piece at a time
        (:func:`~tiered_ckpt.engine.shards.serialize_shards`): the save never holds more."""
        budget = self._staging.budget
        room = None if budget is None else max(0, budget - self._staging.nbytes)
        try:
            replicas = self._replicas(staged, replicated)
            shards: dict[int, memoryview] = {}

            def write() -> _Written:
                written = serialize_shards(
                    step,
                    staged,
                    self._ranks,
                    world_size=self._world_size,
                    numels=numels,
                    max_workers=self._max_workers,
                    replicas=replicas,
                    buffers=self._in_memory,
                    borrowed=borrowed,
                    room=room,
                    spill_dir=self._store.local.root,
                    on_spill=partial(self._tell_spilled, step),
                )
                shards.update((record.rank, data) for record, data in written)
                return _Written(tuple(record.to_dict() for record, _data in written), time.time())

            manifest = self._records(step, gather(self._coordinator, "write", _Written, write), keys, metrics)
            if not to:  # the tier that would keep it is off: nothing else keeps it either
                return None
            outcomes = [replicator.outcome(step) for replicator in to]
            for replicator in to:
                replicator.submit(step, held=MemoryStep(manifest, shards))
            failures: list[BaseException | None] = [outcome.exception() for outcome in outcomes]
        except Exception as exc:  # a collective, a serialization or a bug: logged below, on the handle
            failures = [exc]
        finally:
            if borrowed is not None:
                borrowed.release()
        failed = next((failure for failure in failures if failure is not None), None)
        if failed is not None:
            logger.warning("step %d, to be kept in memory only, is in no tier: %s", step, failed)
            return None
        logger.info(
            "committed step %d (%d bytes) in %s", step, manifest.total_bytes, " and ".join(r.target.url for r in to)
        )
        return manifest

    def _write(
        self,
        step: int,
        staged: list[FlatState],
        keys: tuple[str, ...],
        numels: list[int],
        to: list[Replicator],
        replicated: bool = True,
        *,
        every_tier: bool = False,
        borrowed: Borrowed | None = None,
        metrics: Metrics = (),
    ) -> ShardManifest:
        """Writer thread: write this process's shards, commit once every rank's are durable, queue
        the upload. ``every_tier`` is recorded with the commit: a restart still owes it to every tier.
        ``borrowed``: the caller's arrays the shards read, released once read (or on failure)."""
        local = self._store.local
        committed_here = False
        try:
            replicas = self._replicas(staged, replicated)  # replicated arrays: each written by one rank

            def write() -> _Written:
                records = write_shards(
                    local,
                    step,
                    staged,
                    self._ranks,
                    world_size=self._world_size,
                    numels=numels,
                    max_workers=self._max_workers,
                    replicas=replicas,
                    borrowed=borrowed,
                    baseline=self._baseline,
                )
                mine = dict(zip(self._ranks, staged, strict=True))
                compared = self._stale.compare(self._store, step, records, mine, replicas)
                return _Written(tuple(record.to_dict() for record in records), time.time(), compared)

            written = gather(self._coordinator, "write", _Written, write)
            manifest = self._records(step, written, keys, metrics)
            self._stale.check(step, [part.compared for part in written], self._coordinator.is_leader, not every_tier)

            # The commit is agreed: retention may delete older steps only once every rank has
            # committed this one. A collective on the writer's own channel, so a rank that died
            # fails it on the others (within the coordinator's timeout) rather than hanging them.
            one_process = len(self._ranks) == self._world_size

            def commit() -> None:
                nonlocal committed_here
                # other ranks' shards are on their nodes; with them, the commit is not agreed yet
                local.commit(manifest, held=self._ranks, agreed=one_process, every_tier=every_tier)
                committed_here = True
                if self._baseline is not None:
                    self._baseline.committed(step)

            gather(self._coordinator, "commit", Done, Attempt.run(commit).done)
            if not one_process:  # a restore then tells a lost disk from a save cut short between commits
                local.mark_agreed(step)
            logger.info("committed step %d (%d bytes) in %s", step, manifest.total_bytes, local.step_dir(step))
            for replicator in to:
                replicator.submit(step)
            self._last_retention = self._janitor.submit(self._retain, step)
            return manifest
        except BaseException as exc:
            if self._baseline is not None and not committed_here:
                self._baseline.failed(step)
            self._discard_uncommitted(step)
            where = local.step_dir(step)
            if committed_here:  # but not known to be committed on every rank
                message = (
                    f"background save of step {step} failed: committed in {where}, but not on every rank, so it "
                    f"may not be restorable (and retention keeps the older steps): {exc}"
                )
            else:
                message = f"background save of step {step} to {where} failed: {exc}"
            error = SaveError(message, step=step)
            error.__cause__ = exc
            self._errors.put(error)
            for replicator in self._replicators:  # the step will never be there
                replicator.abandon(step, error)
            raise error from exc
        finally:
            if borrowed is not None:
                borrowed.release()

    def _retain(self, step: int) -> None:
        """Retention thread: local retention after ``step``'s commit, which every rank made (off the write path)."""
        pending: dict[str, list[int]] = {}
        for replicator in self._replicators:  # each one's backlog, shared or not, holds its own queue
            pending.update(replicator.backlog.pending())
        try:
            pruning.retain(self._store, self._store.local, pending, complete=step)
        except (CheckpointError, OSError) as exc:
            error = SaveError(f"step {step} is committed, but the retention that follows failed: {exc}", step=step)
            error.__cause__ = exc
            self._errors.put(error)

    def _discard_uncommitted(self, step: int) -> None:
        """Free the space a failed save took; its step was never visible."""
        try:
            self._store.local.discard_uncommitted(step)
        except (CheckpointError, OSError):
            logger.warning("could not remove step %d after a failed save; the next start will", step, exc_info=True)
