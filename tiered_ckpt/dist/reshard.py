"""N -> M resharding: flat ZeRO-style slices, and the chunks of DTensors.

The partition rule, shared with saving: a flat vector of ``total`` elements over
``world_size`` ranks gives rank ``r`` a contiguous slice of ``total // world_size``
elements, plus one more for the first ``total % world_size`` ranks (see
:func:`partition_sizes`). Resharding concatenates the sharded arrays of the old ranks
in offset order and cuts the result by that rule; replicated arrays, scalars and the
state's structure must be identical on every old rank and are copied to every new one.

A DTensor leaf is saved as its rank's chunk, a box of the global tensor recorded in the
manifest (:class:`~tiered_ckpt.format.manifest.ChunkRecord`). A new rank fills each of its own
chunks from the saved chunks that overlap it (:func:`plan_chunks`, :func:`fill_chunks`),
whatever the old and new placements and world sizes; its other leaves come from the
same rank of the checkpoint, or rank 0's when the world size changed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiered_ckpt.errors import InvalidStateError, ReshardError, UsageError
from tiered_ckpt.format.manifest import ChunkRecord, ShardManifest
from tiered_ckpt.format.differences import into_difference
from tiered_ckpt.format.state import FlatState, State, flatten
from tiered_ckpt.format.structure import Chunk, Structure, path_text

__all__ = [
    "check_data_parallel",
    "partition_sizes",
    "reshard",
    "reshard_flat",
    "reshard_rank",
    "source_ranks",
    "ChunkPlan",
    "plan_chunks",
    "copy_overlap",
    "direct_destination",
    "fill_chunks",
]


def partition_sizes(total: int, world_size: int) -> list[int]:
    """Slice lengths of a flat vector of ``total`` elements over ``world_size`` ranks."""
    if world_size < 1 or total < 0:
        raise UsageError(f"cannot partition {total} elements over {world_size} ranks")
    base, extra = divmod(total, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def source_ranks(manifest: ShardManifest, world_size: int, rank: int) -> list[int]:
    """The ranks of ``manifest``'s checkpoint whose shards new rank ``rank`` of ``world_size`` needs."""
    sizes = partition_sizes(manifest.total_numel, world_size)
    start = sum(sizes[:rank])
    end = start + sizes[rank]
    overlapping = [
        record.rank
        for record in manifest.shards
        if record.param_shard_offset < end and record.param_shard_offset + record.param_shard_numel > start
    ]
    return overlapping or [0]  # an empty slice still takes the replicated arrays from one shard


def _check_same_state(states: Mapping[int, FlatState]) -> Structure:
    """The structure every rank in ``states`` shares; :class:`ReshardError` naming the path otherwise."""
    ranks = sorted(states)
    first = states[ranks[0]].structure
    for rank in ranks[1:]:
        other = states[rank].structure
        differing = sorted(set(first.kinds) ^ set(other.kinds))
        if differing:
            raise ReshardError(f"rank {rank} holds different arrays than rank {ranks[0]}: {differing}")
        where = first.difference(other)
        if where is not None:
            raise ReshardError(
                f"{where} differs between rank {ranks[0]} and rank {rank}: scalars and the state's "
                "structure must be the same on every rank to reshard"
            )
    return first


def _where(structure: Structure, name: str) -> str:
    return path_text(structure.paths[name])


def _replicated(states: Mapping[int, FlatState], name: str) -> np.ndarray:
    ranks = sorted(states)
    first = states[ranks[0]].arrays[name]
    for rank in ranks[1:]:
        other = states[rank].arrays[name]
        if other.dtype != first.dtype or other.shape != first.shape or other.tobytes() != first.tobytes():
            where = _where(states[rank].structure, name)
            raise ReshardError(f"replicated {where} differs between rank {ranks[0]} and rank {rank}")
    return first


def _flat(states: Mapping[int, FlatState], name: str, manifest: ShardManifest) -> np.ndarray:
    ranks = sorted(states)
    dtype = states[ranks[0]].arrays[name].dtype
    for rank in ranks:
        array, numel = states[rank].arrays[name], manifest.shard(rank).param_shard_numel
        if array.ndim != 1 or len(array) != numel or array.dtype != dtype:
            raise ReshardError(
                f"sharded {_where(states[rank].structure, name)} on rank {rank} is {array.dtype} {array.shape}, "
                f"expected {dtype} ({numel},) from param_shard_numel"
            )
    return np.concatenate([states[rank].arrays[name] for rank in ranks])


def check_data_parallel(manifest: ShardManifest) -> None:
    """Raise :class:`ReshardError` if ``manifest`` is a data-parallel step (saved with
    ``replicated=True``: every shard records whole arrays only) in which the ranks each stored
    an array of their own in another dtype or shape: slices of a flat vector saved as data
    parallel, or ragged values of each rank's own, which cannot be re-cut for another world
    size. Values of one dtype and shape that differ (a seed) are each rank's own: a reshard
    gives every new rank rank 0's, as for the plain arrays of a state of DTensors."""
    records = manifest.shards
    if not all(record.chunks for record in records):
        return
    if any(chunk.sizes != chunk.global_shape or any(chunk.offsets) for r in records for chunk in r.chunks):
        return  # a state of DTensors
    seen: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    for record in records:
        for chunk in record.chunks:
            rank, dtype, shape = seen.setdefault(chunk.name, (record.rank, chunk.dtype, chunk.global_shape))
            if (dtype, shape) != (chunk.dtype, chunk.global_shape):
                raise ReshardError(
                    f"{chunk.name!r:.120} is {dtype} {shape} on rank {rank} and {chunk.dtype} {chunk.global_shape} on "
                    f"rank {record.rank} of this data-parallel step: a value of each rank's own cannot be re-cut for "
                    f"another world size (restore it on {manifest.world_size} ranks; slices of a flat vector are "
                    "saved with their sharded_keys, not as data parallel)"
                )


def reshard_rank(states: Mapping[int, FlatState], manifest: ShardManifest, world_size: int, rank: int) -> FlatState:
    """Return new rank ``rank``'s state when ``manifest``'s checkpoint is re-cut for ``world_size`` ranks.

    ``states`` maps old ranks to their verified states and must hold at least
    :func:`source_ranks`. Raises :class:`ReshardError` naming the path if those ranks
    disagree on their structure, a scalar or a replicated array, or a sharded array
    does not match its recorded slice.
    """
    needed = source_ranks(manifest, world_size, rank)
    missing_ranks = sorted(set(needed) - set(states))
    if missing_ranks:
        raise ReshardError(f"new rank {rank} needs the shards of ranks {missing_ranks}")
    sources = {old: states[old] for old in needed}
    structure = _check_same_state(sources)
    sharded = set(manifest.sharded_keys)
    missing = sorted(sharded - set(structure.kinds))
    if missing:
        raise ReshardError(f"sharded keys {missing} are not in the checkpoint's arrays")
    sizes = partition_sizes(manifest.total_numel, world_size)
    start = sum(sizes[:rank]) - manifest.shard(needed[0]).param_shard_offset
    arrays = {
        name: _flat(sources, name, manifest)[start : start + sizes[rank]].copy()
        if name in sharded
        else _replicated(sources, name).copy()
        for name in structure.kinds
    }
    return FlatState(arrays, structure)


def reshard_flat(states: Sequence[FlatState], manifest: ShardManifest, world_size: int) -> list[FlatState]:
    """Return the states of ``manifest``'s checkpoint re-cut for ``world_size`` ranks.

    ``states`` are the verified states of every rank of ``manifest``, in rank order.
    Every old rank is checked, not only each new rank's sources.
    """
    if len(states) != manifest.world_size:
        raise ReshardError(f"got {len(states)} rank states for a checkpoint of {manifest.world_size} ranks")
    by_rank = dict(enumerate(states))
    structure = _check_same_state(by_rank)
    for name in structure.kinds:
        if name not in manifest.sharded_keys:
            _replicated(by_rank, name)
    return [reshard_rank(by_rank, manifest, world_size, rank) for rank in range(world_size)]


def reshard(states: Sequence[State], manifest: ShardManifest, world_size: int) -> list[dict[Any, Any]]:
    """Return the states of ``manifest``'s checkpoint re-cut for ``world_size`` ranks.

    ``states`` are the verified states of every rank of ``manifest`` (as
    :func:`~tiered_ckpt.load_sharded` returns them), in rank order. Raises
    :class:`ReshardError` naming the path if the ranks disagree on their structure, a
    scalar or a replicated array, or a sharded array does not match its recorded slice.
    """
    flat = [flatten(state, f"rank {rank}") for rank, state in enumerate(states)]
    return [state.unflatten() for state in reshard_flat(flat, manifest, world_size)]


# -- DTensor chunks ------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkPlan:
    """What one new rank reads to fill a state of DTensors: per saved rank, the arrays it
    reads from that rank's shard; per array of its own, the saved chunks that overlap it;
    the saved rank whose structure (scalars) it takes; and the plain arrays of that rank's
    state the target leaves out (``taken``: each comes back as read, from the one chunk in
    ``overlaps``)."""

    reads: Mapping[int, frozenset[str]]
    overlaps: Mapping[str, tuple[tuple[int, ChunkRecord], ...]]
    plain_source: int
    taken: frozenset[str] = frozenset()


def _overlaps(
    a_offsets: Sequence[int], a_sizes: Sequence[int], b_offsets: Sequence[int], b_sizes: Sequence[int]
) -> bool:
    if 0 in (*a_sizes, *b_sizes):
        return False
    return all(a < b + m and b < a + n for a, n, b, m in zip(a_offsets, a_sizes, b_offsets, b_sizes, strict=True))


def plan_chunks(manifest: ShardManifest, target: FlatState, rank: int, world_size: int) -> ChunkPlan:
    """The reads that fill ``target`` (new rank ``rank`` of ``world_size``) from ``manifest``'s chunks.

    A DTensor leaf takes the saved chunks that overlap its own; a plain array (the one
    chunk of itself) and the scalars come from the same rank of the checkpoint, or rank
    0's when the world size changed (its *plain source*: the array from that rank's own
    shard, or from the writer its record names for it). A box saved by several ranks (a
    replicated mesh dimension) is read once, from this rank if it saved it, else from the
    lowest rank that did. An array of the plain source's state that ``target`` leaves out
    (a value outside the model's and optimizers' states) is read as that rank holds it: a
    whole one always, and a chunk of a DTensor on the saved world size (this rank's own).
    Raises :class:`ReshardError` naming the path if an array is not one in the checkpoint
    or has another global shape there.
    """
    saved: dict[str, list[tuple[int, ChunkRecord]]] = {}
    for record in manifest.shards:
        for chunk in record.chunks:
            saved.setdefault(chunk.name, []).append((record.rank, chunk))
    plain_source = rank if manifest.world_size == world_size else 0
    record = manifest.shard(plain_source)
    holders = {chunk.name: plain_source for chunk in record.chunks} | {
        name: writer for name, writer in record.replicas
    }  # the rank whose shard holds each array of the plain source's state
    reads: dict[int, set[str]] = {plain_source: set()}
    overlaps: dict[str, tuple[tuple[int, ChunkRecord], ...]] = {}
    for name, array in target.arrays.items():
        where = path_text(target.structure.paths[name])
        mine = target.structure.chunks.get(name, Chunk(tuple(array.shape), (0,) * array.ndim))
        candidates = saved.get(name)
        if not candidates:
            raise ReshardError(f"{where}: the checkpoint holds no chunks of it (was it saved as a state of DTensors?)")
        if candidates[0][1].global_shape != mine.global_shape:
            raise ReshardError(
                f"{where} has global shape {mine.global_shape} here, {candidates[0][1].global_shape} in the checkpoint"
            )
        if name not in target.structure.chunks and name in holders:  # a plain array: the plain source's
            candidates = [(r, chunk) for r, chunk in candidates if r == holders[name]] or candidates
        preferred = rank if name in target.structure.chunks else plain_source
        chosen: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ChunkRecord]] = {}
        for saved_rank, chunk in sorted(candidates, key=lambda item: (item[0] != preferred, item[0])):
            if _overlaps(mine.offsets, array.shape, chunk.offsets, chunk.sizes):
                chosen.setdefault((chunk.offsets, chunk.sizes), (saved_rank, chunk))
        overlaps[name] = tuple(chosen.values())
        for saved_rank, _chunk in chosen.values():
            reads.setdefault(saved_rank, set()).add(name)
    taken = set()
    for name, holder in holders.items():
        held = [chunk for r, chunk in saved.get(name, []) if r == holder]
        if name in target.arrays or not held:
            continue
        if held[0].sizes != held[0].global_shape and manifest.world_size != world_size:
            continue  # a DTensor's chunk, which another world size cuts otherwise: fill_chunks names it
        overlaps[name] = ((holder, held[0]),)
        reads.setdefault(holder, set()).add(name)
        taken.add(name)
    return ChunkPlan({r: frozenset(names) for r, names in reads.items()}, overlaps, plain_source, frozenset(taken))


def copy_overlap(
    target: np.ndarray, target_offsets: Sequence[int], source: np.ndarray, source_offsets: Sequence[int]
) -> int:
    """Copy the part of ``source`` (a box at ``source_offsets``) that overlaps ``target`` (a box
    at ``target_offsets`` of the same global tensor) into ``target``; return the elements copied."""
    low = [max(t, s) for t, s in zip(target_offsets, source_offsets, strict=True)]
    high = [
        min(t + n, s + m) for t, n, s, m in zip(target_offsets, target.shape, source_offsets, source.shape, strict=True)
    ]
    if any(h <= lo for lo, h in zip(low, high, strict=True)):
        return 0
    into = tuple(slice(lo - t, h - t) for lo, h, t in zip(low, high, target_offsets, strict=True))
    out_of = tuple(slice(lo - s, h - s) for lo, h, s in zip(low, high, source_offsets, strict=True))
    view_into: tuple[Any, ...] = (*into, ...)  # with the ellipsis: views, 0-d arrays included
    view_out_of: tuple[Any, ...] = (*out_of, ...)
    destination, part = target[view_into], source[view_out_of]
    if not _same_memory(destination, part):  # read in place already (see direct_destination)
        destination[...] = part
    return math.prod(h - lo for lo, h in zip(low, high, strict=True))


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.strides == b.strides
    )


def direct_destination(target: np.ndarray, target_offsets: Sequence[int], chunk: ChunkRecord) -> np.ndarray | None:
    """The part of ``target`` (a box at ``target_offsets``) that saved ``chunk`` fills whole, if the
    chunk lies inside the target and that part is contiguous memory: the chunk can then be
    read straight into it (no new memory, no copy). None otherwise."""
    inside = all(
        t <= o and o + n <= t + m
        for t, m, o, n in zip(target_offsets, target.shape, chunk.offsets, chunk.sizes, strict=True)
    )
    if not inside or not target.flags.c_contiguous:
        return None
    box = tuple(slice(o - t, o - t + n) for t, o, n in zip(target_offsets, chunk.offsets, chunk.sizes, strict=True))
    view: tuple[Any, ...] = (*box, ...)  # with the ellipsis: a view, 0-d arrays included
    part = target[view]
    return part if part.flags.c_contiguous else None


def fill_chunks(plan: ChunkPlan, read: Mapping[int, FlatState], target: FlatState) -> FlatState:
    """Fill ``target``'s arrays in place from the verified saved arrays ``read`` (by saved rank);
    return the restored state (``target``'s arrays under the saved structure of the plain source).

    Raises :class:`InvalidStateError` naming the path if the target's arrays are not the
    checkpoint's (names, dtypes), and :class:`ReshardError` if the saved chunks do not
    cover one of them.
    """
    structure = read[plan.plain_source].structure
    differing = into_difference(dict.fromkeys(set(structure.kinds) - plan.taken), target.arrays, "the checkpoint")
    if differing:
        raise InvalidStateError(f"into does not match the checkpoint's arrays: {differing}")
    for name, array in target.arrays.items():
        where = path_text(target.structure.paths[name])
        offsets = target.structure.chunks[name].offsets if name in target.structure.chunks else (0,) * array.ndim
        copied = 0
        for saved_rank, chunk in plan.overlaps[name]:
            source = read[saved_rank].arrays[name]
            if source.dtype != array.dtype:
                raise InvalidStateError(f"into {where} is {array.dtype}, the checkpoint holds {source.dtype}")
            copied += copy_overlap(array, offsets, source, chunk.offsets)
        if copied != array.size:
            raise ReshardError(f"the checkpoint's chunks cover {copied} of the {array.size} elements of {where} here")
    # Each new rank its own copy: in one process, new ranks may take the same array read once.
    taken = {name: read[plan.overlaps[name][0][0]].arrays[name].copy() for name in plan.taken if name in structure.kinds}
    return FlatState({**target.arrays, **taken}, structure)
