"""The remote tier: committed checkpoints under one URL (``s3://``, ``gs://``, ``file://`` ...).

Layout under the URL::

    step-000000001200/rank-00000-of-00004.safetensors
    step-000000001200/...
    step-000000001200/manifest.json     the remote manifest, written last
    step-000000001100/kept-for-later-steps.json
                                        a prefix keeping files later steps reference
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
   read goes by what the step's remote manifest records of it, whatever the option. It
   returns what landed (:class:`~tiered_ckpt.tiers.base.Landed`: the object's name, sizes, the
   store's checksum of what was sent, how it is compressed) and keeps nothing of it;
2. :meth:`RemoteTier.confirm`, on every process, checks once more each object its landings
   put (one HEAD each), right before the commit;
3. :meth:`RemoteTier.commit`, handed what every process's landings returned and what each
   confirmed, checks any object none confirmed, then writes the remote manifest (with the
   store's checksums of the shards landed and how each is stored), create-only, then moves
   ``latest``. A step is
   visible remotely exactly when its remote manifest exists.

A step of an incremental save references files of earlier steps: each is landed under its
own step's prefix with the step's shards (found already there, it is not sent again),
confirmed with them, and recorded in the remote manifest; deleting a step keeps what committed
steps reference (:mod:`~tiered_ckpt.tiers.remote.kept`).

**One retry policy** (:class:`RetryPolicy`) covers every request this tier makes, reads
included, and every backend error leaves this module as :class:`RemoteError` (see
:mod:`~tiered_ckpt.tiers.remote.requests`); the clients' own retry loops are turned off where
they have a switch. Storage options (credentials) are never put in messages or reprs.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar, get_args

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
    shard_world_size,
    step_dir_name,
)
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES, ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest, StoredObject, referenced_key
from tiered_ckpt.io.hashing import ShardDigest, Verify, fill_hashing, hash_stream
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.io.zstd_frames import FrameCache, FramesReader, read_range_into
from tiered_ckpt.tiers.base import Capabilities, Confirmed, Landed, ShardSource
from tiered_ckpt.tiers.remote.backends import open_backend
from tiered_ckpt.tiers.remote.backends.base import Backend
from tiered_ckpt.tiers.remote.backends.s3 import same_checksum
from tiered_ckpt.tiers.remote.backends.wrappers import Counting
from tiered_ckpt.tiers.remote.checksums import StoreSums
from tiered_ckpt.tiers.remote.compression import Compression, check_compression, compressed_copy, object_name
from tiered_ckpt.tiers.remote.kept import KeptObjects
from tiered_ckpt.tiers.remote.requests import LimitedReader, Requests, Trouble, is_missing
from tiered_ckpt.tiers.remote.retry import RetryPolicy, is_transient
from tiered_ckpt.tiers.remote.upkeep import BucketUpkeep

__all__ = ["RemoteTier", "RetryPolicy", "is_transient"]

logger = logging.getLogger("tiered_ckpt")
T = TypeVar("T")
Layout = Literal["auto", "flat", "hashed"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
# From this many ranks a step's shard objects are laid out hashed under layout="auto". A rank
# uploading at a few hundred MB/s in 16 MiB parts makes tens of PUTs a second: a few dozen
# ranks reach S3's 3,500 a second per prefix, which a flat step's objects all share.
HASHED_FROM_RANKS = 32

# s3fs's default 50 MiB parts leave a 256 MiB shard in 3-5 parts; 16 MiB parts let its
# concurrent part uploads (max_concurrency, 10 by default) keep the link busy.
DEFAULT_PART_BYTES = 16 << 20
# Parts in flight per tier, before throttling lowers it: boto3's transfer manager and s3fs send
# 10 at once. The S3 client pools twice as many connections (see backends/__init__.py).
DEFAULT_PART_CONCURRENCY = 10


@dataclass(frozen=True)
class _Placement:
    """How a committed step's objects are named and stored, as its remote manifest says (what a
    reader needs of it, kept once read: nothing of a step being landed is kept)."""

    locations: Mapping[str, str] = field(default_factory=dict)
    compression: Mapping[str, CompressedObject] = field(default_factory=dict)
    sha256: Mapping[str, str] = field(default_factory=dict)  # of each shard file, as its record says


class RemoteTier(KeptObjects, BucketUpkeep):
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
        layout: Layout = "auto",
        wrap: Callable[[Backend], Backend] | None = None,
        compression: Compression = "none",
    ) -> None:
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        if layout not in LAYOUTS:
            raise RemoteError(f"{self.url}: layout must be one of {list(LAYOUTS)}, got {layout!r:.40}", transient=False)
        check_compression(compression)
        self.layout, self.compression = layout, compression
        opened = open_backend(
            self.url, storage_options or {}, retry=self.retry, part_bytes=part_bytes, part_concurrency=part_concurrency
        )
        self.backend: Counting = Counting(wrap(opened) if wrap is not None else opened)
        # The bucket's own words on top of what its store can do: receipts of its commits kept
        # by the first tier, run leases, a `latest` pointer, retries under its policy, and the
        # files of deleted steps that committed ones reference kept.
        self.capabilities: Capabilities = replace(
            self.backend.capabilities,
            receipts=True,
            leases=True,
            latest=True,
            retries=True,
            references=True,
            confirms=True,
        )
        self._root = self.backend.root
        self._requests = Requests(self.retry)
        self._run, self._timeout = self._requests.run, self._requests.timeout
        self._confirms_at_once = part_concurrency
        self._placements: dict[int, _Placement] = {}  # committed steps whose remote manifest was read or written
        # earlier steps' files, as those manifests record them, with each file's sha256
        self._referenced: dict[str, tuple[StoredObject, str]] = {}
        self._frames = FrameCache()
        self._looking = threading.Lock()  # guards _lookups
        self._lookups: dict[int, Future[None]] = {}  # the look-ups under way, by step (see _stored)

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    def trouble(self) -> Trouble | None:
        """Whether the store is failing now: its tries that failed for a transient reason since it
        last answered one (see :meth:`~tiered_ckpt.tiers.remote.requests.Requests.trouble`; None: it answers)."""
        return self._requests.trouble()

    # -- names and plumbing -----------------------------------------------------------------

    def _known(self, step: int, path: str) -> StoredObject | None:
        """How the shard file ``path`` of ``step`` is stored, as a remote manifest read or written
        here records it: the step's own, or one of a later step referencing it (None: neither)."""
        known = self._known_file(step, path)
        return known[0] if known is not None else None

    def _known_file(self, step: int, path: str) -> tuple[StoredObject, str] | None:
        """:meth:`_known`, and the sha256 of the shard file the object holds, as its record says."""
        placement = self._placements.get(step)
        if placement is not None and path in placement.sha256:
            stored = StoredObject(placement.locations.get(path, path), placement.compression.get(path))
            return stored, placement.sha256[path]
        return self._referenced.get(referenced_key(step, path))

    def _remember(self, remote: RemoteManifest) -> None:
        """Keep how a committed step's objects and the earlier files it references are stored."""
        sha256 = {record.path: record.sha256 for record in remote.manifest.shards}
        self._placements[remote.manifest.step] = _Placement(remote.locations, remote.compression, sha256)
        for ref, stored in remote.referenced_files():
            self._referenced[referenced_key(ref.step, ref.file.path)] = stored, ref.file.sha256

    def object_name(self, step: int, path: str) -> str:
        """Where the shard file ``path`` of ``step`` is under the step's prefix: as a remote
        manifest read or written here records it (the step's, or a later one's referencing it),
        else as this tier's layout puts it ("flat": ``path``; "hashed": ``<2 hex digits of a
        hash>/path``, spreading a step's objects over 256 key prefixes so that a store's request
        rate per prefix is not the limit; "auto": hashed for a shard of a step of at least
        :data:`HASHED_FROM_RANKS` ranks, as its file name says, flat otherwise)."""
        known = self._known(step, path)
        if known is not None:
            return known.location
        if self.layout == "hashed" or (self.layout == "auto" and (shard_world_size(path) or 0) >= HASHED_FROM_RANKS):
            return f"{hashlib.sha256(f'{step_dir_name(step)}/{path}'.encode()).hexdigest()[:2]}/{path}"
        return path

    def _shard(self, step: int, record: ShardRecord, stored: CompressedObject | None = None) -> str:
        return self._path(step, object_name(self.object_name(step, record.path), stored))

    def shard_location(self, step: int, record: ShardRecord) -> str:
        return self.location(step, object_name(self.object_name(step, record.path), self._stored(step, record)))

    def look_up(self, step: int, record: ShardRecord) -> None:
        """Learn where ``record``'s copy of committed ``step`` is kept, unless known here: read the
        step's remote manifest, or, the step not being committed, those of the committed steps
        after it until one references the file. Raises :class:`RemoteError` if the store fails."""
        self._stored(step, record, read=True)

    def _stored(self, step: int, record: ShardRecord, *, read: bool = False) -> CompressedObject | None:
        """How ``record``'s object is stored (None: as the shard file it is), as a remote manifest
        says once read (see :meth:`_known`). ``read``: if none read here says, look it up (see
        :meth:`look_up`; a reader never goes by its own option). Threads looking up one step
        wait for one look-up and share its outcome, a failure too: a manifest grows with the
        ranks, and failing look-ups made one after another would each spend the retry policy."""
        while read and self._known(step, record.path) is None:
            with self._looking:
                pending = self._lookups.get(step)
                mine = pending is None
                if pending is None:
                    pending = self._lookups[step] = Future()
            if mine:
                self._look_up_once(step, record.path, pending)
                break
            pending.result()  # raises its failure; else, if it did not find this file, look again
        known = self._known(step, record.path)
        return known.compression if known is not None else None

    def _look_up_once(self, step: int, path: str, pending: Future[None]) -> None:
        """One look-up of where ``step``'s file ``path`` is kept, its outcome handed to the threads
        waiting on ``pending``."""
        try:
            try:
                self.read_manifest(step)
            except RemoteError as exc:
                if not is_missing(exc):
                    raise
                self.find_referencing(step, path)
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        else:
            pending.set_result(None)
        finally:
            with self._looking:
                self._lookups.pop(step, None)

    # -- listing and reading ------------------------------------------------------------------

    def read_manifest(self, step: int, *, once: bool = False) -> RemoteManifest:
        """The remote manifest of ``step`` (commit time, store checksums, locations), strictly
        validated (``once``: one try, as for :meth:`survey`)."""
        location = self.location(step, MANIFEST_NAME)
        path = self._path(step, MANIFEST_NAME)

        def read() -> bytes:
            # One ranged GET: asking the size first costs every restore a request's latency more
            self._timeout()  # raises once the deadline has passed: no request starts after it
            try:
                data = self.backend.read(path, 0, MAX_MANIFEST_BYTES + 1)
            except FileNotFoundError:
                raise
            except Exception:  # stores refuse a range of an empty object (416), each in its own words
                if once or self.backend.size(path, timeout=self._timeout()) != 0:
                    raise  # one try is one request: a store that hangs is not asked twice
                data = b""
            if len(data) > MAX_MANIFEST_BYTES:
                raise ManifestError(f"{location}: over the {MAX_MANIFEST_BYTES} bytes a remote manifest may take")
            return data

        remote = RemoteManifest.from_json(self._run(f"reading {location}", read, once=once), source=location)
        if remote.manifest.step != step:
            raise ManifestError(f"{location}: field 'step' is {remote.manifest.step}, the prefix is step {step}")
        self._remember(remote)
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
            if is_missing(exc):
                return f"{location}: missing"
            raise
        problem = record.mismatch(digest)
        return f"{location}: {problem}" if problem else None

    # -- landing and committing ---------------------------------------------------------------

    def _mismatch(
        self, key: str, obj: ShardRecord, sums: Callable[[], StoreSums | None] | None = None, *, prove: bool = False
    ) -> str | None:
        """Why the object ``key`` does not match ``obj`` (the record of its own bytes: size, stored
        sha256), or None; given ``sums``, also the store's checksums of what it received against
        ``sums()`` (called only once the rest matches; None: nothing more to compare), which
        catches bytes changed in transit. ``prove``: where the store keeps neither a sha256 nor
        checksums to compare (a file system, memory), the object is read and its xxh3-64
        compared, so that an object of the same size is never taken for another."""
        try:
            head = self.backend.head(key, timeout=self._timeout())
        except FileNotFoundError:
            return "missing"
        problem = obj.mismatch(ShardDigest(head.size, head.sha256 or "", ""))
        expected = sums() if problem is None and sums is not None else None
        if expected is not None:
            return self.backend.store_problem(head, expected)
        if problem is None and prove and head.sha256 is None:
            with self.backend.open(key) as source:
                stream: Any = LimitedReader(source, self._requests, key, obj.size_bytes + 1)
                return obj.mismatch(hash_stream(stream, "fast"))
        return problem

    def _object(self, step: int, record: ShardRecord, stored: CompressedObject | None) -> tuple[str, ShardRecord]:
        """The key of ``record``'s object stored as ``stored`` says, and the record of its own bytes."""
        return self._shard(step, record, stored), stored.object_record(record) if stored is not None else record

    def land_shard(
        self, step: int, record: ShardRecord, source: ShardSource, *, deadline: float | None = None
    ) -> Landed:
        """Make the shard's object match ``record``: put ``source`` (a stream is staged in a temp file
        first; with ``compression="zstd"``, the file compressed) unless the object is already there
        intact, then confirm; say what landed.

        One operation under the retry policy and ``deadline``: a try that finds the object
        wrong afterwards puts it again. The file is checked against ``record`` before an
        object is made of it. "Intact" includes the store's checksums of what it received
        (bytes changed in transit are never confirmed). What it returns (``sent=False``: it
        was already there) carries what :meth:`commit` records: the object's name, the store's
        checksum of what was sent (none for one found already there) and, for a compressed
        object, how it is stored; nothing of it is kept here.

        A file's shard (``source.path``) of a committed step, or of an earlier step that a
        committed step references, is first looked for where its remote manifest records it.
        For an earlier step's file (``source.earlier``) that manifest is read first, if it was
        not here (the step's own, else those of the committed steps after it): a process that
        never read it (a restore that checked its disk by digest, a new process) finds the file
        where the bucket keeps it instead of sending it again under its own options. A shard of
        a step being sent reads nothing first: a step is sent because the bucket has not
        committed it, and looking costs a request per rank and per committed step.
        """
        if source.earlier and source.path is not None and self._known(step, record.path) is None:
            try:
                self._stored(step, record, read=True)
            except (ManifestError, RemoteError) as exc:  # then it is looked for under its own name
                logger.warning("%s: reading how step %d's %s is stored: %s", self.url, step, record.path, exc)
        known = self._known_file(step, record.path) if source.path is not None else None
        if known is not None and known[1] == record.sha256:  # that object holds this very file
            found = self._found_intact(step, record, known[0], deadline)
            if found is not None:
                return found
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

    def _found_intact(
        self, step: int, record: ShardRecord, known: StoredObject, deadline: float | None
    ) -> Landed | None:
        """What :meth:`land_shard` returns for ``record``'s object found intact where ``known`` says
        it is stored (None: it is not there intact)."""
        what = f"checking {self.location(step, object_name(known.location, known.compression))}"
        return self._run(what, lambda: self._intact_at(step, record, known), deadline)

    def _intact_at(self, step: int, record: ShardRecord, known: StoredObject) -> Landed | None:
        """:meth:`_found_intact`, one try."""
        stored = known.compression
        key, obj = self._path(step, object_name(known.location, stored)), record
        if stored is not None:
            obj = stored.object_record(record)
        if self._mismatch(key, obj, prove=True) is not None:
            return None
        compression = stored.to_json() if stored is not None else None
        sizes = obj.size_bytes, record.size_bytes
        return Landed(record.rank, record.path, known.location, *sizes, compression=compression, sent=False)

    def _put(
        self, step: int, record: ShardRecord, local_path: Path, stored: CompressedObject | None, deadline: float | None
    ) -> Landed:
        """:meth:`land_shard` of the file ``local_path``: the shard, or its compressed copy (``stored``)."""
        key, obj = self._object(step, record, stored)
        name = self.object_name(step, record.path)
        location = self.location(step, object_name(name, stored))

        def landed(checksum: str | None, sent: bool) -> Landed:
            compression = stored.to_json() if stored is not None else None
            sizes = obj.size_bytes, record.size_bytes
            return Landed(record.rank, record.path, name, *sizes, checksum=checksum, compression=compression, sent=sent)

        def put_and_confirm() -> Landed:
            found = self._mismatch(key, obj, lambda: self.backend.sums(local_path, obj), prove=True)
            if found is None:
                return landed(None, False)
            if found != "missing":
                self.refuse_replacing_kept(step, object_name(name, stored), record)
                # That read the remote manifests of the committed steps from this one: an object one
                # records as this very file is kept, never replaced (other compressed bytes of the
                # same file would not match the frames it records), whatever this tier's options.
                known = self._known_file(step, record.path)
                if known is not None and known[1] == record.sha256:
                    intact = self._intact_at(step, record, known[0])
                    if intact is not None:
                        return intact
            self._timeout()
            sums = self.backend.put_shard(local_path, key, obj, deadline=self._requests.deadline).sums
            problem = self._mismatch(key, obj, lambda: sums)
            if problem is not None:
                raise RemoteError(f"{location}: not confirmed after the upload: {problem}", transient=True)
            return landed(sums.kept if sums is not None else None, True)

        return self._run(f"uploading {local_path} to {location}", put_and_confirm, deadline)

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
            if is_missing(exc):
                return f"{location}: missing"
            raise
        if size != obj.size_bytes:
            return f"{location}: {size} bytes, the manifest records {obj.size_bytes}"
        if not same_checksum(kept, expected):
            return f"{location}: the store keeps checksum {kept}, the remote manifest records {expected}"
        return None

    def _confirm(
        self,
        step: int,
        record: ShardRecord,
        name: str,
        stored: CompressedObject | None,
        kept: str | None,
        deadline: float | None,
    ) -> str | None:
        """Check ``record``'s object (``name`` in the step, stored as ``stored`` says) once more, by
        one HEAD, right before a commit: the problem (naming the object; one deleted or replaced
        since it was put), or None if its size, stored sha256 and store checksum (against ``kept``,
        the one of what was sent, if any) are as recorded."""
        key, location = self._path(step, object_name(name, stored)), self.location(step, object_name(name, stored))
        obj = stored.object_record(record) if stored is not None else record

        def head() -> str | None:
            try:
                answer = self.backend.head(key, timeout=self._timeout())
            except FileNotFoundError:
                return "missing"
            problem = obj.mismatch(ShardDigest(answer.size, answer.sha256 or "", ""))
            if problem is None and self.backend.keeps_metadata and answer.sha256 is None:
                problem = "the sha256 stored with it is gone"
            if problem is None and kept is not None:
                found = self.backend.kept_checksum(answer, kept.partition(":")[0])
                if not same_checksum(found, kept):
                    problem = f"the store keeps checksum {found}, the upload sent {kept}"
            return problem

        problem = self._run(f"confirming {location}", head, deadline)
        return f"{location}: {problem}" if problem else None

    def confirm(self, manifest: ShardManifest, landed: Sequence[Landed], deadline: float | None = None) -> Confirmed:
        """Check once more, right before ``manifest``'s commit, the objects of it that ``landed``
        names (what this process's landings returned), by one HEAD each, as :meth:`commit` would
        check them (see :meth:`_confirm`). Handed every process's, the commit checks none of them
        again, so no process makes a request per rank. Never raises for an object changed: its
        problem is returned, and the commit refuses the step."""
        step, source = manifest.step, f"what was landed of {self.location(manifest.step)}"
        shards = {record.path: record for record in manifest.shards}
        files = {(ref.step, ref.file.path): ref.file for record in manifest.shards for ref in record.references}
        checks = []
        for each in landed:
            record = shards.get(each.path) if each.step is None else files.get((each.step, each.path))
            if record is None:
                continue
            try:
                stored = CompressedObject.from_json(each.compression, source=source) if each.compression else None
            except ManifestError:
                continue  # left to the commit, which refuses it as a reader would
            at = step if each.step is None else each.step
            checks.append(((each.step, each.path), (at, record, each.location, stored, each.checksum)))

        def check(item: tuple[tuple[int | None, str], tuple[int, ShardRecord, str, Any, str | None]]) -> str | None:
            at, record, name, stored, kept = item[1]
            return self._confirm(at, record, name, stored, kept, deadline)

        problems = run_parallel(check, checks, self._confirms_at_once)
        return Confirmed(tuple(key for key, _ in checks), tuple(problem for problem in problems if problem))

    def commit(
        self,
        manifest: ShardManifest,
        *,
        landed: Sequence[Landed] = (),
        deadline: float | None = None,
        confirmed: Sequence[Confirmed] = (),
    ) -> RemoteManifest:
        """Commit ``manifest``'s step (every request under ``deadline``, see :meth:`_run`): check every
        shard's object once more, write the remote manifest, create-only where the store supports
        it, recording what ``landed`` says (each object's name, the store's checksum of what was
        sent, how a compressed one is stored; a shard it does not name: under the layout's name,
        as it is), then point ``latest`` at the step (a hint for people and tools; listing is the
        truth). Returns the remote manifest, the receipt of the commit.

        The earlier steps' files that the shards reference are confirmed too, their prefixes marked
        as kept (:mod:`~tiered_ckpt.tiers.remote.kept`) before the manifest is written, and the
        manifest records how each is stored (as ``landed`` says, with its ``step``; one it does not
        name: as a remote manifest read here records it, else under its own name, as it is).

        ``confirmed``: what the processes that landed the objects found checking them (:meth:`confirm`);
        the commit checks the others only.

        A commit over an object missing or changed since it was confirmed is never written
        (:class:`RemoteError`, not transient). If the step is already committed with the same
        shards (a retried or resumed commit), that commit is returned. A remote manifest a
        reader would refuse as too large (a compressed step's frame indexes over tens of TiB)
        is never written: :class:`RemoteError`, not transient.
        """
        step = manifest.step
        location = self.location(step, MANIFEST_NAME)
        path = self._path(step, MANIFEST_NAME)
        source = f"what was landed of {self.location(step)}"
        shards = {record.path: record for record in manifest.shards}
        mine = {each.path: each for each in landed if each.step is None and each.path in shards}
        names = {path: mine[path].location if path in mine else self.object_name(step, path) for path in shards}
        checksums = {path: each.checksum for path, each in mine.items() if each.checksum is not None}
        locations = {path: name for path, name in names.items() if name != path}
        try:  # what crossed from other processes is checked as a reader would, before any request
            compressed = {
                path: CompressedObject.from_json(each.compression, source=source)
                for path, each in mine.items()
                if each.compression is not None
            }
            referenced = self._referenced_landed(manifest, landed, source)
            planned = RemoteManifest(manifest, time.time(), checksums, locations, compressed, referenced)
        except ManifestError as exc:
            raise RemoteError(f"{location}: what was landed cannot be committed: {exc}", transient=False) from exc

        def confirm(item: tuple[int, ShardRecord, StoredObject | None, str | None]) -> str | None:
            at, record, stored, kept = item
            if stored is None:
                path = record.path
                return self._confirm(step, record, names[path], compressed.get(path), checksums.get(path), deadline)
            return self._confirm(at, record, stored.location, stored.compression, kept, deadline)

        files = {(ref.step, ref.file.path): ref.file for record in manifest.shards for ref in record.references}
        kept_sums = {(each.step, each.path): each.checksum for each in landed if each.step is not None}
        done = {key for each in confirmed for key in each.objects}
        checks = [(step, record, None, None) for record in manifest.shards if (None, record.path) not in done] + [
            (at, file, planned.stored(at, path), kept_sums.get((at, path)))
            for (at, path), file in files.items()
            if (at, path) not in done
        ]
        problems = [problem for each in confirmed for problem in each.problems]
        problems += [problem for problem in run_parallel(confirm, checks, self._confirms_at_once) if problem]
        if problems:
            self._refuse_another_commit(manifest)
            raise RemoteError(
                f"step {step} was not committed at {self.location(step)}: {len(problems)} of its objects "
                f"changed after their upload was confirmed (deleted or replaced by someone else?): "
                + "; ".join(problems[:5]),
                transient=False,
            )

        for earlier in sorted({at for at, _path in files}):
            self.mark_kept(earlier, deadline)

        def create() -> RemoteManifest | None:
            remote = replace(planned, committed_at=time.time())
            if len(document := remote.to_json().encode()) > MAX_MANIFEST_BYTES:
                problem = f"{len(document):,} bytes, over the {MAX_MANIFEST_BYTES:,} a reader accepts"
                raise RemoteError(f"{location}: the remote manifest would take {problem}", transient=False)
            try:
                self.backend.put_bytes(path, document, create_only=True, timeout=self._timeout())
            except FileExistsError:
                return None
            return remote

        remote = self._run(f"committing {location}", create, deadline)
        if remote is not None:
            self._remember(remote)
        else:
            remote = self._refuse_another_commit(manifest)
            assert remote is not None
        latest, data = f"{self._root}/{LATEST_NAME}", f"{step}\n".encode()
        self._run(f"writing {self.url}/{LATEST_NAME}", lambda: self.backend.put_bytes(latest, data))
        return remote

    def _referenced_landed(
        self, manifest: ShardManifest, landed: Sequence[Landed], source: str
    ) -> dict[str, StoredObject]:
        """How each earlier step's file that ``manifest``'s shards reference is stored, where not
        under its own name as it is: as ``landed`` says (untrusted: it crossed a collective), else
        as a remote manifest read here says."""
        by_file = {(each.step, each.path): each for each in landed if each.step is not None}
        referenced: dict[str, StoredObject] = {}
        for record in manifest.shards:
            for ref in record.references:
                each = by_file.get((ref.step, ref.file.path))
                if each is not None:
                    compression = (
                        CompressedObject.from_json(each.compression, source=source)
                        if each.compression is not None
                        else None
                    )
                    stored = StoredObject(each.location, compression)
                else:
                    stored = self._known(ref.step, ref.file.path) or StoredObject(ref.file.path)
                if stored != StoredObject(ref.file.path):
                    referenced[referenced_key(ref.step, ref.file.path)] = stored
        return referenced

    def _refuse_another_commit(self, manifest: ShardManifest) -> RemoteManifest | None:
        """The step's remote manifest if it is committed (None if not); :class:`RemoteError`, not
        transient, if it is committed as another checkpoint than ``manifest``."""
        step = manifest.step
        try:
            existing = self.read_manifest(step)
        except RemoteError as exc:
            if is_missing(exc):
                return None
            raise
        if existing.manifest.shards != manifest.shards:
            location = self.location(step, MANIFEST_NAME)
            raise RemoteError(
                f"{location}: a different checkpoint of step {step} is already committed", transient=False
            )
        return existing

    # -- deleting -----------------------------------------------------------------------

    def delete_step(self, step: int) -> None:
        """Delete a step: its remote manifest first (the step turns invisible), then its objects,
        each named by its exact key (no glob expansion), but those a committed step references,
        whose prefix is marked as kept before the manifest goes (all of them where a committed
        step's remote manifest cannot be read; see :mod:`~tiered_ckpt.tiers.remote.kept`)."""
        referenced = self.referenced_objects(self.steps(), after=step)
        kept = referenced.get(step, set()) if referenced is not None else None
        if kept != set():
            self.mark_kept(step)

        def delete() -> None:
            if self.backend.exists(manifest := self._path(step, MANIFEST_NAME)):
                self.backend.delete([manifest])
            if kept == set():
                self.backend.delete_prefix(self._path(step))

        self._run(f"deleting {self.location(step)}", delete)
        self._placements.pop(step, None)
        if kept:
            self.keep_only(step, kept)
