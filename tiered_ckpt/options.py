"""The manager's options as small frozen dataclasses, each checking its own fields.

:func:`~tiered_ckpt.load_config` returns them (one per config table) and
:class:`~tiered_ckpt.CheckpointManager` takes them; a value is checked here and nowhere
else. A failing check raises :class:`~tiered_ckpt.ConfigError` (also a ``ValueError``)
whose ``field`` and ``problem`` let a config loader name the file and key.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypedDict

import fsspec

from tiered_ckpt.engine.replication import ReplicationPolicy, WhenBehind
from tiered_ckpt.errors import ConfigError, UsageError, invalid_option
from tiered_ckpt.io.hashing import VERIFY_MODES, Verify
from tiered_ckpt.tiers.owners import OtherOwners, OwnershipPolicy
from tiered_ckpt.tiers.remote import DEFAULT_PART_BYTES, DEFAULT_PART_CONCURRENCY, Layout, RemoteTier
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.retry import RetryPolicy

__all__ = [
    "LocalOptions",
    "RemoteOptions",
    "UploadOptions",
    "VerifyOptions",
    "Options",
    "ManagerKeywords",
    "KEYWORDS",
    "resolve_options",
    "WhenBehind",
    "check_remote_url",
]


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types)
        raise invalid_option(name, f"must be {expected}, got {type(value).__name__} {value!r:.60}")


def _check_number(name: str, value: Any, minimum: float, types: tuple[type, ...] = (int,)) -> None:
    _check_type(name, value, types)
    if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison
        raise invalid_option(name, f"must be a finite number, got {value!r}")
    if value < minimum:
        raise invalid_option(name, f"must be >= {minimum}, got {value!r}")


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


_ENDPOINT_SCHEMES = ("s3", "s3a", "gs", "gcs")


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
        raise invalid_option("endpoint_url", f"applies to s3:// and gs:// URLs only, not {url!r:.80}")


class _Retained:
    """A tier's options that hold ``keep_last`` and ``keep_every``."""

    keep_last: int | None
    keep_every: int | None

    @property
    def retention(self) -> RetentionPolicy:
        """The tier's retention (constructing it checks ``keep_last`` and ``keep_every``)."""
        return RetentionPolicy(self.keep_last, self.keep_every, getattr(self, "max_awaiting_upload", None))


@dataclass(frozen=True)
class LocalOptions(_Retained):
    """The local tier: its directory and its retention. While the bucket is unreachable,
    at most ``max_awaiting_upload`` steps waiting for their upload are kept beyond what
    ``keep_last`` / ``keep_every`` keep (the newest ones; None: every one, and the disk
    may fill)."""

    dir: Path
    keep_last: int | None = 3
    keep_every: int | None = None
    max_awaiting_upload: int | None = 8

    def __post_init__(self) -> None:
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise invalid_option("dir", f"must be str, got {type(self.dir).__name__} {self.dir!r:.60}")
        object.__setattr__(self, "dir", Path(self.dir).expanduser())
        self.retention  # noqa: B018 -- checks keep_last and keep_every


@dataclass(frozen=True)
class RemoteOptions(_Retained):
    """The remote tier: its URL, fsspec's options for it (never shown), its retention, and
    the layout of its shard objects ("flat", or "hashed": spread over 256 key prefixes
    per step; see :meth:`~tiered_ckpt.tiers.remote.RemoteTier.object_name`). ``endpoint_url``
    (``s3://`` and ``gs://`` only) names the store's endpoint, e.g. a MinIO server; it
    takes precedence over ``storage_options["endpoint_url"]``.

    How a run holds the URL (see :mod:`~tiered_ckpt.tiers.owners`): its lease on it lasts
    ``lease_seconds`` unrenewed (it is renewed every quarter of that while the run lives);
    multipart uploads left open are aborted at start-up only once ``orphan_age_seconds``
    old, and only while no other run's lease is live; another live run on the URL is a
    WARNING naming it (``other_owners="warn"``) or :class:`~tiered_ckpt.RemoteInUseError`
    at start-up (``"refuse"``)."""

    url: str
    keep_last: int | None = None
    keep_every: int | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    layout: Layout = "flat"
    endpoint_url: str | None = None
    lease_seconds: float = 300.0
    orphan_age_seconds: float = 3600.0
    other_owners: OtherOwners = "warn"

    def __post_init__(self) -> None:
        check_remote_url(self.url)
        _check_choice("layout", self.layout, ("flat", "hashed"))
        if not isinstance(self.storage_options, Mapping):
            # The value is never echoed: it may be a secret.
            raise invalid_option("storage_options", f"must be a table, got {type(self.storage_options).__name__}")
        if self.endpoint_url is not None:
            _check_endpoint_url(self.endpoint_url, self.url)
        self.retention  # noqa: B018 -- checks keep_last and keep_every
        self.ownership  # noqa: B018 -- checks lease_seconds, orphan_age_seconds and other_owners

    @property
    def ownership(self) -> OwnershipPolicy:
        """How a run holds the URL (constructing it checks the three fields)."""
        return OwnershipPolicy(self.lease_seconds, self.orphan_age_seconds, self.other_owners)

    def open_tier(self, upload: UploadOptions, *, check_bucket: bool = True) -> RemoteTier:
        """The remote tier these options describe, making its requests as ``upload`` says.

        Its bucket is checked first (one request, see
        :meth:`~tiered_ckpt.tiers.remote.RemoteTier.check_bucket`): a missing or unlistable bucket
        raises :class:`~tiered_ckpt.RemoteError` naming it here, not at the first upload.
        """
        storage_options = dict(self.storage_options)
        if self.endpoint_url is not None:
            storage_options["endpoint_url"] = self.endpoint_url
        tier = RemoteTier(
            self.url, storage_options, retry=upload.retry, part_bytes=upload.part_bytes,
            part_concurrency=upload.part_concurrency, layout=self.layout,
        )  # fmt: skip
        if check_bucket:
            tier.check_bucket()
        return tier


@dataclass(frozen=True)
class UploadOptions:
    """The uploader and the remote tier's requests.

    ``concurrency`` shards of a step go up at once; ``max_pending`` steps wait in the
    queue before ``when_behind`` applies. Every remote request (uploads, reads,
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
    timeout_seconds: float = 60.0
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
        _check_number("part_bytes", self.part_bytes, 5 << 20)  # S3's smallest part
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

    @property
    def replication(self) -> ReplicationPolicy:
        """The uploader's policy: its queue, concurrency and deadline; a step's tries back off as
        the bucket's requests do (its tier's :attr:`retry`)."""
        return ReplicationPolicy(self.concurrency, self.max_pending, self.when_behind, self.deadline_seconds)


@dataclass(frozen=True)
class VerifyOptions:
    """How restores verify shards by default: "full" (sha256) or "fast" (xxh3-64)."""

    mode: Verify = "full"

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, VERIFY_MODES)


class ManagerKeywords(TypedDict, total=False):
    """The keyword arguments :class:`~tiered_ckpt.CheckpointManager` takes for its options
    (each sets one field of one options dataclass; see ``KEYWORDS``)."""

    keep_last: int | None
    keep_every: int | None
    verify: Verify
    remote_url: str | None
    storage_options: Mapping[str, Any] | None
    keep_last_remote: int | None
    keep_every_remote: int | None
    upload_concurrency: int
    upload_max_tries: int
    upload_backoff_seconds: float
    max_pending_uploads: int
    when_uploads_behind: WhenBehind
    upload_deadline_seconds: float | None
    max_awaiting_upload: int | None
    remote_layout: Layout


KEYWORDS: dict[str, tuple[str, str]] = {
    "keep_last": ("local", "keep_last"),
    "keep_every": ("local", "keep_every"),
    "verify": ("verify", "mode"),
    "remote_url": ("remote", "url"),
    "storage_options": ("remote", "storage_options"),
    "keep_last_remote": ("remote", "keep_last"),
    "keep_every_remote": ("remote", "keep_every"),
    "upload_concurrency": ("upload", "concurrency"),
    "upload_max_tries": ("upload", "max_tries"),
    "upload_backoff_seconds": ("upload", "backoff_seconds"),
    "max_pending_uploads": ("upload", "max_pending"),
    "when_uploads_behind": ("upload", "when_behind"),
    "upload_deadline_seconds": ("upload", "deadline_seconds"),
    "max_awaiting_upload": ("local", "max_awaiting_upload"),
    "remote_layout": ("remote", "layout"),
}


@dataclass(frozen=True)
class Options:
    """Everything a manager is configured with, resolved and checked."""

    local: LocalOptions
    remote: RemoteOptions | None
    upload: UploadOptions
    verify: VerifyOptions


def resolve_options(
    local: str | os.PathLike[str] | LocalOptions,
    remote: RemoteOptions | None,
    upload: UploadOptions | None,
    keywords: Mapping[str, Any],
    parameters: Sequence[str] = (),
) -> Options:
    """The options that ``local``, ``remote``, ``upload`` and the keyword arguments stand for.

    A keyword replaces one field of the options object it belongs to (``remote_url``
    starts a :class:`RemoteOptions` if none is given; ``remote_url=None`` removes it).
    An unknown keyword raises :class:`~tiered_ckpt.UsageError` naming it, its close
    matches among ``KEYWORDS`` and ``parameters`` (the caller's other named parameters),
    and every known keyword.
    """
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise _unknown_keywords(unknown, parameters)
    fields: dict[str, dict[str, Any]] = {"local": {}, "remote": {}, "upload": {}, "verify": {}}
    for keyword, value in keywords.items():
        table, name = KEYWORDS[keyword]
        fields[table][name] = value
    if fields["remote"].get("storage_options", {}) is None:
        fields["remote"]["storage_options"] = {}
    try:
        return _resolve(local, remote, upload, fields)
    except ConfigError as exc:  # name the keyword the caller used, not the dataclass field
        if exc.field is None:
            raise
        given = [k for k, (table, name) in KEYWORDS.items() if name == exc.field and k in keywords]
        if given:
            source = f"keyword argument {given[0]}"
        elif exc.field == "dir" and not isinstance(local, LocalOptions):
            source = "argument local_dir"
        else:
            raise
        error = ConfigError(f"{source} {exc.problem}")
        error.field, error.problem = given[0] if given else "local_dir", exc.problem
        raise error from None


def _names(options: type) -> set[str]:
    return {each.name for each in fields(options)}


def _unknown_keywords(unknown: Sequence[str], parameters: Sequence[str]) -> UsageError:
    known = [*parameters, *KEYWORDS]
    hints = []
    for keyword in unknown:
        close = difflib.get_close_matches(keyword, known, n=3)
        owners = [each.__name__ for each in (LocalOptions, RemoteOptions, UploadOptions) if keyword in _names(each)]
        if owners:  # a field of an options object, not a keyword of its own (endpoint_url, lease_seconds...)
            hints.append(f"{keyword} is a field of {owners[0]}: pass {owners[0]}(..., {keyword}=...)")
        elif close:
            hints.append(f"{keyword}: did you mean {' or '.join(close)}?")
    return UsageError(
        f"CheckpointManager got unknown keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
        + "".join(f"; {hint}" for hint in hints)
        + f" (known: {', '.join(known)})"
    )


def _resolve(
    local: str | os.PathLike[str] | LocalOptions,
    remote: RemoteOptions | None,
    upload: UploadOptions | None,
    fields: dict[str, dict[str, Any]],
) -> Options:
    if isinstance(local, LocalOptions):
        local_options = replace(local, **fields["local"])
    else:
        local_options = LocalOptions(local, **fields["local"])  # type: ignore[arg-type]
    remote_fields = fields["remote"]
    if "url" in remote_fields and remote_fields["url"] is None:
        remote_options = None
    elif remote is not None:
        remote_options = replace(remote, **remote_fields)
    elif "url" in remote_fields:
        remote_options = RemoteOptions(**remote_fields)
    else:
        remote_options = None  # retention or storage options without a bucket have nothing to act on
    return Options(
        local_options,
        remote_options,
        replace(upload or UploadOptions(), **fields["upload"]),
        VerifyOptions(**fields["verify"]),
    )
