"""Restoring a step: every process agrees on one, then reads its ranks' shards through the store.

A restore, step by step:

1. every process reports its arguments and the steps its local tier has committed (with
   the world size each was saved with); the leader adds the bucket's steps
   (:class:`~tiered_ckpt.engine.step_choice.StepReport`, one collective);
2. the leader picks the step: the one asked for, or the newest that every process
   holds locally or the bucket holds, and every process gets it (a second collective);
   a step some processes hold and none recorded the agreement of (a save cut short
   between the ranks' commits) is skipped, and deleted from the disks holding it
   (steps 1 and 2: :mod:`~tiered_ckpt.engine.step_choice`);
3. each tier that prepares its reads (``capabilities.prepared_reads``: a partner's memory)
   brings to each process the shards it lacks on disk (a collective of its own,
   :meth:`~tiered_ckpt.tiers.base.PreparedReads.prepare_reads`); each process plans its
   reads (:mod:`~tiered_ckpt.engine.restore_plan`: the world size checked, resharding
   only when asked, the saved ranks it needs) and the one executor runs them
   (:mod:`~tiered_ckpt.engine.read_execution`: local copy, else each later tier in order,
   verified, refilling the local step; the copies read from memory are returned and land
   once the restore returned: :mod:`~tiered_ckpt.engine.refill`), what was read coming
   back as a value (:class:`~tiered_ckpt.engine.assembly.ShardsRead`,
   :mod:`~tiered_ckpt.engine.shard_reads`); the shards whose copy on disk failed and no
   later tier gave are prepared in a second round, then read again; failures on any
   process fail the restore on every process (a third collective); with one process per
   rank on the saved world size, the replicated arrays a rank's shard left to another
   rank then come from that rank's process (:func:`~tiered_ckpt.dist.replicas.share`, a
   fourth collective);
4. the result is assembled from what was read, with no I/O: arrays put back, states
   resharded if asked (:func:`~tiered_ckpt.engine.assembly.assemble`); local steps newer
   than the chosen one whose commit never reached every rank are deleted (they could
   never be restored);
5. the result (:class:`~tiered_ckpt.engine.restore_result.RestoreResult`) holds the
   states and, per shard read, the tier it came from.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import numpy as np

from tiered_ckpt.dist.coordination import Attempt, Coordinator, Done, gather
from tiered_ckpt.dist.replicas import share
from tiered_ckpt.engine.assembly import ShardsRead, assemble
from tiered_ckpt.engine.refill import Refiller
from tiered_ckpt.engine.restore_result import RestoreResult, by_tier, on_devices, rank_ranges
from tiered_ckpt.engine.shard_reads import ShardReader
from tiered_ckpt.engine.step_choice import AgreedStep, StepChooser
from tiered_ckpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    ShardFormatError,
    UsageError,
    restated,
)
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.selection import Paths, check_paths
from tiered_ckpt.format.state import State
from tiered_ckpt.io.hashing import Verify, check_verify
from tiered_ckpt.tiers.base import PreparedReads
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Restorer", "check_restore_arguments"]

logger = logging.getLogger("tiered_ckpt")

P = TypeVar("P")

NOTHING_CHECKED: Attempt[None] = Attempt()  # a caller that ran no checks of its own
_READ_FAILURES = (ChecksumMismatchError, IncompleteCheckpointError, ShardFormatError)  # a copy that did not verify


def check_restore_arguments(step: Any, world_size: Any, verify: Any, into: Any, paths: Any = None) -> None:
    """Raise :class:`UsageError` for arguments :meth:`CheckpointManager.restore` cannot take."""
    if paths is not None:
        check_paths(paths)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"restore: step must be None or an integer >= 0, got {step!r:.60}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"restore: world_size must be an integer >= 1, got {world_size!r:.60}")
    check_verify(verify)
    if into is not None and (isinstance(into, (str, bytes)) or not isinstance(into, (Mapping, Sequence))):
        raise UsageError(f"restore: into must be a dict of arrays or a list of them, got {type(into).__name__}")


class Restorer:
    """Restores for the ranks of ``coordinator`` (see the module doc) through ``store``."""

    def __init__(
        self,
        store: TieredStore,
        coordinator: Coordinator,
        world_size: int,
        max_workers: int | None = None,
        *,
        refiller: Refiller | None = None,
        host_room: Callable[[bool], int | None] = lambda release: None,
    ) -> None:
        self._store = store
        self._refiller = refiller or Refiller(store)
        self._coordinator = coordinator
        self._ranks = tuple(coordinator.local_ranks)
        self._world_size = world_size
        self._chooser = StepChooser(store, coordinator, world_size)
        self._reader = ShardReader(store, self._ranks, world_size, max_workers, host_room)

    def restore(
        self,
        step: int | None,
        *,
        world_size: int,
        reshard: bool,
        verify: Verify,
        into: Sequence[State] | State | None,
        missing_ok: bool,
        checked: Attempt[None] = NOTHING_CHECKED,
        paths: Paths | None = None,
    ) -> RestoreResult | None:
        """Run a restore (collective). ``checked`` is the caller's own checks, run before: if
        they failed, their error is raised inside the first collective, so every rank raises.
        ``paths``: only the parts of the states under them (checked by the caller)."""
        started = time.monotonic()
        selected = None if paths is None else check_paths(paths)
        arguments = json.dumps(
            {"step": step, "world_size": world_size, "reshard": reshard, "paths": selected}, sort_keys=True
        )
        agreed = self._chooser.agree(step, arguments, world_size, missing_ok, checked, reshard)
        self._chooser.drop_unfinished_saves(agreed)
        restored = agreed.choice.step
        if restored is None:
            self._chooser.drop_unrestorable_copies(None, agreed)
            logger.info("restore: no step committed in %s; starting fresh", self._store.where())
            return None
        # None for a bucket that did not answer its listing while the disks serve the step: a copy
        # that fails there is still asked of it (it may hold one), last.
        committed = agreed.committed(restored)
        loaded = self._load(
            restored, committed, world_size, reshard, verify, into, selected, agreed.choice.bucket_shards
        )
        try:
            return self._finish(agreed, restored, loaded, started)
        finally:  # the copies read from memory land once the restore's collectives are over (they verified)
            self._refiller.start(loaded.result.refills if loaded.result is not None else ())

    def _load(
        self,
        restored: int,
        committed: Mapping[str, bool | None],
        world_size: int,
        reshard: bool,
        verify: Verify,
        into: Sequence[State] | State | None,
        selected: tuple[str | tuple[str | int, ...], ...] | None,
        bucket_shards: str | None,
    ) -> Attempt[ShardsRead]:
        """Step 3 of :meth:`restore` for the agreed step ``restored``, up to this process's reads
        (with a peer tier, the collectives of its fetches included); a failure is kept, not raised.
        ``bucket_shards``: the leader's digest of the bucket's manifest (see :class:`StepChoice`)."""

        def load() -> Attempt[ShardsRead]:
            return Attempt.run(
                lambda: self._reader.load(
                    restored, committed, world_size, reshard, verify, into, selected, bucket_shards=bucket_shards
                )
            )

        preparing = [cast(PreparedReads, tier) for tier in self._store.later if tier.capabilities.prepared_reads]
        try:
            if not preparing:
                return load()
            lacking = tuple(rank for rank in self._ranks if not self._store.held_locally(restored, rank))
            self._prepare(preparing, restored, committed, lacking, repairs=False)
            loaded = load()
            # A shard that failed on this disk (it rotted, or was cut short) is asked of the tiers
            # preparing reads, and read again: every process joins, whatever it read.
            failed = tuple(r for r in self._ranks if r not in lacking and isinstance(loaded.error, _READ_FAILURES))
            if self._prepare(preparing, restored, committed, failed, repairs=True) and failed:
                loaded = load()
            return loaded
        finally:
            for tier in preparing:
                tier.finish_reads(restored)  # the refills hold the copies they land

    def _prepare(
        self,
        tiers: Sequence[PreparedReads],
        step: int,
        committed: Mapping[str, bool | None],
        ranks: tuple[int, ...],
        *,
        repairs: bool,
    ) -> bool:
        """Each of ``tiers`` prepares the reads of ``ranks``' shards of ``step`` (collectives, in
        the store's order on every process); True if some tier brought some copy."""

        def collective(label: str, payload: type[P], action: Callable[[], P]) -> list[P]:
            return gather(self._coordinator, label, payload, action)

        elsewhere = any(value is True for value in committed.values())  # a bucket holds every shard
        brought = False
        for tier in tiers:
            brought |= tier.prepare_reads(step, ranks, collective, repairs=repairs, elsewhere=elsewhere)
        return brought

    def _finish(self, agreed: AgreedStep, restored: int, loaded: Attempt[ShardsRead], started: float) -> RestoreResult:
        """Steps 3 (its collectives) to 5 of :meth:`restore` for the agreed step ``restored``."""
        assembled: Attempt[RestoreResult] | None = None
        if loaded.error is None and not loaded.value.from_peers:
            assembled = Attempt.run(lambda: self._assembled(loaded.value))
        gather(self._coordinator, "restore: read", Done, (assembled or loaded).done)
        if assembled is None:  # the same on every process: they hold one manifest and world size
            assembled = Attempt.run(lambda: self._assembled(loaded.value))
            gather(self._coordinator, "restore: replicas", Done, assembled.done)
        result = assembled.value
        if loaded.value.to_device is not None:
            result = on_devices(result, loaded.value.to_device().tensor_for)
        self._chooser.drop_unfinished_commits(restored, agreed)
        self._chooser.drop_unrestorable_copies(restored, agreed)
        result = replace(result, seconds=time.monotonic() - started)
        logger.info(
            "restored step %d for rank(s) %s: %d bytes of %d shard(s) read in %.3f s; shards by tier: %s",
            result.step,
            rank_ranges(result.ranks),
            result.bytes_read,
            len(result.sources),
            result.seconds,
            by_tier(result.sources),
        )
        return result

    @property
    def refill_error(self) -> str | None:
        """The last failure to refill this node's disk after a restore (None: none failed)."""
        return self._refiller.last_error

    def _assembled(self, done: ShardsRead) -> RestoreResult:
        """Steps 3 (the arrays other processes send, when ``done.from_peers``: a collective) and
        4 for ``done``'s reads (:func:`~tiered_ckpt.engine.assembly.assemble`), errors naming the step."""
        try:
            received: dict[int, dict[str, np.ndarray]] = {}
            if done.from_peers:
                (rank,) = self._ranks
                own = done.read[rank].arrays if rank in done.read else {}  # sent to the ranks that left them out
                received = share(self._coordinator, done.manifest, own)
            return assemble(done, received)
        except CheckpointError as exc:
            raise restated(exc, f"restore of step {done.manifest.step}: {exc}") from exc

    def locate(self, step: int | None, checked: Attempt[None] = NOTHING_CHECKED) -> ShardManifest:
        """The manifest of ``step`` (default: the newest step every process can restore), the
        same on every process (collective); for readers that read parts of shards themselves.
        ``checked`` as for :meth:`restore`."""
        arguments = json.dumps({"step": step, "locate": True}, sort_keys=True)
        # reshard=True: a reader reshards as it reads (an error never tells it to ask for it)
        agreed = self._chooser.agree(step, arguments, self._world_size, False, checked, reshard=True)
        chosen = agreed.choice.step
        assert chosen is not None  # missing_ok=False raises instead
        in_local = chosen in self._store.local.steps()
        in_remote = chosen in agreed.remote_steps
        shards = agreed.choice.bucket_shards
        found = Attempt.run(
            lambda: self._store.manifests(chosen, in_local=in_local, in_remote=in_remote, bucket_shards=shards)
        )
        gather(self._coordinator, "locate: manifest", Done, found.done)
        manifest, _remote = found.value
        return manifest
