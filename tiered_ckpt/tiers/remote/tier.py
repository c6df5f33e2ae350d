"""The remote tier: committed checkpoints under one URL (``s3://``, ``gs://``, ``file://`` ...).

Layout under the URL::

    step-000000001200/rank-00000-of-00004.safetensors
    step-000000001200/...
    step-000000001200/manifest.json     the remote manifest, written last
    latest                              the newest committed step (a hint, written after it)

It speaks the tier protocol (:class:`~tiered_ckpt.tiers.base.Tier`) over one
:class:`~tiered_ckpt.tiers.remote.backends.base.Backend`, chosen from the URL's protocol; what
differs between stores is the backend's, and :attr:`RemoteTier.capabilities` says it.
Committing a step, as :class:`~tiered_ckpt.engine.replication.Replicator` drives it:

1. :meth:`RemoteTier.land_shard` puts each shard (its sha256 as object metadata where the
   store keeps metadata) and confirms it: the object's size and stored sha256 must match
   the record, and the checksums the store computed of what it received must match what
   was sent, so a shard is never taken as uploaded on the PUT's word alone. A shard
   already there intact is not sent again. With ``compression="zstd"`` what is put is the
   shard as independent zstd frames (:mod:`~tiered_ckpt.tiers.remote.compression`), and every
   read goes by what the step's remote manifest records of it, whatever the option;
2. :meth:`RemoteTier.confirm_shard` checks each object once more, right before
3. :meth:`RemoteTier.commit` writes the remote manifest (with the store's checksums of the
   shards landed), create-only; :meth:`RemoteTier.set_latest` then moves ``latest``. A step
   is visible remotely exactly when its remote manifest exists.

**One retry policy** (:class:`RetryPolicy`) covers every request this tier makes, reads
included, and every backend error leaves this module as :class:`RemoteError` (see
:mod:`~tiered_ckpt.tiers.remote.requests`); the clients' own retry loops are turned off where
they have a switch. Storage options (credentials) are never put in messages or reprs.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar

import numpy as np

from tiered_ckpt.errors import (
    ChecksumMismatchError,
    IncompleteCheckpointError,
    ManifestError,
    RemoteError,
)
from tiered_ckpt.format.compressed import CompressedObject
from tiered_ckpt.format.layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    step_dir_name,
)
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES, ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.io.hashing import ShardDigest, Verify, fill_hashing, hash_stream
from tiered_ckpt.io.zstd_frames import FrameCache, FramesReader, read_range_into
from tiered_ckpt.tiers.base import Capabilities, ShardSource
from tiered_ckpt.tiers.remote.backends import open_backend
from tiered_ckpt.tiers.remote.backends.base import Backend
from tiered_ckpt.tiers.remote.backends.s3 import same_checksum
from tiered_ckpt.tiers.remote.backends.wrappers import Counting
from tiered_ckpt.tiers.remote.checksums import StoreSums
from tiered_ckpt.tiers.remote.compression import Compression, check_compression, compressed_copy, object_name
from tiered_ckpt.tiers.remote.landed import Landed, LandedShards
from tiered_ckpt.tiers.remote.listing import BucketListing
from tiered_ckpt.tiers.remote.requests import LimitedReader, Requests, Trouble
from tiered_ckpt.tiers.remote.retry import RetryPolicy, is_transient
from tiered_ckpt.tiers.remote.upkeep import BucketUpkeep

__all__ = ["RemoteTier", "RetryPolicy", "is_transient"]

logger = logging.getLogger("tiered_ckpt")
T = TypeVar("T")
Layout = Literal["flat", "hashed"]

# s3fs's default 50 MiB parts leave a 256 MiB shard in 3-5 parts; 16 MiB parts let its
# concurrent part uploads (max_concurrency, 10 by default) keep the link busy.
DEFAULT_PART_BYTES = 16 << 20
DEFAULT_PART_CONCURRENCY = 8  # parts in flight per tier (S3), before throttling lowers it


class RemoteTier(BucketListing, BucketUpkeep):
    """Checkpoints under ``url``, in the store its protocol names, opened with ``storage_options``.

    Every public method makes its requests under ``retry`` (see :class:`RetryPolicy`).
    :attr:`backend` is the store: the URL's backend, given to ``wrap`` if given (a wrapper of
    :mod:`~tiered_ckpt.tiers.remote.backends.wrappers`), in a ``Counting`` wrapper (uploads' requests).
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
        part_concurrency: int = DEFAULT_PART_CONCURRENCY,
        layout: Layout = "flat",
        wrap: Callable[[Backend], Backend] | None = None,
        compression: Compression = "none",
    ) -> None:
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        if layout not in ("flat", "hashed"):
            raise RemoteError(f"{self.url}: layout must be 'flat' or 'hashed', got {layout!r:.40}", transient=False)
        check_compression(compression)
        self.layout, self.compression = layout, compression
        opened = open_backend(
            self.url, storage_options or {}, retry=self.retry, part_bytes=part_bytes, part_concurrency=part_concurrency
        )
        self.backend: Counting = Counting(wrap(opened) if wrap is not None else opened)
        facts = self.backend.facts
        self.capabilities = Capabilities(
            durable=True, shared=True, create_only_commit=facts.create_only,
            store_checksums=facts.store_checksums, ranged_reads=facts.ranged_reads,
        )  # fmt: skip
        self._root = self.backend.root
        self._requests = Requests(self.retry)
        self._run, self._timeout = self._requests.run, self._requests.timeout
        self._locations: dict[int, Mapping[str, str]] = {}  # step -> its remote manifest's object names
        self._compressed: dict[int, Mapping[str, CompressedObject]] = {}  # step -> its manifest's compressed objects
        self._landed = LandedShards()
        self._frames = FrameCache()

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    def trouble(self) -> Trouble | None:
        """Whether the store is failing now: its tries that failed for a transient reason since it
        last answered one (see :meth:`~tiered_ckpt.tiers.remote.requests.Requests.trouble`; None: it answers)."""
        return self._requests.trouble()

    # -- names and plumbing -----------------------------------------------------------------

    def object_name(self, step: int, path: str) -> str:
        """Where the shard file ``path`` of ``step`` is under the step's prefix: as the step's
        remote manifest records it once read, else as this tier's layout puts it ("flat":
        ``path``; "hashed": ``<2 hex digits of a hash>/path``, spreading a step's objects over
        256 key prefixes so that a store's request rate per prefix is not the limit)."""
        recorded = self._locations.get(step, {}).get(path)
        if recorded is not None:
            return recorded
        if self.layout == "hashed":
            return f"{hashlib.sha256(f'{step_dir_name(step)}/{path}'.encode()).hexdigest()[:2]}/{path}"
        return path

    def _shard(self, step: int, record: ShardRecord, stored: CompressedObject | None = None) -> str:
        return self._path(step, object_name(self.object_name(step, record.path), stored))

    def shard_location(self, step: int, record: ShardRecord) -> str:
        return self.location(step, object_name(self.object_name(step, record.path), self._stored(step, record)))

    def _stored(self, step: int, record: ShardRecord, *, read: bool = False) -> CompressedObject | None:
        """How ``record``'s object is stored (None: as the shard file it is): as the step's remote
        manifest says once read, else as this tier landed it. ``read``: read a committed step's
        remote manifest first if this tier has not yet (a reader never goes by its own option)."""
        if step not in self._compressed and (landed := self._landed.compressed(step, record.path)) is not None:
            return landed
        if step not in self._compressed and read:
            try:
                self.read_manifest(step)
            except RemoteError as exc:
                if not isinstance(exc.__cause__, FileNotFoundError):
                    raise
                return None  # not committed: a shard of it is read as it is
        return self._compressed.get(step, {}).get(record.path)

    # -- listing and reading ------------------------------------------------------------------

    def read_manifest(self, step: int) -> RemoteManifest:
        """The remote manifest of ``step`` (commit time, store checksums, locations), strictly validated."""
        location = self.location(step, MANIFEST_NAME)
        path = self._path(step, MANIFEST_NAME)

        def read() -> bytes:
            size = self.backend.size(path, timeout=self._timeout())
            if size > MAX_MANIFEST_BYTES:
                raise ManifestError(f"{location}: {size} bytes, over the {MAX_MANIFEST_BYTES} limit")
            return self.backend.read(path)

        remote = RemoteManifest.from_json(self._run(f"reading {location}", read), source=location)
        if remote.manifest.step != step:
            raise ManifestError(f"{location}: field 'step' is {remote.manifest.step}, the prefix is step {step}")
        self._locations[step], self._compressed[step] = remote.locations, remote.compression
        return remote

    def manifest(self, step: int) -> ShardManifest:
        """The validated manifest of committed ``step`` (see :meth:`read_manifest`)."""
        return self.read_manifest(step).manifest

    def held_ranks(self, step: int, manifest: ShardManifest) -> tuple[int, ...]:
        """Every rank of ``manifest``: a committed step holds every shard, and every node sees them."""
        return tuple(record.rank for record in manifest.shards)

    def open_shard(self, step: int, record: ShardRecord, consume: Callable[[BinaryIO], T]) -> T:
        """Open ``record``'s object and return ``consume(stream)``; retried from the start on a transient error.

        ``consume`` must leave nothing behind when it fails (e.g. write through a temp
        file); a :class:`CheckpointError` it raises (a checksum mismatch) is not retried.
        The stream ends after ``record.size_bytes + 1`` bytes, so an object longer than its
        record is never read whole; where the store tells the object's size on opening it
        (S3, GCS), a size other than the record's raises before ``consume`` is called:
        :class:`IncompleteCheckpointError` if shorter, :class:`ChecksumMismatchError` if longer.
        A compressed object (see :mod:`~tiered_ckpt.tiers.remote.compression`) streams decompressed, a
        frame at a time; its sizes are then the compressed object's, as its remote manifest records.
        """
        stored = self._stored(step, record, read=True)
        location, size_bytes = self.shard_location(step, record), (stored or record).size_bytes

        def read() -> T:
            with self.backend.open(self._shard(step, record, stored)) as source:
                size = getattr(source, "size", None)
                if isinstance(size, int) and size != size_bytes:
                    error = IncompleteCheckpointError if size < size_bytes else ChecksumMismatchError
                    raise error(f"{location}: the object has {size} bytes, the manifest records {size_bytes}")
                stream: Any = LimitedReader(source, self._requests, f"downloading {location}", size_bytes + 1)
                if stored is not None:
                    stream = FramesReader(stream, stored.index(record.size_bytes), location)
                return consume(stream)

        return self._run(f"downloading {location}", read)

    def read_range_into(
        self, step: int, record: ShardRecord, offset: int, buffer: memoryview, verify: Verify = "full"
    ) -> str:
        """Fill ``buffer`` with the shard's bytes from ``offset`` (ranged GETs of at most 16 MiB,
        each retried on a transient error: that is all held beside ``buffer``) and return their
        sha256 (``verify="fast"``: their xxh3-64). Raises :class:`IncompleteCheckpointError` if
        the object is shorter. Of a compressed object, only the frames covering the range are
        fetched (one GET per 64 MiB of them) and decompressed, each at most once while it
        stays among the last few read."""
        stored = self._stored(step, record, read=True)
        end, key = offset + len(buffer), self._shard(step, record, stored)
        what = f"reading bytes {offset}-{end} of {self.shard_location(step, record)}"

        def fetch(start: int, stop: int) -> bytes:
            return self._run(what, lambda: self.backend.read(key, start, stop))

        if stored is not None:
            index, cache = stored.index(record.size_bytes), (self._frames, f"{key} {stored.xxh3_64}")
            return read_range_into(fetch, index, offset, buffer, verify, what, cache)
        return fill_hashing(fetch, offset, np.frombuffer(buffer, np.uint8), verify, what=what)

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        """Stream and hash one shard object (decompressed, if it was compressed); return the problem,
        or None if it matches the record."""
        self._stored(step, record, read=True)
        location = self.shard_location(step, record)
        try:
            digest = self.open_shard(step, record, lambda source: hash_stream(source, "full"))
        except (ChecksumMismatchError, IncompleteCheckpointError) as exc:  # the object's size, told on opening
            return str(exc)
        except RemoteError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return f"{location}: missing"
            raise
        problem = record.mismatch(digest)
        return f"{location}: {problem}" if problem else None

    # -- landing and committing ---------------------------------------------------------------

    def _mismatch(self, key: str, obj: ShardRecord, sums: Callable[[], StoreSums | None] | None = None) -> str | None:
        """Why the object ``key`` does not match ``obj`` (the record of its own bytes: size, stored
        sha256), or None; given ``sums``, also the store's checksums of what it received against
        ``sums()`` (called only once the rest matches; None: nothing more to compare), which
        catches bytes changed in transit."""
        try:
            head = self.backend.head(key, timeout=self._timeout())
        except FileNotFoundError:
            return "missing"
        problem = obj.mismatch(ShardDigest(head.size, head.sha256 or "", ""))
        expected = sums() if problem is None and sums is not None else None
        return self.backend.store_problem(head, expected) if expected is not None else problem

    def _object(self, step: int, record: ShardRecord, stored: CompressedObject | None) -> tuple[str, ShardRecord]:
        """The key of ``record``'s object stored as ``stored`` says, and the record of its own bytes."""
        return self._shard(step, record, stored), stored.object_record(record) if stored is not None else record

    def shard_is_uploaded(self, step: int, record: ShardRecord) -> bool:
        """True if the shard's object exists with the recorded size (and sha256, where kept)."""
        key, obj = self._object(step, record, self._stored(step, record, read=True))
        return self._run(f"checking {self.shard_location(step, record)}", lambda: self._mismatch(key, obj) is None)

    def land_shard(self, step: int, record: ShardRecord, source: ShardSource, *, deadline: float | None = None) -> bool:
        """Make the shard's object match ``record``: put ``source`` (a stream is staged in a temp file
        first; with ``compression="zstd"``, the file compressed) unless the object is already there
        intact, then confirm.

        Returns True if it was put, False if it was already there. One operation under the
        retry policy and ``deadline``: a try that finds the object wrong afterwards puts it
        again. The file is checked against ``record`` before an object is made of it.
        "Intact" includes the store's checksums of what it received (bytes changed in transit
        are never confirmed); the one of what was sent, and how a compressed object is stored,
        are kept for :meth:`commit`.
        """
        if source.write is not None and source.path is None:  # staged in a temp file, checked, put from there
            with tempfile.TemporaryDirectory(prefix="tiered-ckpt-") as directory:
                with open(staged := Path(directory) / record.path, "wb") as out:
                    record.verify(source.write(out), f"{self.shard_location(step, record)} (staged)")
                return self.land_shard(step, record, ShardSource(path=staged), deadline=deadline)
        assert source.path is not None
        if self.compression == "zstd":
            with compressed_copy(source.path, record, str(source.path)) as (compressed, stored):
                return self._put(step, record, compressed, stored, deadline)
        return self._put(step, record, source.path, None, deadline)

    def _put(
        self, step: int, record: ShardRecord, local_path: Path, stored: CompressedObject | None, deadline: float | None
    ) -> bool:
        """:meth:`land_shard` of the file ``local_path``: the shard, or its compressed copy (``stored``)."""
        key, obj = self._object(step, record, stored)
        location = self.location(step, object_name(self.object_name(step, record.path), stored))

        def put_and_confirm() -> bool:
            if self._mismatch(key, obj, lambda: self.backend.sums(local_path, obj)) is None:
                self._landed.keep(step, record.path, None, stored)
                return False
            self._timeout()
            sums = self.backend.put_shard(local_path, key, obj, deadline=self._requests.deadline).sums
            problem = self._mismatch(key, obj, lambda: sums)
            if problem is not None:
                raise RemoteError(f"{location}: not confirmed after the upload: {problem}", transient=True)
            self._landed.keep(step, record.path, sums.kept if sums is not None else None, stored)
            return True

        return self._run(f"uploading {local_path} to {location}", put_and_confirm, deadline)

    def take_landed(self, step: int) -> Landed:
        """What this tier kept of each shard of ``step`` it landed: the store's checksum of what it
        put (one found already there intact has none) and how a compressed one is stored, by shard
        path, as the remote manifest records them; handed over once."""
        return self._landed.take(step)

    def add_landed(self, step: int, landed: Landed) -> None:
        """Take another process's :meth:`take_landed` (its shards of ``step``) for the commit here."""
        self._landed.add(step, landed)

    def take_landed_checksums(self, step: int) -> dict[str, str]:
        """The store's checksums of :meth:`take_landed` (for a tier that compresses, hand that over)."""
        return dict(self._landed.take(step).checksums)

    def add_landed_checksums(self, step: int, checksums: Mapping[str, str]) -> None:
        """Take another process's :meth:`take_landed_checksums` (its shards of ``step``) for the commit here."""
        self._landed.add(step, Landed(checksums))

    def forget_landed(self, step: int) -> None:
        """Drop what this tier kept of ``step``'s landed shards (its upload committed or given up)."""
        self._landed.forget(step)

    def check_store_checksum(self, step: int, record: ShardRecord, expected: str) -> str | None:
        """The problem, or None, comparing without a download the store's checksum of ``record``'s
        object with ``expected`` (the remote manifest's; earlier versions recorded SHA256); of a
        compressed object, both are of its compressed bytes, and so is the size compared."""
        key, obj = self._object(step, record, self._stored(step, record, read=True))
        location = self.shard_location(step, record)
        algorithm = expected.partition(":")[0]

        def head() -> tuple[int, str | None]:
            answer = self.backend.head(key, timeout=self._timeout())
            return answer.size, self.backend.kept_checksum(answer, algorithm)

        try:
            size, kept = self._run(f"reading the checksum of {location}", head)
        except RemoteError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return f"{location}: missing"
            raise
        if size != obj.size_bytes:
            return f"{location}: {size} bytes, the manifest records {obj.size_bytes}"
        if not same_checksum(kept, expected):
            return f"{location}: the store keeps checksum {kept}, the remote manifest records {expected}"
        return None

    def confirm_shard(self, step: int, record: ShardRecord, *, deadline: float | None = None) -> str | None:
        """Check ``record``'s object once more, by one HEAD, right before a commit: the problem
        (naming the object; one deleted or replaced since it was put), or None if its size,
        stored sha256 and store checksum (against what was sent) are as recorded."""
        key, obj = self._object(step, record, self._stored(step, record))
        location, kept = self.shard_location(step, record), self._landed.checksum(step, record.path)

        def head() -> str | None:
            try:
                answer = self.backend.head(key, timeout=self._timeout())
            except FileNotFoundError:
                return "missing"
            problem = obj.mismatch(ShardDigest(answer.size, answer.sha256 or "", ""))
            if problem is None and self.backend.facts.keeps_metadata and answer.sha256 is None:
                problem = "the sha256 stored with it is gone"
            if problem is None and kept is not None:
                found = self.backend.kept_checksum(answer, kept.partition(":")[0])
                if not same_checksum(found, kept):
                    problem = f"the store keeps checksum {found}, the upload sent {kept}"
            return problem

        problem = self._run(f"confirming {location}", head, deadline)
        return f"{location}: {problem}" if problem else None

    def commit(self, manifest: ShardManifest, *, deadline: float | None = None) -> RemoteManifest:
        """Write the remote manifest of ``manifest``'s step, with the store's checksums of the
        shards landed and how those compressed are stored (see :meth:`take_landed`), create-only
        where the store supports it (under ``deadline``, see :meth:`_run`).

        Call only once every shard is confirmed. If the step is already committed with
        the same shards (a retried or resumed commit), that commit is returned. A remote
        manifest a reader would refuse as too large (a compressed step's frame indexes over
        tens of TiB) is never written: :class:`RemoteError`, not transient.
        """
        step = manifest.step
        location = self.location(step, MANIFEST_NAME)
        path = self._path(step, MANIFEST_NAME)
        landed = self._landed.of(step, {record.path for record in manifest.shards})

        def create() -> RemoteManifest | None:
            locations = {
                record.path: self.object_name(step, record.path)
                for record in manifest.shards
                if self.object_name(step, record.path) != record.path
            }
            remote = RemoteManifest(manifest, time.time(), dict(landed.checksums), locations, dict(landed.compressed))
            if len(document := remote.to_json().encode()) > MAX_MANIFEST_BYTES:
                problem = f"{len(document):,} bytes, over the {MAX_MANIFEST_BYTES:,} a reader accepts"
                raise RemoteError(f"{location}: the remote manifest would take {problem}", transient=False)
            try:
                self.backend.put_bytes(path, document, create_only=True, timeout=self._timeout())
            except FileExistsError:
                return None
            return remote

        remote = self._run(f"committing {location}", create, deadline)
        self.forget_landed(step)
        if remote is not None:
            self._compressed[step] = remote.compression
            return remote
        existing = self.read_manifest(step)
        if existing.manifest.shards != manifest.shards:
            raise RemoteError(
                f"{location}: a different checkpoint of step {step} is already committed", transient=False
            )
        return existing

    def set_latest(self, step: int) -> None:
        """Point ``latest`` at ``step`` (a hint for people and tools; listing is the truth)."""
        path, data = f"{self._root}/{LATEST_NAME}", f"{step}\n".encode()
        self._run(f"writing {self.url}/{LATEST_NAME}", lambda: self.backend.put_bytes(path, data))

    # -- deleting -----------------------------------------------------------------------

    def delete_step(self, step: int) -> None:
        """Delete a step: its remote manifest first (the step turns invisible), then its objects,
        each named by its exact key (no glob expansion)."""

        def delete() -> None:
            if self.backend.exists(manifest := self._path(step, MANIFEST_NAME)):
                self.backend.delete([manifest])
            self.backend.delete_prefix(self._path(step))

        self._run(f"deleting {self.location(step)}", delete)
        self.forget_landed(step)
        self._compressed.pop(step, None)
