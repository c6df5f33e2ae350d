"""Landing on this node's disk, after a restore returned, the shards it read from a partner's memory.

A shard a restore takes from a copy in memory is verified and parsed there (the caller's
arrays are filled from it); writing the same bytes to the local disk, durably, is only a
refill: the step is still in the tier it came from. So the restore returns first, and the
refill runs after it, off the caller's thread:

1. the executor of the restore's reads (:mod:`~tiered_ckpt.engine.read_execution`) returns
   a :class:`Refill` for the step with what it read (the verified bytes, and what the step's
   local record needs), and the reader hands it on with what it read;
2. once the restore's last collective is over (whether it succeeded or not: the copies
   verified), the restorer hands it to :meth:`Refiller.start`, which queues it on the
   writer's thread (before any later save's write; the next save, ``wait`` and ``close``
   wait for it);
3. there the shards are landed (temp file, hashed again as they are written, fsync, rename)
   and the step is committed locally, or its held ranks recorded.

A refill that fails is logged at WARNING and kept in :attr:`Refiller.last_error` (shown by
``lag()``), never raised: the job goes on, the step stays readable from the partner or the
bucket, and a directory the restore made is removed again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.tiers.store import Landing, TieredStore

__all__ = ["Refill", "Refiller"]

logger = logging.getLogger("tiered_ckpt")

Schedule = Callable[[Callable[[], None]], None]


@dataclass(frozen=True)
class Refill:
    """What a restore leaves to land on the local disk: the verified ``copies`` of ``manifest``'s
    step read from memory, then the refill of ``ranks`` recorded (``was_committed``: the step was
    committed here before; ``created``: the restore made its directory; ``remote``: the bucket's
    commit, for the receipt)."""

    manifest: ShardManifest
    remote: RemoteManifest | None
    ranks: tuple[int, ...]
    was_committed: bool
    created: bool
    copies: tuple[Landing, ...]


class Refiller:
    """Lands each :class:`Refill` on ``store``'s local disk through ``schedule`` (a queue running
    its jobs one at a time, off the caller's thread; None: at once, on the caller's)."""

    def __init__(self, store: TieredStore, schedule: Schedule | None = None, max_workers: int | None = None) -> None:
        self._store = store
        self._schedule = schedule
        self._max_workers = max_workers
        self.last_error: str | None = None
        """The last failure of a refill in this run (None: none failed)."""

    def start(self, refills: Sequence[Refill]) -> None:
        """Queue ``refills`` (see the module doc); never raises for a refill's failure."""
        for refill in refills:
            if self._schedule is None:
                self._land(refill)
            else:
                self._schedule(lambda refill=refill: self._land(refill))  # type: ignore[misc]

    def _land(self, refill: Refill) -> None:
        store, step = self._store, refill.manifest.step
        try:
            store.land_copies(step, refill.copies, self._max_workers)
            store.record_refill(refill.manifest, refill.remote, refill.ranks, was_committed=refill.was_committed)
        except Exception as exc:  # a disk's failure or a bug: the job goes on, the step is still where it came from
            self.last_error = f"step {step}: refilling {store.local.url} from a partner's memory failed: {exc}"
            logger.warning("%s; the step stays readable from the tier it came from", self.last_error, exc_info=True)
            if refill.created:
                try:
                    store.local.discard_uncommitted(step)
                except (CheckpointError, OSError):
                    logger.warning("step %d: could not remove the refill's directory; the next start will", step)
            return
        ranks = ", ".join(str(record.rank) for record, _data in refill.copies)
        logger.info("step %d: rank(s) %s refilled on %s from a partner's memory", step, ranks, store.local.url)
