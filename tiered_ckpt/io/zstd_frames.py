"""Independent zstd frames: bytes compressed a frame at a time, so that any frame reads alone.

A stream made here is a sequence of standard zstd frames (RFC 8878): the whole of it
decompresses with any zstd tool (``zstd -d``), and frame ``i`` alone decompresses to the
uncompressed bytes ``[start_i, start_i + length_i)``. The frames' uncompressed lengths are
the caller's (:func:`frame_lengths`: a first frame of its own, e.g. a file's header, then
equal frames); their compressed sizes are the index (:class:`FrameIndex`) a reader needs
to fetch and decompress only the frames that cover a range.

Every frame records its content size and a content checksum (the low 32 bits of its
XXH64), so a frame changed in storage or in transit fails to decompress instead of giving
other bytes; the caller's own hash of what it read (a sha256 or xxh3-64 recorded
elsewhere) stays the check that counts. A frame that zstd does not shrink by at least
1/32 is stored as a zstd frame of raw blocks (the bytes as they are, ~100 bytes of framing
per 4 MiB): incompressible data (random bytes, noise-like mantissas) costs no decoding on
a read, and no frame is ever larger than its raw form.

``zstandard`` is an optional dependency (the ``zstd`` extra), imported on first use.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import accumulate
from types import ModuleType
from typing import Any, BinaryIO

import numpy as np
import xxhash

from tiered_ckpt.errors import ChecksumMismatchError, IncompleteCheckpointError, UsageError
from tiered_ckpt.io.hashing import Hasher, ShardDigest, Verify
from tiered_ckpt.io.scratch import refilled

__all__ = [
    "LEVEL",
    "Compressed",
    "FrameCache",
    "FrameIndex",
    "FramesReader",
    "available",
    "compress_frames",
    "decompress_frame",
    "frame_lengths",
    "raw_frame",
    "raw_frame_bytes",
    "read_range_into",
]

# On bf16/fp32 weights and AdamW moments (tests/bench), level 1 shrinks as much as levels 3
# to 9 (the gain is in the exponent bytes, which any level's entropy coding gets) at 1.3-1.6x
# the speed of level 3; negative levels skip that coding and shrink nothing.
LEVEL = 1
_MAGIC = (0xFD2FB528).to_bytes(4, "little")
# Frame header descriptor: an 8-byte content size, single segment (no window descriptor), content checksum.
_RAW_DESCRIPTOR = bytes([0b1110_0100])
_BLOCK_BYTES = 128 << 10  # the largest zstd block
_RAW_HEADER_BYTES = 4 + 1 + 8
_CHECKSUM_BYTES = 4
_KEEP_BELOW = 31 / 32  # a compressed frame is kept only if at most this fraction of its raw form
_FETCH_BYTES = 64 << 20  # compressed bytes fetched by one ranged request, at most
_SOURCE_READ_BYTES = 16 << 20  # what a stream of frames reads from its source at once


@cache
def _zstandard() -> ModuleType:
    try:
        import zstandard
    except ImportError as exc:
        raise UsageError("zstd-compressed objects need the zstandard package: pip install 'tiered-ckpt[zstd]'") from exc
    module: ModuleType = zstandard  # typed as a module also where mypy finds no zstandard (the lint extra)
    return module


def available() -> bool:
    """True if the ``zstandard`` package can be imported here."""
    try:
        _zstandard()
    except UsageError:
        return False
    return True


def frame_lengths(size: int, head_bytes: int, frame_bytes: int) -> list[int]:
    """The uncompressed length of each frame of ``size`` bytes: the first ``head_bytes`` (all of
    them if fewer), then ``frame_bytes`` each, the last one the rest; none for no bytes."""
    if size == 0:
        return []
    if head_bytes < 1 or frame_bytes < 1:
        raise UsageError(f"frames need head_bytes and frame_bytes >= 1, got {head_bytes} and {frame_bytes}")
    head = min(head_bytes, size)
    return [head, *(min(frame_bytes, size - start) for start in range(head, size, frame_bytes))]


def raw_frame_bytes(length: int) -> int:
    """The size of the raw frame of ``length`` bytes (:func:`raw_frame`): the most a frame of them takes."""
    return _RAW_HEADER_BYTES + 3 * max(1, -(-length // _BLOCK_BYTES)) + length + _CHECKSUM_BYTES


def raw_frame(data: bytes | memoryview) -> bytes:
    """``data`` as one zstd frame of raw blocks (stored as they are), with its content size and checksum."""
    view = memoryview(data).cast("B")
    parts: list[bytes | memoryview] = [_MAGIC, _RAW_DESCRIPTOR, len(view).to_bytes(8, "little")]
    for start in range(0, max(len(view), 1), _BLOCK_BYTES):
        piece = view[start : start + _BLOCK_BYTES]
        last = start + _BLOCK_BYTES >= len(view)
        parts += [(len(piece) << 3 | int(last)).to_bytes(3, "little"), piece]  # block type 0: raw
    parts.append((xxhash.xxh64_intdigest(view) & 0xFFFFFFFF).to_bytes(4, "little"))
    return b"".join(parts)


@dataclass(frozen=True)
class Compressed:
    """What :func:`compress_frames` did: each frame's compressed size (``frames``), the digest of
    the bytes read (``source``: size and xxh3-64; the whole source, past the frames' end too) and
    of the bytes written (``output``: size and xxh3-64)."""

    frames: tuple[int, ...]
    source: ShardDigest
    output: ShardDigest


def compress_frames(source: BinaryIO, out: BinaryIO, lengths: Sequence[int], *, level: int = LEVEL) -> Compressed:
    """Compress ``source`` into ``out`` as one frame per ``lengths`` item, reading each frame's
    bytes into one reused buffer (memory: the largest frame, twice).

    A source that ends early gives fewer frames (the digests say so); one longer than the
    lengths is read to its end and hashed. The caller compares ``source`` with what it expected.
    """
    compressor = _zstandard().ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    buffer = memoryview(bytearray(max(lengths, default=0) or 1 << 20))
    read, written = Hasher("fast"), Hasher("fast")
    frames: list[int] = []
    for length in lengths:
        view = buffer[: _read_fully(source, buffer[:length])]
        read.update(view)
        if len(view) < length:
            break
        frame = compressor.compress(view)
        if len(frame) > len(view) * _KEEP_BELOW:
            frame = raw_frame(view)
        out.write(frame)
        written.update(frame)
        frames.append(len(frame))
    else:
        while count := source.readinto(buffer):  # type: ignore[attr-defined]  # typing.BinaryIO omits readinto
            read.update(buffer[:count])
    return Compressed(tuple(frames), read.digest(), written.digest())


def _read_fully(source: Any, view: memoryview) -> int:
    got = 0
    while got < len(view) and (count := source.readinto(view[got:])):
        got += count
    return got


def decompress_frame(data: bytes | bytearray | memoryview, length: int, what: str) -> bytes:
    """The ``length`` bytes that the one zstd frame ``data`` holds; :class:`ChecksumMismatchError`
    naming ``what`` if it is not one whole frame of that content size, or fails its checksum.
    Nothing larger than ``length`` is allocated, whatever the frame's header claims."""
    zstandard = _zstandard()
    try:
        declared = zstandard.frame_content_size(data)
        if declared != length:
            raise ChecksumMismatchError(f"{what}: the frame declares {declared} bytes, the index records {length}")
        result: bytes = zstandard.ZstdDecompressor().decompress(data, max_output_size=length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ChecksumMismatchError(f"{what}: the frame does not decompress: {exc}") from None
    if len(result) != length:
        raise ChecksumMismatchError(f"{what}: the frame holds {len(result)} bytes, the index records {length}")
    return result


@dataclass(frozen=True)
class FrameIndex:
    """Where each frame of a compressed stream lies: ``lengths`` (uncompressed) and ``sizes``
    (compressed) per frame, in order; ``starts`` and ``offsets`` are where each begins in either."""

    lengths: tuple[int, ...]
    sizes: tuple[int, ...]
    starts: tuple[int, ...] = field(init=False)
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.sizes):
            raise UsageError(f"a frame index needs a size per frame: {len(self.lengths)} and {len(self.sizes)}")
        object.__setattr__(self, "starts", (0, *accumulate(self.lengths)))
        object.__setattr__(self, "offsets", (0, *accumulate(self.sizes)))

    @property
    def size(self) -> int:
        """The uncompressed bytes of every frame together."""
        return self.starts[-1]

    def covering(self, start: int, end: int) -> range:
        """The frames holding uncompressed bytes ``[start, end)`` (none for an empty range)."""
        if start >= end:
            return range(0)
        return range(bisect.bisect_right(self.starts, start) - 1, bisect.bisect_left(self.starts, end))


class FrameCache:
    """The last decompressed frames read, up to ``max_bytes`` together, shared by threads: a
    partial read of many small arrays reads each frame once, not once per array."""

    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        self._frames: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> bytes | None:
        with self._lock:
            frame = self._frames.get(key)
            if frame is not None:
                self._frames.move_to_end(key)
            return frame

    def put(self, key: tuple[str, int], frame: bytes) -> None:
        if len(frame) > self.max_bytes // 4:
            return
        with self._lock:
            if key in self._frames:
                return
            self._frames[key] = frame
            self._bytes += len(frame)
            while self._bytes > self.max_bytes:
                self._bytes -= len(self._frames.popitem(last=False)[1])


def read_range_into(
    fetch: Callable[[int, int], bytes],
    index: FrameIndex,
    offset: int,
    buffer: memoryview,
    verify: Verify,
    what: str,
    cache: tuple[FrameCache, str] | None = None,
) -> str:
    """Fill ``buffer`` with the uncompressed bytes from ``offset`` of the stream ``index`` describes,
    decompressing only the frames covering them, and return their sha256 (``verify="fast"``: xxh3-64).

    ``fetch(start, end)`` returns the compressed bytes ``[start, end)`` (a ranged read, at most
    64 MiB); ``cache`` is a :class:`FrameCache` and the stream's identity in it. Raises
    :class:`IncompleteCheckpointError` if the range ends past the stream or a fetch is short,
    :class:`ChecksumMismatchError` if a frame does not decompress to its recorded length.
    """
    end = offset + len(buffer)
    if offset < 0 or end > index.size:
        raise IncompleteCheckpointError(f"{what}: bytes {offset}-{end} are past the end, at {index.size}")
    target = np.frombuffer(buffer, np.uint8)
    paged = refilled(target)  # over an unnamed file: each piece handed over once hashed
    hasher = Hasher(verify)
    for number, frame in _frames(fetch, index, index.covering(offset, end), what, cache):
        start = index.starts[number]
        piece = np.frombuffer(frame, np.uint8)[max(offset - start, 0) : end - start]
        into = target[max(start - offset, 0) : max(start - offset, 0) + len(piece)]
        np.copyto(into, piece)
        hasher.update(into.data)
        if paged is not None:
            paged.filled(max(start - offset, 0), into.data)
    digest = hasher.digest()
    return digest.xxh3_64 if verify == "fast" else digest.sha256


def _frames(
    fetch: Callable[[int, int], bytes],
    index: FrameIndex,
    numbers: range,
    what: str,
    cache: tuple[FrameCache, str] | None,
) -> Iterator[tuple[int, bytes]]:
    """Each of frames ``numbers``, decompressed, in order: from ``cache`` where it is there, the
    others fetched in runs of consecutive frames of up to 64 MiB each."""
    frames, identity = cache if cache is not None else (None, "")
    pending: list[int] = []

    def flush() -> Iterator[tuple[int, bytes]]:
        if not pending:
            return
        first, last = pending[0], pending[-1]
        data = memoryview(fetch(index.offsets[first], index.offsets[last + 1]))
        if len(data) != index.offsets[last + 1] - index.offsets[first]:
            raise IncompleteCheckpointError(f"{what}: frames {first}-{last} end early; the object is shorter")
        for number in pending:
            at = index.offsets[number] - index.offsets[first]
            frame = decompress_frame(
                data[at : at + index.sizes[number]], index.lengths[number], f"{what} frame {number}"
            )
            if frames is not None:
                frames.put((identity, number), frame)
            yield number, frame
        pending.clear()

    for number in numbers:
        found = frames.get((identity, number)) if frames is not None else None
        if found is not None:
            yield from flush()
            yield number, found
            continue
        run = index.offsets[number + 1] - index.offsets[pending[0]] if pending else 0
        if pending and run > _FETCH_BYTES:
            yield from flush()
        pending.append(number)
    yield from flush()


class FramesReader:
    """The uncompressed bytes of the frames ``index`` describes, read in order from ``source`` (the
    compressed stream), as a read-only stream: in memory, one frame and at most 16 MiB of
    compressed bytes read ahead.

    Raises :class:`IncompleteCheckpointError` if ``source`` ends before the last frame,
    :class:`ChecksumMismatchError` if a frame does not decompress to its length or ``source``
    holds more bytes after the last frame. Errors name ``what``.
    """

    def __init__(self, source: Any, index: FrameIndex, what: str) -> None:
        self._source, self._index, self._what = source, index, what
        self._number = 0
        self._frame, self._at = b"", 0  # the frame being read, and how much of it was
        self._read: deque[memoryview] = deque()  # compressed bytes read from source, not yet taken
        self._read_bytes = 0

    def readable(self) -> bool:
        return True

    def _take(self, count: int) -> bytes | memoryview:
        """The next ``count`` compressed bytes (fewer only where ``source`` ends). ``source`` is read
        16 MiB at a time whatever the frames' size, so a remote file makes as few requests as a
        plain read of it; a frame is copied only where it spans two reads."""
        while self._read_bytes < count:
            more = self._source.read(max(count - self._read_bytes, _SOURCE_READ_BYTES))
            if not more:
                break
            self._read.append(memoryview(more))
            self._read_bytes += len(more)
        pieces: list[memoryview] = []
        while count and self._read:
            piece = self._read[0][:count]
            pieces.append(piece)
            if len(piece) == len(self._read[0]):
                self._read.popleft()
            else:
                self._read[0] = self._read[0][len(piece) :]
            count -= len(piece)
            self._read_bytes -= len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _next_frame(self) -> bool:
        index, number = self._index, self._number
        if number == len(index.sizes):
            if self._read_bytes or self._source.read(1):
                raise ChecksumMismatchError(f"{self._what}: the object is longer than its frames")
            return False
        data = self._take(index.sizes[number])
        if len(data) < index.sizes[number]:
            raise IncompleteCheckpointError(f"{self._what}: the object ends in frame {number}; it is shorter")
        self._frame, self._at = decompress_frame(data, index.lengths[number], f"{self._what} frame {number}"), 0
        self._number += 1
        return True

    def _left(self) -> bool:
        return self._at < len(self._frame) or self._next_frame()

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if not view or not self._left():
            return 0
        count = min(len(view), len(self._frame) - self._at)
        view[:count] = memoryview(self._frame)[self._at : self._at + count]
        self._at += count
        return count

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that are left if negative), at most one frame's worth unless
        all are asked for: a whole frame is handed over as it came out of zstd, not copied."""
        if size is None or size < 0:
            parts = []
            while chunk := self.read(1 << 30):
                parts.append(chunk)
            return b"".join(parts)
        if not size or not self._left():
            return b""
        if self._at == 0 and size >= len(self._frame):
            data, self._frame = self._frame, b""
            return data
        data = self._frame[self._at : self._at + size]
        self._at += len(data)
        return data

    def close(self) -> None:
        return None
