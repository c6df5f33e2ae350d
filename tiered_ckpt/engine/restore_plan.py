"""A restore's plan: which saved shards this process reads, from which tiers, into what.

The plan is a pure function of the step's manifest, what each tier holds of it and the
request (this process's ranks, the world size restored on, ``reshard``, the caller's
arrays): no I/O, so every decision a restore makes before it reads is tested alone
(``tests/engine/test_restore_plan.py``). :class:`~tiered_ckpt.engine.shard_reads.ShardReader`
gathers the inputs (the manifest, :class:`StepHoldings`) and executes the plan through the
store.

1. the world size is checked (resharding only when asked): a step this process could not
   read without a bucket is refused saying so, rather than only that its world size differs;
2. the saved ranks this process needs are worked out (its own on the saved world size, else
   every saved rank whose slice overlaps one of its new ranks);
3. each needed shard must have a tier that may hold it (:class:`IncompleteCheckpointError`
   naming the ranks and the local step directory otherwise);
4. each read names the later tiers to try after the first (the local disk, always read
   first), in the store's order, what it reads of the shard (the whole shard; the chunks a
   state of DTensors needs; the arrays under a partial restore's paths) and the caller's
   state it fills, if any.

Every request makes one :class:`RestorePlan`: a whole restore (:func:`plan_restore`), a
restore into states of DTensors (:func:`chunk_plans`, then :func:`plan_chunk_restore`) and a
partial restore (:func:`plan_selected_restore`). The arrays its shards left to other ranks
that no process sends are planned once the first reads said which are wanted
(:func:`plan_replica_reads`); a reader of named arrays (export, the DCP reader) plans its
reads with :func:`plan_parts`. One executor runs every plan
(:mod:`~tiered_ckpt.engine.read_execution`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tiered_ckpt.dist.reshard import ChunkPlan, plan_chunks, source_ranks
from tiered_ckpt.errors import IncompleteCheckpointError, InvalidStateError, UsageError, WorldSizeMismatchError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.validate import check_world_size

__all__ = [
    "Selection",
    "RestorePlan",
    "RestoreRequest",
    "ShardRead",
    "StepHoldings",
    "TierHolding",
    "check_served",
    "check_world",
    "chunk_plans",
    "needed_ranks",
    "plan_chunk_restore",
    "plan_parts",
    "plan_replica_reads",
    "plan_restore",
    "plan_selected_restore",
    "replicas_from_peers",
]


Selection = Sequence[str | tuple[str | int, ...]]
"""A partial restore's paths (checked: :func:`~tiered_ckpt.format.selection.check_paths`)."""


@dataclass(frozen=True)
class TierHolding:
    """What one tier holds of a step, as this process sees it before reading.

    ``ranks``: the saved ranks whose shards it holds for this process (None: not known before
    reading, as a partner's memory: any may be there). ``unlisted``: its listing failed; its
    copies are still tried, but none is counted on."""

    name: str
    ranks: frozenset[int] | None
    unlisted: bool = False

    def may_hold(self, rank: int) -> bool:
        """True if a read of ``rank``'s shard tries this tier."""
        return self.unlisted or self.ranks is None or rank in self.ranks

    def counts_on(self, rank: int) -> bool:
        """True if ``rank``'s shard can be counted on to be in this tier (or may be: not known)."""
        return not self.unlisted and (self.ranks is None or rank in self.ranks)


@dataclass(frozen=True)
class StepHoldings:
    """What the tiers hold of one step: ``tiers[0]`` this node's disk, then the later tiers a
    read may try, nearest first. ``where``: the local step directory, for messages."""

    where: str
    tiers: tuple[TierHolding, ...]

    def later_for(self, rank: int) -> tuple[str, ...]:
        """The later tiers a read of ``rank``'s shard tries, by name, nearest first."""
        return tuple(tier.name for tier in self.tiers[1:] if tier.may_hold(rank))


@dataclass(frozen=True)
class RestoreRequest:
    """What a process asks of a restore: its ``ranks`` of the running job (``one_process``: it
    runs every rank of the job), restored on ``world_size`` ranks, ``reshard`` if the saved
    world size may differ, and ``into``: how many rank states of its own arrays it gave to
    fill (None: none)."""

    ranks: tuple[int, ...]
    world_size: int
    one_process: bool
    reshard: bool = False
    into: int | None = None


@dataclass(frozen=True)
class ShardRead:
    """One read of saved ``rank``'s shard, trying this node's disk, then the later ``tiers`` by
    name, in order: whole, verified by its sha256 (refilling this node's disk from a later
    tier); or only its header and some arrays, each verified: those in ``names``, or, if
    ``selected``, those under the plan's paths. ``into``: the caller's state it fills (an
    index of the caller's list; None: new arrays, or the places the executor finds for
    ``names``)."""

    rank: int
    tiers: tuple[str, ...]
    into: int | None = None
    names: frozenset[str] | None = None
    selected: bool = False

    @property
    def whole(self) -> bool:
        """True if the whole shard is read."""
        return self.names is None and not self.selected


@dataclass(frozen=True)
class RestorePlan:
    """A restore of ``manifest``'s step by this process: the ``reads``, one per saved rank
    needed, in rank order; the result's ranks (``ranks``, of ``target`` ranks in all);
    ``replicas_from_peers``: the arrays its shards left to other ranks come from the processes
    holding them (one process per rank on the saved world size), else they are read here;
    ``paths``: the parts of the states a partial restore reads (None: the whole states);
    ``chunks``: for a restore into states of DTensors, per rank of this process, what fills
    its state (without the arrays other processes send when ``replicas_from_peers``)."""

    manifest: ShardManifest
    target: int
    ranks: tuple[int, ...]
    reads: tuple[ShardRead, ...]
    replicas_from_peers: bool
    paths: Selection | None = None
    chunks: tuple[ChunkPlan, ...] = ()

    @property
    def resharded(self) -> bool:
        """True if the states read are resharded for another world size."""
        return self.manifest.world_size != self.target


def needed_ranks(manifest: ShardManifest, request: RestoreRequest) -> tuple[int, ...]:
    """The saved ranks whose shards ``request``'s process reads, in order: its own on the saved
    world size, else every saved rank whose slice overlaps one of its new ranks."""
    target = request.world_size
    if manifest.world_size == target:
        return request.ranks
    new_ranks = range(target) if request.one_process else request.ranks
    return tuple(sorted({old for rank in new_ranks for old in source_ranks(manifest, target, rank)}))


def _not_served(manifest: ShardManifest, holdings: StepHoldings, ranks: Sequence[int]) -> str | None:
    """What keeps this process from reading ``ranks``' shards (None: nothing): the ranks no tier
    can be counted on for."""
    absent = [rank for rank in ranks if not any(tier.counts_on(rank) for tier in holdings.tiers)]
    if not absent:
        return None
    step = manifest.step
    return (
        f"{holdings.where}: step {step} was saved by {manifest.world_size} ranks; "
        f"the shards of ranks {absent} are not on this node's disk and no remote tier holds the step; "
        "reading another node's shards (to reshard, or after ranks moved between nodes) needs a bucket "
        "(remote.url) holding it"
    )


def check_served(manifest: ShardManifest, holdings: StepHoldings, ranks: Sequence[int]) -> None:
    """Raise :class:`IncompleteCheckpointError` naming the local step directory and the ranks
    unless some tier can be counted on for each of ``ranks``' shards."""
    problem = _not_served(manifest, holdings, ranks)
    if problem is not None:
        raise IncompleteCheckpointError(problem)


def check_world(manifest: ShardManifest, request: RestoreRequest, holdings: StepHoldings) -> None:
    """Raise :class:`WorldSizeMismatchError` if ``manifest`` was saved by another world size and
    ``request`` does not reshard, saying what would restore it when the tiers could not serve
    the reshard either."""
    if request.reshard or manifest.world_size == request.world_size:
        return
    target = request.world_size
    problem = _not_served(manifest, holdings, needed_ranks(manifest, request))
    if problem is not None:
        raise WorldSizeMismatchError(
            f"{problem}; to restore it on {target} rank{'' if target == 1 else 's'}, give the job a bucket "
            f"holding step {manifest.step} (remote.url) and restore with reshard=True (--reshard)"
        )
    check_world_size(manifest, target, holdings.where)


def plan_restore(manifest: ShardManifest, request: RestoreRequest, holdings: StepHoldings) -> RestorePlan:
    """The plan of a whole restore of ``manifest``'s step for ``request`` (see the module doc).

    Raises :class:`WorldSizeMismatchError` (another world size, no ``reshard``),
    :class:`UsageError` (``into`` with ``reshard``), :class:`InvalidStateError` (``into``
    holding another number of rank states than are restored) and
    :class:`IncompleteCheckpointError` (a needed shard no tier can be counted on for)."""
    check_world(manifest, request, holdings)
    target = request.world_size
    resharded = manifest.world_size != target
    if request.reshard and request.into is not None:
        raise UsageError("into cannot be combined with reshard=True (except into a state of DTensors)")
    given = request.into
    if given is not None and request.one_process and given != manifest.world_size:
        raise InvalidStateError(f"into holds {given} rank states, the checkpoint has {manifest.world_size} ranks")
    if given is not None and not request.one_process and given != len(request.ranks):
        raise InvalidStateError(f"into holds {given} rank states, this process restores one")
    wanted = needed_ranks(manifest, request)
    check_served(manifest, holdings, wanted)
    reads = tuple(
        ShardRead(
            rank,
            holdings.later_for(rank),
            index if request.into is not None else None,
        )
        for index, rank in enumerate(wanted)
    )
    ranks = tuple(range(target)) if resharded and request.one_process else request.ranks
    return RestorePlan(manifest, target, ranks, reads, replicas_from_peers(manifest, request))


def _without_replicas(plan: ChunkPlan, record: ShardRecord) -> ChunkPlan:
    """``plan`` without reading the arrays ``record``'s shard left to other ranks (their processes send them)."""
    left = set(record.replicas)
    reads = {rank: frozenset(name for name in names if (name, rank) not in left) for rank, names in plan.reads.items()}
    return ChunkPlan(
        {rank: names for rank, names in reads.items() if names or rank == plan.plain_source},
        plan.overlaps,
        plan.plain_source,
        plan.taken,
    )


def plan_selected_restore(
    manifest: ShardManifest, request: RestoreRequest, holdings: StepHoldings, paths: Selection
) -> RestorePlan:
    """The plan of a partial restore of the parts of the states under ``paths``: of each saved
    shard needed (as for a whole restore), its header and the arrays under ``paths``, or, for
    a record without per-array digests (saved before they were recorded), the whole shard,
    to be cut. The caller's states (``request.into``) are of the selection's nesting.

    Raises :class:`WorldSizeMismatchError` as :func:`check_world` does, :class:`UsageError`
    for a reshard into the caller's arrays or of states of DTensors,
    :class:`InvalidStateError` (``into`` not one state per rank of this process) and
    :class:`IncompleteCheckpointError` (a needed shard no tier can be counted on for)."""
    check_world(manifest, request, holdings)
    target = request.world_size
    resharded = manifest.world_size != target
    if resharded and (request.into is not None or any(record.chunks for record in manifest.shards)):
        raise UsageError(
            "restore: paths with reshard=True takes no into= and no state of DTensors (restore a part "
            "of those on the saved world size)"
        )
    if request.into is not None and request.into != len(request.ranks):
        raise InvalidStateError(f"into holds {request.into} rank states, this process restores {len(request.ranks)}")
    wanted = needed_ranks(manifest, request)
    check_served(manifest, holdings, wanted)
    reads = tuple(
        ShardRead(
            rank,
            holdings.later_for(rank),
            index if request.into is not None else None,
            selected=bool(manifest.shard(rank).chunks or manifest.shard(rank).array_xxh3_64),
        )
        for index, rank in enumerate(wanted)
    )
    ranks = tuple(range(target)) if resharded and request.one_process else request.ranks
    return RestorePlan(manifest, target, ranks, reads, replicas_from_peers(manifest, request), tuple(paths))


def replicas_from_peers(manifest: ShardManifest, request: RestoreRequest) -> bool:
    """True if the arrays ``request``'s shards left to other ranks come from the processes
    holding them (one process per rank on the saved world size, and the checkpoint has some)."""
    same_size = manifest.world_size == request.world_size
    return not request.one_process and same_size and any(record.replicas for record in manifest.shards)


def chunk_plans(
    manifest: ShardManifest, request: RestoreRequest, targets: Sequence[FlatState]
) -> tuple[ChunkPlan, ...]:
    """Per rank of ``request``, what fills its state of DTensors in ``targets`` (without the
    arrays other processes send, :func:`replicas_from_peers`). Raises
    :class:`InvalidStateError` unless ``targets`` holds one state per rank of ``request``."""
    if len(targets) != len(request.ranks):
        raise InvalidStateError(f"into holds {len(targets)} rank states, this process restores {len(request.ranks)}")
    target = request.world_size
    plans = [plan_chunks(manifest, state, rank, target) for rank, state in zip(request.ranks, targets, strict=True)]
    if replicas_from_peers(manifest, request):
        plans = [_without_replicas(plan, manifest.shard(plan.plain_source)) for plan in plans]
    return tuple(plans)


def plan_chunk_restore(
    manifest: ShardManifest,
    request: RestoreRequest,
    holdings: StepHoldings,
    plans: Sequence[ChunkPlan],
    held_here: frozenset[int],
) -> RestorePlan:
    """The plan of a restore into this process's states of DTensors, filled as ``plans``
    (:func:`chunk_plans`) say: of each saved shard whose chunks overlap them, only the header
    and those chunks, except that a shard of this process's own ranks on the saved world size
    that this node's disk does not hold (not in ``held_here``) is read whole, as a whole
    restore reads it, and refills the disk.

    Raises :class:`IncompleteCheckpointError` (a needed shard no tier can be counted on for)."""
    same_size = manifest.world_size == request.world_size
    names: dict[int, set[str]] = {}
    for plan in plans:
        for saved_rank, wanted in plan.reads.items():
            names.setdefault(saved_rank, set()).update(wanted)
    needed = sorted(names)
    check_served(manifest, holdings, needed)
    reads = []
    for rank in needed:
        whole = same_size and rank in request.ranks and rank not in held_here
        tiers = holdings.later_for(rank)
        reads.append(ShardRead(rank, tiers, None, None if whole else frozenset(names[rank])))
    from_peers = replicas_from_peers(manifest, request)
    target = request.world_size
    return RestorePlan(manifest, target, request.ranks, tuple(reads), from_peers, chunks=tuple(plans))


def plan_replica_reads(manifest: ShardManifest, read: Collection[int], holdings: StepHoldings) -> tuple[ShardRead, ...]:
    """The reads of the arrays the shards of the saved ranks in ``read`` left to other ranks
    (``manifest``'s replicas) whose writers' shards are not in ``read``: of each such writer's
    shard, its header and those arrays, trying the tiers that may hold it, in writer order.
    The writers' shards need no tier counted on: a read no tier serves fails naming them."""
    needed: dict[int, set[str]] = {}
    for rank in read:
        for name, writer in manifest.shard(rank).replicas:
            needed.setdefault(writer, set()).add(name)
    return tuple(
        ShardRead(writer, holdings.later_for(writer), names=frozenset(needed[writer]))
        for writer in sorted(needed)
        if writer not in read
    )


def plan_parts(holdings: StepHoldings, wanted: Mapping[int, Collection[str]]) -> tuple[ShardRead, ...]:
    """The reads of the named arrays ``wanted`` of each saved rank's shard (its header and
    those arrays, each verified), in rank order, trying this node's disk, then the tiers that
    may hold it (a read no tier serves fails naming the shard)."""
    return tuple(ShardRead(rank, holdings.later_for(rank), names=frozenset(wanted[rank])) for rank in sorted(wanted))
