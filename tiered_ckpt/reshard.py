"""N -> M resharding of flat ZeRO-style shards.

The partition rule, shared with saving: a flat vector of ``total`` elements over
``world_size`` ranks gives rank ``r`` a contiguous slice of ``total // world_size``
elements, plus one more for the first ``total % world_size`` ranks (see
:func:`partition_sizes`). Resharding concatenates the sharded arrays of the old ranks
in offset order and cuts the result by that rule; replicated arrays must be identical
on every old rank and are copied to every new one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .errors import ReshardError
from .manifest import ShardManifest

__all__ = ["partition_sizes", "reshard", "reshard_rank", "source_ranks"]


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


def _check_same_keys(states: Mapping[int, Mapping[str, np.ndarray]]) -> list[str]:
    ranks = sorted(states)
    keys = sorted(states[ranks[0]])
    for rank in ranks[1:]:
        if sorted(states[rank]) != keys:
            differing = sorted(set(keys) ^ set(states[rank]))
            raise ReshardError(f"rank {rank} holds different keys than rank {ranks[0]}: {differing}")
    return keys


def _replicated(states: Mapping[int, Mapping[str, np.ndarray]], key: str) -> np.ndarray:
    ranks = sorted(states)
    first = states[ranks[0]][key]
    for rank in ranks[1:]:
        other = states[rank][key]
        if other.dtype != first.dtype or other.shape != first.shape or other.tobytes() != first.tobytes():
            raise ReshardError(f"replicated key {key!r} differs between rank {ranks[0]} and rank {rank}")
    return first


def _flat(states: Mapping[int, Mapping[str, np.ndarray]], key: str, manifest: ShardManifest) -> np.ndarray:
    ranks = sorted(states)
    dtype = states[ranks[0]][key].dtype
    for rank in ranks:
        array, numel = states[rank][key], manifest.shard(rank).param_shard_numel
        if array.ndim != 1 or len(array) != numel or array.dtype != dtype:
            raise ReshardError(
                f"sharded key {key!r} on rank {rank} is {array.dtype} {array.shape}, "
                f"expected {dtype} ({numel},) from param_shard_numel"
            )
    return np.concatenate([states[rank][key] for rank in ranks])


def reshard_rank(
    states: Mapping[int, Mapping[str, np.ndarray]], manifest: ShardManifest, world_size: int, rank: int
) -> dict[str, np.ndarray]:
    """Return new rank ``rank``'s state when ``manifest``'s checkpoint is re-cut for ``world_size`` ranks.

    ``states`` maps old ranks to their verified arrays and must hold at least
    :func:`source_ranks`. Raises :class:`ReshardError` naming the key if those ranks
    disagree on their keys or a replicated array, or a sharded array does not match
    its recorded slice.
    """
    needed = source_ranks(manifest, world_size, rank)
    missing_ranks = sorted(set(needed) - set(states))
    if missing_ranks:
        raise ReshardError(f"new rank {rank} needs the shards of ranks {missing_ranks}")
    sources = {old: states[old] for old in needed}
    keys = _check_same_keys(sources)
    sharded = set(manifest.sharded_keys)
    missing = sorted(sharded - set(keys))
    if missing:
        raise ReshardError(f"sharded keys {missing} are not in the checkpoint's arrays")
    sizes = partition_sizes(manifest.total_numel, world_size)
    start = sum(sizes[:rank]) - manifest.shard(needed[0]).param_shard_offset
    result = {key: _flat(sources, key, manifest)[start : start + sizes[rank]].copy() for key in keys if key in sharded}
    result.update({key: _replicated(sources, key).copy() for key in keys if key not in sharded})
    return result


def reshard(
    states: Sequence[Mapping[str, np.ndarray]], manifest: ShardManifest, world_size: int
) -> list[dict[str, np.ndarray]]:
    """Return the states of ``manifest``'s checkpoint re-cut for ``world_size`` ranks.

    ``states`` are the verified arrays of every rank of ``manifest``, in rank order.
    Raises :class:`ReshardError` naming the key if the ranks disagree on their keys or a
    replicated array, or a sharded array does not match its recorded slice.
    """
    if len(states) != manifest.world_size:
        raise ReshardError(f"got {len(states)} rank states for a checkpoint of {manifest.world_size} ranks")
    by_rank = dict(enumerate(states))
    keys = _check_same_keys(by_rank)  # every old rank is checked, not only each new rank's sources
    for key in keys:
        if key not in manifest.sharded_keys:
            _replicated(by_rank, key)
    return [reshard_rank(by_rank, manifest, world_size, rank) for rank in range(world_size)]
