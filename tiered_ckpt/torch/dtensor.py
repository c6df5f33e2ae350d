"""DTensor leaves: a DTensor is saved as its local chunk and the box of the global tensor it is.

torch is optional and never imported here: a DTensor is recognised by its type and read
through its own methods (``placements``, ``to_local``, ``__create_chunk_list__``, the
metadata DCP's planner reads), so ``import tiered_ckpt`` stays free of torch. Turning the
local tensor into bytes is :mod:`tiered_ckpt.torch.tensors`'s part; recording the chunk is
the structure document's (:mod:`tiered_ckpt.format.structure`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import InvalidStateError

__all__ = ["LocalChunk", "is_dtensor", "local_chunk"]


@dataclass(frozen=True)
class LocalChunk:
    """A DTensor's local tensor (``tensor``, contiguous: the bytes this rank saves), where it
    sits in the global tensor (``global_shape``, ``offsets``), and whether another rank may hold
    an identical copy (``replicated``: a Replicate placement on some mesh dimension)."""

    tensor: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replicated: bool


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``, without importing torch."""
    return type(value).__name__ == "DTensor" and hasattr(value, "placements")


def local_chunk(value: Any, what: str) -> LocalChunk:
    """The local chunk of the DTensor ``value`` (its tensor a view, no copy) and its box.

    Raises :class:`InvalidStateError` starting with ``what`` (the owner and path of the leaf)
    for a DTensor that cannot be saved as one box: a Partial placement (a pending reduction),
    a local tensor made of several chunks, or one that is not contiguous.
    """
    if any(placement.is_partial() for placement in value.placements):
        raise InvalidStateError(f"{what} is a DTensor with a Partial placement (a pending reduction): reduce it first")
    chunks = value.__create_chunk_list__()  # DTensor's own metadata, as DCP's planner reads it
    local = value.to_local()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise InvalidStateError(f"{what} is a DTensor whose local tensor is {len(chunks)} chunks, not one")
    if not local.is_contiguous():
        raise InvalidStateError(f"{what} is a DTensor whose local tensor is not contiguous")
    replicated = any(placement.is_replicate() for placement in value.placements)
    return LocalChunk(local, tuple(value.shape), tuple(chunks[0].offsets), replicated)
