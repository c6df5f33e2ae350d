"""A ``torch.distributed.checkpoint`` storage backend: ``dcp.save`` / ``dcp.load`` through a manager.

``TieredWriter(manager, step)`` and ``TieredReader(manager, step=None)`` let DCP plan a
save or a load (its planners, its resharding of DTensors and ShardedTensors) while the
bytes go through this library: one safetensors shard per rank written and committed
atomically, uploaded to the bucket, verified by sha256 when read, each rank reading only
the chunks it needs (its own disk, else the bucket). A writer's manager holds one rank
per process (a ``TorchDistributedCoordinator``, or ``world_size=1``), as DCP saves.

**The step.** ``checkpoint_id`` names the step, as it names the directory for DCP's
``FileSystemWriter``: ``dcp.save(..., checkpoint_id=20, storage_writer=writer)`` saves
step 20 (a writer may be reused for every step), ``dcp.load(..., checkpoint_id=10,
storage_reader=reader)`` loads step 10. Accepted: an ``int`` step, a string of its
digits (``"10"``), or the step's directory as this library lays it out, under the
manager's ``local_dir`` or ``remote_url`` (``<local_dir>/step-000000000010``). Anything
else raises :class:`UsageError` (never a silent other step).

**Nothing is pickled into the checkpoint.** Each rank writes its whole local plan, as
DCP planned it before it removed copies other ranks also hold: so every rank's shard
holds every chunk and value that rank's state had, and a load at the same world size
reads its own shard only (its own disk; no bucket needed, and none of another rank's
objects that may not be uploaded yet). A tensor chunk is saved as a chunk of its global
tensor (:class:`~tiered_ckpt.state.ChunkOf`; complex64/complex128 as their float pairs,
the dtype recorded). A non-tensor value DCP would ``torch.save`` (a "bytes" item) is
taken from the planner as the value itself: ``bytes``, ``io.BytesIO``, a numpy array or
numpy scalar is stored as an array (its bytes, without pickle, and its type recorded);
anything else is stored in the shard's JSON structure document, so it must be what a
state may hold (numbers, strings, None, lists, tuples, dicts, arrays): any other value
is refused with :class:`InvalidStateError` naming it, on every rank, before anything
is written. DCP's metadata is not stored: the reader rebuilds it from the manifest
(every chunk's tensor, box and dtype) and its own shard's structure document (the
values, the complex dtypes, and ``planner_data``: the nested key path of every
flattened key, for DCP's template-free loads). DCP's load planner turns a bytes item
back into a value with ``torch.load``; the reader hands it bytes it has just made with
``torch.save`` from the stored value, never bytes read from storage.

The call sequence, as DCP makes it (every rank):

1. ``dcp.save(state, storage_writer=TieredWriter(manager, step))``: DCP plans, then
   :meth:`TieredWriter.write_data` gives this rank's chunks and values to
   ``manager.save(step, ..., blocking=True)`` (a collective, like every save: every rank
   writes, the step commits once every rank's shard is durable, then uploads);
   :meth:`TieredWriter.finish` has nothing left to do.
2. ``dcp.load(state, storage_reader=TieredReader(manager, step))``:
   :meth:`TieredReader.read_metadata` (no collective: DCP may call it on one rank alone)
   reads the step's manifest and this rank's shard's verified header, from where they
   are (its own disk, else the bucket); with no step named, the newest step this rank's
   tiers hold, the ranks' choices compared in DCP's global plan (different steps raise
   on every rank, asking for a ``checkpoint_id``). :meth:`TieredReader.read_data` reads,
   from each saved shard that holds a chunk this rank's plan needs, the shard's header
   and those chunks, each verified against its recorded sha256. A chunk this rank's shard
   does not hold (a load at another world size, or into another sharding) comes from the
   bucket: right after a save, wait for its upload first (``manager.wait(uploaded=True)``
   on every rank).

``dcp.async_save`` works the same way, its write running on DCP's thread: do not call
the manager from the training loop until its future is done. DCP's process-based
``async_save`` (``AsyncCheckpointerType.PROCESS``) cannot run it: the writer writes
through this process's manager (its directory lock, uploader and coordinator), so it
refuses to be sent to DCP's checkpoint process with a :class:`UsageError` saying so.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

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

from tiered_ckpt.errors import IncompleteCheckpointError, InvalidStateError, ShardFormatError, UsageError
from tiered_ckpt.format.layout import parse_step_dir_name, step_dir_name
from tiered_ckpt.format.manifest import ChunkRecord, ShardManifest
from tiered_ckpt.format.shardfile import DTYPES
from tiered_ckpt.format.state import ChunkOf
from tiered_ckpt.format.structure import Structure, path_text, unescape
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.torch.tensors import as_complex, to_torch

__all__ = ["TieredWriter", "TieredReader"]

_ROOT = "dcp"
_TENSORS_PREFIX = f"{_ROOT}/tensors/"
_VALUE_PREFIXES = (f"{_ROOT}/blobs/", f"{_ROOT}/objects/")
_COMPLEX_DTYPES = {"complex64": torch.complex64, "complex128": torch.complex128}
_PROCESS_REFUSAL = (
    "a TieredWriter cannot be sent to another process (DCP's async_save with "
    "async_checkpointer_type=AsyncCheckpointerType.PROCESS sends it to its checkpoint process): it writes through "
    "this process's CheckpointManager, whose directory lock, uploader and coordinator live here. Use "
    "dcp.async_save with the default AsyncCheckpointerType.THREAD, or manager.save(step, state, blocking=False)"
)


def _done(value: Any) -> Future[Any]:
    """A completed torch future (DCP waits on ``.wait()``)."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _offsets_key(offsets: Sequence[int]) -> str:
    return ",".join(str(offset) for offset in offsets)


def _check_one_rank(manager: CheckpointManager, who: str) -> None:
    if len(manager.ranks) != 1:
        raise UsageError(
            f"{who} needs a manager holding one rank per process (a TorchDistributedCoordinator, or "
            f"world_size=1), as DCP runs one rank per process; this one holds ranks {list(manager.ranks)}"
        )


def _step_of(checkpoint_id: Any, manager: CheckpointManager) -> int:
    """The step a DCP ``checkpoint_id`` names (see the module doc), or :class:`UsageError`."""
    if type(checkpoint_id) is int and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, (str, os.PathLike)):
        text = os.fspath(checkpoint_id)
        if isinstance(text, str):
            if text.isascii() and text.isdigit():
                return int(text)
            parent, _, name = text.rstrip("/").rpartition("/")
            step = parse_step_dir_name(name)
            if step is not None and _is_step_parent(parent, manager):
                return step
    remote = manager.options.remote
    places = [str(manager.root)] + ([remote.url] if remote is not None else [])
    raise UsageError(
        f"checkpoint_id {checkpoint_id!r:.200} names no step of {' or '.join(places)}: give the step "
        f'(10 or "10"), or its directory ({Path(places[0]) / step_dir_name(10)} for step 10)'
    )


def _is_step_parent(parent: str, manager: CheckpointManager) -> bool:
    remote = manager.options.remote
    if remote is not None and parent == remote.url.rstrip("/"):
        return True
    if "://" in parent or not parent:
        return False
    return Path(parent).resolve() == manager.root.resolve()


class TieredWriter(StorageWriter):
    """DCP's writes of one checkpoint, committed as ``step`` by ``manager`` (see the module doc).

    ``step`` may be left out and given to ``dcp.save`` as ``checkpoint_id`` instead; each
    ``checkpoint_id`` given to ``dcp.save`` replaces it, so one writer saves every step.
    """

    def __init__(self, manager: CheckpointManager, step: int | str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        _check_one_rank(manager, "TieredWriter")
        self._manager = manager
        self._step = None if step is None else _step_of(step, manager)
        self._local_plan: SavePlan | None = None

    def __reduce__(self) -> NoReturn:
        raise UsageError(_PROCESS_REFUSAL)

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """Make ``checkpoint_id`` (a step, see the module doc) the step to write; None keeps the step."""
        if checkpoint_id is not None:
            self._step = _step_of(checkpoint_id, self._manager)
        self._local_plan = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank writes its own shard (the commit is the manager's); refuses a save with no step named."""
        if self._step is None:
            raise UsageError("TieredWriter has no step: give it one, TieredWriter(manager, step), or checkpoint_id")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local_plan = plan  # the whole plan: DCP's global plan then leaves other ranks' copies out
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's items (its whole local plan) as the manager's step (blocking; a collective)."""
        if self._step is None:
            raise UsageError("TieredWriter has no step: give it one, TieredWriter(manager, step), or checkpoint_id")
        local = self._local_plan if self._local_plan is not None else plan
        tensors: dict[str, dict[str, ChunkOf]] = {}
        complex_dtypes: dict[str, str] = {}
        for item in {item.index: item for item in (*local.items, *plan.items)}.values():
            if item.type == WriteItemType.BYTE_IO:
                continue
            assert item.tensor_data is not None
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            data = data.detach()
            if data.is_complex():
                complex_dtypes[item.index.fqn] = str(data.dtype).removeprefix("torch.")
            chunk = item.tensor_data.chunk
            tensors.setdefault(item.index.fqn, {})[_offsets_key(chunk.offsets)] = ChunkOf(
                data, tuple(item.tensor_data.size), tuple(chunk.offsets)
            )
        blobs: dict[str, dict[str, ChunkOf]] = {}
        objects: dict[str, Any] = {}
        for fqn, value in _values_of(local, plan, planner).items():
            blob = _blob(value)
            if blob is not None:
                blobs[fqn] = blob
            else:
                objects[fqn] = value  # stored as JSON (its arrays as arrays), never pickled; save checks it
        dcp_state = {
            "tensors": tensors,
            "blobs": blobs,
            "objects": objects,
            "complex": complex_dtypes,
            "planner_data": _planner_data(local),
        }
        try:
            self._manager.save(self._step, {_ROOT: dcp_state}, blocking=True)
        except InvalidStateError as exc:  # raised on every rank: restated with the paths the caller wrote
            raise InvalidStateError(_restated(str(exc), dcp_state["planner_data"], blobs, objects)) from exc
        results = [
            WriteResult(index=item.index, size_in_bytes=_item_bytes(item), storage_data=None) for item in plan.items
        ]
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to do: every rank's save committed the step (its manifest is the commit marker)."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen explicitly (it needs a manager), never by DCP from a path


def _item_bytes(item: Any) -> int:
    if item.tensor_data is None:
        return 0
    return int(np.prod(item.tensor_data.chunk.sizes)) * item.tensor_data.properties.dtype.itemsize


def _values_of(local: SavePlan, plan: SavePlan, planner: SavePlanner) -> dict[str, Any]:
    """Every non-tensor value of this rank's state. DCP's default planner plans them on the
    coordinator only; every rank stores its own (its state is its planner's ``state_dict``)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise UsageError("TieredWriter needs a planner with lookup_object (DCP's DefaultSavePlanner)")
    fqns = [item.index.fqn for item in (*local.items, *plan.items) if item.type == WriteItemType.BYTE_IO]
    state = getattr(planner, "state_dict", None)
    if isinstance(state, Mapping):
        fqns += [fqn for fqn, value in state.items() if isinstance(fqn, str) and not isinstance(value, torch.Tensor)]
    return {fqn: lookup(MetadataIndex(fqn)) for fqn in dict.fromkeys(fqns)}


def _blob(value: Any) -> dict[str, ChunkOf] | None:
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


def _restated(message: str, mapping: Mapping[str, Sequence[str | int]], *sections: Mapping[str, Any]) -> str:
    """``message`` with the paths of this module's own state (``state["dcp"]["objects"]["a.b"]``)
    replaced by those of the state handed to ``dcp.save`` (``state["a"]["b"]``)."""
    for section, values in zip(("blobs", "objects"), sections, strict=True):
        for fqn, value in values.items():
            ours = path_text((_ROOT, section, fqn, *value)) if section == "blobs" else path_text((_ROOT, section, fqn))
            message = message.replace(ours, path_text(tuple(mapping.get(fqn, (fqn,)))))
    return f"dcp.save: {message}"


def _planner_data(plan: SavePlan) -> dict[str, list[str | int]]:
    """DCP's flattening map (flattened key -> the nested key path), as the save planner recorded it."""
    mapping = plan.planner_data
    if not isinstance(mapping, Mapping):
        return {}
    return {
        fqn: list(path)
        for fqn, path in mapping.items()
        if isinstance(fqn, str) and isinstance(path, (tuple, list)) and all(type(key) in (str, int) for key in path)
    }


@dataclass(frozen=True)
class _Located:
    """What :meth:`TieredReader.read_metadata` found, for the plan and reads that follow."""

    manifest: ShardManifest
    rank: int  # whose shard holds this rank's values
    structure: Structure
    where: Mapping[MetadataIndex, tuple[int, str]]
    complex_dtypes: Mapping[str, str]
    values: Mapping[str, tuple[str, ...]]  # fqn -> the path of its stored value


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
        self._step = None if step is None else _step_of(step, manager)
        self._located: _Located | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """Make ``checkpoint_id`` (a step, see the module doc) the step to read; None keeps the step."""
        if checkpoint_id is not None:
            self._step = _step_of(checkpoint_id, self._manager)
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
        first = self._ranks[0]
        rank = first if first < manifest.world_size else 0  # a new rank takes rank 0's values
        structure = store.read_parts(step, manifest.shard(rank), ())[0].structure
        if rank != 0 and "planner_data" not in _keys_at(structure, (_ROOT,)):
            # written by a TieredWriter of 0.2, which stored the values in rank 0's shard only
            rank = 0
            structure = store.read_parts(step, manifest.shard(rank), ())[0].structure
        what = f"rank {rank} of step {step}"
        complex_dtypes = _json_at(structure, ("complex",), what)
        if any(dtype not in _COMPLEX_DTYPES for dtype in complex_dtypes.values()):
            raise ShardFormatError(f"{what}: dcp/complex names a dtype other than {sorted(_COMPLEX_DTYPES)}")
        chunks = self._chunks(manifest, complex_dtypes)
        state: dict[str, Any] = {}
        for index, (_holder, chunk) in chunks.items():
            fqn, pairs = index.fqn, index.fqn in complex_dtypes
            if pairs and chunk.global_shape[-1:] != (2,):
                raise ShardFormatError(f"{what}: {chunk.name!r} is not the float pairs of a complex tensor")
            shape, sizes = (chunk.global_shape[:-1], chunk.sizes[:-1]) if pairs else (chunk.global_shape, chunk.sizes)
            dtype = _COMPLEX_DTYPES[complex_dtypes[fqn]] if pairs else _torch_dtype(chunk.dtype)
            entry = state.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), []))
            entry.chunks.append(ChunkStorageMetadata(torch.Size(index.offset or ()), torch.Size(sizes)))
        where = {index: (holder, chunk.name) for index, (holder, chunk) in chunks.items()}
        values: dict[str, tuple[str, ...]] = {}
        for section in ("blobs", "objects"):
            for fqn in _keys_at(structure, (_ROOT, section)):
                if isinstance(fqn, str):
                    values[fqn] = (_ROOT, section, fqn)
                    state[fqn] = BytesStorageMetadata()
        planner_data = _json_at(structure, ("planner_data",), what)
        paths = planner_data.values()
        if not all(isinstance(path, list) and all(type(key) in (str, int) for key in path) for path in paths):
            raise ShardFormatError(f"{what}: dcp/planner_data must map each key to a list of str and int keys")
        self._located = _Located(manifest, rank, structure, where, complex_dtypes, values)
        return Metadata(
            state_dict_metadata=state,
            planner_data={fqn: tuple(path) for fqn, path in planner_data.items()} if planner_data else None,
        )

    def _chunks(
        self, manifest: ShardManifest, complex_dtypes: Mapping[str, str]
    ) -> dict[MetadataIndex, tuple[int, ChunkRecord]]:
        """Every saved chunk's index and where it is read from: this process's shard if it holds a copy."""
        where: dict[MetadataIndex, tuple[int, ChunkRecord]] = {}
        for record in manifest.shards:
            for chunk in record.chunks:
                if chunk.name.startswith(_VALUE_PREFIXES):
                    continue
                fqn = _fqn_of(chunk.name, f"rank {record.rank} of step {manifest.step}")
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
                value_arrays.update(self._value_arrays(located, item.storage_index.fqn))
        for name, holder in value_arrays.items():
            wanted.setdefault(holder, set()).add(name)
        step = located.manifest.step
        ranks = sorted(wanted)
        parts = run_parallel(
            lambda rank: self._manager.store.read_parts(step, located.manifest.shard(rank), wanted[rank])[0].arrays,
            ranks,
            None,
        )
        read = dict(zip(ranks, parts, strict=True))
        arrays = {name: read[holder][name] for name, holder in value_arrays.items()}
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
        return _done(None)

    def _value_arrays(self, located: _Located, fqn: str) -> dict[str, int]:
        """The arrays of a stored value, each with the rank whose shard holds it (a value's
        array equal on several ranks may have been written by one of them)."""
        path = located.values[fqn]
        replicas = dict(located.manifest.shard(located.rank).replicas)
        return {
            name: replicas.get(name, located.rank)
            for name, name_path in located.structure.paths.items()
            if name_path[: len(path)] == path
        }

    def _require_located(self) -> _Located:
        if self._located is None:
            raise UsageError("TieredReader: read_metadata must come first (dcp.load calls it)")
        return self._located

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _value(located: _Located, fqn: str, arrays: Mapping[str, np.ndarray]) -> Any:
    """A stored non-tensor value as it was handed to ``dcp.save``."""
    path = located.values[fqn]
    if path[1] == "objects":
        return located.structure.build_at(path, arrays, torch=True)  # each array as it was saved
    built = located.structure.build_at(path, arrays)
    if not (isinstance(built, dict) and len(built) == 1):
        raise ShardFormatError(f"rank {located.rank} of step {located.manifest.step}: {fqn!r} is not a stored value")
    ((kind, array),) = built.items()
    if kind == "bytes":
        return np.asarray(array).tobytes()
    if kind == "bytesio":
        return io.BytesIO(np.asarray(array).tobytes())
    if kind == "ndarray":
        return array
    if kind == "npscalar":
        return array[()]
    raise ShardFormatError(f"rank {located.rank} of step {located.manifest.step}: {fqn!r} has unknown kind {kind!r}")


def _keys_at(structure: Structure, path: tuple[str, ...]) -> list[str | int]:
    try:
        return structure.keys_at(path)
    except KeyError:
        return []


def _json_at(structure: Structure, path: tuple[str, ...], what: str) -> dict[str, Any]:
    """A JSON dict the writer stored under ``dcp`` (empty if absent: an older checkpoint)."""
    try:
        value = structure.build_at((_ROOT, *path), {})
    except KeyError:
        return {}
    if not isinstance(value, dict):
        raise ShardFormatError(f"{what}: {'/'.join((_ROOT, *path))} is not a dict")
    return value


def _fqn_of(name: str, what: str) -> str:
    """The DCP key of a chunk's tensor name (``dcp/tensors/<fqn>/<offsets>``)."""
    if not name.startswith(_TENSORS_PREFIX) or name.count("/") != 3:
        raise ShardFormatError(f"{what}: {name!r} is not a chunk written by TieredWriter")
    fqn, _offsets = name[len(_TENSORS_PREFIX) :].split("/")
    return unescape(fqn)


def _torch_dtype(code: str) -> torch.dtype:
    return to_torch(np.empty(0, dtype=DTYPES[code])).dtype
