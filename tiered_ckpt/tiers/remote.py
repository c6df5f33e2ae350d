"""The remote tier: committed checkpoints under one URL (``s3://``, ``gs://``, ``file://`` ...).

Layout under the URL::

    step-000000001200/rank-00000-of-00004.safetensors
    step-000000001200/...
    step-000000001200/manifest.json     the remote manifest, written last
    latest                              the newest committed step (a hint, written after it)

It speaks the tier protocol (:class:`~tiered_ckpt.tiers.base.Tier`) over one
:class:`~tiered_ckpt.tiers.backends.base.Backend`, chosen from the URL's protocol; what
differs between stores is the backend's, and :attr:`RemoteTier.capabilities` says it.
Committing a step, as :class:`~tiered_ckpt.engine.replication.Replicator` drives it:

1. :meth:`RemoteTier.land_shard` puts each shard (its sha256 as object metadata where the
   store keeps metadata) and confirms it: the object's size and stored sha256 must match
   the record, and the checksums the store computed of what it received must match what
   was sent, so a shard is never taken as uploaded on the PUT's word alone. A shard
   already there intact is not sent again;
2. :meth:`RemoteTier.confirm_shard` checks each object once more, right before
3. :meth:`RemoteTier.commit` writes the remote manifest (with the store's checksums of the
   shards landed), create-only; :meth:`RemoteTier.set_latest` then moves ``latest``. A step
   is visible remotely exactly when its remote manifest exists.

**One retry policy** (:class:`RetryPolicy`) covers every request this tier makes, reads
included, and every backend error leaves this module as :class:`RemoteError` (see
:mod:`~tiered_ckpt.tiers.requests`); the clients' own retry loops are turned off where
they have a switch. Storage options (credentials) are never put in messages or reprs.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
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
from tiered_ckpt.format.layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    parse_step_dir_name,
    step_dir_name,
)
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES, ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.io.hashing import ShardDigest, Verify, copy_hashing, hash_stream
from tiered_ckpt.tiers.backends import open_backend
from tiered_ckpt.tiers.backends.base import Backend
from tiered_ckpt.tiers.backends.s3 import same_checksum
from tiered_ckpt.tiers.backends.wrappers import Counting
from tiered_ckpt.tiers.base import Capabilities, ShardSource
from tiered_ckpt.tiers.bucket_upkeep import BucketUpkeep
from tiered_ckpt.tiers.checksums import StoreSums
from tiered_ckpt.tiers.requests import LimitedReader, Requests
from tiered_ckpt.tiers.retry import RetryPolicy, is_transient

__all__ = ["RemoteTier", "RetryPolicy", "is_transient"]

logger = logging.getLogger("tiered_ckpt")
T = TypeVar("T")
Layout = Literal["flat", "hashed"]

# s3fs's default 50 MiB parts leave a 256 MiB shard in 3-5 parts; 16 MiB parts let its
# concurrent part uploads (max_concurrency, 10 by default) keep the link busy.
DEFAULT_PART_BYTES = 16 << 20
DEFAULT_PART_CONCURRENCY = 8  # parts in flight per tier (S3), before throttling lowers it


class RemoteTier(BucketUpkeep):
    """Checkpoints under ``url``, in the store its protocol names, opened with ``storage_options``.

    Every public method makes its requests under ``retry`` (see :class:`RetryPolicy`).
    :attr:`backend` is the store: the URL's backend, given to ``wrap`` if given (a wrapper of
    :mod:`~tiered_ckpt.tiers.backends.wrappers`), in a ``Counting`` wrapper (uploads' requests).
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
    ) -> None:
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        if layout not in ("flat", "hashed"):
            raise RemoteError(f"{self.url}: layout must be 'flat' or 'hashed', got {layout!r:.40}", transient=False)
        self.layout = layout
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
        self._kept: dict[tuple[int, str], str] = {}  # (step, shard path) -> the store's checksum of what was sent
        self._kept_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    def check_bucket(self) -> None:
        """Raise :class:`RemoteError` naming the bucket unless it exists and can be listed.

        One listing request, under the retry policy (a missing or unlistable bucket raises at
        once, saying which); a store without buckets (a file system, memory) has none to check.
        """
        bucket = self.backend.facts.bucket
        if bucket is not None:
            self._run(f"listing {self.url} to check its bucket {bucket}", self.backend.check_bucket)

    # -- names and plumbing -----------------------------------------------------------------

    def _path(self, step: int, name: str | None = None) -> str:
        prefix = f"{self._root}/{step_dir_name(step)}"
        return f"{prefix}/{name}" if name else prefix

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

    def _shard(self, step: int, record: ShardRecord) -> str:
        return self._path(step, self.object_name(step, record.path))

    def shard_location(self, step: int, record: ShardRecord) -> str:
        return self.location(step, self.object_name(step, record.path))

    def location(self, step: int, name: str | None = None) -> str:
        """The URL of a step's prefix or of one object in it, for messages."""
        prefix = f"{self.url}/{step_dir_name(step)}"
        return f"{prefix}/{name}" if name else prefix

    # -- listing and reading ------------------------------------------------------------------

    def list_steps(self) -> tuple[list[int], list[int]]:
        """(committed, uncommitted): steps whose remote manifest exists, and prefixes holding objects but none."""

        def listing() -> tuple[list[int], list[int]]:
            parsed = (parse_step_dir_name(name) for name in self.backend.list_names(self._root))
            steps = sorted(step for step in parsed if step is not None)
            committed = {step for step in steps if self.backend.exists(self._path(step, MANIFEST_NAME))}
            return sorted(committed), [step for step in steps if step not in committed]

        return self._run(f"listing {self.url}", listing)

    def steps(self) -> list[int]:
        """Steps whose remote manifest exists, oldest first."""
        return self.list_steps()[0]

    def uncommitted_steps(self) -> list[int]:
        """Step prefixes holding objects but no remote manifest (half-uploaded steps)."""
        return self.list_steps()[1]

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
        self._locations[step] = remote.locations
        return remote

    def manifest(self, step: int) -> ShardManifest:
        """The validated manifest of committed ``step`` (see :meth:`read_manifest`)."""
        return self.read_manifest(step).manifest

    def open_shard(self, step: int, record: ShardRecord, consume: Callable[[BinaryIO], T]) -> T:
        """Open ``record``'s object and return ``consume(stream)``; retried from the start on a transient error.

        ``consume`` must leave nothing behind when it fails (e.g. write through a temp
        file); a :class:`CheckpointError` it raises (a checksum mismatch) is not retried.
        The stream ends after ``record.size_bytes + 1`` bytes, so an object longer than its
        record is never read whole; where the store tells the object's size on opening it
        (S3, GCS), a size other than the record's raises before ``consume`` is called:
        :class:`IncompleteCheckpointError` if shorter, :class:`ChecksumMismatchError` if longer.
        """
        location = self.shard_location(step, record)

        def read() -> T:
            with self.backend.open(self._shard(step, record)) as source:
                size = getattr(source, "size", None)
                if isinstance(size, int) and size != record.size_bytes:
                    error = IncompleteCheckpointError if size < record.size_bytes else ChecksumMismatchError
                    raise error(f"{location}: the object has {size} bytes, the manifest records {record.size_bytes}")
                stream = LimitedReader(source, self._requests, f"downloading {location}", record.size_bytes + 1)
                return consume(stream)  # type: ignore[arg-type]

        return self._run(f"downloading {location}", read)

    def read_range_into(
        self, step: int, record: ShardRecord, offset: int, buffer: memoryview, verify: Verify = "full"
    ) -> str:
        """Fill ``buffer`` with ``record``'s object's bytes from ``offset`` (one ranged GET, retried
        on a transient error) and return their sha256 (``verify="fast"``: their xxh3-64).
        Raises :class:`IncompleteCheckpointError` if the object is shorter."""
        end = offset + len(buffer)
        what = f"reading bytes {offset}-{end} of {self.shard_location(step, record)}"
        data = self._run(what, lambda: self.backend.read(self._shard(step, record), offset, end))
        if len(data) != len(buffer):
            raise IncompleteCheckpointError(f"{what}: got {len(data)} bytes; the object is shorter than recorded")
        return copy_hashing(np.frombuffer(data, np.uint8), np.frombuffer(buffer, np.uint8), verify)

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        """Stream and hash one shard object; return the problem, or None if it matches the record."""
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

    def _mismatch(
        self, step: int, record: ShardRecord, sums: Callable[[], StoreSums | None] | None = None
    ) -> str | None:
        """Why the shard's object does not match ``record`` (size, stored sha256), or None; given
        ``sums``, also the store's checksums of what it received against ``sums()`` (called only
        once the rest matches; None: nothing more to compare), which catches bytes changed in transit."""
        try:
            head = self.backend.head(self._shard(step, record), timeout=self._timeout())
        except FileNotFoundError:
            return "missing"
        problem = record.mismatch(ShardDigest(head.size, head.sha256 or "", ""))
        expected = sums() if problem is None and sums is not None else None
        return self.backend.store_problem(head, expected) if expected is not None else problem

    def shard_is_uploaded(self, step: int, record: ShardRecord) -> bool:
        """True if the shard's object exists with the recorded size (and sha256, where kept)."""
        return self._run(f"checking {self.shard_location(step, record)}", lambda: self._mismatch(step, record) is None)

    def land_shard(self, step: int, record: ShardRecord, source: ShardSource, *, deadline: float | None = None) -> bool:
        """Make the shard's object match ``record``: put ``source`` (a stream is staged in a temp file
        first) unless the object is already there intact, then confirm.

        Returns True if it was put, False if it was already there. One operation under the
        retry policy and ``deadline``: a try that finds the object wrong afterwards puts it
        again. The file is checked against ``record`` before an object is made of it.
        "Intact" includes the store's checksums of what it received (bytes changed in transit
        are never confirmed); the one of what was sent is kept for :meth:`commit`.
        """
        if source.write is not None and source.path is None:  # staged in a temp file, checked, put from there
            with tempfile.TemporaryDirectory(prefix="tiered-ckpt-") as directory:
                with open(staged := Path(directory) / record.path, "wb") as out:
                    record.verify(source.write(out), f"{self.shard_location(step, record)} (staged)")
                return self.land_shard(step, record, ShardSource(path=staged), deadline=deadline)
        assert source.path is not None
        local_path, location = source.path, self.shard_location(step, record)

        def put_and_confirm() -> bool:
            if self._mismatch(step, record, lambda: self.backend.sums(local_path, record)) is None:
                return False
            self._timeout()
            target, at = self._shard(step, record), self._requests.deadline
            sums = self.backend.put_shard(local_path, target, record, deadline=at).sums
            problem = self._mismatch(step, record, lambda: sums)
            if problem is not None:
                raise RemoteError(f"{location}: not confirmed after the upload: {problem}", transient=True)
            if sums is not None and sums.kept is not None:  # what the store keeps for the bytes we sent
                with self._kept_lock:
                    self._kept[(step, record.path)] = sums.kept
            return True

        return self._run(f"uploading {local_path} to {location}", put_and_confirm, deadline)

    def take_landed_checksums(self, step: int) -> dict[str, str]:
        """The store's checksum of each shard of ``step`` this tier put, by shard path (one found
        already there intact has none), as the remote manifest records them; handed over once."""
        with self._kept_lock:
            taken = {path: kept for (each, path), kept in self._kept.items() if each == step}
        self.forget_landed(step)
        return taken

    def add_landed_checksums(self, step: int, checksums: Mapping[str, str]) -> None:
        """Take another process's :meth:`take_landed_checksums` (its shards of ``step``) for the commit here."""
        with self._kept_lock:
            self._kept.update({(step, path): kept for path, kept in checksums.items()})

    def forget_landed(self, step: int) -> None:
        """Drop what this tier kept of ``step``'s landed shards (its upload committed or given up)."""
        with self._kept_lock:
            for key in [key for key in self._kept if key[0] == step]:
                del self._kept[key]

    def check_store_checksum(self, step: int, record: ShardRecord, expected: str) -> str | None:
        """The problem, or None, comparing without a download the store's checksum of ``record``'s
        object with ``expected`` (the remote manifest's; earlier versions recorded SHA256)."""
        location = self.shard_location(step, record)
        algorithm = expected.partition(":")[0]

        def head() -> tuple[int, str | None]:
            answer = self.backend.head(self._shard(step, record), timeout=self._timeout())
            return answer.size, self.backend.kept_checksum(answer, algorithm)

        try:
            size, kept = self._run(f"reading the checksum of {location}", head)
        except RemoteError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return f"{location}: missing"
            raise
        if size != record.size_bytes:
            return f"{location}: {size} bytes, the manifest records {record.size_bytes}"
        if not same_checksum(kept, expected):
            return f"{location}: the store keeps checksum {kept}, the remote manifest records {expected}"
        return None

    def confirm_shard(self, step: int, record: ShardRecord, *, deadline: float | None = None) -> str | None:
        """Check ``record``'s object once more, by one HEAD, right before a commit: the problem
        (naming the object; one deleted or replaced since it was put), or None if its size,
        stored sha256 and store checksum (against what was sent) are as recorded."""
        location = self.shard_location(step, record)
        with self._kept_lock:
            kept = self._kept.get((step, record.path))

        def head() -> str | None:
            try:
                answer = self.backend.head(self._shard(step, record), timeout=self._timeout())
            except FileNotFoundError:
                return "missing"
            problem = record.mismatch(ShardDigest(answer.size, answer.sha256 or "", ""))
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
        shards landed (see :meth:`take_landed_checksums`), create-only where the store supports it
        (under ``deadline``, see :meth:`_run`).

        Call only once every shard is confirmed. If the step is already committed with
        the same shards (a retried or resumed commit), that commit is returned.
        """
        step = manifest.step
        location = self.location(step, MANIFEST_NAME)
        path = self._path(step, MANIFEST_NAME)
        paths = {record.path for record in manifest.shards}
        with self._kept_lock:
            store_checksums = {each: kept for (at, each), kept in self._kept.items() if at == step and each in paths}

        def create() -> RemoteManifest | None:
            locations = {
                record.path: self.object_name(step, record.path)
                for record in manifest.shards
                if self.object_name(step, record.path) != record.path
            }
            remote = RemoteManifest(
                manifest, committed_at=time.time(), store_checksums=store_checksums, locations=locations
            )
            try:
                self.backend.put_bytes(path, remote.to_json().encode(), create_only=True, timeout=self._timeout())
            except FileExistsError:
                return None
            return remote

        remote = self._run(f"committing {location}", create, deadline)
        self.forget_landed(step)
        if remote is not None:
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
