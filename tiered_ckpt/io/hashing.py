"""Checksums of bytes as they stream: sha256 and xxh3-64 in one pass, S3's CRC32C, a store's checksum forms.

Every function here hashes each piece of bytes right after it was copied (into a file's
staging block, a target array, a buffer), while the piece is in the CPU's cache, so a
checksum costs no second read from memory; except that a verified read of a file
(:class:`HashedStream` with ``behind``) hands its sha256 to a thread of its own, which
hashes what was copied on another core while the next piece is copied. ``"full"``
verification is the sha256, ``"fast"`` the xxh3-64 (~12 GB/s, for inner-loop reloads). It knows nothing of shards
or manifests: :class:`ShardDigest` is what a hashed file's bytes came to.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import queue
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Literal, NamedTuple

import crc32c as _crc32c
import numpy as np
import xxhash

from tiered_ckpt.errors import ConfigError, IncompleteCheckpointError
from tiered_ckpt.io.durable import observe_writes, write_all
from tiered_ckpt.io.files import pread_exactly
from tiered_ckpt.io.scratch import refilled

__all__ = [
    "Verify",
    "VERIFY_MODES",
    "check_verify",
    "CHUNK_BYTES",
    "ShardDigest",
    "PartDigest",
    "Hasher",
    "HashedStream",
    "hashing_writer",
    "hash_stream",
    "copy_and_hash",
    "copy_hashing",
    "copy_hashing_into",
    "fill_hashing",
    "read_hashing",
    "part_crc32c",
    "composite_crc32c",
    "STORE_CHECKSUM",
]

Verify = Literal["full", "fast"]
"""``"full"`` checks the sha256; ``"fast"`` checks only the xxh3-64 (for inner-loop reloads)."""

VERIFY_MODES = ("full", "fast")

# 1 MiB stays in L2 between hashing a chunk and copying it to the page cache.
CHUNK_BYTES = 1 << 20


def check_verify(verify: object) -> None:
    """Raise :class:`ConfigError` unless ``verify`` is "full" or "fast" (a typo must never skip the sha256)."""
    if verify not in VERIFY_MODES:
        raise ConfigError(f"verify must be 'full' (sha256) or 'fast' (xxh3-64), got {verify!r}")


class PartDigest(NamedTuple):
    """Size and checksums of one part of a file (an array's bytes); "" for a checksum not computed.
    A tuple, not a dataclass: a shard of many small arrays makes one per array."""

    size_bytes: int
    sha256: str
    xxh3_64: str


@dataclass(frozen=True)
class ShardDigest:
    """Size and checksums of a shard file's bytes; from :func:`~tiered_ckpt.format.shardfile.write_shard`
    asked for them, also the size and sha256 of its header (the 8 length bytes and the JSON) and the
    digest of each array's bytes (``arrays``: sha256 and xxh3-64 of each), so that a reader of
    parts of the file can verify what it read."""

    size_bytes: int
    sha256: str
    xxh3_64: str
    header_bytes: int = 0
    header_sha256: str = ""
    arrays: Mapping[str, PartDigest] = field(default_factory=dict)


class Hasher:
    """sha256 and xxh3-64 of one byte stream, fed in a single pass (``verify`` limits it to one of them)."""

    def __init__(self, verify: Verify | None = None) -> None:
        self._sha = hashlib.sha256() if verify != "fast" else None
        self._xxh = xxhash.xxh3_64() if verify != "full" else None
        self.size = 0

    def update(self, chunk: memoryview | bytes) -> None:
        """Feed the next bytes of the stream."""
        if self._sha is not None:
            self._sha.update(chunk)
        if self._xxh is not None:
            self._xxh.update(chunk)
        self.size += len(chunk)

    def digest(self) -> ShardDigest:
        """The size and checksums of everything fed so far ("" for a checksum not computed)."""
        return ShardDigest(
            self.size,
            self._sha.hexdigest() if self._sha is not None else "",
            self._xxh.hexdigest() if self._xxh is not None else "",
        )


def hashing_writer(out: BinaryIO, hasher: Hasher) -> Callable[[memoryview | bytes], None]:
    """A function that writes all of a chunk to ``out`` and feeds ``hasher`` every byte, in order.

    A file from atomic_write hashes each piece right after copying it into its staging
    block, while the piece is in the CPU's cache (sha256 reading from memory instead took
    ~25 % more CPU per save); any other file is written first and hashed after.
    """
    if observe_writes(out, hasher.update):
        return lambda chunk: write_all(out, chunk)

    def write_then_hash(chunk: memoryview | bytes) -> None:
        write_all(out, chunk)
        hasher.update(chunk)

    return write_then_hash


def hash_stream(source: BinaryIO, verify: Verify | None = None) -> ShardDigest:
    """Hash everything readable from ``source``; ``verify`` limits which checksums are computed."""
    hasher = Hasher(verify)
    view = memoryview(bytearray(CHUNK_BYTES))
    while count := source.readinto(view):  # type: ignore[attr-defined]  # typing.BinaryIO omits readinto
        hasher.update(view[:count])
    return hasher.digest()


def copy_and_hash(source: BinaryIO, out: BinaryIO, chunk_bytes: int = 8 * CHUNK_BYTES) -> ShardDigest:
    """Copy everything readable from ``source`` to ``out``, hashing the bytes as they pass."""
    hasher = Hasher()
    write = hashing_writer(out, hasher)
    while chunk := source.read(chunk_bytes):
        write(chunk)
    return hasher.digest()


def _hex(hasher: Hasher, verify: Verify) -> str:
    digest = hasher.digest()
    return digest.xxh3_64 if verify == "fast" else digest.sha256


def copy_hashing(source: np.ndarray, target: np.ndarray, verify: Verify = "full") -> str:
    """Copy bytes ``source`` into ``target`` (1-D uint8 arrays of one length) and return their
    sha256 (``verify="fast"``: their xxh3-64), hashing each piece of the copy while it is in
    cache (as :func:`~tiered_ckpt.format.shardfile.read_shard_file` does)."""
    hasher = Hasher(verify)
    copy_hashing_into(source, target, hasher)
    return _hex(hasher, verify)


RANGE_PIECE_BYTES = 16 * 2**20
"""The most :func:`fill_hashing` holds of a ranged read beside its target."""


def fill_hashing(
    read: Callable[[int, int], bytes],
    offset: int,
    target: np.ndarray,
    verify: Verify = "full",
    *,
    what: str = "a ranged read",
    piece_bytes: int = RANGE_PIECE_BYTES,
) -> str:
    """Fill ``target`` (a 1-D uint8 array) with the bytes ``read(start, stop)`` returns from
    ``offset`` on, one read of at most ``piece_bytes`` at a time (all that is held beside
    ``target``, whatever its size), and return their sha256 (``verify="fast"``: their xxh3-64),
    each piece hashed while in cache. Raises :class:`IncompleteCheckpointError` naming ``what``
    and the bytes a read fell short of."""
    hasher = Hasher(verify)
    paged = refilled(target)
    for start in range(0, len(target), piece_bytes):
        piece = target[start : start + piece_bytes]
        data = read(offset + start, offset + start + len(piece))
        if len(data) != len(piece):
            got = f"got {len(data)} of bytes {offset + start}-{offset + start + len(piece)}"
            raise IncompleteCheckpointError(f"{what}: {got}; the object is shorter than recorded")
        copy_hashing_into(np.frombuffer(data, np.uint8), piece, hasher)
        if paged is not None:
            paged.filled(start, piece.data)
    return _hex(hasher, verify)


def copy_hashing_into(source: np.ndarray, target: np.ndarray, hasher: Hasher) -> None:
    """Copy ``source`` into ``target`` (1-D uint8 arrays of one length), feeding ``hasher`` each
    piece of the copy while it is in cache."""
    for start in range(0, len(target), CHUNK_BYTES):
        piece = target[start : start + CHUNK_BYTES]
        np.copyto(piece, source[start : start + CHUNK_BYTES])
        hasher.update(piece.data)


def read_hashing(fd: int, offset: int, target: np.ndarray, verify: Verify = "full") -> str:
    """Read the bytes of the open file ``fd`` from ``offset`` into ``target`` (a 1-D uint8 array)
    and return their sha256 (``verify="fast"``: their xxh3-64), hashing each piece while it is in cache.

    Read with ``pread``, not through a memory map: a failing disk then raises OSError (EIO),
    which the caller can answer, where a mapped page would kill the process with SIGBUS. A
    file that ends before ``target`` is full raises OSError (EIO) too.
    """
    hasher = Hasher(verify)
    paged = refilled(target)
    for start in range(0, len(target), CHUNK_BYTES):
        piece = target[start : start + CHUNK_BYTES]
        pread_exactly(fd, piece.data, offset + start)
        hasher.update(piece.data)
        if paged is not None:
            paged.filled(start, piece.data)
    return _hex(hasher, verify)


class _HashBehind:
    """Feeds a :class:`Hasher` from a thread of its own, in the order given: one sha256 is one
    sequential stream, so the only way to put a second core to work on a verified load is to
    hash the pieces already copied while the caller copies the next (hashlib releases the
    GIL while it hashes). Pieces are handed over a batch of :data:`CHUNK_BYTES` at a time, so a
    run of small arrays costs one hand-over per batch, not one per array; a stream shorter
    than a batch starts no thread."""

    def __init__(self, hasher: Hasher) -> None:
        self._hasher = hasher
        self._batch: list[memoryview | bytes] = []
        self._batched = 0
        self._queue: queue.SimpleQueue[list[memoryview | bytes] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def update(self, piece: memoryview | bytes) -> None:
        self._batch.append(piece)
        self._batched += len(piece)
        if self._batched >= CHUNK_BYTES:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered-ckpt-hash", daemon=True)
                self._thread.start()
            self._queue.put(self._batch)
            self._batch, self._batched = [], 0

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            for piece in batch:
                self._hasher.update(piece)

    def settle(self) -> None:
        """Return once every piece given so far is hashed."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for piece in self._batch:
            self._hasher.update(piece)
        self._batch, self._batched = [], 0


class HashedStream:
    """A file's bytes in order, from :func:`~tiered_ckpt.io.blockread.read_blocks`, taken a piece
    at a time; every byte taken (or skipped with :meth:`hash_rest`) is fed to ``hasher`` once,
    in file order. With ``behind``, what is copied is hashed on a thread of its own while the
    next piece is copied (:meth:`digest` waits for it); call :meth:`close` in any case."""

    def __init__(self, blocks: Iterator[memoryview], hasher: Hasher, *, behind: bool = False) -> None:
        self._blocks = blocks
        self._view = memoryview(b"")
        self._hasher = hasher
        self._behind = _HashBehind(hasher) if behind else None
        self._hash = self._behind.update if self._behind is not None else hasher.update

    def digest(self) -> ShardDigest:
        """The digest of every byte taken so far."""
        if self._behind is not None:
            self._behind.settle()
        return self._hasher.digest()

    def settle(self) -> None:
        """Return once every piece taken so far is hashed: the memory it was copied into is then
        the caller's again (a hashing thread holds each piece until it has hashed it)."""
        if self._behind is not None:
            self._behind.settle()

    def close(self) -> None:
        """Stop the hashing thread, if any (after it has hashed what it was given)."""
        self.settle()

    def _current(self) -> memoryview:
        if not self._view:
            self._view = next(self._blocks, memoryview(b""))
        return self._view

    def take(self, count: int) -> bytes:
        """Up to ``count`` bytes (fewer only at the end of the file), hashed."""
        parts = []
        while count and (view := self._current()):
            piece = bytes(view[:count])  # a copy: a block is reused once the next is asked for
            parts.append(piece)
            self._hash(piece)
            self._view, count = view[len(piece) :], count - len(piece)
        return b"".join(parts)

    def copy_into(self, target: np.ndarray) -> None:
        """Fill ``target`` (1-D uint8) with the next bytes, hashing each piece of the copy
        while it is in the CPU's cache; OSError (EIO) if the file ends first. A target over
        an unnamed file (:func:`~tiered_ckpt.io.scratch.pages_of`) is hashed here, not behind,
        and each piece's pages are let go once hashed: filling it holds a piece of it."""
        paged = refilled(target)
        hash_now = self._hash
        if paged is not None:
            if self._behind is not None:
                self._behind.settle()  # in file order: what was given so far, before these pieces
            hash_now = self._hasher.update
        position = 0
        while position < len(target):
            view = self._current()
            if not view:  # read_blocks raises first; a header that fits the file ensures it
                raise OSError(errno.EIO, f"file ends {len(target) - position} bytes short")
            count = min(len(view), len(target) - position)
            piece = target[position : position + count]
            np.copyto(piece, np.frombuffer(view[:count], np.uint8))
            hash_now(piece.data)
            if paged is not None:
                paged.filled(position, piece.data)
            self._view, position = view[count:], position + count

    def hash_rest(self) -> None:
        """Hash every byte not taken yet, to the end of the file."""
        if self._behind is not None:  # the blocks themselves are hashed: in order, after what was taken
            self._behind.settle()
        while view := self._current():
            self._hasher.update(view)
            self._view = memoryview(b"")


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def part_crc32c(data: bytes | memoryview) -> str:
    """The CRC32C of ``data`` as S3's ``ChecksumCRC32C`` header carries it (base64 of 4 bytes)."""
    return _b64(_crc32c.crc32c(data).to_bytes(4, "big"))


def composite_crc32c(parts: Sequence[str]) -> str:
    """The ``ChecksumCRC32C`` S3 keeps for an object sent as ``parts`` (their CRC32C, base64):
    the one part's, or the CRC32C of the parts' digests with ``-N``."""
    if len(parts) == 1:
        return parts[0]
    return f"{part_crc32c(b''.join(base64.b64decode(part) for part in parts))}-{len(parts)}"


STORE_CHECKSUM = re.compile(
    r"(sha256:[A-Za-z0-9+/]{43}=|crc32c:[A-Za-z0-9+/]{6}==)(-[1-9][0-9]{0,4})?|md5:[A-Za-z0-9+/]{21}[AQgw]=="
)
"""The text forms of the checksum an object store keeps of an object: ``<algorithm>:<base64 of
the digest>``, a CRC32C or SHA256 with ``-N`` for an S3 object of N parts, or the MD5 of a whole
blob (Azure's Content-MD5) in canonical base64 (the bits past its 16 bytes zero)."""
