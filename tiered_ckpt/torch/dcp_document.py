"""What a ``torch.distributed.checkpoint`` save stores in each rank's shard, for the writer and the reader.

:class:`~tiered_ckpt.torch.dcp_writer.TieredWriter` saves one state per rank,
``{"dcp": {...}}``, through the manager; :class:`~tiered_ckpt.torch.dcp_reader.TieredReader`
rebuilds DCP's metadata from it. Its sections, in this order:

- ``tensors``: ``{fqn: {"<offsets>": ChunkOf}}``, every tensor chunk of the rank's whole
  local plan, saved as a chunk of its global tensor (:class:`~tiered_ckpt.format.state.ChunkOf`),
  so the manifest records its tensor, box and dtype; its name in the shard is
  ``dcp/tensors/<fqn>/<offsets>``. A complex64/complex128 chunk is stored as its float
  pairs (one more trailing dimension of 2).
- ``blobs``: ``{fqn: {kind: ChunkOf}}``, a non-tensor value stored as one array: ``bytes``,
  ``io.BytesIO`` (their bytes), a numpy array or a numpy scalar, ``kind`` naming its type.
- ``objects``: ``{fqn: value}``, any other non-tensor value, in the shard's JSON structure
  document, so it must be what a state may hold (the save refuses anything else).
- ``complex``: ``{fqn: "complex64" | "complex128"}``, the tensors stored as float pairs.
- ``planner_data``: ``{fqn: [key, ...]}``, DCP's flattening map (the nested key path of
  every flattened key), for DCP's template-free loads.

**Nothing is pickled into the checkpoint**, and DCP's metadata is not stored: the manifest
and the structure document are the whole of it. A shard read back is untrusted: every
reader function here raises :class:`ShardFormatError` naming the rank and step for a
section that is not what the writer writes. A section may be absent (an older writer's
checkpoint): it reads as empty.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tiered_ckpt.errors import ShardFormatError
from tiered_ckpt.format.shardfile import DTYPES
from tiered_ckpt.format.state import ChunkOf
from tiered_ckpt.format.structure import Structure, unescape
from tiered_ckpt.torch.tensors import to_torch

__all__ = [
    "ROOT",
    "VALUE_SECTIONS",
    "COMPLEX_DTYPES",
    "is_value_chunk",
    "chunk_key",
    "fqn_of",
    "value_path",
    "document",
    "blob_of",
    "blob_value",
    "planner_paths",
    "keys_at",
    "complex_dtypes_of",
    "planner_data_of",
    "torch_dtype",
]

ROOT = "dcp"
VALUE_SECTIONS = ("blobs", "objects")
COMPLEX_DTYPES = {"complex64": torch.complex64, "complex128": torch.complex128}
_TENSORS_PREFIX = f"{ROOT}/tensors/"
_VALUE_PREFIXES = tuple(f"{ROOT}/{section}/" for section in VALUE_SECTIONS)


def is_value_chunk(name: str) -> bool:
    """True for the array of a stored non-tensor value (a ``blobs`` or an ``objects`` entry)."""
    return name.startswith(_VALUE_PREFIXES)


def chunk_key(offsets: Sequence[int]) -> str:
    """The key of a tensor chunk under its fqn in ``tensors``: its offsets, comma-separated."""
    return ",".join(str(offset) for offset in offsets)


def fqn_of(name: str, what: str) -> str:
    """The DCP key of a chunk's tensor name (``dcp/tensors/<fqn>/<offsets>``); ``what`` names the shard."""
    if not name.startswith(_TENSORS_PREFIX) or name.count("/") != 3:
        raise ShardFormatError(f"{what}: {name!r} is not a chunk written by TieredWriter")
    fqn, _offsets = name[len(_TENSORS_PREFIX) :].split("/")
    return unescape(fqn)


def value_path(section: str, fqn: str) -> tuple[str, str, str]:
    """Where the value of ``fqn`` is in the state saved (``section``: one of :data:`VALUE_SECTIONS`)."""
    return (ROOT, section, fqn)


def document(
    tensors: Mapping[str, Mapping[str, ChunkOf]],
    blobs: Mapping[str, Mapping[str, ChunkOf]],
    objects: Mapping[str, Any],
    complex_dtypes: Mapping[str, str],
    planner_data: Mapping[str, Sequence[str | int]],
) -> dict[str, dict[str, Any]]:
    """The state a rank saves: its sections in the order of the module doc (the shard's bytes follow it)."""
    return {
        ROOT: {
            "tensors": tensors,
            "blobs": blobs,
            "objects": objects,
            "complex": complex_dtypes,
            "planner_data": planner_data,
        }
    }


def blob_of(value: Any) -> dict[str, ChunkOf] | None:
    """A value stored as one array (its bytes, or the array itself) with its type as the key, or None."""
    if type(value) in (bytes, io.BytesIO):
        kind = "bytes" if type(value) is bytes else "bytesio"
        data = np.frombuffer(value if type(value) is bytes else value.getvalue(), dtype=np.uint8)
    elif isinstance(value, np.ndarray) and type(value) is np.ndarray:
        kind, data = "ndarray", value
    elif isinstance(value, np.generic):
        kind, data = "npscalar", np.asarray(value)
    else:
        return None
    return {kind: ChunkOf(data, tuple(data.shape), (0,) * data.ndim)}  # a chunk: each rank keeps its own copy


def blob_value(built: Any, what: str) -> Any:
    """The value :func:`blob_of` stored, from its entry as built from the shard (``what`` names it)."""
    if not (isinstance(built, dict) and len(built) == 1):
        raise ShardFormatError(f"{what} is not a stored value")
    ((kind, array),) = built.items()
    if kind == "bytes":
        return np.asarray(array).tobytes()
    if kind == "bytesio":
        return io.BytesIO(np.asarray(array).tobytes())
    if kind == "ndarray":
        return array
    if kind == "npscalar":
        return array[()]
    raise ShardFormatError(f"{what} has unknown kind {kind!r}")


def planner_paths(mapping: object) -> dict[str, list[str | int]]:
    """DCP's flattening map (flattened key -> the nested key path), as a save planner recorded it
    in its plan's ``planner_data``; entries of any other shape are left out."""
    if not isinstance(mapping, Mapping):
        return {}
    return {
        fqn: list(path)
        for fqn, path in mapping.items()
        if isinstance(fqn, str) and isinstance(path, (tuple, list)) and all(type(key) in (str, int) for key in path)
    }


def keys_at(structure: Structure, path: tuple[str, ...]) -> list[str | int]:
    """The keys of the dict at ``path`` of a shard's structure (none if there is no dict there)."""
    try:
        return structure.keys_at(path)
    except KeyError:
        return []


def _json_at(structure: Structure, section: str, what: str) -> dict[str, Any]:
    """A JSON dict the writer stored under ``dcp`` (empty if absent: an older checkpoint)."""
    try:
        value = structure.build_at((ROOT, section), {})
    except KeyError:
        return {}
    if not isinstance(value, dict):
        raise ShardFormatError(f"{what}: {ROOT}/{section} is not a dict")
    return value


def complex_dtypes_of(structure: Structure, what: str) -> dict[str, str]:
    """The ``complex`` section of a shard: the fqns stored as float pairs and their complex dtype names."""
    complex_dtypes = _json_at(structure, "complex", what)
    if any(dtype not in COMPLEX_DTYPES for dtype in complex_dtypes.values()):
        raise ShardFormatError(f"{what}: dcp/complex names a dtype other than {sorted(COMPLEX_DTYPES)}")
    return complex_dtypes


def planner_data_of(structure: Structure, what: str) -> dict[str, tuple[str | int, ...]]:
    """The ``planner_data`` section of a shard, as DCP's ``Metadata.planner_data`` holds it."""
    planner_data = _json_at(structure, "planner_data", what)
    paths = planner_data.values()
    if not all(isinstance(path, list) and all(type(key) in (str, int) for key in path) for path in paths):
        raise ShardFormatError(f"{what}: dcp/planner_data must map each key to a list of str and int keys")
    return {fqn: tuple(path) for fqn, path in planner_data.items()}


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a manifest's dtype code."""
    return to_torch(np.empty(0, dtype=DTYPES[code])).dtype
