"""The running parts of a :class:`~tiered_ckpt.CheckpointManager`, built from its options.

:func:`open_parts`, on every process, in this order:

1. the tiers the options describe, the :class:`~tiered_ckpt.tiers.store.TieredStore`
   over them and the restorer on it;
2. one collective, ``open``: lock the local directory, remove what crashed saves left in
   it, and check the bucket (on every rank, so one rank's failure fails all; a bucket that
   fails the check for a transient reason is no failure: see below);
3. the uploader (the :class:`~tiered_ckpt.engine.replication.Replicator` to the bucket),
   which resumes what an earlier run left waiting for upload (in the background, tried
   until the bucket answers, if it did not answer the check), and the peer tier's
   replicator (a partner node's memory: partners chosen, links built, both collectives);
4. the preemption notice (its signal handlers) and its watch;
5. the writer, which hands each step to the replicators whose cadence takes it.

:meth:`Parts.close` undoes them in reverse order: the writer finishes its queued write,
the handlers are put back, the uploads finish (each until committed or past its
deadline), and the directory is released. A failure while opening closes what was opened.
The parts leave their background failures in one :class:`~tiered_ckpt.engine.background.ErrorBox`;
its errors are raised here, on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass

from tiered_ckpt.dist.coordination import Attempt, Coordinator, gather
from tiered_ckpt.engine.background import ErrorBox
from tiered_ckpt.engine.preemption import PreemptionNotice, PreemptionWatch
from tiered_ckpt.engine.refill import Refiller
from tiered_ckpt.engine.replication import Backlog, Replicator
from tiered_ckpt.engine.replication_policy import ReplicationPolicy
from tiered_ckpt.engine.restore import Restorer
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.engine.writer import Writer
from tiered_ckpt.errors import DirectoryInUseError, RemoteError, UploadError, UsageError, restated
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.selection import Paths
from tiered_ckpt.format.state import State
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.options import LocalOptions, Options, RemoteOptions
from tiered_ckpt.tiers import pruning, survey
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.peer.setup import open_peer_tier
from tiered_ckpt.tiers.peer.tier import PeerTier
from tiered_ckpt.tiers.pruning import PruneResult
from tiered_ckpt.tiers.pull import PullResult, pull
from tiered_ckpt.tiers.store import TieredStore
from tiered_ckpt.tiers.survey import Lag

__all__ = ["Parts", "open_parts", "open_store"]

logger = logging.getLogger("tiered_ckpt")


@dataclass(frozen=True)
class PushResult:
    """What :meth:`~tiered_ckpt.CheckpointManager.push` did: the ``steps`` it uploaded, oldest first."""

    steps: tuple[int, ...]


@dataclass(eq=False)
class Parts:
    """The store, the stages over it and the one error box they report to, with what needs more
    than one of them: the checks before a collective, restoring, lag, waiting and closing.
    Each method does what the :class:`~tiered_ckpt.CheckpointManager` method of its name says."""

    store: TieredStore
    errors: ErrorBox
    restorer: Restorer
    writer: Writer
    uploader: Replicator | None
    peer: Replicator | None
    preemption: PreemptionWatch
    opened: ExitStack
    options: Options
    one_process: bool
    max_workers: int | None
    closed: bool = False

    def before_collective(self) -> None:
        """What every save and restore checks first, on every rank: a background error not yet
        raised (not a step that only missed its upload deadline), and that the directory is
        still the one this manager locked."""
        self.errors.raise_first(transient=False)
        self.store.local.check_locked()

    @contextmanager
    def raised_on_every_rank(self) -> Iterator[None]:
        """Around the collectives of save and restore, where background errors are raised by every rank.

        A rank's uploader may record a failed upload (agreed by every rank's uploader)
        a moment before or after another's: the rank that has it raises it inside the
        collective, so every rank raises it at the same call, and the others' copies,
        when they arrive, are not raised again.
        """
        try:
            yield
        except UploadError as error:
            self.errors.mark_raised(error)
            raise

    def should_save(self, step: int) -> bool:
        """:meth:`~tiered_ckpt.CheckpointManager.should_save` (a step that is not an integer is saved,
        for the save's own checks to refuse it)."""
        if isinstance(step, bool) or not isinstance(step, int) or step == self.preemption.step:
            return True
        to_disk, replicators = self.writer.tiers_of(step)
        return to_disk or bool(replicators)

    def reached_preemption(self, step: int) -> bool:
        """Whether every rank stops at ``step`` for a preemption notice; the first one puts the newest upload first."""
        preemption = self.preemption.reached(step)
        if preemption.new and self.uploader is not None:
            self.uploader.preempt()
        return preemption.stop

    def pull(self, step: int | None) -> PullResult:
        """:meth:`~tiered_ckpt.CheckpointManager.pull`."""
        return pull(self._maintenance("pull"), step, max_workers=self.max_workers)

    def push(self, step: int | None) -> PushResult:
        """:meth:`~tiered_ckpt.CheckpointManager.push`."""
        self._maintenance("push")
        if self.uploader is None:
            raise UsageError("push needs a remote tier (remote.url)")
        return PushResult(tuple(self.uploader.push(step)))

    def prune(self, *, dry_run: bool) -> PruneResult:
        """:meth:`~tiered_ckpt.CheckpointManager.prune`, once every upload is committed or past its deadline."""
        store = self._maintenance("prune")
        if self.uploader is not None:
            self.wait(uploaded=True)
        remote = self.options.remote
        orphans = remote.orphan_age_seconds if remote is not None else 3600.0
        return pruning.prune(store, dry_run=dry_run, orphans_older_than=orphans)

    def _maintenance(self, operation: str) -> TieredStore:
        """The store for ``operation`` (pull, push, prune), once every save so far is committed locally;
        :class:`UsageError` unless one process holds every rank."""
        if not self.one_process:
            raise UsageError(
                f"{operation} is a maintenance operation of one process holding every rank (as the CLI runs it); "
                "saves of one process per rank upload and prune by themselves"
            )
        self.wait(uploaded=False)
        return self.store

    def restore(
        self,
        step: int | None,
        world_size: int,
        *,
        reshard: bool,
        verify: Verify,
        into: Sequence[State] | State | None,
        missing_ok: bool,
        paths: Paths | None = None,
    ) -> RestoreResult | None:
        """The restorer's restore (arguments checked), after this process's checks, raised on every rank."""
        with self.raised_on_every_rank():
            return self.restorer.restore(
                step,
                world_size=world_size,
                reshard=reshard,
                verify=verify,
                into=into,
                missing_ok=missing_ok,
                checked=Attempt.run(self.before_collective),
                paths=paths,
            )

    def locate(self, step: int | None) -> ShardManifest:
        """The restorer's locate, after this process's checks, raised on every rank."""
        with self.raised_on_every_rank():
            return self.restorer.locate(step, checked=Attempt.run(self.before_collective))

    def newest_step(self) -> int | None:
        """The newest step committed locally or (as of this process's last upload) remotely."""
        steps = self.store.local.steps()
        remote = self.uploader.newest_committed if self.uploader is not None else None
        return max([*steps[-1:], *([remote] if remote is not None else [])], default=None)

    def newest_saved(self) -> int | None:
        """The newest step a save must be newer than: :meth:`newest_step`, or a newer one committed
        in this process's peer memory (a restart would restore it, as it would a disk's)."""
        held = self.peer.target.steps()[-1:] if self.peer is not None else []
        return max([*held, *([newest] if (newest := self.newest_step()) is not None else [])], default=None)

    def lag(self) -> Lag:
        """The store's lag, with the uploader's pending steps, rate, last failure and retry, and
        the peer tier's last failure."""
        lag = self._uploads_lag()
        if self.peer is None:
            return lag
        failed = self.peer.last_error
        return dataclasses.replace(
            lag,
            peer_error=failed[1] if failed else None,
            peer_off=self.peer.given_up,
            refill_error=self.restorer.refill_error,
        )

    def _uploads_lag(self) -> Lag:
        uploader = self.uploader
        if uploader is None:
            return survey.lag(self.store)
        lag = survey.lag(self.store, uploader.pending(), uploader.newest_committed)
        failed = uploader.last_failure()
        retrying = uploader.retrying()
        return dataclasses.replace(
            lag,
            upload_bytes_per_second=uploader.upload_rate(),
            last_error=failed[1] if failed else None,
            last_error_at=failed[0] if failed else None,
            retrying_step=retrying[0] if retrying else None,
            retry_tries=retrying[1] if retrying else 0,
        )

    def wait(self, *, uploaded: bool) -> None:
        """Wait for the writes (and, with ``uploaded``, the uploads); raise as
        :meth:`~tiered_ckpt.CheckpointManager.wait` says: with ``uploaded``, the steps that
        missed their deadline raise as one error naming them all."""
        self.writer.settle()
        if uploaded and self.uploader is not None:
            self.uploader.wait()
        self.errors.raise_first(transient=False)
        missed = self.errors.take_transient() if uploaded else []
        if len(missed) == 1:
            raise missed[0]
        if missed:
            steps = ", ".join(str(error.step) for error in missed)
            last = missed[-1]
            raise restated(
                last, f"steps {steps} missed their upload deadline and stay local-only; the last: {last}"
            ) from last.__cause__

    def close(self, name: str, *, give_up_retries: bool = False) -> None:
        """Close every part (see the module doc) and raise a background error not yet raised,
        except a step that missed its upload deadline: that is logged (WARNING) naming
        ``name``. ``give_up_retries``: each upload still queued gets one try. Calling it again does nothing."""
        if self.closed:
            return
        self.closed = True
        if give_up_retries and self.uploader is not None:
            self.uploader.give_up_retries()
        self.opened.close()
        for missed in self.errors.take_transient():
            logger.warning("closing %s: step %d is on local disk only: %s", name, missed.step, missed)
        self.errors.raise_first()


@dataclass(frozen=True)
class _Opened:
    """One process's start-up: whether the bucket answered its check (True without a bucket)."""

    bucket_answered: bool


def _peer_policy(every: int) -> ReplicationPolicy:
    """How the peer tier's replicator sends steps: one shard per process at a time, every
    ``every``-th step, each failure logged rather than raised (never retried: the next step's
    copy is the retry), no deadline beyond the link's timeout."""
    return ReplicationPolicy(concurrency=1, max_pending=2, deadline_seconds=None, every=every, best_effort=True)


def _open_local_dir(store: TieredStore, opened: ExitStack, one_process: bool) -> _Opened:
    """Lock the local directory (released by ``opened``), remove what crashed saves left in it, and
    check the bucket: once, so that a bucket down for a moment costs the start one request; a
    permanent failure (no such bucket, access denied) raises, a transient one is logged."""
    try:
        opened.enter_context(store.local.lock())
    except DirectoryInUseError as exc:
        if one_process:
            raise
        raise DirectoryInUseError(
            f"{exc}; with one process per rank, give each rank a directory of its own (local.dir)"
        ) from exc
    removed = store.local.remove_uncommitted()
    if removed:
        logger.warning("removed what crashed saves left in %s: %s", store.local.root, ", ".join(removed))
    if store.remote is None:
        return _Opened(True)
    try:  # on every rank, in this collective: one rank's permanent failure fails all
        store.remote.check_bucket(once=True)
    except RemoteError as exc:
        if not exc.transient:
            raise
        logger.warning(
            "the bucket %s did not answer at start-up (%s): the manager starts, saves go to %s, and the "
            "bucket's setup (its lease, what an earlier run left to upload) is tried again in the background",
            store.remote.url, exc, store.local.root,
        )  # fmt: skip
        return _Opened(False)
    return _Opened(True)


def open_store(
    local: LocalOptions, remote: RemoteOptions | None, remote_tier: Tier | None, peer_tier: PeerTier | None = None
) -> TieredStore:
    """The store the options describe: the local tier, then ``peer_tier`` and ``remote_tier`` if
    given (nearest first), each with its retention (a partner's memory keeps what its budget holds)."""
    local_tier = LocalTier(local.dir)
    retention = {local_tier.name: local.retention}
    if remote_tier is not None and remote is not None:
        retention[local_tier.name] = dataclasses.replace(local.retention, upload_every=remote.every)
        retention[remote_tier.name] = remote.retention
    later = [tier for tier in (peer_tier, remote_tier) if tier is not None]
    return TieredStore([local_tier, *later], retention)


def open_parts(options: Options, coordinator: Coordinator) -> Parts:
    """Open the parts ``options`` describe for this process's ranks of ``coordinator`` (see the module doc)."""
    max_workers = options.runtime.max_workers
    world_size = coordinator.world_size
    ranks = tuple(coordinator.local_ranks)
    one_process = len(ranks) == world_size
    remote_tier = options.remote.open_tier(options.upload, check_bucket=False) if options.remote is not None else None
    peer_tier = None
    if options.peer is not None:
        peer_tier = open_peer_tier(
            coordinator, local_dir=options.local.dir, memory_dir=options.peer.memory_dir,
            max_bytes=options.peer.max_bytes, timeout_seconds=options.peer.timeout_seconds, nodes=options.peer.nodes,
        )  # fmt: skip
    store = open_store(options.local, options.remote, remote_tier, peer_tier)
    errors = ErrorBox()
    uploader: Replicator | None = None
    peer: Replicator | None = None
    backlog = Backlog()  # local retention keeps what any later tier has still to commit
    stack = ExitStack()
    try:
        opened = gather(coordinator, "open", _Opened, lambda: _open_local_dir(store, stack, one_process))
        if options.remote is not None and remote_tier is not None:
            policy = dataclasses.replace(options.upload.replication, every=options.remote.every)
            uploader = Replicator(
                store,
                remote_tier,
                policy=policy,
                errors=errors,
                coordinator=coordinator.new_channel(),
                ranks=ranks,
                ownership=options.remote.ownership,
                backlog=backlog,
            )
            stack.enter_context(closing(uploader))
            uploader.resume(later=not all(each.bucket_answered for each in opened))
        if peer_tier is not None and options.peer is not None:
            peer = Replicator(
                store, peer_tier, policy=_peer_policy(options.peer.every), errors=errors,
                coordinator=coordinator.new_channel(), ranks=ranks, backlog=backlog,
            )  # fmt: skip
            stack.enter_context(closing(peer))
        notice = stack.enter_context(closing(PreemptionNotice(options.runtime.preemption_signals)))
        preemption = PreemptionWatch(notice, coordinator if one_process else coordinator.new_channel())
    except BaseException:
        stack.close()  # release the directory and stop the uploader: nothing is half-open
        raise
    writer = Writer(
        store,
        coordinator,
        world_size=world_size,
        errors=errors,
        replicators=[each for each in (uploader, peer) if each is not None],
        max_workers=max_workers,
        cpus=options.runtime.writer_cpus,
        local_every=options.local.every,
    )
    stack.enter_context(closing(writer))  # closed first: the last write reaches the replicators before they finish
    refiller = Refiller(store, writer.run_after, max_workers)
    restorer = Restorer(store, coordinator, world_size, max_workers, peer=peer_tier, refiller=refiller)
    return Parts(store, errors, restorer, writer, uploader, peer, preemption, stack, options, one_process, max_workers)
