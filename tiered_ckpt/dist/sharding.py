"""The flat-parameter rule: which arrays of the ranks' states are slices of one flat vector.

The *sharded keys* are the arrays that are each rank's slice of a flat vector (ZeRO
parameters, master weights, optimizer moments). By default they are the keys whose array
is 1-D on every rank; every sharded array of a rank must have the same length, and that
length is the rank's ``param_shard_numel``. Rank ``r``'s ``param_shard_offset`` is the sum
of the lengths of ranks ``0..r-1``. A flat vector has one dtype: every rank's slice of a
sharded key has the same. Every other key is replicated. A save may name them explicitly
(``sharded_keys=``, e.g. when a replicated array is 1-D too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.state import sharded_names

__all__ = ["dtype_summary", "resolve_sharded_keys", "sharding_summary"]


def sharding_summary(state: Mapping[Any, Any]) -> dict[str, list[int]]:
    """The shape of every array of a rank's state: what :func:`resolve_sharded_keys` needs of it."""
    return {
        key: list(array.shape) if type(array) is np.ndarray else [int(n) for n in np.shape(array)]
        for key, array in state.items()
    }


def dtype_summary(state: Mapping[str, np.ndarray]) -> dict[str, str]:
    """The dtype of every 1-D array of a rank's state (the arrays that may be slices of a flat
    vector), by tensor name: what :func:`resolve_sharded_keys` checks the slices' dtypes by."""
    names: dict[np.dtype, str] = {}  # numpy builds a dtype's name in Python on every call: ~2 us an array
    summary = {}
    for key, array in state.items():
        if array.ndim == 1:
            dtype = array.dtype
            name = names.get(dtype)
            if name is None:
                name = names[dtype] = dtype.name
            summary[key] = name
    return summary


def resolve_sharded_keys(
    summaries: Sequence[Mapping[str, Sequence[int]]],
    sharded_keys: Iterable[str | Sequence[str | int]] | None,
    *,
    flat: bool = True,
    dtypes: Sequence[Mapping[str, str]] | None = None,
) -> tuple[tuple[str, ...], list[int]]:
    """Return the sharded keys (tensor names, sorted) and each rank's ``param_shard_numel``.

    ``summaries`` holds each rank's :func:`sharding_summary` (shapes by tensor name), in
    rank order, and ``dtypes`` (if given) each rank's :func:`dtype_summary`; ``sharded_keys``
    names tensors or paths (:func:`~tiered_ckpt.format.state.sharded_names`).
    Without them, the 1-D arrays are the sharded keys if every rank's state is ``flat``
    (a dict of arrays), and no array is otherwise. Raises :class:`InvalidStateError`
    naming the rank and key if the states do not follow the flat-parameter rule, and the
    key and the ranks of each dtype if its slices differ in dtype.
    """
    if sharded_keys is None:
        common = set(summaries[0]).intersection(*summaries[1:]) if summaries and flat else set()
        keys = sorted(k for k in common if all(len(summary[k]) == 1 for summary in summaries))
    else:
        keys = sorted(set(sharded_names(sharded_keys, summaries[0] if summaries else ())))
        for rank, summary in enumerate(summaries):
            for key in keys:
                if key not in summary:
                    raise InvalidStateError(f"rank {rank}: sharded key {key!r} is missing")
                if len(summary[key]) != 1:
                    raise InvalidStateError(
                        f"rank {rank}: sharded key {key!r} has shape {tuple(summary[key])}, not 1-D"
                    )
    numels = []
    for rank, summary in enumerate(summaries):
        lengths = {key: summary[key][0] for key in keys}
        if len(set(lengths.values())) > 1:
            raise InvalidStateError(
                f"rank {rank}: sharded arrays must have one length, got {lengths}; "
                "pass sharded_keys= to name the flat-parameter slices explicitly"
            )
        numels.append(next(iter(lengths.values()), 0))
    for key in keys if dtypes is not None else ():
        _check_one_dtype(key, [summary[key] for summary in dtypes or ()])
    return tuple(keys), numels


def _check_one_dtype(key: str, dtypes: Sequence[str]) -> None:
    """Raise :class:`InvalidStateError` unless every rank's slice of ``key`` (``dtypes[rank]``) has one dtype."""
    ranks: dict[str, list[int]] = {}
    for rank, dtype in enumerate(dtypes):
        ranks.setdefault(dtype, []).append(rank)
    if len(ranks) > 1:
        listed = "; ".join(f"{dtype} on {_ranks(held)}" for dtype, held in ranks.items())
        raise InvalidStateError(
            f"sharded key {key!r} is one flat vector sliced over the ranks, but its slices differ in dtype: {listed}; "
            "give every rank's slice one dtype (or name the flat-parameter slices with sharded_keys=)"
        )


def _ranks(ranks: Sequence[int], shown: int = 8) -> str:
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks[:shown])) + more
