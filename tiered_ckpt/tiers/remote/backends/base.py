"""What the object-store tier needs of a store: the :class:`Backend` interface.

One backend per module (:mod:`.s3`, :mod:`.gcs`, :mod:`.posix`, :mod:`.fsspec`), chosen once
from the URL's protocol by :func:`~tiered_ckpt.tiers.remote.backends.open_backend`; the tier above
speaks only these words and never asks which store it is on. Every path a backend takes
or returns is as its fsspec filesystem names it (``bucket/prefix/...``, no protocol).

A backend makes each request once: retries, deadlines turned into per-request timeouts,
and the translation of errors into :class:`~tiered_ckpt.errors.RemoteError` belong to the
tier. ``timeout`` arguments are the seconds left before the caller's deadline (None: no
deadline); a backend whose client can cut a request short takes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.tiers.base import Capabilities
from tiered_ckpt.tiers.remote.checksums import StoreSums

__all__ = ["Backend", "Head", "OpenUpload", "Sent"]

SHA256_METADATA_KEY = "sha256"


@dataclass(frozen=True)
class Head:
    """An object as the store describes it: its size, the sha256 stored with it (None where the
    store keeps no metadata, or none was sent) and the store's whole answer (its checksums)."""

    size: int
    sha256: str | None
    answer: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sent:
    """What putting one shard took: the checksums the store computes of the bytes sent (None:
    none to compare), the requests made and how many of them the store throttled."""

    sums: StoreSums | None
    requests: int = 1
    throttled: int = 0


@dataclass(frozen=True)
class OpenUpload:
    """An unfinished multipart upload: its object's path, when it started (None: unknown) and
    the store's handle of it."""

    path: str
    started: datetime | None
    upload_id: str


@runtime_checkable
class Backend(Protocol):
    """One store under one URL, as the object-store tier uses it."""

    url: str
    """The URL, for messages (never with credentials: those are storage options)."""
    root: str
    """The URL's path as the filesystem names it, without a trailing slash."""
    fs: Any
    """The fsspec filesystem fsspec's registry chose for the URL's protocol."""
    capabilities: Capabilities
    """What a tier over this store can do, in the tiers' own words (the object-store tier's
    :attr:`~tiered_ckpt.tiers.base.Tier.capabilities` is this): durable and shared, as a bucket
    is; ``create_only_commit`` only where :meth:`put_bytes` creates atomically (a conditional
    request, a link), never by a check before the write."""
    keeps_metadata: bool
    """The sha256 sent with a shard is stored with it and told by :meth:`head`."""
    bucket: str | None
    """The URL of the bucket :meth:`check_bucket` checks (None: none, e.g. a file system)."""

    def sums(self, local_path: Path, record: ShardRecord) -> StoreSums | None:
        """The checksums this store computes of ``local_path`` once uploaded (None: none it keeps),
        in one pass that raises :class:`~tiered_ckpt.errors.ChecksumMismatchError` unless the
        file has ``record``'s size and xxh3-64."""
        ...

    def put_shard(self, local_path: Path, path: str, record: ShardRecord, *, deadline: float | None) -> Sent:
        """Put the file as object ``path`` with ``record.sha256`` stored beside it (where the store
        keeps metadata). A file that does not match ``record`` is never made an object;
        ``deadline`` is a ``time.monotonic()`` time."""
        ...

    def put_bytes(self, path: str, data: bytes, *, create_only: bool = False, timeout: float | None = None) -> None:
        """Write a small object whole; ``create_only`` raises FileExistsError if it exists (atomically
        where ``capabilities.create_only_commit``; otherwise by a check before the write)."""
        ...

    def head(self, path: str, *, timeout: float | None = None) -> Head:
        """The object's size, stored sha256 and the store's answer; FileNotFoundError if missing."""
        ...

    def kept_checksum(self, head: Head, algorithm: str) -> str | None:
        """The store's checksum of ``algorithm`` (``crc32c``, ``sha256``) from ``head``, as
        ``"<algorithm>:<value>"``, or None if it keeps none."""
        ...

    def store_problem(self, head: Head, sums: StoreSums) -> str | None:
        """Where the checksums the store computed of the bytes it holds differ from ``sums``."""
        ...

    def size(self, path: str, *, timeout: float | None = None) -> int:
        """The object's size, asked of the store now (no cached answer)."""
        ...

    def exists(self, path: str) -> bool:
        """True if the object exists now (no cached answer)."""
        ...

    def open(self, path: str) -> AbstractContextManager[BinaryIO]:
        """The object as a read-only stream; its ``size`` attribute, where the store tells it on opening."""
        ...

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, whole or ``[start, end)``."""
        ...

    def list_names(self, prefix: str) -> list[str]:
        """The names directly under ``prefix`` (exactly: no glob expansion); none if it is absent."""
        ...

    def find(self, prefix: str) -> list[str]:
        """Every object under ``prefix/`` (exactly: no glob expansion), sorted; none if absent."""
        ...

    def delete(self, paths: list[str]) -> None:
        """Delete exactly the objects ``paths``; one already gone is no error."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix/``, each by its exact name."""
        ...

    def open_uploads(self) -> list[OpenUpload]:
        """The unfinished multipart uploads under the URL (none where the store lists none)."""
        ...

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort one unfinished multipart upload."""
        ...

    def check_bucket(self) -> None:
        """One listing request; raise :class:`~tiered_ckpt.errors.RemoteError` (not transient) naming
        the bucket if it does not exist or cannot be listed. Nothing to check without a bucket."""
        ...
