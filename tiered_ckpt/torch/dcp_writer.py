"""``TieredWriter``: a ``torch.distributed.checkpoint`` storage writer, ``dcp.save`` through a manager.

DCP plans the save (its planners, its DTensors and ShardedTensors) while the bytes go
through this library: one safetensors shard per rank written and committed atomically,
then uploaded to the bucket. A writer's manager holds one rank per process (a
``TorchDistributedCoordinator``, or ``world_size=1``), as DCP saves; ``checkpoint_id``
names the step (:mod:`tiered_ckpt.torch.dcp_steps`).

Each rank writes its whole local plan, as DCP planned it before it removed copies other
ranks also hold: so every rank's shard holds every chunk and value that rank's state had,
and a load at the same world size reads its own shard only. What a shard holds, and how a
value is stored without pickle, is :mod:`tiered_ckpt.torch.dcp_document`'s. A non-tensor
value DCP would ``torch.save`` (a "bytes" item) is taken from the planner as the value
itself; one the reader could not give back is refused with :class:`InvalidStateError`
naming it, on every rank, before anything is written.

The call sequence, as ``dcp.save(state, storage_writer=writer, checkpoint_id=...)`` makes
it (every rank, except where it says the coordinator):

1. :meth:`TieredWriter.reset` (``checkpoint_id``): the step to write; a ``checkpoint_id``
   replaces the writer's step, so one writer saves every step.
2. :meth:`TieredWriter.set_up_storage_writer`: refuses a save with no step named.
3. :meth:`TieredWriter.prepare_local_plan`: keeps this rank's whole plan.
4. :meth:`TieredWriter.prepare_global_plan` (the coordinator): the plans as DCP made them.
5. :meth:`TieredWriter.write_data`: gives this rank's chunks and values to
   ``manager.save(step, ..., blocking=True)`` (a collective, like every save: every rank
   writes, the step commits once every rank's shard is durable, then uploads).
6. :meth:`TieredWriter.finish` (the coordinator): nothing left to do (the manifest is the
   commit marker).

``dcp.async_save`` works the same way, its write running on DCP's thread: do not call
the manager from the training loop until its future is done. DCP's process-based
``async_save`` (``AsyncCheckpointerType.PROCESS``) cannot run it: the writer writes
through this process's manager (its directory lock, uploader and coordinator), so it
refuses to be sent to DCP's checkpoint process with a :class:`UsageError` saying so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tiered_ckpt.errors import InvalidStateError, UsageError
from tiered_ckpt.format.state import ChunkOf
from tiered_ckpt.format.structure import path_text
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.torch.dcp_document import (
    VALUE_SECTIONS,
    blob_of,
    chunk_key,
    document,
    planner_paths,
    value_path,
)
from tiered_ckpt.torch.dcp_steps import step_of

__all__ = ["TieredWriter"]

_PROCESS_REFUSAL = (
    "a TieredWriter cannot be sent to another process (DCP's async_save with "
    "async_checkpointer_type=AsyncCheckpointerType.PROCESS sends it to its checkpoint process): it writes through "
    "this process's CheckpointManager, whose directory lock, uploader and coordinator live here. Use "
    "dcp.async_save with the default AsyncCheckpointerType.THREAD, or manager.save(step, state, blocking=False)"
)
_NO_STEP = "TieredWriter has no step: give it one, TieredWriter(manager, step), or checkpoint_id"


class TieredWriter(StorageWriter):
    """DCP's writes of one checkpoint, committed as ``step`` by ``manager`` (see the module doc).

    ``step`` may be left out and given to ``dcp.save`` as ``checkpoint_id`` instead; each
    ``checkpoint_id`` given to ``dcp.save`` replaces it, so one writer saves every step.
    """

    def __init__(self, manager: CheckpointManager, step: int | str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        if len(manager.ranks) != 1:
            raise UsageError(
                "TieredWriter needs a manager holding one rank per process (a TorchDistributedCoordinator, or "
                f"world_size=1), as DCP runs one rank per process; this one holds ranks {list(manager.ranks)}"
            )
        self._manager = manager
        self._step = None if step is None else step_of(step, manager)
        self._local_plan: SavePlan | None = None

    def __reduce__(self) -> NoReturn:
        raise UsageError(_PROCESS_REFUSAL)

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """Make ``checkpoint_id`` (a step, see the module doc) the step to write; None keeps the step."""
        if checkpoint_id is not None:
            self._step = step_of(checkpoint_id, self._manager)
        self._local_plan = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank writes its own shard (the commit is the manager's); refuses a save with no step named."""
        if self._step is None:
            raise UsageError(_NO_STEP)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local_plan = plan  # the whole plan: DCP's global plan then leaves other ranks' copies out
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's items (its whole local plan) as the manager's step (blocking; a collective)."""
        if self._step is None:
            raise UsageError(_NO_STEP)
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
            tensors.setdefault(item.index.fqn, {})[chunk_key(chunk.offsets)] = ChunkOf(
                data, tuple(item.tensor_data.size), tuple(chunk.offsets)
            )
        blobs: dict[str, dict[str, ChunkOf]] = {}
        objects: dict[str, Any] = {}
        for fqn, value in _values_of(local, plan, planner).items():
            blob = blob_of(value)
            if blob is not None:
                blobs[fqn] = blob
            else:
                objects[fqn] = value  # stored as JSON (its arrays as arrays), never pickled; save checks it
        planner_data = planner_paths(local.planner_data)
        try:
            self._manager.save(
                self._step, document(tensors, blobs, objects, complex_dtypes, planner_data), blocking=True
            )
        except InvalidStateError as exc:  # raised on every rank: restated with the paths the caller wrote
            raise InvalidStateError(_restated(str(exc), planner_data, blobs, objects)) from exc
        results = [
            WriteResult(index=item.index, size_in_bytes=_item_bytes(item), storage_data=None) for item in plan.items
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to do: every rank's save committed the step (its manifest is the commit marker)."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen explicitly (it needs a manager), never by DCP from a path


def _item_bytes(item: WriteItem) -> int:
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


def _restated(message: str, mapping: Mapping[str, Sequence[str | int]], *sections: Mapping[str, Any]) -> str:
    """``message`` with the paths of the saved document's values (``state["dcp"]["objects"]["a.b"]``)
    replaced by those of the state handed to ``dcp.save`` (``state["a"]["b"]``)."""
    for section, values in zip(VALUE_SECTIONS, sections, strict=True):
        for fqn, value in values.items():
            path = value_path(section, fqn)
            ours = path_text((*path, *value)) if section == "blobs" else path_text(path)
            message = message.replace(ours, path_text(tuple(mapping.get(fqn, (fqn,)))))
    return f"dcp.save: {message}"
