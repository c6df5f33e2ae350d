"""One step sent from the first tier to a later one: stages 2 to 5 of :mod:`~tiered_ckpt.engine.replication`.

:meth:`Sender.send`, on every process at once (its collectives run on the replicator's
own channel):

1. each process lands its ranks' shards in the target, ``concurrency`` at a time, each
   confirmed (a shard already there intact is not sent again);
2. ``put``: every process has landed its shards (on the bucket, the store's checksums of
   them reach the leader);
3. ``commit``: the leader commits the step in a shared target (on the bucket: every object
   confirmed once more first, the manifest create-only, then ``latest``); in a target each
   process holds a part of (a partner's memory), every process commits its part;
4. every process records a durable target's commit in its local step (a receipt).

:meth:`Sender.retain` then applies the retention that follows a commit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tiered_ckpt.dist.coordination import Coordinator, gather, leader_decides
from tiered_ckpt.engine.resume import other_runs
from tiered_ckpt.errors import CheckpointError, RemoteError, Retryable, UploadError
from tiered_ckpt.format.compressed import CompressedObject
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers import pruning
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.remote.landed import Landed
from tiered_ckpt.tiers.remote.leases import Lease
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["HeldStep", "Sender"]

logger = logging.getLogger("tiered_ckpt")


@dataclass(frozen=True)
class HeldStep:
    """A step kept in memory only (not written to the first tier): its ``manifest`` and, by rank,
    the bytes of this process's shards."""

    manifest: ShardManifest
    shards: Mapping[int, memoryview]


@dataclass(frozen=True)
class _Put:
    """What one process's shards left on the bucket: the checksums it computed, as (shard path,
    checksum) pairs, and how those sent compressed are stored, as (shard path, entry as JSON)."""

    checksums: tuple[tuple[str, str], ...]
    compressed: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, landed: Landed) -> _Put:
        return cls(
            tuple(sorted(landed.checksums.items())),
            tuple(sorted((path, stored.to_json()) for path, stored in landed.compressed.items())),
        )

    def landed(self, source: str) -> Landed:
        compressed = {path: CompressedObject.from_json(text, source=source) for path, text in self.compressed}
        return Landed(dict(self.checksums), compressed)


@dataclass(frozen=True)
class _Committed:
    """The leader's remote manifest, as every process records it (None: the target keeps none)."""

    document: str | None


class Sender:
    """Sends steps of ``store``'s first tier to ``target`` for this process's ``ranks`` (None: every rank)."""

    def __init__(
        self,
        store: TieredStore,
        target: Tier,
        coordinator: Coordinator,
        ranks: Sequence[int] | None,
        concurrency: int,
        lease: Lease | None,
    ) -> None:
        self._store = store
        self._target = target
        # The bucket's own words (confirmation, its checksums, latest) go to it alone.
        self._bucket = store.remote if target is store.remote else None
        self._coordinator = coordinator
        self._ranks = ranks
        self._concurrency = concurrency
        self._lease = lease

    def where(self, step: int) -> str:
        """The step's place in the target, for messages."""
        return self._bucket.location(step) if self._bucket is not None else f"{self._target.url} (step {step})"

    def forget(self, step: int) -> None:
        """Drop what this process kept of ``step``'s landing (a step given up keeps nothing)."""
        if self._bucket is not None:
            self._bucket.forget_landed(step)

    def send(self, step: int, deadline: float | None, held: HeldStep | None = None) -> int:
        """Land, commit and record ``step`` in the target (see the module doc); the bytes this process sent.

        ``held``: the step is in no file of the first tier, these are its manifest and bytes."""
        store, target, bucket = self._store, self._target, self._bucket
        manifest = held.manifest if held is not None else store.local.manifest(step)
        ranks = range(manifest.world_size) if self._ranks is None else self._ranks

        def put(rank: int) -> None:
            data = held.shards[rank] if held is not None else None
            store.send_shard(step, manifest.shard(rank), target, deadline=deadline, data=data)

        def put_mine() -> _Put:
            if self._coordinator.is_leader and self._lease is not None and not self._lease.held:  # push() alone
                self._lease.hold()
            run_parallel(put, ranks, self._concurrency)
            return _Put.of(bucket.take_landed(step)) if bucket is not None else _Put(())

        landed = gather(self._coordinator, "put", _Put, put_mine)
        if self._coordinator.is_leader and bucket is not None:  # the one that commits
            for part in landed:
                bucket.add_landed(step, part.landed(f"what was landed of {self.where(step)}"))
        if target.capabilities.shared:  # one copy every node sees: the leader commits it
            remote = leader_decides(
                self._coordinator, "commit", _Committed, lambda: _Committed(self._commit(manifest, deadline))
            )
        else:  # each process holds a part of its own (a partner's memory): every one commits its part
            gather(self._coordinator, "commit", _Committed, lambda: _Committed(self._commit(manifest, deadline)))
            remote = _Committed(None)
        if remote.document is not None:
            store.record_commit(step, target, RemoteManifest.from_json(remote.document, source=self.where(step)))
        return sum(manifest.shard(rank).size_bytes for rank in ranks)

    def _commit(self, manifest: ShardManifest, deadline: float | None) -> str | None:
        """Leader: commit the step in the target; the bucket's remote manifest as JSON, for the receipts.

        On the bucket, every shard's object is confirmed once more first: a commit over an
        object missing or changed since it was confirmed is never written (:class:`RemoteError`,
        not transient)."""
        step, bucket = manifest.step, self._bucket
        if bucket is None:
            self._target.commit(manifest, deadline=deadline)
            return None

        def confirm(record: ShardRecord) -> str | None:
            return bucket.confirm_shard(step, record, deadline=deadline)

        problems = [problem for problem in run_parallel(confirm, manifest.shards, self._concurrency) if problem]
        if problems:
            raise RemoteError(
                f"step {step} was not committed at {self.where(step)}: {len(problems)} of its objects "
                f"changed after their upload was confirmed (deleted or replaced by someone else?): "
                + "; ".join(problems[:5]),
                transient=False,
            )
        remote = bucket.commit(manifest, deadline=deadline)
        bucket.set_latest(manifest.step)
        return remote.to_json()

    def retain(self, step: int, pending: pruning.Pending) -> None:
        """After ``step``'s commit: the leader's retention of the target (not while another live run
        writes there: its steps are not ours to delete), every process's of its local tier
        (``pending``: the steps still queued for each later tier). A transient failure of the target
        is logged (retention runs again after the next commit); any other is an :class:`UploadError`."""
        store, target = self._store, self._target
        try:
            if self._coordinator.is_leader:
                others = other_runs(self._lease)
                if others:
                    logger.warning(
                        "remote retention of %s skipped: run(s) %s also write there", target.url, ", ".join(others)
                    )
                else:
                    pruning.retain(store, target)
            pruning.retain(store, store.local, pending)
        except RemoteError as exc:
            if not exc.transient:
                raise UploadError(
                    f"step {step} is committed at {self.where(step)}, but the retention that follows failed: {exc}",
                    step=step,
                    tries=exc.tries,
                ) from exc
            logger.warning("step %d is committed; the remote retention that follows failed (%s)", step, exc)
        except CheckpointError as exc:
            raise UploadError(
                f"step {step} is committed at {self.where(step)}, but the retention that follows failed: {exc}",
                step=step,
                tries=exc.tries if isinstance(exc, Retryable) else 1,
            ) from exc
