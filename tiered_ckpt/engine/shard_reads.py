"""Reading this process's part of a chosen step through the store: steps 3 and 4 of a restore
(:mod:`~tiered_ckpt.engine.restore`), without a collective of its own.

1. :meth:`ShardReader.load` checks the world size (resharding only when asked), works out
   which saved ranks this process needs, and reads each through
   :meth:`TieredStore.fetch_shard` (local copy, else each later tier, verified, refilling the
   local step; a copy read from memory is left to land after the restore returns: the
   refills are returned with the result, :class:`Loaded`), or, into a state of DTensors,
   just the chunks that overlap its own (:meth:`TieredStore.read_parts`);
2. the arrays its ranks' shards left to other ranks are put back
   (:meth:`ShardReader.complete`): read here, or, with one process per rank on the saved
   world size, received from the processes holding them (the restorer's collective; until
   then :meth:`~ShardReader.load` returns a :class:`PendingRead`);
3. the states are resharded if asked, or the chunks of the caller's DTensors filled.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from tiered_ckpt.dist.replicas import missing, put_back
from tiered_ckpt.dist.reshard import (
    ChunkPlan,
    direct_destination,
    fill_chunks,
    plan_chunks,
    reshard_flat,
    reshard_rank,
)
from tiered_ckpt.engine.node_shards import step_holdings
from tiered_ckpt.engine.refill import Refill
from tiered_ckpt.engine.restore_plan import (
    RestorePlan,
    RestoreRequest,
    StepHoldings,
    check_served,
    check_world,
    needed_ranks,
    plan_restore,
)
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.engine.selected_reads import read_selected
from tiered_ckpt.errors import (
    CheckpointError,
    InvalidStateError,
    UsageError,
    restated,
)
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.format.selection import selects
from tiered_ckpt.format.state import FlatState, State, flatten_into
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.store import FetchedShard, Source, TieredStore

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
    sources: Mapping[int, Source]
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


def _without_replicas(plan: ChunkPlan, record: ShardRecord) -> ChunkPlan:
    """``plan`` without reading the arrays ``record``'s shard left to other ranks (their processes send them)."""
    left = set(record.replicas)
    reads = {rank: frozenset(name for name in names if (name, rank) not in left) for rank, names in plan.reads.items()}
    return ChunkPlan(
        {rank: names for rank, names in reads.items() if names or rank == plan.plain_source},
        plan.overlaps,
        plan.plain_source,
    )


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
                if manifest.world_size != target and (targets is not None or any(r.chunks for r in manifest.shards)):
                    raise UsageError(
                        "restore: paths with reshard=True takes no into= and no state of DTensors (restore a part "
                        "of those on the saved world size)"
                    )
                selection = _Selection(paths, remote, in_local, in_remote)
                return self._completed_here(self._load_selected(step, manifest, selection, request, targets, verify))
            if targets is not None and any(state.structure.chunks for state in targets):
                where = _Selection((), remote, in_local, in_remote)
                return self._completed_here(self._load_chunks(step, manifest, where, target, targets, verify))
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
        """Run ``plan``'s reads through the store's chain, refilling the local step (a copy read
        from memory lands after the restore returns: :attr:`PendingRead.refills`)."""
        store, manifest = self._store, plan.manifest
        step, wanted = manifest.step, [read.rank for read in plan.reads]
        with self._step_dir(step) as created:
            fetched = run_parallel(
                lambda read: store.fetch_shard(
                    step,
                    manifest.shard(read.rank),
                    verify=verify,
                    into=targets[read.into].arrays if targets is not None and read.into is not None else None,
                    later=read.tiers,
                ),
                plan.reads,
                self._max_workers,
            )
            refills = self._refills(manifest, remote, wanted, in_local, created, fetched)
        return PendingRead(
            step,
            manifest,
            plan.target,
            read={rank: each.state for rank, each in zip(wanted, fetched, strict=True)},
            sources={rank: each.source for rank, each in zip(wanted, fetched, strict=True)},
            bytes_read=sum(manifest.shard(rank).size_bytes for rank in wanted),
            from_peers=plan.replicas_from_peers,
            later=store.readable(in_remote),
            into={rank: state.arrays for rank, state in zip(wanted, targets or (), strict=False)},
            refills=refills,
        )

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

    def _from_peers(self, manifest: ShardManifest, target: int) -> bool:
        """True if this process's rank gets the arrays its shard left out from the ranks holding
        them (one process per rank on the saved world size, and the checkpoint has some)."""
        return not self._one_process and manifest.world_size == target and any(r.replicas for r in manifest.shards)

    def _completed_here(self, pending: PendingRead) -> Loaded:
        """The result, if no array ``pending`` lacks must come from another process; else ``pending``."""
        return Loaded(pending if pending.from_peers else self.complete(pending, {}), pending.refills)

    def complete(self, pending: PendingRead, received: Mapping[int, Mapping[str, np.ndarray]]) -> RestoreResult:
        """The end of a read: the arrays ``pending``'s shards left to other ranks put back (by holder
        rank, ``received`` from their processes, else read here), then the states resharded, or
        the chunks of the caller's DTensors filled."""
        step, manifest = pending.step, pending.manifest
        if pending.plans:
            read = dict(pending.read)
            for holder, arrays in received.items():
                base = read.get(holder, read[pending.plans[0].plain_source])
                read[holder] = FlatState({**base.arrays, **arrays} if holder in read else dict(arrays), base.structure)
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
        """By holder rank, the arrays the shards in ``read`` left to other ranks: from the
        holder's shard if it is in ``read``, else by a verified partial read of it; and the
        bytes those partial reads took."""
        needed = missing(manifest.shard(rank) for rank in read)
        found: dict[int, Mapping[str, np.ndarray]] = {h: read[h].arrays for h in needed if h in read}
        absent = sorted(holder for holder in needed if holder not in read)
        parts = run_parallel(
            lambda holder: self._store.read_parts(step, manifest.shard(holder), needed[holder], later=later),
            absent,
            self._max_workers,
        )
        found.update((holder, state.arrays) for holder, (state, _source) in zip(absent, parts, strict=True))
        return found, sum(_part_bytes(manifest.shard(h), state) for h, (state, _) in zip(absent, parts, strict=True))

    def _resharded(
        self,
        step: int,
        manifest: ShardManifest,
        target: int,
        read: Mapping[int, FlatState],
        sources: dict[int, Source],
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
        step: int,
        manifest: ShardManifest,
        where: _Selection,
        target: int,
        targets: list[FlatState],
        verify: Verify,
    ) -> PendingRead:
        """Fill states of DTensors in place: each of this process's ranks reads, of the saved
        shards whose chunks overlap its own, just the header and those chunks, each verified
        against the sha256 the manifest records for it, or its xxh3-64 with ``verify="fast"``
        (:meth:`TieredStore.read_parts`). A shard of this process's own ranks on the saved world
        size that its disk does not hold is read whole instead, as a whole restore reads it, and
        refills the disk (:meth:`_read_whole`). With one process per rank on the saved world size,
        the arrays a rank's shard left to other ranks come from their processes instead
        (given to :meth:`complete`). ``where``: the step's remote manifest and tiers (no paths)."""
        in_remote = where.in_remote
        if len(targets) != len(self._ranks):
            raise InvalidStateError(f"into holds {len(targets)} rank states, this process restores {len(self._ranks)}")
        from_peers = self._from_peers(manifest, target)
        plans = [plan_chunks(manifest, state, rank, target) for rank, state in zip(self._ranks, targets, strict=True)]
        if from_peers:
            plans = [_without_replicas(plan, manifest.shard(plan.plain_source)) for plan in plans]
        needed = sorted({rank for plan in plans for rank in plan.reads})
        check_served(manifest, self._holdings(manifest, needed, in_remote), needed)
        names: dict[int, set[str]] = {}
        direct: dict[int, dict[str, np.ndarray]] = {}
        for plan, state in zip(plans, targets, strict=True):
            for saved_rank, wanted in plan.reads.items():
                names.setdefault(saved_rank, set()).update(wanted)
            for name, overlaps in plan.overlaps.items():
                array = state.arrays[name]
                chunked = state.structure.chunks.get(name)
                offsets = chunked.offsets if chunked is not None else (0,) * array.ndim
                for saved_rank, chunk in overlaps:
                    destination = direct_destination(array, offsets, chunk)
                    if destination is not None:
                        direct.setdefault(saved_rank, {})[name] = destination
        ranks = sorted(names)
        whole = [rank for rank in ranks if self._refills_here(manifest, target, rank)]
        parts = [rank for rank in ranks if rank not in whole]
        fetched = dict(
            zip(
                parts,
                run_parallel(
                    lambda rank: self._store.read_parts(
                        step,
                        manifest.shard(rank),
                        names[rank],
                        later=self._store.readable(in_remote),
                        into=direct.get(rank),
                        verify=verify,
                    ),
                    parts,
                    self._max_workers,
                ),
                strict=True,
            )
        )
        refills: tuple[Refill, ...] = ()
        if whole:
            read_whole, refills = self._read_whole(manifest, where, whole, verify)
            fetched.update(read_whole)
        read = {rank: fetched[rank][0] for rank in ranks}
        return PendingRead(
            step,
            manifest,
            target,
            read=read,
            sources={rank: fetched[rank][1] for rank in ranks},
            bytes_read=sum(
                manifest.shard(rank).size_bytes if rank in whole else _part_bytes(manifest.shard(rank), state)
                for rank, state in read.items()
            ),
            from_peers=from_peers,
            later=self._store.readable(in_remote),
            plans=tuple(plans),
            targets=tuple(targets),
            refills=refills,
        )

    def _refills_here(self, manifest: ShardManifest, target: int, rank: int) -> bool:
        """True if ``rank``'s shard belongs on this process's disk (one of its ranks, on the saved
        world size) and the disk does not hold it: a read of it should refill the disk."""
        return (
            rank in self._ranks and manifest.world_size == target and not self._store.held_locally(manifest.step, rank)
        )

    def _read_whole(
        self,
        manifest: ShardManifest,
        where: _Selection,
        ranks: list[int],
        verify: Verify,
    ) -> tuple[dict[int, tuple[FlatState, Source]], tuple[Refill, ...]]:
        """The verified states of the whole shards of ``ranks``, read through the store's chain
        (into new arrays: a shard fills a whole ``into`` only), refilling the local step as a
        whole restore does (a copy read from memory lands after the restore returns)."""
        step, store = manifest.step, self._store
        with self._step_dir(step) as created:
            fetched = run_parallel(
                lambda rank: store.fetch_shard(
                    step, manifest.shard(rank), verify=verify, later=store.readable(where.in_remote)
                ),
                ranks,
                self._max_workers,
            )
            refills = self._refills(manifest, where.remote, ranks, where.in_local, created, fetched)
        return {rank: (each.state, each.source) for rank, each in zip(ranks, fetched, strict=True)}, refills

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
        """A partial restore: each saved rank this process needs reads, of its shard, the header
        and the arrays under the selection's paths (:func:`~tiered_ckpt.format.selection.select`),
        each verified (:meth:`TieredStore.read_parts`), into ``targets``' arrays when given (a
        state of the selection's nesting: every rank's checked against its shard's header before
        any is filled, :class:`InvalidStateError` naming the arrays that differ); a shard whose
        record has no per-array digests (saved before they were recorded) is read whole,
        verified by its sha256, and cut (:func:`~tiered_ckpt.engine.selected_reads.read_selected`). The
        manifest handed on keeps only the replicated arrays and sharded keys inside the
        selection, so that only those are put back and resharded (every rank of one job
        selects the same names: their states share one nesting)."""
        if targets is not None and len(targets) != len(self._ranks):
            raise InvalidStateError(f"into holds {len(targets)} rank states, this process restores {len(self._ranks)}")
        target = request.world_size
        wanted = list(needed_ranks(manifest, request))
        check_served(manifest, self._holdings(manifest, wanted, selection.in_remote), wanted)
        later = self._store.readable(selection.in_remote)
        whole = [rank for rank in wanted if not (manifest.shard(rank).chunks or manifest.shard(rank).array_xxh3_64)]
        with self._step_dir(step) if whole else nullcontext():
            fetched, starts = read_selected(
                self._store, manifest, wanted, whole, selection.paths, targets, verify, later, self._max_workers
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
            target,
            read=read_states,
            sources={rank: source for rank, (_state, source) in zip(wanted, fetched, strict=True)},
            bytes_read=sum(
                manifest.shard(rank).size_bytes if rank in whole else _part_bytes(manifest.shard(rank), state)
                for rank, state in read_states.items()
            ),
            from_peers=self._from_peers(cut, target),
            later=later,
            into={rank: state.arrays for rank, state in zip(wanted, targets or (), strict=False)},
        )
