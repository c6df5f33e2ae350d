"""N -> M resharding of flat ZeRO-style shards.

The partition rule, shared with saving: a flat vector of ``total`` elements over
``world_size`` ranks gives rank ``r`` a contiguous slice of ``total // world_size``
elements, plus one more for the first ``total % world_size`` ranks (see
:func:`partition_sizes`). Resharding concatenates the sharded arrays of the old ranks
in offset order and cuts the result by that rule; replicated arrays, scalars and the
state's structure must be identical on every old rank and are copied to every new one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import ReshardError
from .manifest import ShardManifest
from .state import FlatState, State, Structure, flatten, path_text

__all__ = ["partition_sizes", "reshard", "reshard_flat", "reshard_rank", "source_ranks"]


def partition_sizes(total: int, world_size: int) -> list[int]:
    """Slice lengths of a flat vector of ``total`` elements over ``world_size`` ranks."""
    if world_size < 1 or total < 0:
        raise ValueError(f"cannot partition {total} elements over {world_size} ranks")
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
