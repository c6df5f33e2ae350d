"""The remote tier: committed checkpoints under one fsspec URL (``s3://``, ``gs://``, ``file://`` ...).

Layout under the URL::

    step-000000001200/rank-00000-of-00004.safetensors
    step-000000001200/...
    step-000000001200/manifest.json     the remote manifest, written last
    latest                              the newest committed step (a hint, written after it)

Committing a step, as :class:`~tiered_ckpt.uploader.Uploader` drives it:

1. :meth:`RemoteTier.put_shard` puts each shard (its sha256 as object metadata where
   the store keeps metadata: S3, GCS) and confirms it: the object's size and stored
   sha256 must match the record, so a shard is never taken as uploaded on the PUT's
   word alone. A shard already there intact is not sent again;
2. :meth:`RemoteTier.commit` writes the remote manifest, create-only where the store
   supports it; :meth:`RemoteTier.set_latest` then moves ``latest``. A step is visible
   remotely exactly when its remote manifest exists.

On a file system (a plain path or ``file://``: NFS, Lustre), shards and manifests land
by temp name, fsync and rename, parent directories are created, and the manifest is
linked into place create-only.

This tier knows nothing of the local one: downloads hand the object's byte stream to
a function of the caller's (:meth:`RemoteTier.read_shard`), which never sees more than
the recorded size plus one byte of it.

**Exact keys.** Every list, read, write and delete names exact keys or prefixes: fsspec's
``rm(recursive=True)``, ``glob`` and ``expand_path`` treat ``[]``, ``*`` and ``?`` as
patterns and are never called, so a URL such as ``s3://b/sweep[12]`` is as good as any
(its steps are listed with ``ls``/``find`` on the exact prefix and deleted object by
object, or by S3's ``DeleteObjects`` naming each key). No character is refused.

**A bucket that exists.** :meth:`RemoteTier.check_bucket` (the manager and the CLI call
it when they open the tier) makes one listing request and raises :class:`RemoteError`
naming the bucket if it does not exist or cannot be listed.

**One retry policy** (:class:`RetryPolicy`) covers every request this tier makes,
reads included: an operation is tried at most ``max_tries`` times, with exponential
backoff and full jitter, and no new try starts once ``max_seconds`` have passed since
the first; each request times out after ``timeout_seconds``. The clients' own retry
loops are turned off where they have a switch (botocore's and s3fs's), so tries do not
multiply; gcsfs retries each request up to 6 times on its own and has no switch.

Every backend error leaves this module as :class:`RemoteError`, its ``transient`` flag
set when trying again may help (throttling, 5xx, resets, timeouts), ``tries`` counting
the tries made, the original exception chained. Storage options (credentials) are never
put in messages or reprs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar

import numpy as np
from fsspec.asyn import sync
from fsspec.core import url_to_fs

from tiered_ckpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    ManifestError,
    RemoteError,
)
from tiered_ckpt.format.layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    OWNERS_DIR,
    owner_name,
    parse_owner_name,
    parse_step_dir_name,
    step_dir_name,
)
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES, RemoteManifest, ShardManifest, ShardRecord
from tiered_ckpt.io.hashing import ShardDigest, Verify, copy_and_hash, copy_hashing, hash_stream
from tiered_ckpt.io.durable import atomic_write, write_bytes
from tiered_ckpt.tiers.checksums import StoreSums, check_source, store_sums
from tiered_ckpt.tiers.multipart import Upload, Window, list_open_uploads
from tiered_ckpt.tiers.retry import RetryPolicy, is_transient

__all__ = ["RemoteTier", "RetryPolicy", "is_transient"]

logger = logging.getLogger("tiered_ckpt")
T = TypeVar("T")
Layout = Literal["flat", "hashed"]

# s3fs's default 50 MiB parts leave a 256 MiB shard in 3-5 parts; 16 MiB parts let its
# concurrent part uploads (max_concurrency, 10 by default) keep the link busy.
DEFAULT_PART_BYTES = 16 << 20
DEFAULT_PART_CONCURRENCY = 8  # parts in flight per tier (S3), before throttling lowers it
SHA256_METADATA_KEY = "sha256"
STREAM_BLOCK_BYTES = 16 << 20
MAX_OWNER_BYTES = 64 << 10  # an owner record is a few hundred bytes; a bigger object is not one
DELETE_BATCH = 1000  # keys per S3 DeleteObjects request (its limit)


def _same_checksum(kept: str | None, expected: str) -> bool:
    """True if the store's checksum ``kept`` is ``expected``; a composite's part count (``-N``)
    may be left off by the store (moto's HEAD leaves it off; its GET and S3 say it)."""
    base, dash, parts = expected.rpartition("-")
    return kept is not None and (kept == expected or (bool(dash) and parts.isdigit() and kept == base))


def _client_options(protocols: set[str], options: Mapping[str, Any], retry: RetryPolicy) -> dict[str, Any]:
    """fsspec options with the client's own retries off (where it has a switch) and request timeouts set."""
    merged = dict(options)
    if protocols & {"s3", "s3a"}:
        config = dict(merged.get("config_kwargs") or {})
        config.setdefault("connect_timeout", retry.timeout_seconds)
        config.setdefault("read_timeout", retry.timeout_seconds)
        config["retries"] = {"total_max_attempts": 1}  # ours are the only retries
        merged["config_kwargs"] = config
    elif protocols & {"gs", "gcs"}:
        merged.setdefault("requests_timeout", retry.timeout_seconds)
    merged.setdefault("skip_instance_cache", True)  # an instance of our own: its settings are ours to change
    return merged


class _Reader:
    """A read-only stream whose backend errors become :class:`RemoteError` (reads are remote
    requests), ending after ``limit`` bytes: an object longer than its record is never read
    past one byte more than the record (enough to tell it is longer)."""

    def __init__(self, source: Any, tier: RemoteTier, what: str, limit: int) -> None:
        self._source, self._tier, self._what = source, tier, what
        self._left = limit

    def read(self, size: int = -1) -> bytes:
        size = self._left if size is None or size < 0 else min(size, self._left)
        if size == 0:
            return b""
        with self._tier._translated(self._what):
            data = self._source.read(size)
        self._left -= len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: self._left]
        if not len(view):
            return 0
        with self._tier._translated(self._what):
            count = self._source.readinto(view)
        self._left -= count
        return count


class RemoteTier:
    """Checkpoints under ``url``, reached through fsspec with ``storage_options``.

    Every public method makes its requests under ``retry`` (see :class:`RetryPolicy`).
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
        part_concurrency: int = DEFAULT_PART_CONCURRENCY,
        layout: Layout = "flat",
    ) -> None:
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._part_bytes = part_bytes
        scheme = self.url.partition("://")[0] if "://" in self.url else "file"
        options = _client_options({scheme}, storage_options or {}, self.retry)
        try:
            self._fs, self._root = url_to_fs(self.url, **options)
        except Exception as exc:  # a missing backend, a bad option, a backend that connects at once and fails
            raise RemoteError(
                f"cannot open {self.url}: {type(exc).__name__}: {exc}", transient=is_transient(exc)
            ) from exc
        self._root = self._root.rstrip("/")
        # The deadline (``at``) of the operation running on each thread (uploads of several
        # shards run at once).
        self._context = threading.local()
        self.window = Window(part_concurrency)
        if layout not in ("flat", "hashed"):
            raise RemoteError(f"{self.url}: layout must be 'flat' or 'hashed', got {layout!r:.40}", transient=False)
        self.layout = layout
        self._locations: dict[int, Mapping[str, str]] = {}  # step -> its remote manifest's object names
        self._kept: dict[tuple[int, str], str] = {}  # (step, shard path) -> the store's checksum of the object
        self.requests = 0  # S3 upload requests made, and how many of them the store throttled
        self.throttled = 0
        protocol = self._fs.protocol
        protocols = {protocol} if isinstance(protocol, str) else set(protocol)
        self._s3 = bool(protocols & {"s3", "s3a"})
        self._gcs = bool(protocols & {"gs", "gcs"})
        self._posix = bool(protocols & {"file", "local"})
        self._memory = "memory" in protocols
        if self._s3:
            self._fs.retries = 1  # s3fs's own retry loop (no constructor argument): ours are the only retries

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    def check_bucket(self) -> None:
        """Raise :class:`RemoteError` naming the bucket unless it exists and can be listed.

        One listing request (S3: ``ListObjectsV2`` of at most one key under the URL; GCS: a
        listing of at most one object), under the retry policy: a transient error is tried
        again, then raised (``transient`` set); a missing bucket or a refused listing is
        raised at once, saying which. A file system or memory URL has no bucket: its
        directory is created by the first upload, so nothing is checked.
        """
        if not (self._s3 or self._gcs):
            return
        bucket, prefix = self._root.partition("/")[::2]
        scheme = "s3" if self._s3 else "gs"

        def list_one() -> None:
            try:
                if self._s3:
                    self._fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
                else:
                    self._fs.call("GET", "b/{}/o", bucket, prefix=f"{prefix}/" if prefix else None, maxResults=1)
            except FileNotFoundError as exc:
                raise RemoteError(
                    f"{self.url}: the bucket {bucket!r} does not exist ({scheme}://{bucket}): {exc}", transient=False
                ) from exc
            except PermissionError as exc:
                raise RemoteError(
                    f"{self.url}: access to the bucket {bucket!r} is denied (it cannot be listed with these "
                    f"credentials): {exc}",
                    transient=False,
                ) from exc

        self._run(f"listing {self.url} to check its bucket {scheme}://{bucket}", list_one)

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

    def _shard_location(self, step: int, record: ShardRecord) -> str:
        return self.location(step, self.object_name(step, record.path))

    def location(self, step: int, name: str | None = None) -> str:
        """The URL of a step's prefix or of one object in it, for messages."""
        prefix = f"{self.url}/{step_dir_name(step)}"
        return f"{prefix}/{name}" if name else prefix

    @contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            transient = is_transient(exc)
            kind = "transient" if transient else "permanent"
            raise RemoteError(f"{what}: {kind} error {type(exc).__name__}: {exc}", transient=transient) from exc

    def _run(self, what: str, action: Callable[[], T], deadline: float | None = None) -> T:
        """``action`` under the retry policy, its backend errors translated; with a ``deadline``
        (a ``time.monotonic()`` time), no try starts after it and a request still running
        then is cut short (see :meth:`_limit`)."""

        def once() -> T:
            with self._translated(what):
                return action()

        self._context.at = deadline
        try:
            return self.retry.run(what, once, deadline=deadline)
        finally:
            self._context.at = None

    def _limit(self) -> dict[str, Any]:
        """The keyword that cuts an fsspec call short at this thread's deadline (async backends
        take ``timeout``: fsspec cancels the request's coroutine), or none without one."""
        deadline = getattr(self._context, "at", None)
        if deadline is None or not getattr(self._fs, "async_impl", False):
            return {}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            error = RemoteError("the deadline passed before this request could start", transient=False)
            error.deadline = True
            raise error
        return {"timeout": remaining}

    def _fresh_info(self, path: str) -> dict[str, Any]:
        self._fs.invalidate_cache(path)
        return self._fs.info(path, **self._limit())

    def _exists(self, path: str) -> bool:
        self._fs.invalidate_cache(path)
        return self._fs.exists(path)

    # -- listing and reading ------------------------------------------------------------------

    def _step_prefixes(self) -> list[int]:
        self._fs.invalidate_cache(self._root)
        try:
            entries = self._fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        steps = (parse_step_dir_name(entry.rstrip("/").rsplit("/", 1)[-1]) for entry in entries)
        return sorted(step for step in steps if step is not None)

    def list_steps(self) -> tuple[list[int], list[int]]:
        """(committed, uncommitted): steps whose remote manifest exists, and prefixes holding objects but none."""

        def listing() -> tuple[list[int], list[int]]:
            steps = self._step_prefixes()
            committed = {step for step in steps if self._exists(self._path(step, MANIFEST_NAME))}
            return sorted(committed), [step for step in steps if step not in committed]

        return self._run(f"listing {self.url}", listing)

    def committed_steps(self) -> list[int]:
        """Steps whose remote manifest exists, oldest first."""
        return self.list_steps()[0]

    def uncommitted_steps(self) -> list[int]:
        """Step prefixes holding objects but no remote manifest (half-uploaded steps)."""
        return self.list_steps()[1]

    def read_manifest(self, step: int) -> RemoteManifest:
        """Read and strictly validate the remote manifest of ``step``."""
        location = self.location(step, MANIFEST_NAME)
        path = self._path(step, MANIFEST_NAME)

        def read() -> bytes:
            size = self._fresh_info(path).get("size", 0)
            if size > MAX_MANIFEST_BYTES:
                raise ManifestError(f"{location}: {size} bytes, over the {MAX_MANIFEST_BYTES} limit")
            return self._fs.cat_file(path)

        remote = RemoteManifest.from_json(self._run(f"reading {location}", read), source=location)
        if remote.manifest.step != step:
            raise ManifestError(f"{location}: field 'step' is {remote.manifest.step}, the prefix is step {step}")
        self._locations[step] = remote.locations
        return remote

    def read_shard(self, step: int, record: ShardRecord, consume: Callable[[BinaryIO], T]) -> T:
        """Open ``record``'s object and return ``consume(stream)``; retried from the start on a transient error.

        ``consume`` must leave nothing behind when it fails (e.g. write through a temp
        file); a :class:`CheckpointError` it raises (a checksum mismatch) is not retried.
        The stream ends after ``record.size_bytes + 1`` bytes, so an object longer than its
        record is never read whole; where the store tells the object's size on opening it
        (S3, GCS), a size other than the record's raises before ``consume`` is called:
        :class:`IncompleteCheckpointError` if shorter, :class:`ChecksumMismatchError` if longer.
        """
        location = self._shard_location(step, record)

        def read() -> T:
            with self._fs.open(self._shard(step, record), "rb", block_size=STREAM_BLOCK_BYTES) as source:
                size = getattr(source, "size", None)
                if isinstance(size, int) and size != record.size_bytes:
                    error = IncompleteCheckpointError if size < record.size_bytes else ChecksumMismatchError
                    raise error(f"{location}: the object has {size} bytes, the manifest records {record.size_bytes}")
                stream = _Reader(source, self, f"downloading {location}", record.size_bytes + 1)
                return consume(stream)  # type: ignore[arg-type]

        return self._run(f"downloading {location}", read)

    def read_range_into(
        self, step: int, record: ShardRecord, offset: int, buffer: memoryview, verify: Verify = "full"
    ) -> str:
        """Fill ``buffer`` with ``record``'s object's bytes from ``offset`` (one ranged GET, retried
        on a transient error) and return their sha256 (``verify="fast"``: their xxh3-64).
        Raises :class:`IncompleteCheckpointError` if the object is shorter."""
        end = offset + len(buffer)
        what = f"reading bytes {offset}-{end} of {self._shard_location(step, record)}"
        data = self._run(what, lambda: self._fs.cat_file(self._shard(step, record), start=offset, end=end))
        if len(data) != len(buffer):
            raise IncompleteCheckpointError(f"{what}: got {len(data)} bytes; the object is shorter than recorded")
        return copy_hashing(np.frombuffer(data, np.uint8), np.frombuffer(buffer, np.uint8), verify)

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        """Stream and hash one shard object; return the problem, or None if it matches the record."""
        location = self._shard_location(step, record)
        try:
            digest = self.read_shard(step, record, lambda source: hash_stream(source, "full"))
        except (ChecksumMismatchError, IncompleteCheckpointError) as exc:  # the object's size, told on opening
            return str(exc)
        except RemoteError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return f"{location}: missing"
            raise
        problem = record.mismatch(digest)
        return f"{location}: {problem}" if problem else None

    # -- uploading ------------------------------------------------------------------------

    def _put_kwargs(self, sha256: str) -> dict[str, Any]:
        """Backend arguments of a shard's PUT: its sha256 as metadata, and the multipart part size."""
        if self._s3:
            return {"Metadata": {SHA256_METADATA_KEY: sha256}, "chunksize": self._part_bytes}
        if self._gcs:
            return {"metadata": {SHA256_METADATA_KEY: sha256}, "chunksize": self._part_bytes}
        return {}

    def _head(self, path: str) -> tuple[int, str | None, dict[str, Any]]:
        """The object's size, the sha256 stored with it (metadata we sent; None where the store
        keeps none) and what the store says of it (S3: HEAD with its checksums; else fsspec's info)."""
        if self._s3:
            bucket, key, _version = self._fs.split_path(path)
            answer = self._fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED", **self._limit())
            return int(answer.get("ContentLength", -1)), answer.get("Metadata", {}).get(SHA256_METADATA_KEY), answer
        info = self._fresh_info(path)
        stored = (info.get("metadata") or {}).get(SHA256_METADATA_KEY) if self._gcs else None
        return int(info.get("size") or 0), stored, info

    def _store_problem(self, head: Mapping[str, Any], sums: StoreSums) -> str | None:
        """Where the checksums the store computed of the bytes it holds differ from ``sums``."""
        if self._s3:
            computed = {"ETag": sums.etag, "ChecksumCRC32C": sums.kept and sums.kept.removeprefix("crc32c:")}
        else:
            computed = {"md5Hash": sums.etag}
        for name, expected in computed.items():
            if expected is not None and not _same_checksum(head.get(name), expected):
                return f"the store computed {name} {head.get(name)} of the bytes it holds, expected {expected}"
        return None

    def _mismatch(
        self, step: int, record: ShardRecord, sums: Callable[[], StoreSums | None] | None = None
    ) -> str | None:
        """Why the shard's object does not match ``record``, or None.

        Compared: the object's size, the sha256 stored with it (metadata we sent), and,
        when ``sums`` is given, the checksums the store computed from the bytes it received
        (which catches bytes changed in transit; see :mod:`~tiered_ckpt.checksums`) against
        ``sums()``, called only once the rest matches (None: nothing more to compare).
        """
        path = self._shard(step, record)
        try:
            size, stored, head = self._head(path)
        except FileNotFoundError:
            return "missing"
        problem = record.mismatch(ShardDigest(size, stored or "", ""))
        expected = sums() if problem is None and sums is not None else None
        return self._store_problem(head, expected) if expected is not None else problem

    def shard_is_uploaded(self, step: int, record: ShardRecord) -> bool:
        """True if the shard's object exists with the recorded size (and sha256, where kept)."""
        location = self._shard_location(step, record)
        return self._run(f"checking {location}", lambda: self._mismatch(step, record) is None)

    def _pipe(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a small object whole; ``create_only`` raises FileExistsError if it exists."""
        if self._posix:  # temp name, fsync, rename (or link, create-only)
            write_bytes(Path(path), data, create_only=create_only)
        else:
            self._fs.pipe_file(path, data, mode="create" if create_only else "overwrite", **self._limit())

    def _put(self, local_path: Path, step: int, record: ShardRecord) -> StoreSums | None:
        """Send the shard's file; return the checksums the store computes of it (None: none compared)."""
        path = self._shard(step, record)
        if self._s3:
            bucket, key, _version = self._fs.split_path(path)
            upload = Upload(
                self._fs, local_path, bucket, key, part_bytes=self._part_bytes, window=self.window,
                max_tries=self.retry.max_tries, backoff_seconds=self.retry.backoff_seconds,
                extra={"Metadata": {SHA256_METADATA_KEY: record.sha256}}, deadline=getattr(self._context, "at", None),
                verify_source=functools.partial(check_source, local_path, record),
            )  # fmt: skip
            stats = sync(self._fs.loop, upload.run, **self._limit())
            self.requests += stats.requests
            self.throttled += stats.throttled
            return stats.sums
        if not self._posix:
            sums = store_sums(local_path, record, s3=False, gcs=self._gcs, part_bytes=self._part_bytes)
            self._fs.put_file(str(local_path), path, **self._put_kwargs(record.sha256), **self._limit())
            return sums
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(local_path, "rb") as source:
            what = f"{self._shard_location(step, record)} from {local_path}"
            atomic_write(target, lambda out: copy_and_hash(source, out), check=lambda d: record.verify(d, what))
        return None

    def put_shard(self, step: int, local_path: Path, record: ShardRecord, *, deadline: float | None = None) -> bool:
        """Make the shard's object match ``record``: put it unless it is already there intact, then confirm.

        Returns True if it was put, False if it was already there. One operation under
        the retry policy (and ``deadline``, see :meth:`_run`): a try that finds the object
        wrong afterwards puts it again. The file is checked against ``record`` before an
        object is created from it. "Intact" includes the checksums the store computed of
        what it received (see :mod:`~tiered_ckpt.checksums`), so bytes changed in transit
        are never confirmed.
        """
        location = self._shard_location(step, record)

        def sums_of_the_file() -> StoreSums | None:  # computed only when the object is there already
            return store_sums(local_path, record, s3=self._s3, gcs=self._gcs, part_bytes=self._part_bytes)

        def put_and_confirm() -> bool:
            if self._mismatch(step, record, sums_of_the_file) is None:
                return False
            sums = self._put(local_path, step, record)
            problem = self._mismatch(step, record, lambda: sums)
            if problem is not None:
                raise RemoteError(f"{location}: not confirmed after the upload: {problem}", transient=True)
            if sums is not None and sums.kept is not None:  # what the store keeps for the bytes we sent
                self._kept[(step, record.path)] = sums.kept
            return True

        return self._run(f"uploading {local_path} to {location}", put_and_confirm, deadline)

    def store_checksum(self, step: int, record: ShardRecord) -> str | None:
        """The checksum the store keeps for ``record``'s object, as :meth:`put_shard` of this tier
        computed it when it sent the object (None: not sent by this tier, e.g. already there
        intact, or a store that keeps none we read). Asked once: it is forgotten then."""
        return self._kept.pop((step, record.path), None)

    def check_store_checksum(self, step: int, record: ShardRecord, expected: str) -> str | None:
        """Compare the checksum the store keeps for ``record``'s object with ``expected`` (from
        the remote manifest) without downloading it; return the problem, or None if they match.

        S3 checks every part against its CRC32C on receipt (moto's server computes a multipart
        object's from the parts it received, and keeps a one-request object's as sent); GCS
        computes an object's CRC32C itself. ``expected`` may name SHA256 (earlier versions)."""
        location = self._shard_location(step, record)
        path = self._shard(step, record)
        algorithm = expected.partition(":")[0]

        def head() -> tuple[int, str | None]:
            size, _stored, answer = self._head(path)
            return size, self._kept_checksum(answer, algorithm)

        try:
            size, kept = self._run(f"reading the checksum of {location}", head)
        except RemoteError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return f"{location}: missing"
            raise
        if size != record.size_bytes:
            return f"{location}: {size} bytes, the manifest records {record.size_bytes}"
        if not _same_checksum(kept, expected):
            return f"{location}: the store keeps checksum {kept}, the remote manifest records {expected}"
        return None

    def _kept_checksum(self, head: Mapping[str, Any], algorithm: str) -> str | None:
        """The checksum of ``algorithm`` the store keeps for an object, from its HEAD answer ``head``."""
        if self._s3:
            kept = head.get("ChecksumCRC32C" if algorithm == "crc32c" else "ChecksumSHA256")
        else:  # GCS keeps it in the object's metadata
            kept = head.get("crc32c")
        return f"{algorithm}:{kept}" if kept else None

    def confirm_shard(
        self, step: int, record: ShardRecord, kept: str | None = None, *, deadline: float | None = None
    ) -> str | None:
        """Check ``record``'s object once more, by one HEAD, and return the problem (naming the
        object), or None if it is there as recorded: its size, the sha256 stored with it (where
        the store keeps metadata: S3, GCS) and, given ``kept`` (the checksum the store keeps for
        the bytes this job sent, see :meth:`store_checksum`), the store's own checksum of it.
        Made right before a commit: an object deleted or replaced since it was put is caught.
        Under ``deadline`` (see :meth:`_run`)."""
        location = self._shard_location(step, record)
        path = self._shard(step, record)

        def head() -> str | None:
            try:
                size, stored, answer = self._head(path)
            except FileNotFoundError:
                return "missing"
            problem = record.mismatch(ShardDigest(size, stored or "", ""))
            if problem is None and (self._s3 or self._gcs) and stored is None:
                problem = "the sha256 stored with it is gone"
            if problem is None and kept is not None:
                found = self._kept_checksum(answer, kept.partition(":")[0])
                if not _same_checksum(found, kept):
                    problem = f"the store keeps checksum {found}, the upload sent {kept}"
            return problem

        problem = self._run(f"confirming {location}", head, deadline)
        return f"{location}: {problem}" if problem else None

    def commit(
        self,
        manifest: ShardManifest,
        *,
        deadline: float | None = None,
        store_checksums: Mapping[str, str] | None = None,
    ) -> RemoteManifest:
        """Write the remote manifest of ``manifest``'s step, create-only where the store supports it
        (under ``deadline``, see :meth:`_run`).

        Call only once every shard is confirmed. If the step is already committed with
        the same shards (a retried or resumed commit), that commit is returned.
        """
        step = manifest.step
        location = self.location(step, MANIFEST_NAME)
        path = self._path(step, MANIFEST_NAME)

        def create() -> RemoteManifest | None:
            locations = {
                record.path: self.object_name(step, record.path)
                for record in manifest.shards
                if self.object_name(step, record.path) != record.path
            }
            remote = RemoteManifest(
                manifest, committed_at=time.time(), store_checksums=dict(store_checksums or {}), locations=locations
            )
            try:
                self._pipe(path, remote.to_json().encode(), create_only=True)
            except FileExistsError:
                return None
            return remote

        remote = self._run(f"committing {location}", create, deadline)
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
        self._run(f"writing {self.url}/{LATEST_NAME}", lambda: self._pipe(path, data))

    # -- deleting -----------------------------------------------------------------------

    def abort_orphans(self, older_than_seconds: float = 0.0, *, now: float | None = None) -> list[str]:
        """Abort the multipart uploads left open under this tier's URL (S3) by an upload that
        failed or was killed, started at least ``older_than_seconds`` before ``now`` (a Unix
        time; default: the clock's); return their URLs.

        The caller makes sure no live run is uploading under the URL (see
        :mod:`~tiered_ckpt.owners`): an open upload does not say which run started it.
        Only uploads of this library's objects (``step-*/...`` under the URL) are touched.
        Elsewhere there is nothing to do: a file system leaves temp files the next upload
        replaces, and GCS offers no listing of unfinished resumable uploads (it expires them
        after a week).
        """
        if not self._s3:
            return []
        bucket, prefix, _version = self._fs.split_path(self._root)
        uploads = self._run(
            f"listing unfinished multipart uploads under {self.url}",
            lambda: list_open_uploads(self._fs, bucket, prefix),
        )
        now = time.time() if now is None else now
        aborted = []
        for upload in uploads:
            key, started = upload["Key"], upload.get("Initiated")
            relative = key[len(prefix) :].lstrip("/") if prefix else key
            if parse_step_dir_name(relative.split("/", 1)[0]) is None or "/" not in relative:
                continue  # not an object of ours
            if started is not None and now - started.timestamp() < older_than_seconds:
                continue  # may belong to an upload still running
            location = f"{self.url}/{relative}"
            abort = functools.partial(
                self._fs.call_s3, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"]
            )
            self._run(f"aborting the unfinished multipart upload of {location}", abort)
            logger.warning("aborted an unfinished multipart upload of %s (started %s)", location, started)
            aborted.append(location)
        return aborted

    def _objects(self, prefix: str) -> list[str]:
        """Every object under ``prefix``: exact, since ``find`` lists by prefix and expands no
        glob characters (unlike ``rm(recursive=True)`` and ``glob``)."""
        self._fs.invalidate_cache(prefix)
        try:
            found = self._fs.find(prefix)
        except FileNotFoundError:
            return []
        return sorted(path for path in found if path.startswith(f"{prefix}/"))

    def _delete_objects(self, paths: list[str]) -> None:
        """Delete exactly the objects ``paths`` (S3: ``DeleteObjects`` naming each key, 1000 a
        request; elsewhere one by one); an object already gone is no error."""
        if self._s3:
            bucket = self._fs.split_path(self._root)[0]
            keys = [self._fs.split_path(path)[1] for path in paths]
            for start in range(0, len(keys), DELETE_BATCH):
                batch = [{"Key": key} for key in keys[start : start + DELETE_BATCH]]
                answer = self._fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
                failed = answer.get("Errors") or []
                if failed:
                    first = failed[0]
                    raise OSError(
                        f"deleting s3://{bucket}/{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                    )
            return
        for path in paths:
            try:
                self._fs.rm_file(path)
            except FileNotFoundError:
                pass

    def delete_step(self, step: int) -> None:
        """Delete a step: its remote manifest first (the step turns invisible), then its objects,
        each named by its exact key (see the module doc: no glob expansion)."""

        def delete() -> None:
            manifest = self._path(step, MANIFEST_NAME)
            if self._exists(manifest):
                self._fs.rm_file(manifest)
            prefix = self._path(step)
            if self._posix:
                if Path(prefix).is_dir():
                    shutil.rmtree(prefix)
                return
            self._delete_objects(self._objects(prefix))
            if self._memory:  # fsspec's memory filesystem keeps directories of its own
                for directory in sorted(d for d in self._fs.pseudo_dirs if d == prefix or d.startswith(f"{prefix}/")):
                    self._fs.pseudo_dirs.remove(directory)
            self._fs.invalidate_cache(prefix)

        self._run(f"deleting {self.location(step)}", delete)

    # -- owner records (see tiered_ckpt.owners) -----------------------------------------------

    def _owner_path(self, run_id: str) -> str:
        return f"{self._root}/{OWNERS_DIR}/{owner_name(run_id)}"

    def owner_location(self, run_id: str) -> str:
        """The URL of run ``run_id``'s owner record, for messages."""
        return f"{self.url}/{OWNERS_DIR}/{owner_name(run_id)}"

    def write_owner(self, run_id: str, document: bytes) -> None:
        """Write (or overwrite) run ``run_id``'s owner record."""
        path = self._owner_path(run_id)
        if self._posix:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._run(f"writing {self.owner_location(run_id)}", lambda: self._pipe(path, document))

    def read_owners(self) -> dict[str, bytes]:
        """Every owner record under the URL, by run id (an exact listing of ``owners/``; a
        record deleted while listed is left out; at most 64 KiB + 1 byte of each is read)."""
        directory = f"{self._root}/{OWNERS_DIR}"

        def read() -> dict[str, bytes]:
            records: dict[str, bytes] = {}
            for path in self._objects(directory):
                run_id = parse_owner_name(path.rsplit("/", 1)[-1])
                if run_id is None:
                    continue
                try:
                    records[run_id] = self._fs.cat_file(path, start=0, end=MAX_OWNER_BYTES + 1)
                except FileNotFoundError:
                    continue  # released while we listed
            return records

        return self._run(f"reading the owner records under {self.url}/{OWNERS_DIR}", read)

    def delete_owner(self, run_id: str) -> None:
        """Delete run ``run_id``'s owner record (none there is no error)."""
        path = self._owner_path(run_id)
        self._run(f"deleting {self.owner_location(run_id)}", lambda: self._delete_objects([path]))
