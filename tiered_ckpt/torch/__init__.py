"""torch glue beyond state dicts: the ``torch.distributed.checkpoint`` storage backend.

Importing this package imports torch (an optional dependency).
"""

from .dcp import TieredReader, TieredWriter

__all__ = ["TieredReader", "TieredWriter"]
