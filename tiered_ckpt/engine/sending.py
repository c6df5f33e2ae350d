"""One step sent from the first tier to a later one: stages 2 to 5 of :mod:`~tiered_ckpt.engine.replication`.

:meth:`Sender.send`, on every process at once (its collectives run on the replicator's
own channel):

1. each process lands its ranks' shards in the target, ``concurrency`` at a time, each
   confirmed (a shard already there intact is not sent again), and the earlier steps' files
   they reference (an incremental save's) under those steps' places, from the first tier
   (by landings of their own, or with the shards, in a target whose landings pair the
   processes up: a partner's memory);
   each landing returns what landed (:class:`~tiered_ckpt.tiers.base.Landed`), which the tier
   does not keep;
2. ``put``: every process has landed its shards, and what landed reaches every process
   (a collective's payload);
3. ``confirm``, in a shared target that ``confirms``: each process checks once more the
   objects it landed, and what each found reaches every process (so no process makes a
   request per rank);
4. ``commit``: the leader commits the step in a shared target, handing the tier what every
   process landed and confirmed (the tier checks what none confirmed, commits, and moves its
   ``latest`` where it keeps one); in a target each process holds a part of (a partner's
   memory), every process commits its part;
5. every process records the commit of a target with receipts in its local step, from the
   record the commit returned.

:meth:`Sender.retain` then applies the retention that follows a commit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.dist.coordination import Coordinator, from_payload, gather, leader_decides, to_payload
from tiered_ckpt.engine.resume import other_runs
from tiered_ckpt.errors import CheckpointError, RemoteError, Retryable, UploadError
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.format.manifest import Reference, ShardManifest
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers import pruning
from tiered_ckpt.tiers.abilities import confirms_of
from tiered_ckpt.tiers.base import Confirmed, Landed, Tier
from tiered_ckpt.tiers.remote.leases import Lease
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["MemoryStep", "Sender"]

logger = logging.getLogger("tiered_ckpt")


@dataclass(frozen=True)
class MemoryStep:
    """A step kept in memory only (not written to the first tier): its ``manifest`` and, by rank,
    the bytes of this process's shards."""

    manifest: ShardManifest
    shards: Mapping[int, memoryview]


@dataclass(frozen=True)
class _Landings:
    """What one process's shards left in the target, as a collective carries it: each
    :class:`~tiered_ckpt.tiers.base.Landed` as its JSON fields."""

    shards: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, landed: Sequence[Landed]) -> _Landings:
        return cls(tuple(to_payload(each) for each in landed))

    def landed(self) -> list[Landed]:
        return [from_payload(Landed, each) for each in self.shards]


@dataclass(frozen=True)
class _Committed:
    """The leader's record of a commit, as every process keeps it as a receipt (None: the target keeps none)."""

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
        self._coordinator = coordinator
        self._ranks = ranks
        self._concurrency = concurrency
        self._lease = lease
        self._landed: dict[tuple[int | None, str], Landed] = {}  # what the tries of the step landed, by step and path
        self._sending: int | None = None

    def where(self, step: int) -> str:
        """The step's place in the target, for messages."""
        return f"{self._target.url}/{step_dir_name(step)}"

    def forget(self, step: int) -> None:
        """Drop what the tries of ``step`` landed (a step settled keeps nothing)."""
        if self._sending == step:
            self._landed, self._sending = {}, None

    def send(self, step: int, deadline: float | None, held: MemoryStep | None = None) -> int:
        """Land, commit and record ``step`` in the target (see the module doc); the bytes this process sent.

        ``held``: the step is in no file of the first tier, these are its manifest and bytes."""
        store, target = self._store, self._target
        manifest = held.manifest if held is not None else store.local.manifest(step)
        ranks = range(manifest.world_size) if self._ranks is None else self._ranks

        def put(rank: int) -> Landed:
            data = held.shards[rank] if held is not None else None
            return store.send_shard(step, manifest.shard(rank), target, deadline=deadline, data=data)

        def put_referenced(ref: Reference) -> Landed:
            return store.send_referenced(ref, target, deadline=deadline)

        mine_landed: list[Landed] = []

        def put_mine() -> _Landings:
            if self._coordinator.is_leader and self._lease is not None and not self._lease.held:  # push() alone
                self._lease.hold()
            mine_landed.extend(run_parallel(put, ranks, self._concurrency))
            if not target.capabilities.references_with_shards:  # else landed with the shards that reference them
                refs = {(ref.step, ref.file.path): ref for rank in ranks for ref in manifest.shard(rank).references}
                mine_landed.extend(run_parallel(put_referenced, list(refs.values()), self._concurrency))
            return _Landings.of(mine_landed)

        landings = gather(self._coordinator, "put", _Landings, put_mine)
        landed = self._with_earlier_tries(step, [each for part in landings for each in part.landed()])
        confirmer = confirms_of(target)
        confirmed: list[Confirmed] = []
        if confirmer is not None and target.capabilities.shared:  # each process its own objects, none all of them
            own = [self._landed[(each.step, each.path)] for each in mine_landed]  # as an earlier try landed them
            confirmed = gather(
                self._coordinator, "confirm", Confirmed, lambda: confirmer.confirm(manifest, own, deadline)
            )

        receipts = target.capabilities.receipts
        mine: list[_Committed] = []

        def commit() -> _Committed:
            if confirmer is not None:
                committed = confirmer.commit(manifest, landed=landed, deadline=deadline, confirmed=confirmed)
            else:
                committed = target.commit(manifest, landed=landed, deadline=deadline)
            mine.append(_Committed(committed.to_json() if committed is not None and receipts else None))
            return mine[-1]

        if target.capabilities.shared:  # one copy every node sees: the leader commits it
            record = leader_decides(self._coordinator, "commit", _Committed, commit)
        else:  # each process holds a part of its own (a partner's memory): every one commits its part
            gather(self._coordinator, "commit", _Committed, commit)
            record = mine[0]
        if record.document is not None:
            store.record_commit(step, target, RemoteManifest.from_json(record.document, source=self.where(step)))
        return sum(manifest.shard(rank).size_bytes for rank in ranks)

    def _with_earlier_tries(self, step: int, landed: list[Landed]) -> list[Landed]:
        """``landed``, each shard found already there intact on this try as an earlier try of the
        step landed it, if one did (what that try's sending gave: the store's checksum of it)."""
        if self._sending != step:
            self._landed, self._sending = {}, step
        for each in landed:
            before = self._landed.get((each.step, each.path))
            same_object = before is not None and (before.location, before.compression) == (
                each.location,
                each.compression,
            )
            if each.sent or not same_object or each.checksum is not None:
                self._landed[(each.step, each.path)] = each
        return [self._landed[(each.step, each.path)] for each in landed]

    def retain(self, step: int, pending: pruning.Pending) -> None:
        """After ``step``'s commit: the leader's retention of the target (not while another live run
        writes there: its steps are not ours to delete), every process's of its local tier
        (``pending``: the steps still queued for each later tier). A transient failure of the target
        is logged (retention runs again after the next commit); any other is an :class:`UploadError`."""
        store, target = self._store, self._target
        try:
            # a target that keeps every step deletes none: no other run's lease to look for
            if self._coordinator.is_leader and not store.policy(target).keeps_everything:
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
