"""The one exception tree of tiered_ckpt.

Every error this library raises on purpose derives from :class:`CheckpointError`, so
``except CheckpointError`` catches all of them, and each belongs to one of five groups
that say what to do about it::

    CheckpointError
    ├── CorruptCheckpointError        what is stored is wrong: use another step or copy
    │   ├── ManifestError             a manifest failed strict validation
    │   │   └── ShardCountMismatchError   its shard list does not match its world_size
    │   ├── ChecksumMismatchError     a shard's bytes do not match the recorded sha256
    │   ├── IncompleteCheckpointError no manifest, or a shard missing or short
    │   └── ShardFormatError          a shard file is not a valid shard (bytes verified)
    ├── StorageError                  the storage failed: try again, or fix the storage
    │   ├── RemoteError               the object store failed a request (.transient says
    │   │   │                         whether trying again may help; the cause is chained)
    │   │   └── RemoteInUseError      another live run writes under the remote URL
    │   └── DirectoryInUseError       another save or manager holds the directory (the lock)
    ├── BackgroundError               a background stage failed (.step; the cause is chained)
    │   ├── SaveError                 a step's write or commit on local disk
    │   └── UploadError               a step's commit in the bucket (.tries, .transient)
    ├── UsageError                    the call was wrong (also a ValueError)
    │   ├── ConfigError               a config file, variable or option is not valid
    │   ├── InvalidStateError         the arrays handed to save cannot be saved as given
    │   ├── CheckpointExistsError     the step is not newer than every committed one
    │   ├── WorldSizeMismatchError    the checkpoint was saved with another world size
    │   └── ReshardError              the checkpoint cannot be resharded as asked
    └── CoordinationError             a collective with the other ranks failed (a rank
        │                             died or timed out; the cause is chained)
        └── RankFailedError           another rank failed with an exception not of this tree

:class:`RemoteError`, :class:`PeerError` and :class:`UploadError` are also :class:`Retryable`:
``.transient`` says whether another try may succeed, ``.tries`` how many were made.

An error one rank raises in a collective is raised on every rank: on the others as the
same class of this tree with the same fields, its ``rank`` attribute naming the rank it
came from (None: this rank's own); an exception not of this tree (an ``OSError``, a bug)
arrives as a :class:`RankFailedError` carrying the rank, the class name and the message.
Messages name the directory or file, and the rank or field, that the error is about.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "Retryable",
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
    "WorldSizeMismatchError",
    "ReshardError",
    "CoordinationError",
    "RankFailedError",
    "TREE",
    "invalid_option",
    "restated",
    "as_upload_error",
]


class CheckpointError(Exception):
    """Base class of every error raised by tiered_ckpt.

    ``rank`` is the rank whose failure this is, when another rank raised it first in a
    collective (None: this process's own)."""

    rank: int | None = None


class Retryable:
    """Mixed into the errors whose operation another try may cure: every reader checks
    ``isinstance(error, Retryable)`` and reads these two fields, declared here once.

    ``transient``: True when trying again may succeed (an unreachable, failing or throttling
    store; a copy that did not verify), False when it cannot (access denied, no such bucket, a
    partner given up). ``tries``: the tries already made of what failed.
    """

    transient: bool = False
    tries: int = 1


# -- what is stored is wrong --------------------------------------------------------------


class CorruptCheckpointError(CheckpointError):
    """What is stored is not what it should be: a manifest, a shard's bytes or its format,
    or a checkpoint left incomplete. Nothing is read from it; another copy or step may be."""


class ManifestError(CorruptCheckpointError):
    """A manifest is missing a field, has a wrong type or an inconsistent value."""


class ShardCountMismatchError(ManifestError):
    """A manifest lists a different number of shards than its ``world_size``."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A shard's bytes do not hash to the sha256 its manifest records."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """A checkpoint is not complete: no manifest, or a shard is missing or short."""


class ShardFormatError(CorruptCheckpointError):
    """A shard file's header is malformed although its bytes verified."""


# -- the storage failed -------------------------------------------------------------------


class StorageError(CheckpointError):
    """The storage failed: the object store, or the lock of a local directory."""


class RemoteError(StorageError, Retryable):
    """The remote store failed a request; ``transient`` is True when a retry may succeed.

    ``tries`` is the number of tries made of the operation that failed; ``deadline`` is
    True when it stopped because its deadline came (see ``upload.deadline_seconds``);
    ``exhausted`` is True when a lower layer already spent the tries on it (the retry
    policy does not try it again, though a later try of the whole step may succeed).
    """

    deadline: bool = False
    exhausted: bool = False

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class RemoteInUseError(RemoteError):
    """Another live run holds a lease on the remote URL (see :mod:`~tiered_ckpt.tiers.remote.leases`), and the
    remote options say ``other_owners="refuse"``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False)


class DirectoryInUseError(StorageError):
    """Another save, or another CheckpointManager, holds the directory."""


class PeerError(StorageError, Retryable):
    """A partner rank did not take or give a copy for the peer tier: it died, hangs, or its
    bytes did not verify. Never raised by a save: the step is simply not in that tier.
    ``transient`` is False when the partner gave no answer in time: its link is given up
    for the run (a copy's bytes that did not verify, or a full memory, are transient)."""

    def __init__(self, message: str, *, transient: bool = True) -> None:
        super().__init__(message)
        self.transient = transient


class MemoryBudgetError(PeerError):
    """A partner's memory cannot hold what it is asked to (``peer.max_bytes``)."""


# -- a background stage failed ------------------------------------------------------------


class BackgroundError(CheckpointError):
    """A stage running in the background failed for step ``step``; ``__cause__`` holds the
    original exception. The manager raises it from its next call (or a future of the step's
    :class:`~tiered_ckpt.SaveHandle` does), once."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class SaveError(BackgroundError):
    """A background save failed: step ``step`` is not committed on local disk."""


class UploadError(BackgroundError, Retryable):
    """Step ``step`` could not be committed to the remote tier after ``tries`` tries.

    The local copy of the step is kept; ``__cause__`` holds the last error. ``transient``
    is True when only transient failures (an unreachable or failing bucket) kept the step
    from its remote commit until its deadline: ``wait(uploaded=True)`` raises such an
    error, ``save`` and ``close`` do not (the step stays local-only).
    """

    def __init__(self, message: str, *, step: int, tries: int, transient: bool = False) -> None:
        super().__init__(message, step=step)
        self.tries = tries
        self.transient = transient


# -- the call was wrong -------------------------------------------------------------------


class UsageError(CheckpointError, ValueError):
    """The library was called wrongly: a value it cannot take, an operation after ``close``
    or where it does not apply (pull on one rank of many)."""


class ConfigError(UsageError):
    """A configuration or option is not valid, or the ranks' options differ where every rank must have
    the same (see :mod:`~tiered_ckpt.agreement`); the message names the file (or variable) and the key.

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


class InvalidStateError(UsageError):
    """The state handed to a save cannot be saved (bad key, unsupported dtype, ...)."""


class CheckpointExistsError(UsageError):
    """A committed checkpoint already exists where a new one was to be written."""


class CheckpointNotFoundError(UsageError, FileNotFoundError):
    """A path given to load from names nothing there: also a ``FileNotFoundError``, as the
    contracts of the frameworks calling the library (Lightning's ``CheckpointIO``) expect."""


class WorldSizeMismatchError(UsageError):
    """A checkpoint saved with one world size was loaded expecting another (``reshard=True`` re-cuts it)."""


class ReshardError(UsageError):
    """The checkpoint cannot be resharded as asked: inconsistent replicated or sharded arrays,
    or ranks whose shards it does not hold."""


# -- the ranks could not agree ------------------------------------------------------------


class CoordinationError(CheckpointError):
    """A collective call with the other ranks failed: a rank died, or did not join in time.

    ``__cause__`` holds the backend's error. The checkpoint being saved is not committed.
    """


class RankFailedError(CoordinationError):
    """Rank ``rank`` failed with an exception not of this tree: ``kind`` is its class name
    (``"OSError"``), ``message`` its message."""

    def __init__(self, message: str, *, rank: int, kind: str, during: str | None = None) -> None:
        where = f' (during "{during}")' if during is not None else ""
        super().__init__(f"rank {rank}{where} failed with {kind}: {message}")
        self.rank = rank
        self.kind = kind
        self.message = message


def _tree(root: type[CheckpointError]) -> dict[str, type[CheckpointError]]:
    found = {root.__name__: root}
    for child in root.__subclasses__():
        if child.__module__ == __name__:
            found |= _tree(child)
    return found


def restated(error: CheckpointError, message: str) -> CheckpointError:
    """A copy of ``error`` (same class, same fields such as ``step``) that says ``message``."""
    # Built without __init__: some classes take keyword-only fields, copied over instead.
    copy = type(error).__new__(type(error))
    Exception.__init__(copy, message)
    copy.__dict__.update(error.__dict__)
    return copy


def as_upload_error(step: int, exc: BaseException, tries: int | None = None, what: str = "upload") -> UploadError:
    """``exc`` as the :class:`UploadError` of ``step`` (as it is, if it already is one)."""
    if isinstance(exc, UploadError):
        return exc
    tries = tries if tries is not None else exc.tries if isinstance(exc, Retryable) else 1
    message = f"{what} of step {step} failed after {tries} {'try' if tries == 1 else 'tries'}: {exc}"
    error = UploadError(message, step=step, tries=tries)
    error.__cause__ = exc
    return error


# Every class of the tree by name: how a collective carries another rank's error.
TREE: dict[str, type[CheckpointError]] = _tree(CheckpointError)
