"""torch glue: tensor views and the ``torch.distributed.checkpoint`` storage backend.

``tiered_ckpt.torch.tensors`` never imports torch; the DCP backend (``TieredReader``,
``TieredWriter``) does, so it is imported on first use.
"""

from typing import Any

__all__ = ["TieredReader", "TieredWriter"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tiered_ckpt.torch import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module 'tiered_ckpt.torch' has no attribute {name!r}")
