"""A ``torch.distributed.checkpoint`` storage backend: ``dcp.save`` / ``dcp.load`` through a manager.

``TieredWriter(manager, step)`` and ``TieredReader(manager, step=None)`` let DCP plan a
save or a load (its planners, its resharding of DTensors and ShardedTensors) while the
bytes go through this library: one safetensors shard per rank written and committed
atomically, uploaded to the bucket, verified by sha256 when read, each rank reading only
the chunks it needs (its own disk, else the bucket).

Nothing is pickled into the checkpoint. A tensor chunk DCP writes is saved as a chunk of
its global tensor (:class:`~tiered_ckpt.state.ChunkOf`); a non-tensor value DCP would
``torch.save`` (a "bytes" item) is taken from the planner as the value itself and stored
in the shard's JSON structure document, so it must be what a state may hold (numbers,
strings, None, lists, tuples, dicts): anything else is refused with
:class:`InvalidStateError` naming it. DCP's metadata is not stored at all: the reader
rebuilds it from the manifest (every chunk's tensor, box and dtype) and the shards'
structure documents. (DCP's default load planner turns a bytes item back into a value
with ``torch.load``; the reader hands it bytes it has just made with ``torch.save`` from
the JSON value, never bytes read from storage.)

The call sequence, as DCP makes it (every rank):

1. ``dcp.save(state, storage_writer=TieredWriter(manager, step))``: DCP plans, then
   :meth:`TieredWriter.write_data` gives this rank's chunks and values to
   ``manager.save(step, ..., blocking=True)`` (a collective, like every save: every rank
   writes, the step commits once every rank's shard is durable, then uploads);
   :meth:`TieredWriter.finish` has nothing left to do.
2. ``dcp.load(state, storage_reader=TieredReader(manager, step))``:
   :meth:`TieredReader.read_metadata` agrees on the step with the other ranks
   (``manager.locate``) and rebuilds DCP's metadata; :meth:`TieredReader.read_data` reads,
   from each saved shard that holds a chunk this rank's plan needs, the shard's header
   and those chunks, each verified against its recorded sha256.

``dcp.async_save`` works the same way, its write running on DCP's thread: do not call
the manager from the training loop until its future is done.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..errors import ShardFormatError, UsageError
from ..manager import CheckpointManager
from ..manifest import ShardManifest
from ..sharded import run_parallel
from ..shardfile import DTYPES
from ..state import ChunkOf, FlatState, unescape
from ..tensors import to_torch

__all__ = ["TieredWriter", "TieredReader"]

_ROOT = "dcp"
_TENSORS_PREFIX = f"{_ROOT}/tensors/"


def _done(value: Any) -> Future[Any]:
    """A completed torch future (DCP waits on ``.wait()``)."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _offsets_key(offsets: Sequence[int]) -> str:
    return ",".join(str(offset) for offset in offsets)


class TieredWriter(StorageWriter):
    """DCP's writes of one checkpoint, committed as ``step`` by ``manager`` (see the module doc)."""

    def __init__(self, manager: CheckpointManager, step: int) -> None:
        super().__init__()
        self._manager = manager
        self._step = step

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: the step given at construction is the checkpoint."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank writes its own shard; the commit is the manager's, so no rank is special here."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's items of ``plan`` as the manager's ``step`` (blocking; a collective)."""
        tensors: dict[str, dict[str, ChunkOf]] = {}
        objects: dict[str, Any] = {}
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                lookup = getattr(planner, "lookup_object", None)
                if lookup is None:
                    raise UsageError("TieredWriter needs a planner with lookup_object (DCP's DefaultSavePlanner)")
                objects[item.index.fqn] = lookup(item.index)  # the value itself: stored as JSON, never pickled
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
                continue
            assert item.tensor_data is not None
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            data = data.detach()
            chunk = item.tensor_data.chunk
            tensors.setdefault(item.index.fqn, {})[_offsets_key(chunk.offsets)] = ChunkOf(
                data, tuple(item.tensor_data.size), tuple(chunk.offsets)
            )
            results.append(
                WriteResult(index=item.index, size_in_bytes=data.numel() * data.element_size(), storage_data=None)
            )
        self._manager.save(self._step, {_ROOT: {"tensors": tensors, "objects": objects}}, blocking=True)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to do: every rank's save committed the step (its manifest is the commit marker)."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen explicitly, never by DCP from a path


class TieredReader(StorageReader):
    """DCP's reads of ``step`` (default: the newest step every rank can restore) through ``manager``."""

    def __init__(self, manager: CheckpointManager, step: int | None = None) -> None:
        super().__init__()
        self._manager = manager
        self._step = step
        self._manifest: ShardManifest | None = None
        self._where: dict[MetadataIndex, tuple[int, str]] = {}
        self._objects: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: the step given at construction (or the newest) is the checkpoint."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the step, rebuilt from its manifest and its shards' (verified) headers."""
        manifest = self._manager.locate(self._step)
        self._manifest = manifest
        tensors: dict[str, TensorStorageMetadata] = {}
        seen: set[tuple[str, tuple[int, ...]]] = set()
        for record in manifest.shards:
            for chunk in record.chunks:
                fqn = _fqn_of(chunk.name, f"rank {record.rank} of step {manifest.step}")
                properties = TensorProperties(dtype=_torch_dtype(chunk.dtype))
                entry = tensors.setdefault(fqn, TensorStorageMetadata(properties, torch.Size(chunk.global_shape), []))
                if (fqn, chunk.offsets) not in seen:  # a replicated chunk written by several ranks
                    seen.add((fqn, chunk.offsets))
                    entry.chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)))
                    self._where[MetadataIndex(fqn, chunk.offsets)] = (record.rank, chunk.name)
        headers = run_parallel(
            lambda record: self._manager.store.read_parts(manifest.step, record, ())[0], manifest.shards, None
        )
        state: dict[str, Any] = dict(tensors)
        for header in headers:
            for fqn, value in _objects_of(header).items():
                self._objects.setdefault(fqn, value)
                state[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=state, storage_data=dict(self._where))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank reads for itself; nothing to set up."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the chunks ``plan`` needs (header and chunks only, verified), then hand them to ``planner``."""
        manifest = self._manifest
        if manifest is None:
            raise UsageError("read_data before read_metadata")
        wanted: dict[int, set[str]] = {}
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                rank, name = self._where[item.storage_index]
                wanted.setdefault(rank, set()).add(name)
        ranks = sorted(wanted)
        parts = run_parallel(
            lambda rank: self._manager.store.read_parts(manifest.step, manifest.shard(rank), wanted[rank])[0],
            ranks,
            None,
        )
        read = dict(zip(ranks, parts, strict=True))
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(self._objects[item.storage_index.fqn], buffer)  # made here from JSON, not read
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            rank, name = self._where[item.storage_index]
            source = to_torch(read[rank].arrays[name])
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _fqn_of(name: str, what: str) -> str:
    """The DCP key of a chunk's tensor name (``dcp/tensors/<fqn>/<offsets>``)."""
    if not name.startswith(_TENSORS_PREFIX) or name.count("/") != 3:
        raise ShardFormatError(f"{what}: {name!r} is not a chunk written by TieredWriter")
    fqn, _offsets = name[len(_TENSORS_PREFIX) :].split("/")
    return unescape(fqn)


def _objects_of(state: FlatState) -> Mapping[str, Any]:
    """The non-tensor values a rank's shard holds (its structure document's ``dcp/objects``)."""
    built = state.structure.build({name: np.empty(0) for name in state.structure.kinds})
    objects = built.get(_ROOT, {}).get("objects", {})
    return objects if isinstance(objects, dict) else {}


def _torch_dtype(code: str) -> torch.dtype:
    return to_torch(np.empty(0, dtype=DTYPES[code])).dtype
