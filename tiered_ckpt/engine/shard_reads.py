"""Reading this process's part of a chosen step through the store: steps 3 and 4 of a restore
(:mod:`~tiered_ckpt.engine.restore`), without a collective of its own.

1. :meth:`ShardReader.load` looks at what the tiers hold of the step and has the restore
   planned (:mod:`~tiered_ckpt.engine.restore_plan`: the world size checked, resharding only
   when asked, the saved ranks this process needs, whole shards or only the chunks of a
   state of DTensors, or the arrays under ``paths``), then runs the plan's reads through
   the store (:meth:`ShardReader._run`; a selection's through
   :func:`~tiered_ckpt.engine.selected_reads.read_selected`): each shard whole through
   :meth:`TieredStore.fetch_shard` (local copy, else each later tier, verified, refilling the
   local step; a copy read from memory is left to land after the restore returns: the
   refills are returned with the result, :class:`Loaded`), or in parts through
   :meth:`TieredStore.read_parts`;
2. the arrays its ranks' shards left to other ranks are put back
   (:meth:`ShardReader.complete`): read here, or, with one process per rank on the saved
   world size, received from the processes holding them (the restorer's collective; until
   then :meth:`~ShardReader.load` returns a :class:`PendingRead`);
3. the states are resharded if asked, or the chunks of the caller's DTensors filled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from tiered_ckpt.dist.replicas import missing, put_back
from tiered_ckpt.dist.reshard import (
    ChunkPlan,
    direct_destination,
    fill_chunks,
    reshard_flat,
    reshard_rank,
)
from tiered_ckpt.engine.node_shards import step_holdings
from tiered_ckpt.engine.refill import Refill
from tiered_ckpt.engine.restore_plan import (
    RestorePlan,
    RestoreRequest,
    ShardRead,
    StepHoldings,
    check_world,
    chunk_plans,
    needed_ranks,
    plan_chunk_restore,
    plan_restore,
    plan_selected_restore,
    replicas_from_peers,
)
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.engine.selected_reads import read_selected
from tiered_ckpt.errors import (
    CheckpointError,
    restated,
)
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.format.selection import selects
from tiered_ckpt.format.state import FlatState, State, flatten_into
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.store import FetchedShard, TieredStore, TierName

__all__ = ["Loaded", "PendingRead", "ShardReader"]


def _part_bytes(record: ShardRecord, state: FlatState) -> int:
    """The bytes a partial read of ``record``'s shard took: its header and the arrays in ``state``."""
    return record.header_bytes + sum(array.nbytes for array in state.arrays.values())


@dataclass(frozen=True)
class _Selection:
    """A partial restore's paths (none: a restore into DTensors), and where its step is: the
    bucket's remote manifest (None if a nearer tier's manifest was used), and whether the local
    disk and the bucket committed it."""

    paths: Sequence[str | tuple[str | int, ...]]
    remote: RemoteManifest | None
    in_local: bool
    in_remote: bool | None  # None: the bucket could not be listed; its copies are tried last


@dataclass(frozen=True)
class PendingRead:
    """This process's part of a restore once its own reads are done, before the arrays its
    ranks' shards left to other ranks are put back (:meth:`ShardReader.complete` does that).

    ``read``: by saved rank, the verified states read (whole shards, or the parts needed),
    from the tiers in ``sources``, ``bytes_read`` bytes in all. ``from_peers``: the left-out
    arrays come from the processes holding them (else they are read here, from the bucket
    tiers named in ``later``). Whole reads: ``into`` are the caller's arrays by saved rank, resharded
    for ``target`` ranks. Chunk reads (``plans`` not empty): per rank of this process, its
    plan and the state of DTensors (``targets``) the chunks fill.
    """

    step: int
    manifest: ShardManifest
    target: int
    read: Mapping[int, FlatState]
    sources: Mapping[int, TierName]
    bytes_read: int
    from_peers: bool
    later: tuple[str, ...]
    into: Mapping[int, Mapping[str, np.ndarray]] = field(default_factory=dict)
    plans: tuple[ChunkPlan, ...] = ()
    targets: tuple[FlatState, ...] = ()
    refills: tuple[Refill, ...] = ()


@dataclass(frozen=True)
class Loaded:
    """What :meth:`ShardReader.load` gives: the ``result``, or, while arrays must come from other
    processes, what :meth:`ShardReader.complete` completes; and the ``refills`` its reads left
    to land once the restore's collectives are over (:mod:`~tiered_ckpt.engine.refill`)."""

    result: RestoreResult | PendingRead
    refills: tuple[Refill, ...] = ()


class ShardReader:
    """Reads, through ``store``, the shards the processes' ``ranks`` of a job of ``world_size``
    ranks need (see the module doc), ``max_workers`` at a time."""

    def __init__(
        self, store: TieredStore, ranks: Sequence[int], world_size: int, max_workers: int | None = None
    ) -> None:
        self._store = store
        self._ranks = tuple(ranks)
        self._world_size = world_size
        self._max_workers = max_workers

    @property
    def _one_process(self) -> bool:
        return len(self._ranks) == self._world_size

    def load(
        self,
        step: int,
        in_remote: bool | None,
        target: int,
        reshard: bool,
        verify: Verify,
        into: Sequence[State] | State | None,
        paths: Sequence[str | tuple[str | int, ...]] | None = None,
    ) -> Loaded:
        """This process's part of a restore: its ranks' verified states (resharded when asked),
        or, when their replicated arrays must come from other processes, all but those;
        with ``paths``, only the parts of the states under them (:meth:`_load_selected`); and
        the refills its reads left to land.
        A whole restore reads what :func:`~tiered_ckpt.engine.restore_plan.plan_restore` plans."""
        store = self._store
        in_local = step in store.local.steps()
        into_list = [into] if isinstance(into, Mapping) else into
        try:
            targets = (
                [flatten_into(state, f"into[{index}]") for index, state in enumerate(into_list)]
                if into_list is not None
                else None
            )
            manifest, remote = store.manifests(step, in_local=in_local, in_remote=in_remote is True)
            given = None if into_list is None else len(into_list)
            request = RestoreRequest(self._ranks, target, self._one_process, reshard, given)
            wanted = needed_ranks(manifest, request)
            holdings = self._holdings(manifest, wanted, in_remote)
            check_world(manifest, request, holdings)
            if paths is not None:
                selection = _Selection(paths, remote, in_local, in_remote)
                return self._completed_here(self._load_selected(step, manifest, selection, request, targets, verify))
            if targets is not None and any(state.structure.chunks for state in targets):
                where = _Selection((), remote, in_local, in_remote)
                return self._completed_here(self._load_chunks(manifest, where, request, targets, verify))
            plan = plan_restore(manifest, request, holdings)
            return self._completed_here(self._execute(plan, remote, in_local, targets, verify, in_remote))
        except CheckpointError as exc:
            raise restated(exc, f"restore of step {step}: {exc}") from exc

    def _holdings(self, manifest: ShardManifest, ranks: Sequence[int], in_remote: bool | None) -> StepHoldings:
        return step_holdings(self._store, self._one_process, manifest, ranks, in_remote)

    def _execute(
        self,
        plan: RestorePlan,
        remote: RemoteManifest | None,
        in_local: bool,
        targets: list[FlatState] | None,
        verify: Verify,
        in_remote: bool | None,
    ) -> PendingRead:
        """Run a whole restore's ``plan`` (:meth:`_run`)."""
        manifest = plan.manifest

        def into(read: ShardRead) -> Mapping[str, np.ndarray] | None:
            return targets[read.into].arrays if targets is not None and read.into is not None else None

        read, sources, bytes_read, refills = self._run(manifest, plan.reads, verify, remote, in_local, into)
        wanted = [each.rank for each in plan.reads]
        return PendingRead(
            manifest.step,
            manifest,
            plan.target,
            read=read,
            sources=sources,
            bytes_read=bytes_read,
            from_peers=plan.replicas_from_peers,
            later=self._store.readable(in_remote),
            into={rank: state.arrays for rank, state in zip(wanted, targets or (), strict=False)},
            refills=refills,
        )

    def _run(
        self,
        manifest: ShardManifest,
        reads: Sequence[ShardRead],
        verify: Verify,
        remote: RemoteManifest | None,
        in_local: bool,
        into: Callable[[ShardRead], Mapping[str, np.ndarray] | None],
    ) -> tuple[dict[int, FlatState], dict[int, TierName], int, tuple[Refill, ...]]:
        """The one executor of a plan's ``reads``, through the store's chain, ``max_workers`` at a
        time, each into ``into(read)``'s arrays: by saved rank, the verified states and the tiers
        they came from; the bytes read; and the refills (a whole read from a later tier refills
        the local step, which is created for it and removed again if the reads fail before it
        was committed; a copy read from memory lands after the restore returns)."""
        store, step = self._store, manifest.step

        def one(read: ShardRead) -> FetchedShard:
            record = manifest.shard(read.rank)
            if read.whole:
                return store.fetch_shard(step, record, verify=verify, into=into(read), later=read.tiers)
            assert read.names is not None  # a selection's reads look at each header first: read_selected
            state, source = store.read_parts(step, record, read.names, later=read.tiers, into=into(read), verify=verify)
            return FetchedShard(state, source)

        whole = [read.rank for read in reads if read.whole]
        with self._step_dir(step) if whole else nullcontext(False) as created:
            fetched = run_parallel(one, reads, self._max_workers)
            refills: tuple[Refill, ...] = ()
            if whole:
                wholes = [each for read, each in zip(reads, fetched, strict=True) if read.whole]
                refills = self._refills(manifest, remote, whole, in_local, created, wholes)
        read = {each.rank: got.state for each, got in zip(reads, fetched, strict=True)}
        sources = {each.rank: got.source for each, got in zip(reads, fetched, strict=True)}
        bytes_read = sum(
            manifest.shard(each.rank).size_bytes
            if each.whole
            else _part_bytes(manifest.shard(each.rank), read[each.rank])
            for each in reads
        )
        return read, sources, bytes_read, refills

    @contextmanager
    def _step_dir(self, step: int) -> Iterator[bool]:
        """The local directory of ``step`` while shards are read into it: created if needed (True
        is yielded), and removed again if this restore created it and fails before committing it."""
        created = not self._store.local.step_dir(step).is_dir()
        self._store.local.new_step_dir(step)
        try:
            yield created
        except BaseException:
            if created:
                self._store.local.discard_uncommitted(step)
            raise

    def _completed_here(self, pending: PendingRead) -> Loaded:
        """The result, if no array ``pending`` lacks must come from another process; else ``pending``."""
        return Loaded(pending if pending.from_peers else self.complete(pending, {}), pending.refills)

    def complete(self, pending: PendingRead, received: Mapping[int, Mapping[str, np.ndarray]]) -> RestoreResult:
        """The end of a read: the arrays ``pending``'s shards left to other ranks put back (by writer
        rank, ``received`` from their processes, else read here), then the states resharded, or
        the chunks of the caller's DTensors filled."""
        step, manifest = pending.step, pending.manifest
        if pending.plans:
            read = dict(pending.read)
            for writer, arrays in received.items():
                base = read.get(writer, read[pending.plans[0].plain_source])
                read[writer] = FlatState({**base.arrays, **arrays} if writer in read else dict(arrays), base.structure)
            plans = zip(pending.plans, pending.targets, strict=True)
            states = [fill_chunks(plan, read, state) for plan, state in plans]
            unflattened = [state.unflatten() for state in states]
            sources = dict(pending.sources)
            return RestoreResult(step, unflattened, sources, self._ranks, manifest, tuple(states), pending.bytes_read)
        parts_bytes = 0
        if not pending.from_peers:
            received, parts_bytes = self._replicas_read(step, manifest, pending.read, pending.later)
        for rank, state in pending.read.items():
            into = pending.into.get(rank)
            put_back(state, manifest.shard(rank), manifest, received, into, self._store.local.step_dir(step))
        result = self._resharded(step, manifest, pending.target, pending.read, dict(pending.sources))
        return replace(result, bytes_read=pending.bytes_read + parts_bytes)

    def _replicas_read(
        self, step: int, manifest: ShardManifest, read: Mapping[int, FlatState], later: tuple[str, ...]
    ) -> tuple[dict[int, Mapping[str, np.ndarray]], int]:
        """By writer rank, the arrays the shards in ``read`` left to other ranks: from the
        writer's shard if it is in ``read``, else by a verified partial read of it; and the
        bytes those partial reads took."""
        needed = missing(manifest.shard(rank) for rank in read)
        found: dict[int, Mapping[str, np.ndarray]] = {h: read[h].arrays for h in needed if h in read}
        absent = sorted(writer for writer in needed if writer not in read)
        parts = run_parallel(
            lambda writer: self._store.read_parts(step, manifest.shard(writer), needed[writer], later=later),
            absent,
            self._max_workers,
        )
        found.update((writer, state.arrays) for writer, (state, _source) in zip(absent, parts, strict=True))
        return found, sum(_part_bytes(manifest.shard(h), state) for h, (state, _) in zip(absent, parts, strict=True))

    def _resharded(
        self,
        step: int,
        manifest: ShardManifest,
        target: int,
        read: Mapping[int, FlatState],
        sources: dict[int, TierName],
    ) -> RestoreResult:
        """The result: the states read, resharded for ``target`` ranks when the world size changed."""
        ranks = self._ranks
        if manifest.world_size == target:
            states = [read[rank] for rank in ranks]
        elif self._one_process:
            states = reshard_flat([read[rank] for rank in range(manifest.world_size)], manifest, target)
            ranks = tuple(range(target))
        else:
            states = [reshard_rank(read, manifest, target, rank) for rank in ranks]
        return RestoreResult(step, [state.unflatten() for state in states], sources, ranks, manifest, tuple(states))

    def _load_chunks(
        self,
        manifest: ShardManifest,
        where: _Selection,
        request: RestoreRequest,
        targets: list[FlatState],
        verify: Verify,
    ) -> PendingRead:
        """Fill states of DTensors in place, as
        :func:`~tiered_ckpt.engine.restore_plan.plan_chunk_restore` plans: each part read
        (:meth:`TieredStore.read_parts`) is verified against the sha256 the manifest records for
        each chunk, or its xxh3-64 with ``verify="fast"``, straight into the caller's memory
        where a chunk is one contiguous piece of it. ``where``: the step's remote manifest and
        tiers (no paths)."""
        step, store = manifest.step, self._store
        plans = chunk_plans(manifest, request, targets)
        needed = sorted({rank for chunk_plan in plans for rank in chunk_plan.reads})
        holdings = self._holdings(manifest, needed, where.in_remote)
        mine = [rank for rank in self._ranks if rank < manifest.world_size]
        held_here = frozenset(rank for rank in mine if store.held_locally(step, rank))
        plan = plan_chunk_restore(manifest, request, holdings, plans, held_here)
        direct: dict[int, dict[str, np.ndarray]] = {}
        for chunk_plan, state in zip(plan.plans, targets, strict=True):
            for name, overlaps in chunk_plan.overlaps.items():
                array = state.arrays[name]
                chunked = state.structure.chunks.get(name)
                offsets = chunked.offsets if chunked is not None else (0,) * array.ndim
                for saved_rank, chunk in overlaps:
                    destination = direct_destination(array, offsets, chunk)
                    if destination is not None:
                        direct.setdefault(saved_rank, {})[name] = destination

        def into(read: ShardRead) -> Mapping[str, np.ndarray] | None:
            return direct.get(read.rank) if read.names is not None else None  # a whole shard into new arrays

        read, sources, bytes_read, refills = self._run(manifest, plan.reads, verify, where.remote, where.in_local, into)
        return PendingRead(
            step,
            manifest,
            request.world_size,
            read=read,
            sources=sources,
            bytes_read=bytes_read,
            from_peers=plan.replicas_from_peers,
            later=store.readable(where.in_remote),
            plans=plan.plans,
            targets=tuple(targets),
            refills=refills,
        )

    def _refills(
        self,
        manifest: ShardManifest,
        remote: RemoteManifest | None,
        ranks: Sequence[int],
        was_committed: bool,
        created: bool,
        fetched: Sequence[FetchedShard],
    ) -> tuple[Refill, ...]:
        """After ``ranks``' shards were ``fetched`` into the local step: the refill the copies read
        from memory leave to land after the restore returns, or, with none, the refill recorded now."""
        copies = tuple(each.copy for each in fetched if each.copy is not None)
        if copies:
            return (Refill(manifest, remote, tuple(ranks), was_committed, created, copies),)
        self._store.record_refill(manifest, remote, ranks, was_committed=was_committed)
        return ()

    def _load_selected(
        self,
        step: int,
        manifest: ShardManifest,
        selection: _Selection,
        request: RestoreRequest,
        targets: list[FlatState] | None,
        verify: Verify,
    ) -> PendingRead:
        """A partial restore, as :func:`~tiered_ckpt.engine.restore_plan.plan_selected_restore`
        plans: each saved rank this process needs reads, of its shard, the header
        and the arrays under the selection's paths (:func:`~tiered_ckpt.format.selection.select`),
        each verified (:meth:`TieredStore.read_parts`), into ``targets``' arrays when given (a
        state of the selection's nesting: every rank's checked against its shard's header before
        any is filled, :class:`InvalidStateError` naming the arrays that differ); a shard whose
        record has no per-array digests (saved before they were recorded) is read whole,
        verified by its sha256, and cut (:func:`~tiered_ckpt.engine.selected_reads.read_selected`). The
        manifest handed on keeps only the replicated arrays and sharded keys inside the
        selection, so that only those are put back and resharded (every rank of one job
        selects the same names: their states share one nesting)."""
        wanted = needed_ranks(manifest, request)
        holdings = self._holdings(manifest, wanted, selection.in_remote)
        plan = plan_selected_restore(manifest, request, holdings, selection.paths)
        whole = [read.rank for read in plan.reads if read.whole]
        with self._step_dir(step) if whole else nullcontext():
            fetched, starts = read_selected(
                self._store, manifest, plan.reads, selection.paths, targets, verify, self._max_workers
            )
            if whole:  # a shard read whole from a later tier refilled the local step
                self._store.record_refill(manifest, selection.remote, whole, was_committed=selection.in_local)
        read_states = {rank: state for rank, (state, _source) in zip(wanted, fetched, strict=True)}
        # What is put back and resharded is decided from names alone, so that every process cuts
        # the manifest alike: the replicas exchanged are then the same on every process.
        chosen = partial(selects, starts[wanted[0]])
        records = [replace(r, replicas=tuple(p for p in r.replicas if chosen(p[0]))) for r in manifest.shards]
        keys = tuple(key for key in manifest.sharded_keys if chosen(key))
        cut = replace(manifest, shards=tuple(records), sharded_keys=keys, source=f"the manifest of step {step}")
        return PendingRead(
            step,
            cut,
            plan.target,
            read=read_states,
            sources={rank: source for rank, (_state, source) in zip(wanted, fetched, strict=True)},
            bytes_read=sum(
                manifest.shard(rank).size_bytes if rank in whole else _part_bytes(manifest.shard(rank), state)
                for rank, state in read_states.items()
            ),
            from_peers=replicas_from_peers(cut, request),
            later=self._store.readable(selection.in_remote),
            into={rank: state.arrays for rank, state in zip(wanted, targets or (), strict=False)},
        )
