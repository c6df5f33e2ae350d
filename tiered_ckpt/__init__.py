"""tiered_ckpt: sharded, verified, crash-safe checkpoints for distributed training.

``import tiered_ckpt`` imports the error tree only; every other name is imported when it is
first used (``tiered_ckpt.CheckpointManager``, ``from tiered_ckpt import ...``), so that a
command or a rank process pays for what it calls (numpy, fsspec, ml_dtypes: most of a
second), not for the whole package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from tiered_ckpt.config import Config, load_config
    from tiered_ckpt.dist.coordination import Coordinator, SingleProcessCoordinator, TorchDistributedCoordinator
    from tiered_ckpt.dist.reshard import partition_sizes
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

_LAZY = {  # each name imported on first use, from its module
    **dict.fromkeys(["Config", "load_config"], "tiered_ckpt.config"),
    **dict.fromkeys(
        ["Coordinator", "SingleProcessCoordinator", "TorchDistributedCoordinator"], "tiered_ckpt.dist.coordination"
    ),
    "partition_sizes": "tiered_ckpt.dist.reshard",
    **dict.fromkeys(["ExportResult", "export_safetensors"], "tiered_ckpt.export"),
    **dict.fromkeys(["ShardManifest", "ShardRecord"], "tiered_ckpt.format.manifest"),
    **dict.fromkeys(
        ["CheckpointManager", "PruneResult", "PullResult", "PushResult", "RestoreResult", "SaveHandle"],
        "tiered_ckpt.manager",
    ),
    **dict.fromkeys(["load_sharded", "save_sharded"], "tiered_ckpt.oneshot"),
    **dict.fromkeys(
        [
            "LocalOptions",
            "PeerOptions",
            "RemoteOptions",
            "RestoreOptions",
            "RuntimeOptions",
            "TierOptions",
            "UploadOptions",
        ],
        "tiered_ckpt.options",
    ),
    "TieredStore": "tiered_ckpt.tiers.store",
    **dict.fromkeys(["Lag", "ShardCheck", "StepStatus", "VerifyResult"], "tiered_ckpt.tiers.survey"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # a submodule, as the package's imports used to make every one an attribute
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
