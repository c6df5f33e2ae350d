"""The manager's options: one small frozen dataclass per concern, each checking its own fields.

They are plain data: nothing here builds a tier or starts a stage (:mod:`~tiered_ckpt.build`
does, from them).

Each option has one name, ``<group>.<field>``: the same field of the group's dataclass
given to :class:`~tiered_ckpt.CheckpointManager` (``upload=UploadOptions(max_tries=8)``),
the same key of a config table (``[upload] max_tries = 8``, see
:func:`~tiered_ckpt.load_config`) and the same environment variable
(``TIERED_CKPT_UPLOAD_MAX_TRIES=8``). A value is checked here and nowhere else: a
failing check raises :class:`~tiered_ckpt.ConfigError` (also a ``ValueError``) whose
``field`` and ``problem`` let a config loader name the file and key.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import fsspec

from tiered_ckpt.errors import ConfigError, UsageError, invalid_option, restated
from tiered_ckpt.format.bounds import MAX_COUNT, MAX_PART_BYTES, MAX_SECONDS, check_number
from tiered_ckpt.io.hashing import VERIFY_MODES, Verify
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.remote.compression import Compression, check_compression
from tiered_ckpt.tiers.remote.leases import OtherOwners, OwnershipPolicy
from tiered_ckpt.tiers.remote.retry import RetryPolicy
from tiered_ckpt.tiers.remote.tier import DEFAULT_PART_BYTES, DEFAULT_PART_CONCURRENCY, LAYOUTS, Layout
from tiered_ckpt.tiers.retention import BestMode, RetentionPolicy

WhenBehind = Literal["wait", "skip"]
"""What the uploader does while the bucket is behind: "wait" (queue every step up to
``local.max_awaiting_upload``) or "skip" (keep ``upload.max_pending``, the oldest step stays local-only)."""

__all__ = [
    "LocalOptions",
    "RemoteOptions",
    "UploadOptions",
    "RestoreOptions",
    "RuntimeOptions",
    "PeerOptions",
    "TierOptions",
    "Options",
    "GROUPS",
    "resolve_options",
    "WhenBehind",
    "check_remote_url",
]


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types)
        raise invalid_option(name, f"must be {expected}, got {type(value).__name__} {value!r:.60}")


def _check_number(name: str, value: Any, minimum: float, types: tuple[type, ...] = (int,)) -> None:
    """A count (``types`` int) up to :data:`MAX_COUNT`, or seconds up to :data:`MAX_SECONDS`."""
    check_number(name, value, minimum, MAX_SECONDS if float in types else MAX_COUNT, types)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise invalid_option(name, f"must be one of {sorted(choices)}, got {value!r:.60}")


def check_remote_url(url: Any) -> None:
    """Refuse a remote URL fsspec cannot open, one that names no bucket or directory, or one
    holding a password (``ftp://user:password@host/...``: the URL is shown in reprs and logs).

    ``s3://`` alone would otherwise open ``s3:`` as a relative local directory.
    """
    _check_type("url", url, (str,))
    scheme, separator, rest = url.partition("://")
    if not separator:
        scheme, rest = "file", url
    if scheme not in fsspec.available_protocols():
        raise invalid_option("url", f"has unsupported URL scheme {scheme!r}")
    if separator and ":" in rest.partition("/")[0].rpartition("@")[0]:  # never echoed: the URL holds a password
        raise invalid_option(
            "url", f"must not hold a user and password ({scheme}:// URL; use the store's own credential chain)"
        )
    if not rest.strip("/"):
        raise invalid_option("url", f"{url!r} names no bucket or directory")


_ENDPOINT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def _check_endpoint_url(endpoint: Any, url: str) -> None:
    """Refuse an endpoint that is not an http(s) URL of a host, or that holds a user or password.

    No message shows the value (only a scheme fsspec knows): a refused endpoint may hold a
    secret. Any ``@`` is refused (no S3 or GCS endpoint has one): ``urllib.parse`` takes
    ``user:password@host`` without ``//`` for a scheme and a path, and so sees no user in it.
    """
    if not isinstance(endpoint, str):
        raise invalid_option("endpoint_url", f"must be str, got {type(endpoint).__name__}")
    scheme, separator, rest = endpoint.partition("://")
    if not separator:
        scheme, rest = "", endpoint
    if "@" in endpoint:  # user:password@host, whatever the scheme (anywhere: a password may hold a "/")
        raise invalid_option(
            "endpoint_url", "must not hold credentials, a user or password (use the store's own credential chain)"
        )
    if scheme not in ("http", "https"):
        known = scheme in fsspec.available_protocols()  # a name anyone may read, unlike an arbitrary word
        given = f"scheme {scheme}://" if known else "another scheme" if separator else "no scheme"
        raise invalid_option("endpoint_url", f"must be an http:// or https:// URL, got {given}")
    if not rest.strip("/"):
        raise invalid_option("endpoint_url", f"names no host after {scheme}://")
    if url.partition("://")[0] not in _ENDPOINT_SCHEMES:
        raise invalid_option("endpoint_url", f"applies to s3://, gs:// and az:// URLs only, not {url!r:.80}")


class _Retained:
    """A tier's options that hold its retention: ``keep_last``, ``keep_every`` and ``keep_best``
    with ``best_metric`` and ``best_mode`` (see :class:`~tiered_ckpt.tiers.retention.RetentionPolicy`)."""

    keep_last: int | None
    keep_every: int | None
    keep_best: int | None
    best_metric: str | None
    best_mode: BestMode

    @property
    def retention(self) -> RetentionPolicy:
        """The tier's retention (constructing it checks its fields)."""
        return RetentionPolicy(
            self.keep_last,
            self.keep_every,
            getattr(self, "max_awaiting_upload", None),
            keep_best=self.keep_best,
            best_metric=self.best_metric,
            best_mode=self.best_mode,
        )


@dataclass(frozen=True)
class LocalOptions(_Retained):
    """The local tier: its directory ``dir`` (one per process; ``~`` is expanded) and its
    retention. ``keep_last`` keeps the newest steps (None keeps all), ``keep_every`` also
    keeps every step divisible by it, and ``keep_best`` the steps with the best value of
    the metric ``best_metric`` their saves recorded (``save(..., metrics=)``), the lowest
    with ``best_mode="min"``, the highest with ``"max"`` (a step without a value is never
    among them); the newest committed step is never deleted. While
    the bucket is unreachable, at most ``max_awaiting_upload`` steps waiting for their
    upload are kept beyond those (the newest ones; None: every one, and the disk may fill).
    Only the saved steps divisible by ``every`` are written to disk (1: every one); with a
    peer tier, the others can be kept in a partner's memory only (see :class:`PeerOptions`)."""

    dir: Path
    keep_last: int | None = 3
    keep_every: int | None = None
    max_awaiting_upload: int | None = 8
    every: int = 1
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: BestMode = "min"

    def __post_init__(self) -> None:
        _check_number("every", self.every, 1)
        if not isinstance(self.dir, (str, os.PathLike)):
            raise invalid_option("dir", f"must be a path, got {type(self.dir).__name__} {self.dir!r:.60}")
        if not str(self.dir):
            raise invalid_option("dir", "must not be empty")
        object.__setattr__(self, "dir", Path(self.dir).expanduser())
        self.retention  # noqa: B018 -- checks keep_last, keep_every and keep_best


@dataclass(frozen=True)
class RemoteOptions(_Retained):
    """The remote tier: its ``url``, fsspec's ``storage_options`` for it (never shown), its
    retention (``keep_last``, ``keep_every``, ``keep_best`` with ``best_metric`` and ``best_mode``: as
    the local tier's, default all), and the
    ``layout`` of its shard objects ("hashed": spread over 256 key prefixes per step; "flat";
    "auto": hashed for a step of at least 32 ranks; see
    :meth:`~tiered_ckpt.tiers.remote.tier.RemoteTier.object_name`). ``endpoint_url``
    (``s3://``, ``gs://`` and ``az://``/``abfs://`` only) names the store's endpoint, e.g. a
    MinIO server, or for Azure the account's blob URL (``http://127.0.0.1:10000/devstoreaccount1``
    for Azurite); it takes precedence over ``storage_options["endpoint_url"]``.

    How a run holds the URL (see :mod:`~tiered_ckpt.tiers.remote.leases`): its lease on it lasts
    ``lease_seconds`` unrenewed (it is renewed every quarter of that while the run lives);
    multipart uploads left open are aborted at start-up only once ``orphan_age_seconds``
    old, and only while no other run's lease is live; another live run on the URL is a
    WARNING naming it (``other_owners="warn"``) or :class:`~tiered_ckpt.RemoteInUseError`
    at start-up (``"refuse"``). Only the saved steps divisible by ``every`` are uploaded
    (1: every one; local retention keeps each until its upload).

    ``compression="zstd"`` (the ``zstd`` extra) puts shard objects as zstd frames; ``"none"``
    as they are. A reader goes by each step's remote manifest (:mod:`~tiered_ckpt.tiers.remote.compression`)."""

    url: str
    keep_last: int | None = None
    keep_every: int | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    layout: Layout = "auto"
    endpoint_url: str | None = None
    lease_seconds: float = OwnershipPolicy.lease_seconds
    orphan_age_seconds: float = OwnershipPolicy.orphan_age_seconds
    other_owners: OtherOwners = OwnershipPolicy.other_owners
    every: int = 1
    compression: Compression = "none"
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: BestMode = "min"

    def __post_init__(self) -> None:
        check_remote_url(self.url)
        _check_number("every", self.every, 1)
        _check_choice("layout", self.layout, LAYOUTS)
        check_compression(self.compression)
        if not isinstance(self.storage_options, Mapping):
            # The value is never echoed: it may be a secret.
            raise invalid_option("storage_options", f"must be a table, got {type(self.storage_options).__name__}")
        if self.endpoint_url is not None:
            _check_endpoint_url(self.endpoint_url, self.url)
        self.retention  # noqa: B018 -- checks keep_last, keep_every and keep_best
        self.ownership  # noqa: B018 -- checks lease_seconds, orphan_age_seconds and other_owners

    @property
    def ownership(self) -> OwnershipPolicy:
        """How a run holds the URL (constructing it checks the three fields)."""
        return OwnershipPolicy(self.lease_seconds, self.orphan_age_seconds, self.other_owners)


@dataclass(frozen=True)
class UploadOptions:
    """The uploader and the remote tier's requests.

    ``concurrency`` shards of a step go up at once. A save never waits for the upload
    queue: with ``when_behind="wait"`` up to the local tier's ``max_awaiting_upload`` steps
    wait in it, each uploaded in order; with ``"skip"``, ``max_pending`` while the bucket
    answers; beyond that the oldest waiting step stays local-only (superseded). Every remote request (uploads, reads,
    listings, deletions) is tried at most ``max_tries`` times, backing off from
    ``backoff_seconds`` (each wait at most ``max_backoff_seconds``), and no more tries
    start once ``max_seconds`` have passed since the first; a request that gets no answer
    fails after ``timeout_seconds``. A step's upload that fails for a transient reason is
    tried again as a whole, with the same capped backoff, until ``deadline_seconds`` after
    it started; then it fails with :class:`~tiered_ckpt.UploadError` (requests still
    running are cut short), the step stays local-only and the queue moves on. None: no
    deadline (a transient failure is retried until the bucket answers). S3 objects of at least
    ``2 * part_bytes`` go up in parts of ``part_bytes``, at most ``part_concurrency`` in
    flight (fewer while the store throttles).
    """

    concurrency: int = 2
    max_tries: int = 5
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0
    max_seconds: float = 300.0
    timeout_seconds: float = 10.0
    max_pending: int = 2
    when_behind: WhenBehind = "wait"
    deadline_seconds: float | None = 3600.0
    part_bytes: int = DEFAULT_PART_BYTES
    part_concurrency: int = DEFAULT_PART_CONCURRENCY

    def __post_init__(self) -> None:
        _check_number("concurrency", self.concurrency, 1)
        _check_number("max_tries", self.max_tries, 1)
        _check_number("backoff_seconds", self.backoff_seconds, 0, (int, float))
        _check_number("max_backoff_seconds", self.max_backoff_seconds, 0, (int, float))
        _check_number("max_seconds", self.max_seconds, 0, (int, float))
        _check_number("timeout_seconds", self.timeout_seconds, 0.001, (int, float))
        _check_number("max_pending", self.max_pending, 1)
        _check_choice("when_behind", self.when_behind, ("wait", "skip"))
        if self.deadline_seconds is not None:
            _check_number("deadline_seconds", self.deadline_seconds, 0.001, (int, float))
        check_number("part_bytes", self.part_bytes, 5 << 20, MAX_PART_BYTES)  # S3's smallest part, see bounds
        _check_number("part_concurrency", self.part_concurrency, 1)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(
            max_tries=self.max_tries,
            backoff_seconds=self.backoff_seconds,
            max_backoff_seconds=self.max_backoff_seconds,
            max_seconds=self.max_seconds,
            timeout_seconds=self.timeout_seconds,
        )


@dataclass(frozen=True)
class RestoreOptions:
    """How restores verify shards unless a call says otherwise: ``verify="full"`` (sha256)
    or ``"fast"`` (xxh3-64, for a copy this job wrote itself)."""

    verify: Verify = "full"

    def __post_init__(self) -> None:
        _check_choice("verify", self.verify, VERIFY_MODES)


SignalLike = int | str | signal.Signals
STALE_MODES = ("warn", "error", "off")  # runtime.stale_saves: what a stale step does (engine/stale.py)
ShardedKey = str | Sequence[str | int]


@dataclass(frozen=True)
class RuntimeOptions:
    """How this process runs its saves.

    ``sharded_keys`` names the flat-parameter slices (tensor names or paths; default: the
    arrays 1-D on every rank, see :func:`~tiered_ckpt.save_sharded`). ``max_workers``
    bounds the threads that read and write shards (default: one per shard, at most
    twice the cores).
    ``writer_cpus`` (e.g. ``{3}``; Linux) keeps the background writer and retention
    threads, and the threads they start, on those CPUs (say, cores the training loop
    leaves free); they always run at a lower priority than the training loop.
    ``host_memory_bytes`` caps the host memory this process's saves hold for staging (default:
    a quarter of the node's memory, or of its cgroup's limit, shared by the node's processes,
    at least 256 MiB: :func:`~tiered_ckpt.engine.memory_budget.default_host_memory_bytes`): the
    arrays of a state larger than it that do not fit are written straight from the caller's
    memory while :meth:`~tiered_ckpt.CheckpointManager.save` waits (``docs/guides/memory.md``).
    ``preemption_signals`` (e.g. ``("SIGTERM",)``; default none) installs handlers that
    note a preemption notice for :meth:`~tiered_ckpt.CheckpointManager.reached_preemption`,
    only from the main thread: one per signal for the process, shared by every manager,
    chained to a Python handler it replaced but never to the default action (``SIG_DFL``,
    SIGINT's ``KeyboardInterrupt``), which the notice replaces; the last manager to close
    puts the old handler back, whatever order managers close in.
    ``stale_saves`` says what a save does whose arrays did not change since the step before
    it on this disk (compared by the digests the manifests record for each array): ``"warn"``
    (a WARNING naming both steps), ``"error"`` (the save fails before anything is committed)
    or ``"off"``; with ``must_change`` (tensor names or paths, e.g. ``["optim"]``), also one
    in which none of the arrays under those paths changed (:mod:`~tiered_ckpt.engine.stale`).
    ``incremental`` (default True): an array unchanged since the step before on this disk is
    referenced in the earlier file that holds its bytes instead of written again, where every
    tier keeps referenced files (:mod:`~tiered_ckpt.engine.incremental`); False writes every
    array of every step.
    """

    sharded_keys: tuple[ShardedKey, ...] | None = None
    max_workers: int | None = None
    writer_cpus: frozenset[int] | None = None
    preemption_signals: tuple[signal.Signals, ...] = ()
    host_memory_bytes: int | None = None
    must_change: tuple[ShardedKey, ...] = ()
    stale_saves: str = "warn"
    incremental: bool = True

    def __init__(
        self,
        sharded_keys: Iterable[ShardedKey] | None = None,
        max_workers: int | None = None,
        writer_cpus: Iterable[int] | None = None,
        preemption_signals: Iterable[SignalLike] = (),
        host_memory_bytes: int | None = None,
        must_change: Iterable[ShardedKey] = (),
        stale_saves: str = "warn",
        incremental: bool = True,
    ) -> None:
        object.__setattr__(self, "sharded_keys", _sharded_keys(sharded_keys))
        if max_workers is not None:
            _check_number("max_workers", max_workers, 1)
        object.__setattr__(self, "max_workers", max_workers)
        object.__setattr__(self, "writer_cpus", _cpus(writer_cpus))
        if isinstance(preemption_signals, (str, bytes)) or not isinstance(preemption_signals, Iterable):
            raise invalid_option("preemption_signals", f"must be a list of signals, got {preemption_signals!r:.60}")
        chosen = tuple(dict.fromkeys(_signal(each) for each in preemption_signals))
        object.__setattr__(self, "preemption_signals", chosen)
        if host_memory_bytes is not None:
            _check_number("host_memory_bytes", host_memory_bytes, 1)
        object.__setattr__(self, "host_memory_bytes", host_memory_bytes)
        object.__setattr__(self, "must_change", _sharded_keys(must_change, "must_change") or ())
        _check_choice("stale_saves", stale_saves, STALE_MODES)
        object.__setattr__(self, "stale_saves", stale_saves)
        if not isinstance(incremental, bool):
            raise invalid_option("incremental", f"must be true or false, got {incremental!r:.60}")
        object.__setattr__(self, "incremental", incremental)


def _sharded_keys(keys: Any, option: str = "sharded_keys") -> tuple[ShardedKey, ...] | None:
    if keys is None:
        return None
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise invalid_option(option, f"must be a list of tensor names or paths, got {keys!r:.60}")
    chosen: list[ShardedKey] = []
    for key in keys:
        if isinstance(key, str):
            chosen.append(key)
        elif isinstance(key, Sequence) and not isinstance(key, bytes) and key:
            if not all(isinstance(part, str) or (isinstance(part, int) and not isinstance(part, bool)) for part in key):
                raise invalid_option(option, f"path {key!r:.60} must hold only names and list indices")
            chosen.append(tuple(key))
        else:
            raise invalid_option(option, f"{key!r:.60} is neither a tensor name nor a path")
    return tuple(chosen)


def _cpus(cpus: Any) -> frozenset[int] | None:
    if cpus is None:
        return None
    if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Iterable):
        raise invalid_option("writer_cpus", f"must be a set of CPU numbers, got {cpus!r:.60}")
    chosen = list(cpus)
    for each in chosen:
        _check_number("writer_cpus", each, 0)
    if not hasattr(os, "sched_setaffinity"):
        raise invalid_option("writer_cpus", "needs Linux (os.sched_setaffinity) to pin threads to CPUs")
    allowed = os.sched_getaffinity(0)
    if not chosen or not set(chosen) <= allowed:
        raise invalid_option(
            "writer_cpus", f"must be a non-empty set of this process's CPUs {sorted(allowed)}, got {sorted(chosen)}"
        )
    return frozenset(chosen)


def _signal(value: Any) -> signal.Signals:
    """``value`` (a number, ``signal.SIGTERM``, ``"SIGTERM"`` or ``"TERM"``) as a signal that can be caught."""
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str) and value.strip().isdigit():  # a number, as a variable gives it
            chosen = signal.Signals(int(value))
        elif isinstance(value, str):
            name = value.strip().upper()
            chosen = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        else:
            chosen = signal.Signals(value)
    except (KeyError, ValueError, TypeError):
        raise invalid_option("preemption_signals", f"{value!r:.40} is not a signal") from None
    if chosen in (signal.SIGKILL, signal.SIGSTOP):
        raise invalid_option("preemption_signals", f"{chosen.name} cannot be caught")
    return chosen


@dataclass(frozen=True)
class PeerOptions:
    """The peer tier: each rank's newest shards also held in the memory of a partner rank on
    another node, so a lost node restores from its partners rather than from the bucket
    (one process per rank under ``torch.distributed``, on two nodes or more; see
    ``docs/guides/peer-tier.md``).

    Only the saved steps divisible by ``every`` are copied. A rank holds at most
    ``max_bytes`` of its partners' shards (None: one step of them, kept until the next is
    committed); it keeps them in ``memory_dir``, a folder of a memory file system, so they
    outlive a restart of the training process. A partner that does not answer a round of a
    copy within ``timeout_seconds`` (plus the time its bytes take at 50 MB/s) is given up
    for the run. ``nodes`` names the node of each rank (by rank); None: the launcher's
    ``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``, else the host name.
    """

    every: int = 1
    max_bytes: int | None = None
    timeout_seconds: float = 30.0
    memory_dir: Path = Path("/dev/shm/tiered_ckpt")
    nodes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_number("every", self.every, 1)
        if self.max_bytes is not None:
            _check_number("max_bytes", self.max_bytes, 1)
        _check_number("timeout_seconds", self.timeout_seconds, 0.001, (int, float))
        if not isinstance(self.memory_dir, (str, os.PathLike)) or not str(self.memory_dir):
            raise invalid_option("memory_dir", f"must be a path, got {self.memory_dir!r:.60}")
        object.__setattr__(self, "memory_dir", Path(self.memory_dir).expanduser())
        if self.nodes is not None:
            if isinstance(self.nodes, (str, bytes)) or not isinstance(self.nodes, Iterable):
                raise invalid_option("nodes", f"must be a list of node names by rank, got {self.nodes!r:.60}")
            nodes = tuple(self.nodes)
            if not nodes or not all(isinstance(node, str) and node for node in nodes):
                raise invalid_option("nodes", f"must be a non-empty list of node names, got {nodes!r:.60}")
            object.__setattr__(self, "nodes", nodes)


_NAMES_TAKEN = ("local", "peer", "remote")  # the tiers the other groups describe


@dataclass(frozen=True)
class TierOptions(_Retained):
    """A later tier of the caller's own (a second disk, a shared memory such as Redis), given to
    the manager as ``tiers=[TierOptions(tier, ...)]``: ``tier`` speaks the tier protocol
    (:class:`~tiered_ckpt.tiers.base.Tier`; :mod:`tiered_ckpt.testing` holds the contract that
    proves it) under a ``name`` of its own (not ``local``, ``peer`` nor ``remote``). The store
    reads such tiers after the partners' memory and before the bucket, in the order given.

    Its retention: ``keep_last``, ``keep_every`` and ``keep_best`` as the local tier's (default: keep all).
    Only the saved steps divisible by ``every`` are copied to it, by a replicator of its own;
    a step's copy is tried again after a transient failure until ``deadline_seconds`` (None:
    no deadline). A failure is raised by the manager's next call, as the bucket's is, unless
    ``best_effort`` (a cache: it is logged, and the step is simply not in the tier). How it
    went for each step is the save's ``SaveHandle.replicated[name]``.

    The one group that is not plain data (it holds the tier itself): no config file or
    environment variable gives it.
    """

    tier: Any
    keep_last: int | None = None
    keep_every: int | None = None
    every: int = 1
    deadline_seconds: float | None = 3600.0
    best_effort: bool = False
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: BestMode = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.tier, Tier):
            raise invalid_option("tier", f"must speak the tier protocol (tiers.base.Tier), got {self.tier!r:.60}")
        if self.tier.name in _NAMES_TAKEN:
            raise invalid_option("tier", f"is called {self.tier.name!r}, a name the manager's own tiers take")
        _check_number("every", self.every, 1)
        if self.deadline_seconds is not None:
            _check_number("deadline_seconds", self.deadline_seconds, 0.001, (int, float))
        if not isinstance(self.best_effort, bool):
            raise invalid_option("best_effort", f"must be True or False, got {self.best_effort!r:.60}")
        self.retention  # noqa: B018 -- checks keep_last, keep_every and keep_best


@dataclass(frozen=True)
class Options:
    """Everything a manager is configured with, resolved and checked: one group per concern."""

    local: LocalOptions
    remote: RemoteOptions | None = None
    upload: UploadOptions = UploadOptions()
    restore: RestoreOptions = RestoreOptions()
    runtime: RuntimeOptions = RuntimeOptions()
    peer: PeerOptions | None = None
    tiers: tuple[TierOptions, ...] = ()


def resolve_options(
    local: str | os.PathLike[str] | LocalOptions,
    remote: str | RemoteOptions | None = None,
    upload: UploadOptions | None = None,
    restore: RestoreOptions | None = None,
    runtime: RuntimeOptions | None = None,
    peer: PeerOptions | None = None,
    tiers: Sequence[TierOptions] = (),
) -> Options:
    """The options a manager's arguments stand for: a path is ``LocalOptions(path)``, a URL
    ``RemoteOptions(url)``, and a group not given its defaults (``tiers``: none).

    Raises :class:`~tiered_ckpt.UsageError` naming the argument whose value is not one of those.
    """
    if not isinstance(local, LocalOptions):
        if not isinstance(local, (str, os.PathLike)):
            raise UsageError(f"argument local must be a path or LocalOptions, got {type(local).__name__}")
        try:
            local = LocalOptions(local)  # type: ignore[arg-type]  # LocalOptions makes it a Path
        except ConfigError as exc:
            raise restated(exc, f"argument local: {exc}") from None
    if isinstance(remote, str):
        try:
            remote = RemoteOptions(remote)
        except ConfigError as exc:
            raise restated(exc, f"argument remote: {exc}") from None
    given: dict[str, tuple[object, type]] = {"remote": (remote, RemoteOptions), "upload": (upload, UploadOptions)}
    given |= {"restore": (restore, RestoreOptions), "runtime": (runtime, RuntimeOptions), "peer": (peer, PeerOptions)}
    for name, (value, kind) in given.items():
        if value is not None and not isinstance(value, kind):
            accepted = f"a URL or {kind.__name__}" if name == "remote" else kind.__name__
            raise UsageError(f"argument {name} must be {accepted} or None, got {type(value).__name__}")
    if isinstance(remote, RemoteOptions) and remote.every % local.every:  # uploads are made from the disk
        raise invalid_option(
            "remote.every",
            f"is {remote.every}, not a multiple of local.every ({local.every}): the bucket gets disk steps",
        )
    if isinstance(tiers, TierOptions) or not all(isinstance(each, TierOptions) for each in tiers):
        raise UsageError(f"argument tiers must be a list of TierOptions, got {tiers!r:.80}")
    names = [each.tier.name for each in tiers]
    if len(set(names)) != len(names):
        raise UsageError(f"argument tiers: each tier needs a name of its own, got {names}")
    return Options(
        local,
        remote,
        upload or UploadOptions(),
        restore or RestoreOptions(),
        runtime or RuntimeOptions(),
        peer,
        tuple(tiers),
    )


# One group per concern, each the same in the constructor, a config table and the
# TIERED_CKPT_<TABLE>_<KEY> variables.
GROUPS: dict[str, type] = {
    "local": LocalOptions,
    "remote": RemoteOptions,
    "upload": UploadOptions,
    "restore": RestoreOptions,
    "runtime": RuntimeOptions,
    "peer": PeerOptions,
}
