"""A Lightning ``.ckpt`` file of a step :class:`~tiered_ckpt.lightning.TieredCheckpointIO` saved,
for the tools that take a checkpoint as one file (``Model.load_from_checkpoint(path)``, a model
hub, an evaluation harness).

A ``.ckpt`` is torch's checkpoint format: a zip whose index is a pickle. This module writes one
only because such a tool asks for it, and only of what ``torch.load(path, weights_only=True)``
reads, the unpickler that builds nothing but tensors and plain values: dicts, lists, tuples,
tensors, ``int``, ``float``, ``bool``, ``str``, ``bytes``, ``complex`` and None. A numpy array
(a value torch has no tensor for as it was saved) becomes a tensor. Anything else is refused
before a byte is written, naming its path. Nothing here reads a pickle.

By default the file holds the weights and what builds the module: ``state_dict``,
``hyper_parameters`` (``hparams_name``), ``epoch``, ``global_step`` and
``pytorch-lightning_version``. ``full=True`` writes the whole checkpoint (the optimizers, the
loops, the callbacks), which a plain Lightning ``Trainer`` resumes from.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch

from tiered_ckpt.errors import InvalidStateError, UsageError
from tiered_ckpt.export import ExportedFile
from tiered_ckpt.io.durable import atomic_write
from tiered_ckpt.io.hashing import Hasher, hashing_writer
from tiered_ckpt.lightning_load import read_checkpoint
from tiered_ckpt.torch.tensors import to_torch

__all__ = ["WEIGHTS_KEYS", "export_lightning", "write_lightning_file"]

WEIGHTS_KEYS = ("state_dict", "hyper_parameters", "hparams_name", "epoch", "global_step", "pytorch-lightning_version")
"""The keys of a checkpoint a weights-only ``.ckpt`` holds (those it has)."""

_LEAVES = (torch.Tensor, int, float, bool, str, bytes, complex, type(None))


def export_lightning(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    full: bool = False,
) -> ExportedFile:
    """Write the step ``path`` names (a pointer the plugin wrote, or a step's directory on disk or
    in a bucket, as :func:`~tiered_ckpt.lightning.load_from_checkpoint` takes) to the ``.ckpt``
    file ``out`` (see the module doc). Reads the step verified, from the nearest tier, and only
    reads there; ``out`` is written through a temp file, fsynced and renamed, so it holds either
    what it held or the whole new file. Returns its name, size and sha256."""
    return write_lightning_file(read_checkpoint(path, storage_options=storage_options), out, full=full)


def write_lightning_file(
    checkpoint: dict[str, Any], out: str | os.PathLike[str], *, full: bool = False
) -> ExportedFile:
    """Write ``checkpoint`` (a Lightning checkpoint dict; with ``full=False`` its
    :data:`WEIGHTS_KEYS` only) to the ``.ckpt`` file ``out``, durably (see :func:`export_lightning`).
    Raises :class:`UsageError` for a dict without a ``state_dict`` and :class:`InvalidStateError`
    naming the first value ``torch.load(weights_only=True)`` could not read back."""
    target = Path(out)
    if target.is_dir() or not target.parent.is_dir():
        problem = "is a directory" if target.is_dir() else f"is in {target.parent}, which is not a directory"
        raise UsageError(f"{target}: the .ckpt file to write {problem}")
    if "state_dict" not in checkpoint:
        raise UsageError(f"{target}: the checkpoint holds no state_dict (keys: {sorted(map(str, checkpoint))[:10]})")
    chosen = checkpoint if full else {key: checkpoint[key] for key in WEIGHTS_KEYS if key in checkpoint}
    plain = _plain(chosen, "checkpoint")
    hasher = Hasher("full")

    def write(file: Any) -> int:
        sink = _Sink(hashing_writer(file, hasher))
        torch.save(plain, cast(IO[bytes], sink))
        return sink.size

    size = atomic_write(target, write)
    return ExportedFile(target.name, size, hasher.digest().sha256)


class _Sink:
    """The file-like object ``torch.save`` writes a zip to: every byte to ``write``, counted."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self.size = 0

    def write(self, data: bytes) -> int:
        self._write(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _plain(value: Any, where: str) -> Any:
    """``value`` with numpy values as tensors and Python numbers; :class:`InvalidStateError` naming
    ``where`` (the path) for a value the weights-only unpickler does not build."""
    if isinstance(value, np.ndarray):
        try:  # ascontiguousarray makes a 0-d array 1-d: the shape is put back
            return to_torch(np.ascontiguousarray(value).reshape(value.shape))
        except TypeError:
            raise InvalidStateError(f"{where}: a numpy array of {value.dtype}, which torch has no tensor for") from None
    if isinstance(value, np.generic):
        return _plain(value.item(), where)  # a datetime64's item is no plain value: checked as any
    if type(value) in (dict, list, tuple):  # exactly: a subclass would be pickled as its class
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise InvalidStateError(f"{where}: a key {key!r:.60} that is not a str or int")
            return {key: _plain(item, f"{where}[{key!r}]") for key, item in value.items()}
        return type(value)(_plain(item, f"{where}[{i}]") for i, item in enumerate(value))
    if isinstance(value, dict):  # a dict subclass (an AttributeDict) as the plain dict it holds
        return _plain(dict(value), where)
    if type(value) in _LEAVES or type(value) is torch.nn.Parameter:
        return value
    raise InvalidStateError(
        f"{where}: a {type(value).__name__} cannot be in a .ckpt that torch.load(weights_only=True) reads"
    )
