"""torch glue: tensor views, DTensor leaves and the ``torch.distributed.checkpoint`` storage backend.

- :mod:`~tiered_ckpt.torch.tensors`: torch tensors <-> the numpy arrays a shard holds.
- :mod:`~tiered_ckpt.torch.dtensor`: a DTensor as its local chunk and the box it is.
- The DCP backend: :mod:`~tiered_ckpt.torch.dcp_writer` (``TieredWriter``, ``dcp.save``),
  :mod:`~tiered_ckpt.torch.dcp_reader` (``TieredReader``, ``dcp.load``), and what both
  share: :mod:`~tiered_ckpt.torch.dcp_steps` (the step a ``checkpoint_id`` names) and
  :mod:`~tiered_ckpt.torch.dcp_document` (what a DCP save stores in each shard).

``tensors`` and ``dtensor`` never import torch; the DCP backend does, so ``TieredReader``
and ``TieredWriter`` are imported on first use (``import tiered_ckpt`` stays free of torch).
"""

from importlib import import_module
from typing import Any

__all__ = ["TieredReader", "TieredWriter"]

_HOMES = {"TieredReader": "tiered_ckpt.torch.dcp_reader", "TieredWriter": "tiered_ckpt.torch.dcp_writer"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'tiered_ckpt.torch' has no attribute {name!r}")
