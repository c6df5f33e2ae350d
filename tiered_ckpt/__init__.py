"""tiered_ckpt: sharded, verified, crash-safe checkpoints for distributed training."""

from tiered_ckpt.config import Config, load_config
from tiered_ckpt.dist.coordination import Coordinator, SingleProcessCoordinator, TorchDistributedCoordinator
from tiered_ckpt.dist.reshard import partition_sizes
from tiered_ckpt.errors import (
    BackgroundError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    CoordinationError,
    CorruptCheckpointError,
    DirectoryInUseError,
    IncompleteCheckpointError,
    InvalidStateError,
    ManifestError,
    MemoryBudgetError,
    PeerError,
    RankFailedError,
    RemoteError,
    RemoteInUseError,
    ReshardError,
    Retryable,
    SaveError,
    ShardCountMismatchError,
    ShardFormatError,
    StorageError,
    UploadError,
    UsageError,
    WorldSizeMismatchError,
)
from tiered_ckpt.export import ExportResult, export_safetensors
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.manager import CheckpointManager, PruneResult, PullResult, PushResult, RestoreResult, SaveHandle
from tiered_ckpt.oneshot import load_sharded, save_sharded
from tiered_ckpt.options import (
    LocalOptions,
    PeerOptions,
    RemoteOptions,
    RestoreOptions,
    RuntimeOptions,
    TierOptions,
    UploadOptions,
)
from tiered_ckpt.tiers.store import TieredStore
from tiered_ckpt.tiers.survey import Lag, ShardCheck, StepStatus, VerifyResult

__all__ = [
    # the manager, its options and its results
    "CheckpointManager",
    "LocalOptions",
    "RemoteOptions",
    "UploadOptions",
    "RestoreOptions",
    "RuntimeOptions",
    "PeerOptions",
    "TierOptions",
    "load_config",
    "Config",
    "SaveHandle",
    "RestoreResult",
    "PullResult",
    "PushResult",
    "PruneResult",
    "Lag",
    # one-shot functions
    "save_sharded",
    "load_sharded",
    "partition_sizes",
    "export_safetensors",
    "ExportResult",
    # what is stored, and reading it
    "ShardManifest",
    "ShardRecord",
    "TieredStore",
    "StepStatus",
    "ShardCheck",
    "VerifyResult",
    # processes
    "Coordinator",
    "SingleProcessCoordinator",
    "TorchDistributedCoordinator",
    # the error tree (tiered_ckpt.errors)
    "CheckpointError",
    "CorruptCheckpointError",
    "ManifestError",
    "ShardCountMismatchError",
    "ChecksumMismatchError",
    "IncompleteCheckpointError",
    "ShardFormatError",
    "StorageError",
    "RemoteError",
    "RemoteInUseError",
    "DirectoryInUseError",
    "PeerError",
    "MemoryBudgetError",
    "BackgroundError",
    "SaveError",
    "UploadError",
    "UsageError",
    "ConfigError",
    "InvalidStateError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "WorldSizeMismatchError",
    "ReshardError",
    "CoordinationError",
    "RankFailedError",
    "Retryable",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiered-ckpt")  # the one place of the version: pyproject.toml
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()
