"""The running parts of a :class:`~tiered_ckpt.CheckpointManager`, built from its options.

:func:`open_parts`, on every process, in this order:

1. the tiers the options describe (:mod:`~tiered_ckpt.build` makes them), the
   :class:`~tiered_ckpt.tiers.store.TieredStore` over them and the restorer on it;
2. one collective, ``open``: lock the local directory, remove what crashed saves left in
   it, and check the bucket (on every rank, so one rank's failure fails all; a bucket that
   fails the check for a transient reason is no failure: see below);
3. the uploader (the :class:`~tiered_ckpt.engine.replication.Replicator` to the bucket),
   which resumes what an earlier run left waiting for upload (in the background, tried
   until the bucket answers, if it did not answer the check), the peer tier's
   replicator (a partner node's memory: partners chosen, links built, both collectives),
   and one replicator for each of the caller's tiers (``options.tiers``), which resumes too;
4. the preemption notice (its signal handlers) and its watch;
5. the writer, which hands each step to the replicators whose cadence takes it.

:meth:`Parts.close` undoes them in reverse order: the writer finishes its queued write,
the handlers are put back, the uploads finish (each until committed or past its
deadline), and the directory is released. A failure while opening closes what was opened.
The parts leave their background failures in one :class:`~tiered_ckpt.engine.background.ErrorBox`,
which the manager raises on the caller's thread. Nothing here forwards a call: the
manager calls the parts it was given.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, closing
from dataclasses import dataclass

from tiered_ckpt import build
from tiered_ckpt.dist.coordination import Coordinator, gather
from tiered_ckpt.engine.background import ErrorBox
from tiered_ckpt.engine.memory_budget import default_host_memory_bytes
from tiered_ckpt.engine.preemption import PreemptionNotice, PreemptionWatch
from tiered_ckpt.engine.refill import Refiller
from tiered_ckpt.engine.replication import Backlog, Replicator
from tiered_ckpt.engine.restore import Restorer
from tiered_ckpt.engine.stale import StaleCheck
from tiered_ckpt.engine.writer import Writer
from tiered_ckpt.errors import DirectoryInUseError, RemoteError
from tiered_ckpt.options import Options
from tiered_ckpt.raising import raise_closed
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Parts", "open_parts"]

logger = logging.getLogger("tiered_ckpt")


@dataclass(eq=False)
class Parts:
    """The running parts :func:`open_parts` built: the store, the stages over it and the one
    error box they report to. The manager calls them itself; :meth:`close` undoes them."""

    store: TieredStore
    errors: ErrorBox
    restorer: Restorer
    writer: Writer
    uploader: Replicator | None
    peer: Replicator | None
    others: tuple[Replicator, ...]  # one per tier of ``options.tiers``, in their order
    preemption: PreemptionWatch
    opened: ExitStack
    closed: bool = False

    def close(self, name: str, *, give_up_retries: bool = False) -> None:
        """Close every part in the reverse of the order they were opened (see the module doc), then
        raise a background error not yet raised, except a step that missed its upload deadline:
        that is logged naming ``name`` (:func:`~tiered_ckpt.raising.raise_closed`).
        ``give_up_retries``: each upload still queued gets one try. Calling it again does nothing."""
        if self.closed:
            return
        self.closed = True
        if give_up_retries and self.uploader is not None:
            self.uploader.give_up_retries()
        self.opened.close()
        raise_closed(self.errors, name)


@dataclass(frozen=True)
class _Opened:
    """One process's start-up: whether the bucket answered its check (True without a bucket)."""

    bucket_answered: bool


def _open_local_dir(store: TieredStore, opened: ExitStack, one_process: bool, bucket: RemoteTier | None) -> _Opened:
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
    if bucket is None:
        return _Opened(True)
    try:  # on every rank, in this collective: one rank's permanent failure fails all
        bucket.check_bucket(once=True)
    except RemoteError as exc:
        if not exc.transient:
            raise
        setup = "the bucket's setup (its lease, what an earlier run left to upload) is tried again in the background"
        logger.warning(
            "the bucket %s did not answer at start-up (%s): the manager starts, saves go to %s, and %s",
            bucket.url,
            exc,
            store.local.root,
            setup,
        )
        return _Opened(False)
    return _Opened(True)


def open_parts(options: Options, coordinator: Coordinator) -> Parts:
    """Open the parts ``options`` describe for this process's ranks of ``coordinator`` (see the module doc)."""
    max_workers = options.runtime.max_workers
    world_size = coordinator.world_size
    ranks = tuple(coordinator.local_ranks)
    one_process = len(ranks) == world_size
    remote, peer_options = options.remote, options.peer
    remote_tier = build.open_remote_tier(remote, options.upload, check_bucket=False) if remote is not None else None
    peer_tier = build.peer_tier(peer_options, coordinator, options.local.dir) if peer_options is not None else None
    store = build.tiered_store(options.local, remote, remote_tier, peer_tier, options.tiers)
    errors = ErrorBox()
    uploader: Replicator | None = None
    peer: Replicator | None = None
    others: list[Replicator] = []
    backlog = Backlog()  # local retention keeps what any later tier has still to commit
    stack = ExitStack()
    try:
        opened = gather(coordinator, "open", _Opened, lambda: _open_local_dir(store, stack, one_process, remote_tier))
        if remote is not None and remote_tier is not None:
            policy = build.replication_policy(options.upload, every=remote.every)
            uploader = Replicator(
                store,
                remote_tier,
                policy=policy,
                errors=errors,
                coordinator=coordinator.new_channel(),
                ranks=ranks,
                ownership=remote.ownership,
                backlog=backlog,
            )
            stack.enter_context(closing(uploader))
            uploader.resume(later=not all(each.bucket_answered for each in opened))
        if peer_tier is not None and peer_options is not None:
            policy = build.peer_policy(peer_options)
            channel = coordinator.new_channel()
            peer = Replicator(
                store, peer_tier, policy=policy, errors=errors, coordinator=channel, ranks=ranks, backlog=backlog
            )
            stack.enter_context(closing(peer))
        for extra in options.tiers:
            channel = coordinator.new_channel()
            policy = build.tier_policy(extra)
            other = Replicator(
                store, extra.tier, policy=policy, errors=errors, coordinator=channel, ranks=ranks, backlog=backlog
            )
            stack.enter_context(closing(other))
            others.append(other)
            if extra.tier.capabilities.shared or one_process:  # what a crash kept from it (see engine/resume.py)
                other.resume()
        notice = stack.enter_context(closing(PreemptionNotice(options.runtime.preemption_signals)))
        preemption = PreemptionWatch(notice, coordinator if one_process else coordinator.new_channel())
    except BaseException:
        stack.close()  # release the directory and stop the uploader: nothing is half-open
        raise
    budget = options.runtime.host_memory_bytes or default_host_memory_bytes()
    writer = Writer(
        store,
        coordinator,
        world_size=world_size,
        errors=errors,
        replicators=[each for each in (uploader, peer, *others) if each is not None],
        max_workers=max_workers,
        cpus=options.runtime.writer_cpus,
        local_every=options.local.every,
        host_memory_bytes=budget,
        stale=StaleCheck(options.runtime.stale_saves, options.runtime.must_change),
        incremental=options.runtime.incremental,
    )
    stack.enter_context(closing(writer))  # closed first: the last write reaches the replicators before they finish
    refiller = Refiller(store, writer.run_after, max_workers)
    restorer = Restorer(store, coordinator, world_size, max_workers, refiller=refiller, host_room=writer.restore_room)
    return Parts(store, errors, restorer, writer, uploader, peer, tuple(others), preemption, stack)
