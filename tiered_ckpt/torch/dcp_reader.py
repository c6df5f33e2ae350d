"""``TieredReader``: a ``torch.distributed.checkpoint`` storage reader, ``dcp.load`` through a manager.

DCP plans the load (its planners, its resharding of DTensors and ShardedTensors) while
the bytes come through this library: each rank reads only the chunks it needs (its own
disk, else the bucket), each verified by sha256. ``checkpoint_id`` names the step
(:mod:`tiered_ckpt.torch.dcp_steps`).

DCP's metadata is not stored: the reader rebuilds it from the manifest (every chunk's
tensor, box and dtype) and its own shard's structure document (the values, the complex
dtypes, and ``planner_data``, as :mod:`tiered_ckpt.torch.dcp_document` lays them out).
A load at the same world size reads its own shard only (its own disk; no bucket needed,
and none of another rank's objects that may not be uploaded yet). DCP's load planner
turns a bytes item back into a value with ``torch.load``; the reader hands it bytes it
has just made with ``torch.save`` from the stored value, never bytes read from storage.

The call sequence, as ``dcp.load(state, storage_reader=reader, checkpoint_id=...)`` makes
it (every rank, except where it says the coordinator):

1. :meth:`TieredReader.reset` (``checkpoint_id``): the step to read; a ``checkpoint_id``
   replaces the reader's step.
2. :meth:`TieredReader.read_metadata` (no collective: DCP may call it on one rank alone):
   reads the step's manifest and this rank's shard's verified header, from where they
   are (its own disk, else the bucket); with no step named, the newest step this rank's
   tiers hold.
3. :meth:`TieredReader.set_up_storage_reader`: nothing to set up.
4. :meth:`TieredReader.prepare_local_plan`: records the step this rank found in its plan.
5. :meth:`TieredReader.prepare_global_plan` (the coordinator): compares the ranks' steps
   (different steps raise on every rank, asking for a ``checkpoint_id``).
6. :meth:`TieredReader.read_data`: reads, from each saved shard that holds a chunk this
   rank's plan needs, the shard's header and those chunks, each verified against its
   recorded sha256 (planned and run as a restore's reads are:
   :func:`~tiered_ckpt.engine.restore_plan.plan_parts`), and hands them to DCP's planner.
   A chunk this rank's shard does not hold (a load at another world size, or into another
   sharding) comes from the bucket: right after a save, wait for its upload first
   (``manager.wait(uploaded=True)`` on every rank).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
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
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiered_ckpt.engine.node_shards import step_holdings
from tiered_ckpt.engine.read_execution import ReadExecutor
from tiered_ckpt.engine.restore_plan import StepHoldings, plan_parts
from tiered_ckpt.errors import IncompleteCheckpointError, ShardFormatError, UsageError
from tiered_ckpt.format.manifest import ChunkRecord, ShardManifest
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.structure import Structure
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.torch.dcp_document import (
    COMPLEX_DTYPES,
    ROOT,
    VALUE_SECTIONS,
    blob_value,
    complex_dtypes_of,
    fqn_of,
    is_value_chunk,
    keys_at,
    planner_data_of,
    torch_dtype,
    value_path,
)
from tiered_ckpt.torch.dcp_steps import step_of
from tiered_ckpt.torch.tensors import as_complex, to_torch

__all__ = ["TieredReader"]


@dataclass(frozen=True)
class _Located:
    """What :meth:`TieredReader.read_metadata` found, for the plan and reads that follow."""

    manifest: ShardManifest
    rank: int  # whose shard holds this rank's values
    structure: Structure
    where: Mapping[MetadataIndex, tuple[int, str]]
    complex_dtypes: Mapping[str, str]
    values: Mapping[str, tuple[str, ...]]  # fqn -> the path of its stored value
    holdings: StepHoldings  # what the tiers hold of the step: the reads' plan's input


class TieredReader(StorageReader):
    """DCP's reads of ``step`` through ``manager`` (see the module doc).

    With one process holding every rank (``world_size=N``, one directory holding every
    shard, or the bucket), one process reads a checkpoint that N ranks saved: DCP's
    template-free loads and ``dcp_to_torch_save`` consolidate it; its values are rank 0's.

    ``step`` (or a ``checkpoint_id`` given to ``dcp.load``, which replaces it) names the
    step; by default, the newest step this rank's disk or the bucket holds (the ranks must
    agree on it, else the load raises on every rank asking for a ``checkpoint_id``).
    """

    def __init__(self, manager: CheckpointManager, step: int | str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self._manager = manager
        self._ranks = manager.ranks  # one with one process per rank; every rank in a process holding them all
        self._step = None if step is None else step_of(step, manager)
        self._located: _Located | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """Make ``checkpoint_id`` (a step, see the module doc) the step to read; None keeps the step."""
        if checkpoint_id is not None:
            self._step = step_of(checkpoint_id, self._manager)
        self._located = None

    def read_metadata(self) -> Metadata:
        """DCP's metadata of the step, rebuilt from its manifest and this rank's shard's verified
        header, read from where they are; this process's alone (no collective)."""
        manager = self._manager
        manager.wait()  # a save still being written commits first (its errors raise here)
        store = manager.store
        local_steps = manager.steps()
        step = self._step
        # a step on this rank's disk needs nothing of the bucket (which may be out of reach)
        remote_steps = [] if step is not None and step in local_steps else manager.remote_steps()
        if step is None:
            step = max([*local_steps, *remote_steps], default=None)
            if step is None:
                raise IncompleteCheckpointError(f"{store.where()}: no committed checkpoint to load")
        if step not in local_steps and step not in remote_steps:
            raise IncompleteCheckpointError(
                f"{store.where()}: step {step} is not committed; committed steps: "
                f"{sorted(set(local_steps) | set(remote_steps))}"
            )
        manifest, _remote = store.manifests(step, in_local=step in local_steps, in_remote=step in remote_steps)
        # a bucket not listed (the step is on this disk) is still tried, last, for a copy that fails here
        in_remote = True if step in remote_steps else None if step in local_steps else False
        committed = {store.remote.name: in_remote} if store.remote is not None else {}
        holdings = step_holdings(store, False, manifest, (), committed)
        first = self._ranks[0]
        rank = first if first < manifest.world_size else 0  # a new rank takes rank 0's values
        structure = self._read(manifest, holdings, {rank: ()})[rank].structure
        if rank != 0 and "planner_data" not in keys_at(structure, (ROOT,)):
            # written by a TieredWriter of 0.2, which stored the values in rank 0's shard only
            rank = 0
            structure = self._read(manifest, holdings, {rank: ()})[rank].structure
        what = f"rank {rank} of step {step}"
        complex_dtypes = complex_dtypes_of(structure, what)
        chunks = self._chunks(manifest, complex_dtypes)
        state: dict[str, Any] = {}
        for index, (_writer, chunk) in chunks.items():
            fqn, pairs = index.fqn, index.fqn in complex_dtypes
            if pairs and chunk.global_shape[-1:] != (2,):
                raise ShardFormatError(f"{what}: {chunk.name!r} is not the float pairs of a complex tensor")
            shape, sizes = (chunk.global_shape[:-1], chunk.sizes[:-1]) if pairs else (chunk.global_shape, chunk.sizes)
            dtype = COMPLEX_DTYPES[complex_dtypes[fqn]] if pairs else torch_dtype(chunk.dtype)
            entry = state.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), []))
            entry.chunks.append(ChunkStorageMetadata(torch.Size(index.offset or ()), torch.Size(sizes)))
        where = {index: (writer, chunk.name) for index, (writer, chunk) in chunks.items()}
        values: dict[str, tuple[str, ...]] = {}
        for section in VALUE_SECTIONS:
            for key in keys_at(structure, (ROOT, section)):
                if isinstance(key, str):
                    values[key] = value_path(section, key)
                    state[key] = BytesStorageMetadata()
        planner_data = planner_data_of(structure, what)
        self._located = _Located(manifest, rank, structure, where, complex_dtypes, values, holdings)
        return Metadata(state_dict_metadata=state, planner_data=planner_data or None)

    def _read(
        self, manifest: ShardManifest, holdings: StepHoldings, wanted: Mapping[int, Collection[str]]
    ) -> Mapping[int, FlatState]:
        """By saved rank, its shard's structure and the arrays ``wanted`` of it, each verified:
        planned and run as a restore's reads are (:func:`~tiered_ckpt.engine.restore_plan.plan_parts`)."""
        return ReadExecutor(self._manager.store).run(manifest, plan_parts(holdings, wanted)).states

    def _chunks(
        self, manifest: ShardManifest, complex_dtypes: Mapping[str, str]
    ) -> dict[MetadataIndex, tuple[int, ChunkRecord]]:
        """Every saved chunk's index and where it is read from: this process's shard if it holds a copy."""
        where: dict[MetadataIndex, tuple[int, ChunkRecord]] = {}
        for record in manifest.shards:
            for chunk in record.chunks:
                if is_value_chunk(chunk.name):
                    continue
                fqn = fqn_of(chunk.name, f"rank {record.rank} of step {manifest.step}")
                offsets = chunk.offsets[:-1] if fqn in complex_dtypes else chunk.offsets
                index = MetadataIndex(fqn, offsets)
                if index not in where or record.rank in self._ranks:
                    where[index] = (record.rank, chunk)
        return where

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        """Every rank reads for itself; nothing to set up."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        located = self._require_located()
        return dataclasses.replace(plan, storage_data=located.manifest.step)  # compared in the global plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Refuse a load whose ranks found different newest steps (every rank raises)."""
        steps = {rank: plan.storage_data for rank, plan in enumerate(plans)}
        if len(set(steps.values())) > 1:
            raise IncompleteCheckpointError(
                f"the ranks would load different steps ({steps}: a save cut short between ranks, or a rank's "
                "disk replaced); name the step: dcp.load(..., checkpoint_id=STEP)"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the chunks and values ``plan`` needs (header and those arrays only, verified), then
        hand them to ``planner``."""
        located = self._require_located()
        wanted: dict[int, set[str]] = {}
        value_arrays: dict[str, int] = {}  # the arrays of the values to load, and whose shard holds each
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                rank, name = located.where[item.storage_index]
                wanted.setdefault(rank, set()).add(name)
            else:
                value_arrays.update(_value_arrays(located, item.storage_index.fqn))
        for name, writer in value_arrays.items():
            wanted.setdefault(writer, set()).add(name)
        read = {rank: state.arrays for rank, state in self._read(located.manifest, located.holdings, wanted).items()}
        arrays = {name: read[writer][name] for name, writer in value_arrays.items()}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                value = _value(located, item.storage_index.fqn, arrays)
                buffer = io.BytesIO()
                torch.save(value, buffer)  # made here from the stored value, not read
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            rank, name = located.where[item.storage_index]
            source = to_torch(read[rank][name])
            dtype = located.complex_dtypes.get(item.storage_index.fqn)
            if dtype is not None:
                source = as_complex(source, dtype)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _require_located(self) -> _Located:
        if self._located is None:
            raise UsageError("TieredReader: read_metadata must come first (dcp.load calls it)")
        return self._located

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _value_arrays(located: _Located, fqn: str) -> dict[str, int]:
    """The arrays of a stored value, each with the rank whose shard holds it (a value's
    array equal on several ranks may have been written by one of them)."""
    path = located.values[fqn]
    replicas = dict(located.manifest.shard(located.rank).replicas)
    return {
        name: replicas.get(name, located.rank)
        for name, name_path in located.structure.paths.items()
        if name_path[: len(path)] == path
    }


def _value(located: _Located, fqn: str, arrays: Mapping[str, np.ndarray]) -> Any:
    """A stored non-tensor value as it was handed to ``dcp.save``."""
    path = located.values[fqn]
    if path[1] == "objects":
        return located.structure.build_at(path, arrays, torch=True)  # each array as it was saved
    return blob_value(
        located.structure.build_at(path, arrays), f"rank {located.rank} of step {located.manifest.step}: {fqn!r}"
    )
