"""Reading this process's part of a chosen step through the store: step 3 of a restore
(:mod:`~tiered_ckpt.engine.restore`), without a collective of its own.

:meth:`ShardReader.load`, step by step:

1. it gathers the plan's inputs: the step's manifest, what the tiers hold of it
   (:func:`~tiered_ckpt.engine.node_shards.step_holdings`) and the request (this process's
   ranks, the world size restored on, ``reshard``, the caller's arrays, ``paths``);
2. it has the restore planned (:mod:`~tiered_ckpt.engine.restore_plan`: the world size
   checked, resharding only when asked, the saved ranks this process needs, whole shards,
   the chunks a state of DTensors needs, or the arrays under ``paths``);
3. the one executor runs the plan's reads (:mod:`~tiered_ckpt.engine.read_execution`), and
   then, unless the processes holding them send them, the reads of the arrays its shards
   left to other ranks (:func:`~tiered_ckpt.engine.restore_plan.plan_replica_reads`);
4. it returns what was read, with the refills left to land
   (:class:`~tiered_ckpt.engine.assembly.ShardsRead`): the restorer exchanges the arrays
   the processes send each other, if any, and assembles the result
   (:func:`~tiered_ckpt.engine.assembly.assemble`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial

import numpy as np

from tiered_ckpt.dist.reshard import direct_destination
from tiered_ckpt.engine.assembly import ShardsRead
from tiered_ckpt.engine.node_shards import step_holdings
from tiered_ckpt.engine.read_execution import ReadExecutor
from tiered_ckpt.engine.restore_plan import (
    RestorePlan,
    RestoreRequest,
    Selection,
    StepHoldings,
    check_world,
    chunk_plans,
    needed_ranks,
    plan_chunk_restore,
    plan_replica_reads,
    plan_restore,
    plan_selected_restore,
    replicas_from_peers,
)
from tiered_ckpt.errors import CheckpointError, restated
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.selection import selects
from tiered_ckpt.format.state import FlatState, State, flatten_into
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.tiers.store import TieredStore
from tiered_ckpt.torch.device_copies import DeviceTargets

__all__ = ["ShardReader"]


class ShardReader:
    """Reads, through ``store``, the shards the processes' ``ranks`` of a job of ``world_size``
    ranks need (see the module doc), ``max_workers`` at a time."""

    def __init__(
        self,
        store: TieredStore,
        ranks: Sequence[int],
        world_size: int,
        max_workers: int | None = None,
        host_room: Callable[[bool], int | None] = lambda release: None,
    ) -> None:
        self._store = store
        self._host_room = host_room  # the room for pinned buffers of CUDA tensors of into= (None: no bound)
        self._ranks = tuple(ranks)
        self._world_size = world_size
        self._executor = ReadExecutor(store, max_workers)

    @property
    def _one_process(self) -> bool:
        return len(self._ranks) == self._world_size

    def load(
        self,
        step: int,
        committed: Mapping[str, bool | None],
        target: int,
        reshard: bool,
        verify: Verify,
        into: Sequence[State] | State | None,
        paths: Selection | None = None,
        *,
        bucket_shards: str | None = None,
    ) -> ShardsRead:
        """This process's reads of a restore of ``step`` on ``target`` ranks (see the module doc):
        its ranks' verified states, all but the arrays other processes send; with ``paths``,
        only the parts of the states under them. ``committed``: by shared, durable tier (a
        bucket), whether it committed the step (None: it could not be listed; its copies are
        still tried); ``bucket_shards``: the digest a disk's manifest is checked against instead
        of reading the bucket's (see :meth:`~tiered_ckpt.tiers.store.TieredStore.manifests`).
        Errors name the step."""
        store = self._store
        in_local = step in store.local.steps()
        into_list = [into] if isinstance(into, Mapping) else into
        devices = DeviceTargets(self._host_room, store.local.root)
        try:
            targets = (
                [flatten_into(state, f"into[{index}]", devices) for index, state in enumerate(into_list)]
                if into_list is not None
                else None
            )
            in_remote = any(value is True for value in committed.values())
            manifest, remote = store.manifests(
                step, in_local=in_local, in_remote=in_remote, bucket_shards=bucket_shards
            )
            given = None if into_list is None else len(into_list)
            request = RestoreRequest(self._ranks, target, self._one_process, reshard, given)
            holdings = self._holdings(manifest, needed_ranks(manifest, request), committed)
            check_world(manifest, request, holdings)
            plan = self._plan(manifest, request, holdings, targets, paths, committed)
            arrays = _into(plan, targets)
            executed = self._executor.run(
                manifest, plan.reads, verify=verify, into=arrays, paths=plan.paths, remote=remote, in_local=in_local
            )
            read = dict(executed.states)
            cut = manifest if paths is None else _cut(manifest, executed.starts[plan.reads[0].rank])
            from_peers = replicas_from_peers(cut, request)
            found: Mapping[int, Mapping[str, np.ndarray]] = {}
            bytes_read = executed.bytes_read
            if not from_peers and not plan.chunks:  # a chunk plan reads the writers' chunks itself
                found, replica_bytes = self._replicas(cut, read, holdings, verify)
                bytes_read += replica_bytes
            return ShardsRead(
                cut,
                target,
                self._ranks,
                self._one_process,
                read,
                dict(executed.sources),
                bytes_read,
                from_peers,
                str(store.local.step_dir(step)),
                found=found,
                into={} if plan.chunks else arrays,
                chunks=plan.chunks,
                targets=tuple(targets or ()) if plan.chunks else (),
                refills=executed.refills,
                to_device=devices.copy_back,
            )
        except CheckpointError as exc:
            raise restated(exc, f"restore of step {step}: {exc}") from exc

    def _replicas(
        self, manifest: ShardManifest, read: Mapping[int, FlatState], holdings: StepHoldings, verify: Verify
    ) -> tuple[dict[int, Mapping[str, np.ndarray]], int]:
        """By writer rank, the arrays the shards in ``read`` left to other ranks: from the
        writer's state if it is in ``read``, else by the planned reads of its shard's parts
        (:func:`~tiered_ckpt.engine.restore_plan.plan_replica_reads`); and the bytes those took."""
        writers = {writer for rank in read for _name, writer in manifest.shard(rank).replicas}
        found: dict[int, Mapping[str, np.ndarray]] = {w: read[w].arrays for w in writers if w in read}
        reads = plan_replica_reads(manifest, read, holdings)
        if not reads:
            return found, 0
        parts = self._executor.run(manifest, reads, verify=verify)
        found.update((writer, state.arrays) for writer, state in parts.states.items())
        return found, parts.bytes_read

    def _holdings(
        self, manifest: ShardManifest, ranks: Sequence[int], committed: Mapping[str, bool | None]
    ) -> StepHoldings:
        return step_holdings(self._store, self._one_process, manifest, ranks, committed)

    def _plan(
        self,
        manifest: ShardManifest,
        request: RestoreRequest,
        holdings: StepHoldings,
        targets: list[FlatState] | None,
        paths: Selection | None,
        committed: Mapping[str, bool | None],
    ) -> RestorePlan:
        """The plan of the restore ``request`` asks for: of the parts under ``paths``, into
        states of DTensors (``targets`` with chunks), or whole."""
        if paths is not None:
            return plan_selected_restore(manifest, request, holdings, paths)
        if targets is None or not any(state.structure.chunks for state in targets):
            return plan_restore(manifest, request, holdings)
        plans = chunk_plans(manifest, request, targets)
        needed = sorted({rank for chunk_plan in plans for rank in chunk_plan.reads})
        mine = [rank for rank in self._ranks if rank < manifest.world_size]
        held_here = frozenset(rank for rank in mine if self._store.held_locally(manifest.step, rank))
        return plan_chunk_restore(manifest, request, self._holdings(manifest, needed, committed), plans, held_here)


def _into(plan: RestorePlan, targets: Sequence[FlatState] | None) -> dict[int, Mapping[str, np.ndarray]]:
    """By saved rank, the caller's arrays ``plan``'s reads fill: a rank's state of its own, or,
    for a state of DTensors, each chunk that is one contiguous piece of the caller's memory
    (a shard read whole, to refill this node's disk, goes into new arrays)."""
    if targets is None:
        return {}
    if not plan.chunks:
        return {read.rank: targets[read.into].arrays for read in plan.reads if read.into is not None}
    direct: dict[int, dict[str, np.ndarray]] = {}
    for chunk_plan, state in zip(plan.chunks, targets, strict=True):
        for name, overlaps in chunk_plan.overlaps.items():
            if name in chunk_plan.taken:  # not the caller's: read into new memory
                continue
            array = state.arrays[name]
            chunked = state.structure.chunks.get(name)
            offsets = chunked.offsets if chunked is not None else (0,) * array.ndim
            for saved_rank, chunk in overlaps:
                destination = direct_destination(array, offsets, chunk)
                if destination is not None:
                    direct.setdefault(saved_rank, {})[name] = destination
    whole = {read.rank for read in plan.reads if read.whole}
    return {rank: arrays for rank, arrays in direct.items() if rank not in whole}


def _cut(manifest: ShardManifest, starts: tuple[str, ...]) -> ShardManifest:
    """``manifest`` keeping only the replicated arrays and sharded keys under a selection's
    ``starts``, so that only those are put back and resharded."""
    # Decided from names alone, so that every process cuts the manifest alike: the replicas
    # exchanged are then the same on every process.
    chosen = partial(selects, starts)
    records = [replace(r, replicas=tuple(p for p in r.replicas if chosen(p[0]))) for r in manifest.shards]
    keys = tuple(key for key in manifest.sharded_keys if chosen(key))
    return replace(manifest, shards=tuple(records), sharded_keys=keys, source=f"the manifest of step {manifest.step}")
