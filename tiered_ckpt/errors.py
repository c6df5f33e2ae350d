"""The one exception tree of tiered_ckpt.

Every error this library raises on purpose derives from :class:`CheckpointError`,
so ``except CheckpointError`` catches all of them::

    CheckpointError
    ├── ManifestError                 a manifest failed strict validation
    │   └── ShardCountMismatchError   its shard list does not match its world_size
    ├── WorldSizeMismatchError        the checkpoint was saved with another world size
    ├── IncompleteCheckpointError     no manifest, or a shard missing or short
    ├── ChecksumMismatchError         a shard's bytes do not match the recorded sha256
    ├── ShardFormatError              a shard file is not a valid shard (bytes verified)
    ├── CheckpointExistsError         refusing to overwrite a committed checkpoint
    ├── DirectoryInUseError           another save or manager holds the directory
    ├── InvalidStateError             the arrays handed to save cannot be saved as given
    ├── ReshardError                  the checkpoint cannot be resharded as asked
    ├── SaveError                     a background save failed (the cause is chained)
    ├── RemoteError                   the object store failed a request (.transient says
    │                                 whether trying again may help; the cause is chained)
    ├── UploadError                   a step could not be committed remotely (.tries)
    ├── CoordinationError             a collective with the other ranks failed (a rank
    │                                 died or timed out; the cause is chained)
    └── ConfigError                   a config file, variable or argument is not valid

Messages name the directory or file, and the rank or field, that the error is about.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ManifestError",
    "ShardCountMismatchError",
    "WorldSizeMismatchError",
    "IncompleteCheckpointError",
    "ChecksumMismatchError",
    "ShardFormatError",
    "CheckpointExistsError",
    "DirectoryInUseError",
    "InvalidStateError",
    "ReshardError",
    "SaveError",
    "RemoteError",
    "UploadError",
    "CoordinationError",
    "ConfigError",
    "restated",
]


class CheckpointError(Exception):
    """Base class of every error raised by tiered_ckpt."""


class ManifestError(CheckpointError):
    """A manifest is missing a field, has a wrong type or an inconsistent value."""


class ShardCountMismatchError(ManifestError):
    """A manifest lists a different number of shards than its ``world_size``."""


class WorldSizeMismatchError(CheckpointError):
    """A checkpoint saved with one world size was loaded expecting another."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint is not complete: no manifest, or a shard is missing or short."""


class ChecksumMismatchError(CheckpointError):
    """A shard's bytes do not hash to the sha256 its manifest records."""


class ShardFormatError(CheckpointError):
    """A shard file's header is malformed although its bytes verified."""


class CheckpointExistsError(CheckpointError):
    """A committed checkpoint already exists where a new one was to be written."""


class InvalidStateError(CheckpointError, ValueError):
    """The state handed to a save cannot be saved (bad key, unsupported dtype, ...)."""


class DirectoryInUseError(CheckpointError):
    """Another save, or another CheckpointManager, holds the directory."""


class ReshardError(CheckpointError):
    """The checkpoint cannot be resharded: inconsistent replicated or sharded arrays."""


class SaveError(CheckpointError):
    """A background save failed; ``__cause__`` holds the original exception.

    ``step`` is the step whose save failed.
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class RemoteError(CheckpointError):
    """The remote store failed a request; ``transient`` is True when a retry may succeed."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class UploadError(CheckpointError):
    """Step ``step`` could not be committed to the remote tier after ``tries`` tries.

    The local copy of the step is kept; ``__cause__`` holds the last error.
    """

    def __init__(self, message: str, *, step: int, tries: int) -> None:
        super().__init__(message)
        self.step = step
        self.tries = tries


class CoordinationError(CheckpointError):
    """A collective call with the other ranks failed: a rank died, or did not join in time.

    ``__cause__`` holds the backend's error. The checkpoint being saved is not committed.
    """


class ConfigError(CheckpointError):
    """A configuration is not valid; the message names the file (or variable) and the key."""


def restated(error: CheckpointError, message: str) -> CheckpointError:
    """A copy of ``error`` (same class, same fields such as ``step``) that says ``message``."""
    # Built without __init__: some classes take keyword-only fields, copied over instead.
    copy = type(error).__new__(type(error))
    Exception.__init__(copy, message)
    copy.__dict__.update(error.__dict__)
    return copy
