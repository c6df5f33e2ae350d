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
3. each process checks the world size (resharding only when asked), works out which
   saved ranks it needs, and reads each through :meth:`TieredStore.fetch_shard`
   (local copy, else a partner's memory, else the bucket, verified, refilling the local
   step, from memory once the restore returned: :mod:`~tiered_ckpt.engine.refill`; with a
   peer tier, the shards a process lacks on disk are first fetched from the
   processes holding them, a collective of its own, and after the read those whose copy on
   disk failed and no later tier gave, in a second one, then read again); failures on any
   process fail the restore on every process (a third collective); with one process per
   rank on the saved world size, the replicated arrays a rank's shard left to another
   rank then come from that rank's process (:func:`~tiered_ckpt.dist.replicas.share`, a
   fourth collective);
4. the shards are resharded if asked (steps 3 and 4: :mod:`~tiered_ckpt.engine.shard_reads`);
   local steps newer than the chosen one whose commit never reached every rank are
   deleted (they could never be restored);
5. the result (:class:`~tiered_ckpt.engine.restore_result.RestoreResult`) holds the
   states and, per shard read, the tier it came from.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tiered_ckpt.dist.coordination import Attempt, Coordinator, Done, gather
from tiered_ckpt.dist.replicas import share
from tiered_ckpt.engine.refill import Refiller
from tiered_ckpt.engine.restore_result import RestoreResult, by_tier, rank_ranges
from tiered_ckpt.engine.shard_reads import PendingRead, ShardReader
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
from tiered_ckpt.tiers.peer.tier import PeerTier
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Restorer", "check_restore_arguments"]

logger = logging.getLogger("tiered_ckpt")

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


@dataclass(frozen=True)
class _PartnerPlan:
    """One process's part of fetching from partners: the ranks it lacks on disk, and the ranks it holds in memory."""

    needs: tuple[int, ...]
    held: tuple[int, ...]


class Restorer:
    """Restores for the ranks of ``coordinator`` (see the module doc) through ``store``."""

    def __init__(
        self,
        store: TieredStore,
        coordinator: Coordinator,
        world_size: int,
        max_workers: int | None = None,
        *,
        peer: PeerTier | None = None,
        refiller: Refiller | None = None,
    ) -> None:
        self._store = store
        self._refiller = refiller or Refiller(store)
        self._coordinator = coordinator
        self._ranks = tuple(coordinator.local_ranks)
        self._world_size = world_size
        self._peer = peer
        self._chooser = StepChooser(store, coordinator, world_size, peer)
        self._reader = ShardReader(store, self._ranks, world_size, max_workers)

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
        # None: the bucket did not answer its listing and the disks serve the step; a copy that
        # fails there is still asked of the bucket (it may hold one), last.
        in_remote = True if restored in agreed.remote_steps else None if agreed.bucket_unlisted else False
        try:
            return self._read(agreed, restored, in_remote, started, world_size, reshard, verify, into, selected)
        finally:  # the copies read from memory land once the restore's collectives are over (they verified)
            self._refiller.start(self._reader.take_refills())

    def _read(
        self,
        agreed: AgreedStep,
        restored: int,
        in_remote: bool | None,
        started: float,
        world_size: int,
        reshard: bool,
        verify: Verify,
        into: Sequence[State] | State | None,
        selected: tuple[str | tuple[str | int, ...], ...] | None,
    ) -> RestoreResult:
        """Steps 3 to 5 of :meth:`restore` for the agreed step ``restored``."""

        def load() -> Attempt[RestoreResult | PendingRead]:
            return Attempt.run(
                lambda: self._reader.load(restored, in_remote, world_size, reshard, verify, into, selected)
            )

        try:
            if self._peer is None:
                loaded = load()
            else:
                peer = self._peer
                lacking = tuple(rank for rank in self._ranks if not self._store.held_locally(restored, rank))
                self._fetch_from_partners(peer, restored, in_remote, lacking)
                loaded = load()
                # A shard that failed on this disk (it rotted, or was cut short) is asked of the
                # partner holding a copy, and read again: every process joins, whatever it read.
                failed = tuple(r for r in self._ranks if r not in lacking and isinstance(loaded.error, _READ_FAILURES))
                if self._fetch_from_partners(peer, restored, in_remote, failed, repairs=True) and failed:
                    loaded = load()
        finally:
            if self._peer is not None:
                self._peer.forget(restored)  # the refills hold the copies they land
        gather(self._coordinator, "restore: read", Done, loaded.done)
        result = loaded.value
        if isinstance(result, PendingRead):  # the same on every process: they hold one manifest and world size
            pending = result
            finished = Attempt.run(lambda: self._finish_from_peers(pending))
            gather(self._coordinator, "restore: replicas", Done, finished.done)
            result = finished.value
        self._chooser.drop_unfinished_commits(restored, agreed)
        self._chooser.drop_unrestorable_copies(restored, agreed)
        result = replace(result, seconds=time.monotonic() - started)
        logger.info(
            "restored step %d for rank(s) %s: %d bytes of %d shard(s) read in %.3f s; shards by tier: %s",
            result.step, rank_ranges(result.ranks), result.bytes_read, len(result.sources), result.seconds,
            by_tier(result.sources),
        )  # fmt: skip
        return result

    @property
    def refill_error(self) -> str | None:
        """The last failure to refill this node's disk after a restore (None: none failed)."""
        return self._refiller.last_error

    def _fetch_from_partners(
        self, peer: PeerTier, step: int, in_remote: bool | None, needs: tuple[int, ...], *, repairs: bool = False
    ) -> bool:
        """Fetch from the processes holding them in memory the shards of ``step`` of this process's
        ranks ``needs`` (those it lacks on disk, or, ``repairs``, whose disk copy failed), for the
        store's chain to read and verify (a collective; a copy that does not arrive leaves the
        bucket to read). True if some process fetched some copy (the same on every process)."""
        label = "restore: repairs" if repairs else "restore: partners"
        plans = gather(
            self._coordinator, label, _PartnerPlan, lambda: _PartnerPlan(needs, peer.holdings().get(step, ()))
        )
        transfers = []
        for needer, wanted in enumerate(plans):
            for rank in wanted.needs:
                holder = next((each for each, other in enumerate(plans) if rank in other.held), None)
                if holder is not None and holder != needer:
                    transfers.append((holder, needer, rank))
        if not transfers:
            return False
        # A copy of a step no disk of this node holds, nor the bucket, exists only while its holder lives
        only_there = not in_remote and not repairs
        for rank in peer.fetch(step, transfers):
            holder = next(h for h, _n, r in transfers if r == rank)
            level = logging.WARNING if only_there else logging.INFO
            logger.log(level, "restore of step %d: rank %d's shard came from rank %d's memory%s", step, rank, holder,
                       " (on no disk of this node, not in the bucket: only while that partner lived)" if only_there
                       else "")  # fmt: skip
        return True

    def _finish_from_peers(self, pending: PendingRead) -> RestoreResult:
        """Step 3 continued, with one process per rank on the saved world size: the arrays
        this rank's shard left to other ranks come from their processes (collective)."""
        (rank,) = self._ranks
        held = pending.read[rank].arrays if rank in pending.read else {}  # sent to the ranks that left them out
        try:
            return self._reader.complete(pending, share(self._coordinator, pending.manifest, held))
        except CheckpointError as exc:
            raise restated(exc, f"restore of step {pending.manifest.step}: {exc}") from exc

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
        found = Attempt.run(lambda: self._store.manifests(chosen, in_local=in_local, in_remote=in_remote))
        gather(self._coordinator, "locate: manifest", Done, found.done)
        manifest, _remote = found.value
        return manifest
