"""What a save's input and a load's request must be, checked before anything is written or read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tiered_ckpt.errors import InvalidStateError, WorldSizeMismatchError
from tiered_ckpt.format.manifest import ShardManifest, manifest_problem
from tiered_ckpt.format.metrics import Metrics
from tiered_ckpt.format.state import FlatState

__all__ = [
    "MAX_STEP",
    "check_into",
    "check_manifest_fits",
    "check_same_tensors",
    "check_world_size",
    "tensor_summary",
    "validate_states",
    "validate_step",
]

TensorSummary = tuple[tuple[str, str, tuple[int, ...]], ...]
"""A rank's DTensors: the name, dtype and global shape of each (what crosses a save's collective)."""

# A step names a directory (step-<digits>: a file name of at most 255 bytes) and is a JSON
# integer every reader parses: an int64, as any training loop's counter is.
MAX_STEP = 2**63 - 1


def validate_states(states_per_rank: Sequence[Mapping[Any, Any]], world_size: int | None) -> int:
    """Check the shape of a save's input (a list of one dict per rank); return the world size."""
    if isinstance(states_per_rank, Mapping) or not isinstance(states_per_rank, Sequence):
        raise InvalidStateError("states_per_rank must be a list with one dict of arrays per rank")
    if not states_per_rank:
        raise InvalidStateError("states_per_rank is empty: a checkpoint needs at least one rank")
    if world_size is not None and world_size != len(states_per_rank):
        raise InvalidStateError(f"world_size is {world_size} but {len(states_per_rank)} rank states were given")
    for rank, state in enumerate(states_per_rank):
        if not isinstance(state, Mapping):
            raise InvalidStateError(f"rank {rank}: state is a {type(state).__name__}, not a dict of arrays")
    return len(states_per_rank)


def validate_step(step: int) -> None:
    """Raise :class:`InvalidStateError` unless ``step`` is an integer in ``[0, MAX_STEP]``."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidStateError(f"step must be an integer from 0 to 2**63 - 1, got {step!r:.80}")


def check_manifest_fits(
    record_bytes: Sequence[int], sharded_keys: Sequence[str], step: int, metrics: Metrics = ()
) -> None:
    """Raise :class:`InvalidStateError` if the manifest of ``step``, whose ranks' records take at most
    ``record_bytes`` (:meth:`FlatState.record_bytes`), with ``metrics``, might be over the size a reader accepts."""
    problem = manifest_problem(record_bytes, sharded_keys, metrics)
    if problem is not None:
        raise InvalidStateError(
            f"step {step}: the manifest of its {len(record_bytes)} ranks (a record of every array of a state of "
            f"DTensors) {problem}: save fewer, larger arrays"
        )


def check_world_size(manifest: ShardManifest, expected_world_size: int, where: str) -> None:
    """Raise :class:`WorldSizeMismatchError` unless the manifest has ``expected_world_size`` ranks."""
    if manifest.world_size != expected_world_size:
        raise WorldSizeMismatchError(
            f"{where}: checkpoint of step {manifest.step} was saved by {manifest.world_size} ranks, "
            f"but {expected_world_size} are loading it; reshard it explicitly to change the world size"
        )


def check_into(into: Sequence[Mapping[Any, Any]] | None, manifest: ShardManifest) -> None:
    """Raise :class:`InvalidStateError` unless ``into`` is None or holds one dict per rank."""
    if into is not None and len(into) != manifest.world_size:
        raise InvalidStateError(f"into holds {len(into)} rank states, the checkpoint has {manifest.world_size} ranks")


def tensor_summary(state: FlatState) -> TensorSummary:
    """The name, dtype and global shape of each DTensor of a rank's ``state``."""
    chunks = state.structure.chunks.items()
    return tuple((name, state.arrays[name].dtype.name, tuple(chunk.global_shape)) for name, chunk in chunks)


def check_same_tensors(tensors: Sequence[TensorSummary]) -> None:
    """Raise :class:`InvalidStateError` unless every rank's chunks of a DTensor (``tensors[rank]``,
    :func:`tensor_summary`) agree on its dtype and global shape."""
    seen: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    for rank, held in enumerate(tensors):
        for name, dtype, shape in held:
            first = seen.setdefault(name, (rank, dtype, tuple(shape)))
            if first[1:] != (dtype, tuple(shape)):
                raise InvalidStateError(
                    f"rank {rank}: the DTensor {name!r:.120} is {dtype} {tuple(shape)} here, {first[1]} {first[2]} on "
                    f"rank {first[0]}: every rank's chunks of one tensor have its one dtype and global shape"
                )
