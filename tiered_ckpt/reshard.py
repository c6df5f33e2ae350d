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

__all__ = ["partition_sizes", "reshard"]


def partition_sizes(total: int, world_size: int) -> list[int]:
    """Slice lengths of a flat vector of ``total`` elements over ``world_size`` ranks."""
    if world_size < 1 or total < 0:
        raise ValueError(f"cannot partition {total} elements over {world_size} ranks")
    base, extra = divmod(total, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def _check_same_keys(states: Sequence[Mapping[str, np.ndarray]]) -> list[str]:
    keys = sorted(states[0])
    for rank, state in enumerate(states[1:], start=1):
        if sorted(state) != keys:
            differing = sorted(set(keys) ^ set(state))
            raise ReshardError(f"rank {rank} holds different keys than rank 0: {differing}")
    return keys


def _replicated(states: Sequence[Mapping[str, np.ndarray]], key: str) -> np.ndarray:
    first = states[0][key]
    for rank, state in enumerate(states[1:], start=1):
        other = state[key]
        if other.dtype != first.dtype or other.shape != first.shape or other.tobytes() != first.tobytes():
            raise ReshardError(f"replicated key {key!r} differs between rank 0 and rank {rank}")
    return first


def _flat(states: Sequence[Mapping[str, np.ndarray]], key: str, manifest: ShardManifest) -> np.ndarray:
    dtype = states[0][key].dtype
    for rank, state in enumerate(states):
        array, numel = state[key], manifest.shard(rank).param_shard_numel
        if array.ndim != 1 or len(array) != numel or array.dtype != dtype:
            raise ReshardError(
                f"sharded key {key!r} on rank {rank} is {array.dtype} {array.shape}, "
                f"expected {dtype} ({numel},) from param_shard_numel"
            )
    return np.concatenate([state[key] for state in states])


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
    keys = _check_same_keys(states)
    sharded = set(manifest.sharded_keys)
    missing = sorted(sharded - set(keys))
    if missing:
        raise ReshardError(f"sharded keys {missing} are not in the checkpoint's arrays")
    flats = {key: _flat(states, key, manifest) for key in keys if key in sharded}
    replicated = {key: _replicated(states, key) for key in keys if key not in sharded}
    sizes = partition_sizes(manifest.total_numel, world_size)
    result, offset = [], 0
    for size in sizes:
        rank_state = {key: flat[offset : offset + size].copy() for key, flat in flats.items()}
        rank_state.update({key: array.copy() for key, array in replicated.items()})
        result.append(rank_state)
        offset += size
    return result
