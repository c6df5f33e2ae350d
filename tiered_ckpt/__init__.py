"""tiered_ckpt: sharded, verified, crash-safe checkpoints for distributed training."""

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    InvalidStateError,
    ManifestError,
    ShardCountMismatchError,
    ShardFormatError,
    WorldSizeMismatchError,
)
from .manifest import ShardManifest, ShardRecord
from .sharded import load_sharded, save_sharded

__all__ = [
    "save_sharded",
    "load_sharded",
    "ShardManifest",
    "ShardRecord",
    "CheckpointError",
    "CheckpointExistsError",
    "ChecksumMismatchError",
    "IncompleteCheckpointError",
    "InvalidStateError",
    "ManifestError",
    "ShardCountMismatchError",
    "ShardFormatError",
    "WorldSizeMismatchError",
]

__version__ = "0.1.0"
