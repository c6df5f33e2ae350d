"""tiered_ckpt: sharded, verified, crash-safe checkpoints for distributed training."""

from tiered_ckpt.config import Config, load_config
from tiered_ckpt.dist.coordination import Coordinator, SingleProcessCoordinator, TorchDistributedCoordinator
from tiered_ckpt.dist.reshard import partition_sizes
from tiered_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatchError,
    ConfigError,
    CoordinationError,
    DirectoryInUseError,
    IncompleteCheckpointError,
    InvalidStateError,
    ManifestError,
    RemoteError,
    RemoteInUseError,
    ReshardError,
    SaveError,
    ShardCountMismatchError,
    ShardFormatError,
    UploadError,
    UsageError,
    WorldSizeMismatchError,
)
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.manager import CheckpointManager, RestoreResult, SaveHandle
from tiered_ckpt.oneshot import load_sharded, save_sharded
from tiered_ckpt.options import LocalOptions, RemoteOptions, UploadOptions
from tiered_ckpt.tiers.store import TieredStore
from tiered_ckpt.tiers.survey import Lag

__all__ = [
    "CheckpointManager",
    "SaveHandle",
    "RestoreResult",
    "save_sharded",
    "load_sharded",
    "partition_sizes",
    "load_config",
    "Config",
    "ShardManifest",
    "ShardRecord",
    "Coordinator",
    "SingleProcessCoordinator",
    "TorchDistributedCoordinator",
    "CheckpointError",
    "CheckpointExistsError",
    "ChecksumMismatchError",
    "ConfigError",
    "CoordinationError",
    "DirectoryInUseError",
    "IncompleteCheckpointError",
    "InvalidStateError",
    "ManifestError",
    "RemoteError",
    "RemoteInUseError",
    "ReshardError",
    "SaveError",
    "ShardCountMismatchError",
    "ShardFormatError",
    "UploadError",
    "UsageError",
    "WorldSizeMismatchError",
    "LocalOptions",
    "RemoteOptions",
    "UploadOptions",
    "TieredStore",
    "Lag",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiered-ckpt")  # the one place of the version: pyproject.toml
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()
