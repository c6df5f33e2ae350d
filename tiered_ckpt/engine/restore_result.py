"""What a restore gives back (:class:`RestoreResult`), and how its ranks and tiers are written in messages."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from tiered_ckpt.errors import UsageError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.tiers.store import TierName

__all__ = ["RestoreResult", "by_tier", "on_devices", "rank_ranges"]


@dataclass(frozen=True, repr=False)
class RestoreResult:
    """What :meth:`CheckpointManager.restore` returns.

    ``states[i]`` is the state of rank ``ranks[i]`` as it was saved (nested dicts, lists,
    tuples and scalars with their types), every array as a numpy array (but for the CUDA
    tensors of ``into``, filled in place: those tensors): every rank when one process holds
    them all, this process's rank under a multi-process coordinator.
    ``sources`` maps each shard this process read (by the rank that saved it) to the
    name of the tier it was read from (``"local"``, ``"remote"``, ...). ``bytes_read`` counts
    the bytes of shards this process read (whole, or the parts it needed), ``seconds`` the time the
    restore took. The repr names the step, ranks, sources and sizes, never the arrays.
    """

    step: int
    states: list[dict[Any, Any]]
    sources: dict[int, TierName]
    ranks: tuple[int, ...]
    manifest: ShardManifest
    flat: tuple[FlatState, ...] = ()
    bytes_read: int = 0
    seconds: float = 0.0

    def __repr__(self) -> str:
        arrays = [array for state in self.flat for array in state.arrays.values()]
        return (
            f"RestoreResult(step={self.step}, ranks={rank_ranges(self.ranks)}, sources={by_tier(self.sources)}, "
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


def on_devices(result: RestoreResult, tensor_for: Callable[[Any], Any | None]) -> RestoreResult:
    """``result`` with each host array that stood in for a CUDA tensor of ``into`` replaced by
    that tensor (``tensor_for``: the tensor of a value, None for a value that stood in for
    none), so that the result holds no host copy of them."""
    flat = tuple(
        replace(state, arrays={name: _swapped(array, tensor_for) for name, array in state.arrays.items()})
        for state in result.flat
    )
    return replace(result, states=[_swapped(state, tensor_for) for state in result.states], flat=flat)


def _swapped(value: Any, tensor_for: Callable[[Any], Any | None]) -> Any:
    if isinstance(value, dict):
        return {key: _swapped(item, tensor_for) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_swapped(item, tensor_for) for item in value)
    tensor = tensor_for(value)
    return value if tensor is None else tensor


def rank_ranges(ranks: Collection[int]) -> str:
    """``ranks`` as short runs, for messages: "0-3,6,8-9" ("-" if none)."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs) or "-"


def by_tier(sources: Mapping[int, TierName]) -> str:
    """``sources`` (by rank, the tier each shard was read from) as "{local: 0-2, remote: 3}"."""
    tiers = sorted(set(sources.values()))
    listed = (f"{tier}: {rank_ranges([rank for rank, held in sources.items() if held == tier])}" for tier in tiers)
    return "{" + ", ".join(listed) + "}"
