"""Restoring a step: every process agrees on one, then reads its ranks' shards through the store.

A restore, step by step (DESIGN.md section 7):

1. every process reports its arguments and the steps its local tier has committed (with
   the world size each was saved with); the leader adds the bucket's steps
   (:class:`StepReport`, one collective);
2. the leader picks the step: the one asked for, or the newest that every process
   holds locally or the bucket holds, and every process gets it (a second collective);
   a step some processes hold and none recorded the agreement of (a save cut short
   between the ranks' commits) is skipped, and deleted from the disks holding it;
3. each process checks the world size (resharding only when asked), works out which
   saved ranks it needs, and reads each through :meth:`TieredStore.fetch_shard`
   (local copy, else the bucket, verified, refilling the local step); failures on any
   process fail the restore on every process (a third collective); with one process per
   rank on the saved world size, the replicated arrays a rank's shard left to another
   rank then come from that rank's process (:func:`~tiered_ckpt.replicas.share`, a
   fourth collective);
4. the shards are resharded if asked; local steps newer than the chosen one whose commit
   never reached every rank are deleted (they could never be restored).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tiered_ckpt.dist.coordination import Attempt, Coordinator, Done, gather, leader_decides
from tiered_ckpt.dist.replicas import missing, put_back, share
from tiered_ckpt.dist.reshard import (
    ChunkPlan,
    direct_destination,
    fill_chunks,
    plan_chunks,
    reshard_flat,
    reshard_rank,
    source_ranks,
)
from tiered_ckpt.errors import (
    CheckpointError,
    IncompleteCheckpointError,
    InvalidStateError,
    ManifestError,
    UsageError,
    WorldSizeMismatchError,
    restated,
)
from tiered_ckpt.format.manifest import RemoteManifest, ShardManifest, ShardRecord
from tiered_ckpt.format.state import FlatState, State, flatten_into
from tiered_ckpt.format.validate import check_into, check_world_size
from tiered_ckpt.io.hashing import Verify, check_verify
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.store import Source, TieredStore

__all__ = ["RestoreResult", "Restorer", "StepReport", "same_call", "rank_ranges"]

logger = logging.getLogger("tiered_ckpt")

NOTHING_CHECKED: Attempt[None] = Attempt()  # a caller that ran no checks of its own


@dataclass(frozen=True, repr=False)
class RestoreResult:
    """What :meth:`CheckpointManager.restore` returns.

    ``states[i]`` is the state of rank ``ranks[i]`` as it was saved (nested dicts, lists,
    tuples and scalars with their types), every array as a numpy array: every rank when
    one process holds them all, this process's rank under a multi-process coordinator.
    ``sources`` maps each shard this process read (by the rank that saved it) to the
    tier it was read from: ``"local"`` or ``"remote"``. ``bytes_read`` counts the bytes of
    shards this process read (whole, or the parts it needed), ``seconds`` the time the
    restore took. The repr names the step, ranks, sources and sizes, never the arrays.
    """

    step: int
    states: list[dict[Any, Any]]
    sources: dict[int, Source]
    ranks: tuple[int, ...]
    manifest: ShardManifest
    flat: tuple[FlatState, ...] = ()
    bytes_read: int = 0
    seconds: float = 0.0

    def __repr__(self) -> str:
        arrays = [array for state in self.flat for array in state.arrays.values()]
        return (
            f"RestoreResult(step={self.step}, ranks={rank_ranges(self.ranks)}, sources={_by_tier(self.sources)}, "
            f"arrays={len(arrays)}, nbytes={sum(array.nbytes for array in arrays)}, bytes_read={self.bytes_read})"
        )

    @property
    def state(self) -> dict[Any, Any]:
        """The one rank's state, when this process holds one rank (one process per rank)."""
        return self.states[self._single()]

    def _single(self) -> int:
        if len(self.states) != 1:
            raise UsageError(f"this result holds {len(self.states)} ranks; use .states")
        return 0

    def torch_states(self) -> list[dict[Any, Any]]:
        """``states`` with every leaf that was saved as a torch tensor as a CPU tensor sharing
        the array's memory (leaves saved as numpy stay numpy; every array of a shard written
        before structure documents becomes a tensor). Needs torch."""
        return [state.unflatten(torch=True) for state in self.flat]

    def torch_state(self) -> dict[Any, Any]:
        """:attr:`state` with each leaf saved as a torch tensor as a CPU tensor (see :meth:`torch_states`)."""
        return self.flat[self._single()].unflatten(torch=True)


def rank_ranges(ranks: Collection[int]) -> str:
    """``ranks`` as short runs, for messages: "0-3,6,8-9" ("-" if none)."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs) or "-"


def _ranks_text(ranks: Collection[int]) -> str:
    """``rank 2`` or ``ranks 0-1,3``."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}"


def _by_tier(sources: Mapping[int, Source]) -> str:
    """``sources`` as "{local: 0-2, remote: 3}"."""
    tiers = sorted(set(sources.values()))
    listed = (f"{tier}: {rank_ranges([rank for rank, held in sources.items() if held == tier])}" for tier in tiers)
    return "{" + ", ".join(listed) + "}"


def _part_bytes(record: ShardRecord, state: FlatState) -> int:
    """The bytes a partial read of ``record``'s shard took: its header and the arrays in ``state``."""
    return record.header_bytes + sum(array.nbytes for array in state.arrays.values())


@dataclass(frozen=True)
class _Pending:
    """This process's part of a restore once its own reads are done, before the arrays its
    ranks' shards left to other ranks are put back (:meth:`Restorer._complete` does that).

    ``read``: by saved rank, the verified states read (whole shards, or the parts needed),
    from the tiers in ``sources``, ``bytes_read`` bytes in all. ``from_peers``: the left-out
    arrays come from the processes holding them (else they are read here, from the bucket
    if ``use_remote``). Whole reads: ``into`` are the caller's arrays by saved rank, resharded
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
    use_remote: bool
    into: Mapping[int, Mapping[str, np.ndarray]] = field(default_factory=dict)
    plans: tuple[ChunkPlan, ...] = ()
    targets: tuple[FlatState, ...] = ()


def _without_replicas(plan: ChunkPlan, record: ShardRecord) -> ChunkPlan:
    """``plan`` without reading the arrays ``record``'s shard left to other ranks (their processes send them)."""
    left = set(record.replicas)
    reads = {rank: frozenset(name for name in names if (name, rank) not in left) for rank, names in plan.reads.items()}
    return ChunkPlan({rank: names for rank, names in reads.items() if names or rank == plan.plain_source},
                     plan.overlaps, plan.plain_source)  # fmt: skip


@dataclass(frozen=True)
class StepReport:
    """One process's part of step 1: its arguments (canonical JSON), its committed local
    steps with the world size of each (None: the manifest does not validate), on the
    leader only the bucket's committed steps, and for each local step whether the ranks
    agreed on its commit (None: no record says, e.g. a step saved before such records)."""

    arguments: str
    local: tuple[tuple[int, int | None], ...]
    remote: tuple[int, ...] | None
    agreed: tuple[tuple[int, bool | None], ...] = ()


@dataclass(frozen=True)
class _Choice:
    """The step every process restores (None: none), and the unfinished saves every process deletes."""

    step: int | None
    unfinished: tuple[int, ...] = ()


def same_call(arguments: Sequence[str], call: str) -> None:
    """Raise :class:`InvalidStateError` on every rank if the ranks made ``call`` with different arguments."""
    if len(set(arguments)) > 1:
        shown = {rank: json.loads(text) for rank, text in enumerate(arguments)}
        raise InvalidStateError(f"the ranks called {call} with different arguments: {shown}")


def check_restore_arguments(step: Any, world_size: Any, verify: Any, into: Any) -> None:
    """Raise :class:`UsageError` for arguments :meth:`CheckpointManager.restore` cannot take."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"restore: step must be None or an integer >= 0, got {step!r:.60}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"restore: world_size must be an integer >= 1, got {world_size!r:.60}")
    check_verify(verify)
    if into is not None and (isinstance(into, (str, bytes)) or not isinstance(into, (Mapping, Sequence))):
        raise UsageError(f"restore: into must be a dict of arrays or a list of them, got {type(into).__name__}")


@dataclass(frozen=True)
class _Disks:
    """What each rank's disk holds (index: rank), from the ranks' :class:`StepReport`: per
    committed step the world size it was saved by (None: its manifest is damaged) and whether
    the ranks agreed its commit (None: no record, or a damaged one)."""

    world_sizes: tuple[Mapping[int, int | None], ...]
    agreed: tuple[Mapping[int, bool | None], ...]

    @classmethod
    def of(cls, reports: Sequence[StepReport]) -> _Disks:
        return cls(tuple(dict(r.local) for r in reports), tuple(dict(r.agreed) for r in reports))

    def steps(self) -> set[int]:
        """The steps committed on some rank's disk."""
        return set().union(*self.world_sizes)

    def on_every_disk(self) -> set[int]:
        return set(self.world_sizes[0]).intersection(*self.world_sizes[1:])

    def holders(self, step: int) -> list[int]:
        return [rank for rank, steps in enumerate(self.world_sizes) if step in steps]

    def lacking(self, step: int) -> list[int]:
        return [rank for rank, steps in enumerate(self.world_sizes) if step not in steps]

    def without(self, steps: Collection[int]) -> _Disks:
        """The same disks, ``steps`` left out."""
        return _Disks(
            tuple({s: size for s, size in held.items() if s not in steps} for held in self.world_sizes), self.agreed
        )


class Restorer:
    """Restores for the ranks of ``coordinator`` (see the module doc) through ``store``."""

    def __init__(
        self, store: TieredStore, coordinator: Coordinator, world_size: int, max_workers: int | None = None
    ) -> None:
        self._store = store
        self._coordinator = coordinator
        self._ranks = tuple(coordinator.local_ranks)
        self._world_size = world_size
        self._max_workers = max_workers

    @property
    def _one_process(self) -> bool:
        return len(self._ranks) == self._world_size

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
    ) -> RestoreResult | None:
        """Run a restore. ``checked`` is the caller's own checks, run before: if they failed,
        their error is raised inside the first collective, so every rank raises."""
        started = time.monotonic()
        arguments = json.dumps({"step": step, "world_size": world_size, "reshard": reshard}, sort_keys=True)
        chosen, remote_steps, complete, reports = self._agree_on_step(
            step, arguments, world_size, missing_ok, checked, reshard
        )
        self._drop_unfinished_saves(chosen.unfinished)
        restored = chosen.step
        if restored is None:
            logger.info("restore: no step committed in %s; starting fresh", self._store.where())
            return None
        loaded = Attempt.run(lambda: self._load(restored, restored in remote_steps, world_size, reshard, verify, into))
        gather(self._coordinator, "restore: read", Done, loaded.done)
        result = loaded.value
        if isinstance(result, _Pending):  # the same on every process: they hold one manifest and world size
            pending = result
            finished = Attempt.run(lambda: self._finish_from_peers(pending))
            gather(self._coordinator, "restore: replicas", Done, finished.done)
            result = finished.value
        self._drop_unfinished_commits(restored, complete, reports)
        result = replace(result, seconds=time.monotonic() - started)
        logger.info(
            "restored step %d for rank(s) %s: %d bytes of %d shard(s) read in %.3f s; shards by tier: %s",
            result.step, rank_ranges(result.ranks), result.bytes_read, len(result.sources), result.seconds,
            _by_tier(result.sources),
        )  # fmt: skip
        return result

    def _finish_from_peers(self, pending: _Pending) -> RestoreResult:
        """Step 3 continued, with one process per rank on the saved world size: the arrays
        this rank's shard left to other ranks come from their processes (collective)."""
        (rank,) = self._ranks
        held = pending.read[rank].arrays if rank in pending.read else {}  # sent to the ranks that left them out
        try:
            return self._complete(pending, share(self._coordinator, pending.manifest, held))
        except CheckpointError as exc:
            raise restated(exc, f"restore of step {pending.manifest.step}: {exc}") from exc

    def _agree_on_step(
        self,
        step: int | None,
        arguments: str,
        world_size: int,
        missing_ok: bool,
        checked: Attempt[None],
        reshard: bool = False,
    ) -> tuple[_Choice, set[int], list[int], list[StepReport]]:
        """Steps 1 and 2: the step every process restores (None: none, and ``missing_ok``) with
        the unfinished saves to delete, the bucket's steps, the steps complete in some tier,
        and every process's report."""
        reports = gather(
            self._coordinator, "restore: steps", StepReport, lambda: self._report(arguments, world_size, checked)
        )
        same_call([report.arguments for report in reports], "restore")
        remote_steps = set(reports[0].remote or ())
        disks = _Disks.of(reports)
        complete = sorted(remote_steps.union(disks.on_every_disk()))
        chosen = leader_decides(
            self._coordinator,
            "restore: choice",
            _Choice,
            lambda: self._choose(step, complete, disks, missing_ok, reshard),
        )
        return chosen, remote_steps, complete, reports

    def locate(self, step: int | None, checked: Attempt[None] = NOTHING_CHECKED) -> ShardManifest:
        """The manifest of ``step`` (default: the newest step every process can restore), the
        same on every process (collective); for readers that read parts of shards themselves.
        ``checked`` as for :meth:`restore`."""
        arguments = json.dumps({"step": step, "locate": True}, sort_keys=True)
        # reshard=True: a reader reshards as it reads (an error never tells it to ask for it)
        choice, remote_steps, _complete, _reports = self._agree_on_step(
            step, arguments, self._world_size, False, checked, reshard=True
        )
        chosen = choice.step
        assert chosen is not None  # missing_ok=False raises instead
        in_local = chosen in self._store.local.steps()
        found = Attempt.run(lambda: self._store.manifests(chosen, in_local=in_local, in_remote=chosen in remote_steps))
        gather(self._coordinator, "locate: manifest", Done, found.done)
        manifest, _remote = found.value
        return manifest

    def _report(self, arguments: str, world_size: int, checked: Attempt[None]) -> StepReport:
        checked.done()
        if not self._one_process and world_size != self._world_size:
            raise UsageError(f"with one process per rank the world size is the coordinator's, {self._world_size}")
        local: list[tuple[int, int | None]] = []
        steps = self._store.local.steps()
        for step in steps:
            try:
                local.append((step, self._store.local.manifest(step).world_size))
            except ManifestError:
                local.append((step, None))  # damaged: the restore falls back to the remote manifest or fails
        remote = tuple(self._store.remote_steps()) if self._coordinator.is_leader else None
        agreed = tuple((step, self._store.local.agreement(step)) for step in steps)
        return StepReport(arguments, tuple(local), remote, agreed)

    def _choose(self, step: int | None, complete: list[int], disks: _Disks, missing_ok: bool, reshard: bool) -> _Choice:
        """Leader: the step every rank restores (None: nothing anywhere, and ``missing_ok``),
        passing over the saves cut short between the ranks' commits (:meth:`_unfinished`)."""
        unfinished = self._unfinished(disks.steps() - set(complete), disks)
        for partial in unfinished:
            logger.warning(
                "step %d is committed on the disks of %s only, and no rank recorded that every rank committed it "
                "(a save cut short before every rank committed): it was never restorable; deleting it from "
                "those disks and restoring an older step, if any",
                partial, _ranks_text(disks.holders(partial)),
            )  # fmt: skip
        if step in unfinished:
            raise IncompleteCheckpointError(
                f"{self._store.where()}: step {step} was never committed on every rank (a save cut short before "
                f"every rank committed); committed steps: {complete}"
            )
        return _Choice(self._chosen(step, complete, disks.without(unfinished), missing_ok, reshard), unfinished)

    def _unfinished(self, partial: set[int], disks: _Disks) -> tuple[int, ...]:
        """Of the ``partial`` steps (committed on some ranks' disks, not on all and not in the
        bucket), those saved by this job's world size that every rank holding one recorded as
        not agreed: the save was cut short before every rank committed, so it never existed
        on every rank. A step some rank marked agreed was committed everywhere (a disk lost it
        since); one with no record (saved by an older version) cannot be told apart: both
        stay, and refuse the restore as before."""
        found = []
        for step in sorted(partial):
            holders = disks.holders(step)
            ours = (disks.world_sizes[rank].get(step) == self._world_size for rank in holders)
            if all(ours) and all(disks.agreed[rank].get(step) is False for rank in holders):
                found.append(step)
        return tuple(found)

    def _chosen(
        self, step: int | None, complete: list[int], disks: _Disks, missing_ok: bool, reshard: bool
    ) -> int | None:
        """:meth:`_choose` once the unfinished saves are left out of ``disks``."""
        held = disks.steps()
        if missing_ok and step is None and not complete and not held:
            return None
        unavailable = not complete if step is None else step not in complete
        if unavailable:
            wanted = max(held, default=None) if step is None else step
            if wanted in held:
                raise self._held_by_some(wanted, disks, reshard)
            if step is None:
                raise IncompleteCheckpointError(f"{self._store.where()}: no committed checkpoint to restore")
            raise IncompleteCheckpointError(
                f"{self._store.where()}: step {step} is not committed; committed steps: {complete}"
            )
        for partial in sorted(held - set(complete)):
            logger.warning(
                "step %d is committed on ranks %s only and not in the bucket (a save cut short between "
                "ranks' commits, or a node's disk replaced): it cannot be restored",
                partial,
                disks.holders(partial),
            )
        return complete[-1] if step is None else step

    def _held_by_some(self, step: int, disks: _Disks, reshard: bool) -> CheckpointError:
        """Leader, one process per rank: the error for ``step``, committed on some ranks' disks
        only and in no bucket. It says what is true: the step exists, saved by so many ranks;
        the ranks without a copy cannot read other nodes' disks; what would restore it."""
        holders, lacking = disks.holders(step), disks.lacking(step)
        saved_by = next((known[step] for known in disks.world_sizes if known.get(step) is not None), None)
        remote = self._store.remote
        bucket = "no bucket is configured (remote_url)" if remote is None else f"the bucket {remote.url} lacks it"
        problem = (
            f"{self._store.local.root}: step {step}, saved by {saved_by or 'an unknown number of'} ranks, "
            f"is committed on the disks of {_ranks_text(holders)} only and {bucket}: {_ranks_text(lacking)} of "
            f"this job's {self._world_size} {'holds' if len(lacking) == 1 else 'hold'} no copy, and a rank can read "
            "the shards on other nodes' disks only through a bucket"
        )
        if saved_by is None or saved_by == self._world_size:
            if any(disks.agreed[rank].get(step) for rank in holders):
                return IncompleteCheckpointError(f"{problem} (every rank committed it: a node's disk was replaced)")
            return IncompleteCheckpointError(
                f"{problem} (a save cut short between ranks' commits, or a node's disk replaced)"
            )
        fix = f"to restore it on {self._world_size} ranks, give the job a bucket holding step {step} (remote_url)"
        if reshard:
            return IncompleteCheckpointError(f"{problem}; {fix}")
        return WorldSizeMismatchError(f"{problem}; {fix} and restore with reshard=True (--reshard)")

    def _needed(self, manifest: ShardManifest, target: int) -> list[int]:
        """The saved ranks whose shards this process reads."""
        if manifest.world_size == target:
            return list(self._ranks)
        new_ranks = range(target) if self._one_process else self._ranks
        return sorted({old for rank in new_ranks for old in source_ranks(manifest, target, rank)})

    def _load(
        self,
        step: int,
        in_remote: bool,
        target: int,
        reshard: bool,
        verify: Verify,
        into: Sequence[State] | State | None,
    ) -> RestoreResult | _Pending:
        """This process's part of a restore: its ranks' verified states (resharded when asked),
        or, when their replicated arrays must come from other processes, all but those."""
        store = self._store
        in_local = step in store.local.steps()
        into_list = [into] if isinstance(into, Mapping) else into
        try:
            targets = (
                [flatten_into(state, f"into[{index}]") for index, state in enumerate(into_list)]
                if into_list is not None
                else None
            )
            manifest, remote = store.manifests(step, in_local=in_local, in_remote=in_remote)
            if not reshard:
                check_world_size(manifest, target, str(store.local.step_dir(step)))
            if targets is not None and any(state.structure.chunks for state in targets):
                return self._completed_here(self._load_chunks(step, manifest, remote, target, targets, verify))
            from_peers = self._from_peers(manifest, target)
            if reshard and into_list is not None:
                raise UsageError("into cannot be combined with reshard=True (except into a state of DTensors)")
            if self._one_process:
                check_into(into_list, manifest)
            elif into_list is not None and len(into_list) != len(self._ranks):
                raise InvalidStateError(f"into holds {len(into_list)} rank states, this process restores one")
            wanted = self._needed(manifest, target)
            if remote is None and not self._one_process:
                self._check_on_this_node(manifest, wanted)
            with self._step_dir(step):
                fetched = run_parallel(
                    lambda index: store.fetch_shard(
                        step,
                        manifest.shard(wanted[index]),
                        verify=verify,
                        into=targets[index].arrays if targets is not None else None,
                        use_remote=remote is not None,
                    ),
                    range(len(wanted)),
                    self._max_workers,
                )
                store.record_refill(manifest, remote, wanted, was_committed=in_local)
            pending = _Pending(
                step,
                manifest,
                target,
                read={rank: state for rank, (state, _source) in zip(wanted, fetched, strict=True)},
                sources={rank: source for rank, (_state, source) in zip(wanted, fetched, strict=True)},
                bytes_read=sum(manifest.shard(rank).size_bytes for rank in wanted),
                from_peers=from_peers,
                use_remote=remote is not None,
                into={rank: state.arrays for rank, state in zip(wanted, targets or (), strict=False)},
            )
            return self._completed_here(pending)
        except CheckpointError as exc:
            raise restated(exc, f"restore of step {step}: {exc}") from exc

    @contextmanager
    def _step_dir(self, step: int) -> Iterator[None]:
        """The local directory of ``step`` while shards are read into it: created if needed, and
        removed again if this restore created it and fails before committing it."""
        created = not self._store.local.step_dir(step).is_dir()
        self._store.local.new_step_dir(step)
        try:
            yield
        except BaseException:
            if created:
                self._store.local.discard_uncommitted(step)
            raise

    def _from_peers(self, manifest: ShardManifest, target: int) -> bool:
        """True if this process's rank gets the arrays its shard left out from the ranks holding
        them (one process per rank on the saved world size, and the checkpoint has some)."""
        return not self._one_process and manifest.world_size == target and any(r.replicas for r in manifest.shards)

    def _completed_here(self, pending: _Pending) -> RestoreResult | _Pending:
        """The result, if no array ``pending`` lacks must come from another process; else ``pending``."""
        return pending if pending.from_peers else self._complete(pending, {})

    def _complete(self, pending: _Pending, received: Mapping[int, Mapping[str, np.ndarray]]) -> RestoreResult:
        """The end of step 3: the arrays ``pending``'s shards left to other ranks put back (by holder
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
            received, parts_bytes = self._replicas_read(step, manifest, pending.read, pending.use_remote)
        for rank, state in pending.read.items():
            into = pending.into.get(rank)
            put_back(state, manifest.shard(rank), manifest, received, into, self._store.local.step_dir(step))
        result = self._resharded(step, manifest, pending.target, pending.read, dict(pending.sources))
        return replace(result, bytes_read=pending.bytes_read + parts_bytes)

    def _replicas_read(
        self, step: int, manifest: ShardManifest, read: Mapping[int, FlatState], use_remote: bool
    ) -> tuple[dict[int, Mapping[str, np.ndarray]], int]:
        """By holder rank, the arrays the shards in ``read`` left to other ranks: from the
        holder's shard if it is in ``read``, else by a verified partial read of it; and the
        bytes those partial reads took."""
        needed = missing(manifest.shard(rank) for rank in read)
        found: dict[int, Mapping[str, np.ndarray]] = {h: read[h].arrays for h in needed if h in read}
        absent = sorted(holder for holder in needed if holder not in read)
        parts = run_parallel(
            lambda holder: self._store.read_parts(step, manifest.shard(holder), needed[holder], use_remote=use_remote),
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
        remote: RemoteManifest | None,
        target: int,
        targets: list[FlatState],
        verify: Verify,
    ) -> _Pending:
        """Fill states of DTensors in place: each of this process's ranks reads, of the saved
        shards whose chunks overlap its own, just the header and those chunks, each verified
        against the sha256 the manifest records for it, or its xxh3-64 with ``verify="fast"``
        (:meth:`TieredStore.read_parts`). With one process per rank on the saved world size,
        the arrays a rank's shard left to other ranks come from their processes instead
        (see :meth:`_finish_from_peers`)."""
        if len(targets) != len(self._ranks):
            raise InvalidStateError(f"into holds {len(targets)} rank states, this process restores {len(self._ranks)}")
        from_peers = self._from_peers(manifest, target)
        plans = [plan_chunks(manifest, state, rank, target) for rank, state in zip(self._ranks, targets, strict=True)]
        if from_peers:
            plans = [_without_replicas(plan, manifest.shard(plan.plain_source)) for plan in plans]
        if remote is None and not self._one_process:
            self._check_on_this_node(manifest, sorted({rank for plan in plans for rank in plan.reads}))
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
        fetched = run_parallel(
            lambda rank: self._store.read_parts(
                step,
                manifest.shard(rank),
                names[rank],
                use_remote=remote is not None,
                into=direct.get(rank),
                verify=verify,
            ),  # fmt: skip
            ranks,
            self._max_workers,
        )
        read = {rank: state for rank, (state, _source) in zip(ranks, fetched, strict=True)}
        return _Pending(
            step,
            manifest,
            target,
            read=read,
            sources={rank: source for rank, (_state, source) in zip(ranks, fetched, strict=True)},
            bytes_read=sum(_part_bytes(manifest.shard(rank), state) for rank, state in read.items()),
            from_peers=from_peers,
            use_remote=remote is not None,
            plans=tuple(plans),
            targets=tuple(targets),
        )

    def _check_on_this_node(self, manifest: ShardManifest, ranks: list[int]) -> None:
        """Without a bucket, a rank can read only the shards on its own disk: say so if some are not."""
        local = self._store.local
        absent = [rank for rank in ranks if not local.shard_path(manifest.step, manifest.shard(rank)).is_file()]
        if absent:
            raise IncompleteCheckpointError(
                f"{local.step_dir(manifest.step)}: step {manifest.step} was saved by {manifest.world_size} ranks; "
                f"the shards of ranks {absent} are not on this node's disk and no remote tier holds the step; "
                "reading another node's shards (to reshard, or after ranks moved between nodes) needs a bucket "
                "(remote_url) holding it"
            )

    def _drop_unfinished_saves(self, steps: Collection[int]) -> None:
        """Delete this process's copies of ``steps``, saves cut short before every rank committed
        (:meth:`_unfinished`): never restorable, never in the bucket, and each would refuse
        the save of its step number again."""
        held = set(self._store.local.steps())
        for step in steps:
            if step in held:
                logger.warning(
                    "deleting step %d from %s: the save was cut short before every rank committed it",
                    step, self._store.local.root,
                )  # fmt: skip
                self._store.local.delete_step(step)

    def _drop_unfinished_commits(self, restored: int, complete: list[int], reports: list[StepReport]) -> None:
        """Delete local steps newer than ``restored`` whose commit did not reach every rank.

        Such a step can never be restored (a rank lacks it and so does the bucket), and
        it would refuse the save of its step number again. Steps of another world size
        are kept: the ranks that would complete them are not in this job.
        """
        world_sizes = _Disks.of(reports).world_sizes
        for step in self._store.local.steps():
            saved_with = {known.get(step, self._world_size) for known in world_sizes}
            if step > restored and step not in complete and saved_with == {self._world_size}:
                logger.warning(
                    "deleting step %d from %s: its commit did not reach every rank", step, self._store.local.root
                )
                self._store.local.delete_step(step)
