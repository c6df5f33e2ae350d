"""The step a ``torch.distributed.checkpoint`` ``checkpoint_id`` names, for the writer and the reader.

``checkpoint_id`` names the step, as it names the directory for DCP's
``FileSystemWriter``: ``dcp.save(..., checkpoint_id=20, storage_writer=writer)`` saves
step 20 (a writer may be reused for every step), ``dcp.load(..., checkpoint_id=10,
storage_reader=reader)`` loads step 10. Accepted: an ``int`` step, a string of its
digits (``"10"``), or the step's directory as this library lays it out, under the
manager's ``local.dir`` or ``remote.url`` (``<local.dir>/step-000000000010``). Anything
else raises :class:`UsageError` (never a silent other step).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import UsageError
from tiered_ckpt.format.layout import parse_step_dir_name, step_dir_name
from tiered_ckpt.manager import CheckpointManager

__all__ = ["step_of"]


def step_of(checkpoint_id: Any, manager: CheckpointManager) -> int:
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
    """True if ``parent`` is the directory holding the manager's steps: its ``local.dir`` or ``remote.url``."""
    remote = manager.options.remote
    if remote is not None and parent == remote.url.rstrip("/"):
        return True
    if "://" in parent or not parent:
        return False
    return Path(parent).resolve() == manager.root.resolve()
