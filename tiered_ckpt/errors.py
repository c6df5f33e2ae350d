"""The one exception tree of tiered_ckpt.

Every error this library raises on purpose derives from :class:`CheckpointError`,
so ``except CheckpointError`` catches all of them. Data errors say that what is
stored (or handed to ``save``) is not what it should be; usage errors say that the
library was called wrongly::

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
    │   └── RemoteInUseError          another live run writes under the remote URL
    │                                 (raised only with other_owners="refuse")
    ├── UploadError                   a step could not be committed remotely (.tries)
    ├── CoordinationError             a collective with the other ranks failed (a rank
    │                                 died or timed out; the cause is chained)
    ├── ConfigError                   a config file, variable or option is not valid
    │                                 (also a ValueError)
    └── UsageError                    an operation called out of order or where it does
                                      not apply (a closed manager, pull on one rank of many),
                                      or with a keyword it does not take

Messages name the directory or file, and the rank or field, that the error is about.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

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
    "RemoteInUseError",
    "UploadError",
    "CoordinationError",
    "ConfigError",
    "invalid_option",
    "UsageError",
    "ErrorBox",
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
    """The remote store failed a request; ``transient`` is True when a retry may succeed.

    ``tries`` is the number of tries made of the operation that failed; ``deadline`` is
    True when it stopped because its deadline came (see ``upload_deadline_seconds``);
    ``exhausted`` is True when a lower layer already spent the tries on it (the retry
    policy does not try it again, though a later try of the whole step may succeed).
    """

    tries: int = 1
    deadline: bool = False
    exhausted: bool = False

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class RemoteInUseError(RemoteError):
    """Another live run holds a lease on the remote URL (see :mod:`~tiered_ckpt.tiers.owners`), and the
    remote options say ``other_owners="refuse"``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False)


class UploadError(CheckpointError):
    """Step ``step`` could not be committed to the remote tier after ``tries`` tries.

    The local copy of the step is kept; ``__cause__`` holds the last error. ``transient``
    is True when only transient failures (an unreachable or failing bucket) kept the step
    from its remote commit until its deadline: ``wait(uploaded=True)`` raises such an
    error, ``save`` and ``close`` do not (the step stays local-only).
    """

    def __init__(self, message: str, *, step: int, tries: int, transient: bool = False) -> None:
        super().__init__(message)
        self.step = step
        self.tries = tries
        self.transient = transient


class CoordinationError(CheckpointError):
    """A collective call with the other ranks failed: a rank died, or did not join in time.

    ``__cause__`` holds the backend's error. The checkpoint being saved is not committed.
    """


class ConfigError(CheckpointError, ValueError):
    """A configuration or option is not valid; the message names the file (or variable) and the key.

    An option's own check sets ``field`` and ``problem`` (``"keep_last"``, ``"must be >= 1,
    got 0"``) so that a config loader can name the file and table it came from.
    """

    field: str | None = None
    problem: str | None = None


def invalid_option(field: str, problem: str) -> ConfigError:
    """The :class:`ConfigError` of an option that fails its check: "``field`` ``problem``"."""
    error = ConfigError(f"{field} {problem}")
    error.field, error.problem = field, problem
    return error


class UsageError(CheckpointError):
    """The library was called wrongly: after ``close``, an operation this object cannot do, or an
    unknown keyword argument (not a ``TypeError``: every error raised on purpose is a CheckpointError)."""


def restated(error: CheckpointError, message: str) -> CheckpointError:
    """A copy of ``error`` (same class, same fields such as ``step``) that says ``message``."""
    # Built without __init__: some classes take keyword-only fields, copied over instead.
    copy = type(error).__new__(type(error))
    Exception.__init__(copy, message)
    copy.__dict__.update(error.__dict__)
    return copy


class ErrorBox:
    """Where background threads leave their failures until a caller's thread raises them.

    Each failure is raised once: :meth:`raise_first` raises the oldest one not yet
    raised. A failure raised by another path (``SaveHandle.wait``, or another rank's copy
    raised inside a collective) is passed to :meth:`mark_raised`: it is then dropped if
    it is waiting here, or, if it has not arrived yet, dropped when it arrives. Two
    errors are the same failure when they are the same object, or upload failures of
    the same step. Thread-safe; never calls back into its owner.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[CheckpointError] = []
        self._expected: set[Hashable] = set()  # raised already; their own copy is still to come

    @staticmethod
    def _key(error: CheckpointError) -> Hashable:
        return ("upload", error.step) if isinstance(error, UploadError) else id(error)

    def put(self, error: CheckpointError) -> None:
        """Record a background failure."""
        with self._lock:
            key = self._key(error)
            if key in self._expected:
                self._expected.discard(key)
            else:
                self._errors.append(error)

    def mark_raised(self, error: CheckpointError) -> None:
        """Note that ``error`` reached the caller another way, so it is not raised here again."""
        with self._lock:
            key = self._key(error)
            waiting = [pending for pending in self._errors if self._key(pending) == key]
            if waiting:
                self._errors.remove(waiting[0])
            elif isinstance(error, UploadError):
                self._expected.add(key)

    def raise_first(self, *, transient: bool = True) -> None:
        """Raise the oldest failure not yet raised, if any (and forget it); ``transient=False``
        passes over the upload failures that only missed their deadline (see :class:`UploadError`)."""
        with self._lock:
            chosen = [error for error in self._errors if transient or not _missed_deadline(error)]
            if chosen:
                self._errors.remove(chosen[0])
        if chosen:
            raise chosen[0]

    def take_transient(self) -> list[UploadError]:
        """Remove and return the upload failures that only missed their deadline, oldest first."""
        with self._lock:
            taken = [error for error in self._errors if _missed_deadline(error)]
            self._errors = [error for error in self._errors if not _missed_deadline(error)]
        return taken  # type: ignore[return-value]


def _missed_deadline(error: CheckpointError) -> bool:
    return isinstance(error, UploadError) and getattr(error, "transient", False)
