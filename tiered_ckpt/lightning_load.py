"""Reading what :class:`~tiered_ckpt.lightning.TieredCheckpointIO` wrote, outside a Trainer:
its pointers (their format, read strictly), a step's checkpoint dict (:func:`read_checkpoint`),
and :func:`load_from_checkpoint`, which builds a module for evaluation or serving from a
pointer or a step's directory, reading only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from tiered_ckpt.build import open_store
from tiered_ckpt.dist.replicas import missing
from tiered_ckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError, UsageError, restated
from tiered_ckpt.format.layout import parse_step_dir_name
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.strict_json import Fields, load_object
from tiered_ckpt.options import LocalOptions, RemoteOptions
from tiered_ckpt.tiers.store import TieredStore

__all__ = [
    "POINTER_FORMAT",
    "POINTER_VERSION",
    "device_of",
    "load_from_checkpoint",
    "parse_pointer",
    "read_checkpoint",
    "read_step",
]

POINTER_FORMAT = "tiered-ckpt-lightning-pointer"
"""The ``format`` field of the pointer file the plugin writes at each path Lightning saves to."""
POINTER_VERSION = 1
"""The pointer's ``version`` this release writes and reads."""
_POINTER_MAX_BYTES = 64 * 1024  # a pointer is ~200 bytes; anything much larger is not one


def parse_pointer(target: Path) -> tuple[int, str, str | None]:
    """The step, local directory and remote URL the pointer at ``target`` names, read strictly:
    :class:`UsageError` if it is no pointer, :class:`ManifestError` if it is a damaged one."""
    wrote = "TieredCheckpointIO"
    if not target.is_file():
        raise UsageError(f"{target} is not a pointer {wrote} wrote (it is not a file)")
    with open(target, "rb") as file:
        data = file.read(_POINTER_MAX_BYTES + 1)
    if len(data) > _POINTER_MAX_BYTES or not data.lstrip().startswith(b"{"):
        raise UsageError(
            f"{target} is not a pointer {wrote} wrote (a torch checkpoint? TorchCheckpointIO reads those); "
            "it names no step"
        )
    document = load_object(data, str(target), _POINTER_MAX_BYTES)
    if document.get("format") != POINTER_FORMAT:
        raise UsageError(f"{target} is a JSON file, not a pointer {wrote} wrote")
    fields = Fields(document, str(target), "")
    fields.reject_unknown({"format", "version", "step", "local", "remote"})
    if fields.integer("version", minimum=1) != POINTER_VERSION:
        raise UsageError(f"{target}: pointer version {document['version']}; this version reads {POINTER_VERSION}")
    step = fields.integer("step", minimum=0)
    local = fields.string("local")
    remote = None if document.get("remote", "") is None else fields.string("remote")
    return step, local, remote


def load_from_checkpoint(
    cls: type[Any],
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    map_location: Any | None = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """What ``cls.load_from_checkpoint(path)`` gives (``cls`` a ``LightningModule`` or
    ``LightningDataModule`` class) for a checkpoint :class:`TieredCheckpointIO` saved, which
    Lightning's own method cannot read (it reads files with ``torch.load``).

    ``path`` is a pointer the plugin wrote (the step is read from the manager's local
    directory the pointer names, where it is there, else from its bucket), or a step's
    directory on disk or in a bucket (``/nvme/ckpt/step-000000000100``,
    ``s3://bucket/run/step-000000000100``); ``storage_options`` are the bucket's client's. The
    module is built as Lightning builds it: from the saved hyper-parameters, those given in
    ``kwargs`` replacing them, then ``on_load_checkpoint`` and ``load_state_dict`` (``strict``);
    its tensors on the CPU, or on ``map_location``. Reads only: no lock is taken and nothing is
    written (an evaluation may run beside the training job), every array verified as it is
    read. Raises :class:`CheckpointNotFoundError` for a path that does not exist,
    :class:`UsageError` for one that names no step, a step saved by several ranks, and what a
    restore raises.
    """
    _check_module_class(cls)
    device = device_of(map_location)
    checkpoint = read_checkpoint(path, storage_options=storage_options)
    if device is not None:
        checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda tensor: tensor.to(device))
    return _built(cls, checkpoint, strict, kwargs)


def read_checkpoint(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint dict the plugin saved as the step ``path`` names (a pointer, or a step's
    directory on disk or in a bucket, as :func:`load_from_checkpoint` takes), its tensors on the
    CPU, every array verified as it is read; reads only (no lock, nothing written)."""
    step, local, remote = _located(path)
    with tempfile.TemporaryDirectory(prefix="tiered-ckpt-load-") as scratch:
        here = local if local is not None and Path(local).is_dir() else scratch  # a machine without the disk
        bucket = RemoteOptions(remote, storage_options=storage_options or {}) if remote is not None else None
        return read_step(open_store(LocalOptions(Path(here)), bucket), step)


def _located(path: str | os.PathLike[str]) -> tuple[int, str | None, str | None]:
    """The step ``path`` names, and the local directory and remote URL holding it (None: not there)."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise UsageError(f"{text!r:.200} is not a path of text")
    parent, _, name = text.rstrip("/").rpartition("/")
    step = parse_step_dir_name(name)
    if "://" in text:
        if step is None:
            raise UsageError(f"{text}: a checkpoint in a bucket is named by its step's directory (step-<12 digits>)")
        return step, None, parent
    target = Path(text).absolute()
    if not target.exists():
        raise CheckpointNotFoundError(f"Checkpoint file not found: {text} ({target} does not exist)")
    if step is not None and target.is_dir():
        return step, str(target.parent), None
    return parse_pointer(target)


def read_step(store: TieredStore, step: int) -> dict[str, Any]:
    """The checkpoint dict of ``step``, read from the nearest tier of ``store`` holding it,
    verified: its one rank's, or, for a step of several data-parallel ranks
    (:class:`~tiered_ckpt.lightning.TieredDDPStrategy`), rank 0's, with the arrays other ranks
    wrote for it; :class:`UsageError` for a step of sharded ranks (a state of DTensors)."""
    in_local = step in store.local.steps()
    in_remote = not in_local and store.remote is not None and step in store.remote.steps()
    if not (in_local or in_remote):
        raise IncompleteCheckpointError(f"{store.where()}: step {step} is committed in no tier")
    manifest, _remote = store.manifests(step, in_local=in_local, in_remote=in_remote)
    record = manifest.shard(0)
    if manifest.world_size > 1 and (manifest.sharded_keys or not all(each.chunks for each in manifest.shards)):
        raise UsageError(
            f"{store.where()}: step {step} was saved by {manifest.world_size} ranks, each its own state (not data "
            "parallel); a Lightning module is loaded from a step of one rank, or of data-parallel ranks "
            "(TieredDDPStrategy): restore the others with a CheckpointManager"
        )
    state, _tier = store.read_parts(step, record, lambda structure: structure)
    if state.structure.chunks:
        raise UsageError(
            f"{store.where()}: step {step} holds the shards of {manifest.world_size} ranks (a state of DTensors); "
            "a Lightning module is loaded from a whole state (restore the shards with a CheckpointManager)"
        )
    arrays = dict(state.arrays)
    for writer, names in sorted(missing([record]).items()):  # what other ranks wrote for rank 0, once each
        try:
            arrays.update(store.read_parts(step, manifest.shard(writer), sorted(names))[0].arrays)
        except IncompleteCheckpointError as exc:
            raise restated(
                exc,
                f"{exc}: rank {writer} wrote {len(names)} arrays of this data-parallel step into its own shard, on "
                "its own disk; read the step from the bucket (a manager with remote.url uploads every rank's "
                "shards), or from a directory holding every rank's shards",
            ) from exc
    return FlatState(arrays, state.structure).unflatten(torch=True)  # type: ignore[no-any-return]


def _check_module_class(cls: Any) -> None:
    import lightning.pytorch as pl

    if not (isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))):
        raise UsageError(f"{cls!r:.80} is not a LightningModule or LightningDataModule class")


def _built(cls: type[Any], checkpoint: dict[str, Any], strict: bool | None, kwargs: dict[str, Any]) -> Any:
    """The module (or data module) Lightning's ``load_from_checkpoint`` builds from ``checkpoint``."""
    import lightning.pytorch as pl
    from lightning.pytorch.core.saving import _load_state  # its build from a dict: no public function takes one

    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = cast(pl.LightningModule, _load_state(cls, checkpoint, strict=strict, **kwargs))
    tensors = [value for value in checkpoint.get("state_dict", {}).values() if isinstance(value, torch.Tensor)]
    return model.to(tensors[0].device) if tensors else model


def device_of(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise UsageError(f"map_location must be None, a torch.device or a device's name, got {map_location!r:.80}")
