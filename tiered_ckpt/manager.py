"""``CheckpointManager``: the object a training job holds for the whole run.

It calls the parts :mod:`~tiered_ckpt.compose` built from the options (the writer, the
restorer, the uploader, the store) and owns only the order of a save: raise any background
error not yet raised and wait for the previous write; check the call on every rank (one
collective, :func:`~tiered_ckpt.engine.saving.check_save`); stage the arrays (the writer,
within the host memory budget) and queue the write. Background failures wait in one error
box (:mod:`~tiered_ckpt.raising`): nothing calls back up here. With one process per rank,
collectives run on the caller's thread, the writer's and the uploader's, each on a process
group of its own; every rank makes the same calls in order.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

from tiered_ckpt import maintenance
from tiered_ckpt.agreement import agree_on_options
from tiered_ckpt.compose import open_parts
from tiered_ckpt.config import Config, load_config
from tiered_ckpt.dist.coordination import Attempt, Coordinator, resolve_coordinator
from tiered_ckpt.engine.restore import check_restore_arguments
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.engine.save_handle import SaveHandle
from tiered_ckpt.engine.saving import check_save, not_saved
from tiered_ckpt.errors import CheckpointError, UsageError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.metrics import GivenMetrics
from tiered_ckpt.format.selection import Paths
from tiered_ckpt.format.state import State
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.maintenance import PruneResult, PullResult, PushResult
from tiered_ckpt.options import (
    LocalOptions,
    PeerOptions,
    RemoteOptions,
    RestoreOptions,
    RuntimeOptions,
    TierOptions,
    UploadOptions,
    resolve_options,
)
from tiered_ckpt.raising import raise_waited, raised_on_every_rank
from tiered_ckpt.tiers import survey
from tiered_ckpt.tiers.store import TieredStore
from tiered_ckpt.tiers.survey import Lag, VerifyResult

__all__ = ["CheckpointManager", "SaveHandle", "RestoreResult", "PullResult", "PushResult", "PruneResult"]

logger = logging.getLogger("tiered_ckpt")


class CheckpointManager:
    """Saves, retains and restores the checkpoints of one training job in the directory ``local``.

    ``world_size`` ranks are saved per step, each into its own shard. By default one process holds them all; with
    ``coordinator=TorchDistributedCoordinator()`` each process holds its own rank (``world_size`` then defaults to
    the coordinator's), and the directory must be this process's own (one per rank, e.g. on the node's local disk).
    Starting a manager removes what crashed saves left in the directory; two managers cannot hold one directory at
    once (:class:`DirectoryInUseError`).

    The options come in one group per concern, each a frozen dataclass of :mod:`tiered_ckpt.options` whose fields
    are the keys of the same config table (``docs/reference/options.md``): ``local`` (a path, or directory and
    retention), ``remote`` (a URL or its options; None: local only), ``upload`` (the uploader and every remote
    request), ``restore`` (verification), ``runtime`` (sharded keys, threads, CPUs, preemption signals), ``peer`` (a
    partner node's memory; None: none), ``tiers`` (later tiers of the caller's own, each with its retention and
    cadence: :class:`TierOptions`). ``world_size`` and ``coordinator`` describe the job's processes and are not
    options.

    Use it as a context manager, or call :meth:`close` at the end of the run.
    """

    def __init__(
        self,
        local: str | os.PathLike[str] | LocalOptions,
        *,
        remote: str | RemoteOptions | None = None,
        upload: UploadOptions | None = None,
        restore: RestoreOptions | None = None,
        runtime: RuntimeOptions | None = None,
        peer: PeerOptions | None = None,
        tiers: Sequence[TierOptions] = (),
        world_size: int | None = None,
        coordinator: Coordinator | None = None,
    ) -> None:
        resolved = Attempt.run(lambda: resolve_options(local, remote, upload, restore, runtime, peer, tiers))
        coordinator = resolve_coordinator(coordinator, world_size)
        options = agree_on_options(coordinator, resolved)  # the first collective: every rank raises together
        self._ranks = tuple(coordinator.local_ranks)
        self.options = options
        self.world_size = coordinator.world_size
        self._coordinator = coordinator
        self._parts = open_parts(options, coordinator)

    @classmethod
    def from_config(
        cls,
        config: Config | str | os.PathLike[str],
        *,
        world_size: int | None = None,
        local: str | os.PathLike[str] | LocalOptions | None = None,
        **kwargs: Any,
    ) -> CheckpointManager:
        """A manager as a config file (or a loaded :class:`Config`) describes it.

        ``local`` and ``kwargs`` (:class:`CheckpointManager` arguments such as ``coordinator`` or
        ``runtime``) override the config (explicit argument > environment > file > default): a path
        as ``local`` replaces ``local.dir`` only (e.g. one directory per rank under the config's).
        """
        if not isinstance(config, Config):
            config = load_config(config)
        with config.naming_origins():
            return cls(world_size=world_size, **config.arguments(local) | kwargs)

    @property
    def root(self) -> Path:
        """The local directory."""
        return self.options.local.dir

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks this process saves and restores (one, with one process per rank)."""
        return self._ranks

    @property
    def store(self) -> TieredStore:
        """Every tier, for reading (steps, manifests, verification); the manager does the writing."""
        return self._parts.store

    def __repr__(self) -> str:
        remote = f", remote={self.options.remote.url!r}" if self.options.remote is not None else ""
        return (
            f"CheckpointManager({str(self.root)!r}, world_size={self.world_size}, "
            f"keep_last={self.options.local.keep_last}, keep_every={self.options.local.keep_every}{remote})"
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # leaving on an error: a failing bucket is not waited for
            self._parts.close(repr(self), give_up_retries=True)
        except CheckpointError:  # the exception already propagating is the one the caller needs to see
            logger.exception("error while closing %r during another exception", self)

    def save(
        self,
        step: int,
        states: Sequence[State] | State,
        *,
        blocking: bool = False,
        metrics: GivenMetrics | None = None,
        replicated: bool = False,
    ) -> SaveHandle:
        """Checkpoint ``states`` (one state per rank) as ``step``.

        A state is a dict nesting dicts, lists and tuples of numpy arrays, torch tensors and scalars
        (:mod:`tiered_ckpt.format.state`); ``restore`` gives it back with its types. With one process per rank,
        ``states`` is this rank's state. Returns once the arrays are staged (those past
        ``runtime.host_memory_bytes`` written): the caller may then overwrite them, and the write runs in the
        background. The :class:`SaveHandle` holds futures of the local commit (``committed``, which
        ``blocking=True`` waits for) and of each later tier's (``replicated``; the bucket's is ``uploaded``); a
        step no tier takes is not saved (:meth:`should_save`). ``metrics`` (``{"val_loss": 0.25}``, rank 0's
        count) go into the step's manifest for ``keep_best`` retention. ``replicated=True`` (data parallel: the
        ranks hold the same state) writes each array once, by one of the ranks holding identical copies, and
        :meth:`restore` puts it back on each. Raises first any background error not yet raised
        (:class:`SaveError`, a permanent :class:`UploadError`), saying that ``step`` was not saved, then
        :class:`InvalidStateError` for bad input and :class:`CheckpointExistsError` if ``step`` is not newer
        than every committed step (on every rank, the partners' memory included). An unreachable bucket never
        makes it raise (retried until its deadline).
        """
        started = time.monotonic()
        self._check_open()
        parts = self._parts
        if not self.should_save(step):
            return parts.writer.skipped(step)
        parts.writer.settle(retention=False)

        def checked() -> int | None:
            self._before_collective()
            held = parts.peer.target.steps()[-1:] if parts.peer is not None else []  # a restart restores these too
            return max([*held, *([newest] if (newest := self.latest_step()) is not None else [])], default=None)

        with raised_on_every_rank(self._parts.errors), not_saved(step):
            plan = check_save(
                self._coordinator,
                step,
                states,
                checked=Attempt.run(checked),
                sharded_keys=self.options.runtime.sharded_keys,
                where=str(self.root) if parts.peer is None else f"{self.root} and the partners' memory (peer tier)",
                stop_step=parts.preemption.step,
                metrics=metrics,
                replicated=replicated,
            )
        stop = step == parts.preemption.step  # a preemption's step goes to every tier
        return parts.writer.submit(step, plan, every_tier=stop, blocking=blocking, started=started)

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` of ``step`` saves it: a tier's cadence takes it (``local.every``, or
        ``peer.every`` if the peer tier opened), or a preemption notice stopped at it. A save of
        another step returns at once (``committed`` holds None) and raises nothing, not even a
        background error: the next save that saves raises it, on every rank together."""
        if isinstance(step, bool) or not isinstance(step, int) or step == self._parts.preemption.step:
            return True  # a step that is no integer is saved, for the save's own checks to refuse it
        to_disk, replicators = self._parts.writer.tiers_of(step)
        return to_disk or bool(replicators)

    def reached_preemption(self, step: int) -> bool:
        """True once a ``runtime.preemption_signals`` signal has arrived: save ``step`` now and wait for its upload.

        Cheap enough to call at every step. With one process per rank it is a collective
        (every rank calls it at the same step) that returns True on every rank at the same
        step if any rank was signalled. From then on, uploads put the newest step first.
        Ask it after the step's training and before the step's regular save, so that the
        stop step is never one saved already (a signal that arrives during or after the
        regular save is answered at the next step), as the loop in
        ``docs/guides/saving-and-restoring.md`` does.
        """
        self._check_open()
        preemption = self._parts.preemption.reached(step)
        if preemption.new and self._parts.uploader is not None:
            self._parts.uploader.preempt()
        return preemption.stop

    def wait(self, *, uploaded: bool = False) -> None:
        """Block until every save so far (and a restore's refill of the disk) is committed locally
        and, with ``uploaded=True``, in the bucket and each tier of ``tiers`` or past its deadline.

        Raises a background error not yet raised: :class:`SaveError` or a permanent :class:`UploadError`;
        with ``uploaded=True`` also the :class:`UploadError` (``transient`` True; one naming them all, ``step``
        the newest) of the steps that missed their deadline while the bucket was unreachable: the caller
        asked for the bucket's copy and does not have it. Each such step is reported once; its local copy is kept."""
        parts = self._parts
        parts.writer.settle()
        for replicator in [each for each in (parts.uploader, *parts.others) if each is not None and uploaded]:
            replicator.wait()
        raise_waited(parts.errors, uploaded=uploaded)

    def check_for_errors(self) -> None:
        """Raise the oldest background error not yet raised, without saving or waiting: a :class:`SaveError` or a
        permanent :class:`UploadError` (each is raised once, by this or by the next call that raises them)."""
        self._parts.errors.raise_first(transient=False)

    def close(self) -> None:
        """Finish pending saves and uploads, release the directory, and raise a background error not yet raised.

        Uploads are waited for until each is committed or past its deadline. A step that missed its deadline
        while the bucket was unreachable is logged (WARNING), not raised: it is safe on local disk, a manager
        started on this directory uploads it again, and a job ending while its bucket is down should not fail
        for it. A permanent failure (no such bucket, access denied, a failed save) is raised. Leaving a ``with``
        block on an exception does not wait for a failing bucket: each upload still queued gets one try. Calling
        it again does nothing."""
        self._parts.close(repr(self))

    def _check_open(self) -> None:
        if self._parts.closed:
            raise UsageError(f"{self!r} is closed")

    def _before_collective(self) -> None:
        """Every save's and restore's first checks: a background error (not a missed deadline), the lock."""
        self._parts.errors.raise_first(transient=False)
        self._parts.store.local.check_locked()

    def steps(self) -> list[int]:
        """Committed steps in the local directory, oldest first."""
        return self._parts.store.local.steps()

    def remote_steps(self) -> list[int]:
        """Steps committed in the remote tier, oldest first (empty without a remote tier)."""
        return self._parts.store.remote_steps()

    def latest_step(self) -> int | None:
        """The newest step committed on disk or in the bucket, or None if there is none: with one
        process per rank, this rank's view (its own directory and the bucket as of its last
        upload); :meth:`restore` is what makes the ranks agree."""
        remote = [self._parts.uploader.newest_committed] if self._parts.uploader is not None else []
        return max([*self.steps()[-1:], *(step for step in remote if step is not None)], default=None)

    def lag(self) -> Lag:
        """How far the bucket is behind this process's disk (a :class:`~tiered_ckpt.tiers.survey.Lag`): the
        newest step of each tier, the steps waiting for upload with their bytes and how long the oldest
        has waited, the last remote commits' rate, the last upload failure and its time. Lists no bucket."""
        parts = self._parts
        return maintenance.lag(parts.store, parts.uploader, parts.peer, parts.restorer.refill_error)

    @overload
    def restore(
        self,
        step: int | None = None,
        *,
        world_size: int | None = None,
        reshard: bool = False,
        verify: Verify | None = None,
        into: Sequence[State] | State | None = None,
        missing_ok: Literal[False] = False,
        paths: Paths | None = None,
    ) -> RestoreResult: ...

    @overload
    def restore(
        self,
        step: int | None = None,
        *,
        world_size: int | None = None,
        reshard: bool = False,
        verify: Verify | None = None,
        into: Sequence[State] | State | None = None,
        missing_ok: bool,
        paths: Paths | None = None,
    ) -> RestoreResult | None: ...

    def restore(
        self,
        step: int | None = None,
        *,
        world_size: int | None = None,
        reshard: bool = False,
        verify: Verify | None = None,
        into: Sequence[State] | State | None = None,
        missing_ok: bool = False,
        paths: Paths | None = None,
    ) -> RestoreResult | None:
        """Load a committed step (default: the newest) with every shard verified.

        ``world_size`` (default: the manager's) must match the checkpoint's, else
        :class:`WorldSizeMismatchError`, unless ``reshard=True`` asks for the flat shards to be re-cut for it.
        ``verify="fast"`` checks xxh3-64 instead of sha256 (default: the manager's ``verify``). ``into`` (a
        state of the same nesting) fills the caller's arrays and CPU tensors in place; with resharding only a
        state of DTensors, whose chunks are filled from the saved chunks that overlap them, each read in part
        and verified by its own sha256. ``paths`` (top-level keys, tensor names or key tuples) restores only
        what lies under them, reading only those arrays (see ``docs/guides/saving-and-restoring.md``). A damaged
        step fails loudly naming step, rank and file; it never falls back to an older step by itself.
        ``missing_ok=True`` returns None instead of raising when no tier (of no rank) holds any committed step:
        a fresh start. With one process per rank every rank calls it and gets its own rank's state
        (:attr:`RestoreResult.state`); the step is the newest that every rank holds locally or some tier holds,
        and a failure on any rank raises on every rank.
        """
        self._check_open()
        self._parts.writer.settle()
        verify = self.options.restore.verify if verify is None else verify
        target = self.world_size if world_size is None else world_size
        check_restore_arguments(step, target, verify, into, paths)
        checked = Attempt.run(self._before_collective)
        with raised_on_every_rank(self._parts.errors):
            return self._parts.restorer.restore(
                step,
                world_size=target,
                reshard=reshard,
                verify=verify,
                into=into,
                missing_ok=missing_ok,
                checked=checked,
                paths=paths,
            )

    def locate(self, step: int | None = None) -> ShardManifest:
        """The manifest of ``step`` (default: the newest step every rank can restore), agreed by
        every rank (a collective with one process per rank). For readers of their own, such as
        :class:`tiered_ckpt.torch.TieredReader`; :meth:`restore` does this itself."""
        self._check_open()
        self._parts.writer.settle()
        with raised_on_every_rank(self._parts.errors):
            return self._parts.restorer.locate(step, checked=Attempt.run(self._before_collective))

    def pull(self, step: int | None = None) -> PullResult:
        """Fill the local tier with a remote step (default: the newest) without loading it. Local shards
        that verify are kept; the others are streamed from the bucket and verified. Returns the step
        and, per rank, the tier each shard now on disk came from (one process holding every rank)."""
        return maintenance.pull(self._maintenance("pull"), step, max_workers=self.options.runtime.max_workers)

    def push(self, step: int | None = None) -> PushResult:
        """Upload ``step`` (default: every local step not yet committed remotely) and wait for it;
        return the steps uploaded (``steps``); raise :class:`UploadError` if one fails."""
        pushed = maintenance.push(self._maintenance("push"), self._parts.uploader, step)
        self._parts.errors.raise_first()
        return pushed

    def verify(self, step: int | None = None) -> VerifyResult:
        """Hash every shard of ``step`` (default: every committed step) in each tier that holds it
        and report each copy (what ``tiered-ckpt verify`` prints); reads only, beside saves."""
        self._check_open()
        return survey.verify(self._parts.store, step)

    def prune(self, *, dry_run: bool = False) -> PruneResult:
        """Apply retention to every tier now; return the steps deleted per tier (or, with ``dry_run``, to delete)."""
        store = self._maintenance("prune")
        if self._parts.uploader is not None:
            self.wait(uploaded=True)  # every upload committed or past its deadline
        return maintenance.prune(store, self.options.remote, dry_run=dry_run)

    def _maintenance(self, operation: str) -> TieredStore:
        """The store for ``operation`` (pull, push, prune), once every save so far is committed locally."""
        self._check_open()
        maintenance.check_one_process(operation, len(self._ranks), self.world_size)
        self.wait()
        return self._parts.store
