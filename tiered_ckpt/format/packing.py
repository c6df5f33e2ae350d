"""A shard's arrays to and from its bytes, with small arrays handled in blocks rather than one by one.

A state of tens of thousands of small arrays (a few KiB each) would otherwise cost a
write call, a checksum update and an allocation per array, each more than moving its
bytes: the rate of such a shard fell to a fraction of the same bytes in a few large
arrays. So small arrays are gathered: on write, consecutive ones are copied into one
buffer of up to :data:`GATHER_BYTES`, written (and hashed) as one piece, and each array's
own digest is taken in one call; on read, consecutive ones are filled into one block
of up to :data:`GATHER_BYTES` and returned as views of it. Large arrays stream as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal, NamedTuple

import numpy as np
import xxhash

from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.io.fresh_memory import new_array
from tiered_ckpt.io.hashing import CHUNK_BYTES, HashedStream, Hasher, PartDigest
from tiered_ckpt.io.off_host import OffHost

__all__ = ["GATHER_BYTES", "SMALL_ARRAY_BYTES", "Placed", "byte_chunks", "fill_arrays", "write_arrays", "read_arrays"]

GATHER_BYTES = CHUNK_BYTES  # one write (and one block of views) holds up to this many bytes of small arrays
# A fill of the caller's arrays holds at most this many bytes of blocks not yet hashed behind it
_UNHASHED_BYTES = 8 * GATHER_BYTES
SMALL_ARRAY_BYTES = 64 << 10  # an array this small costs more in calls than in bytes: it is gathered

PartDigests = Literal["both", "xxh3"] | None


class Placed(NamedTuple):
    """One array of a shard: its name, dtype and shape, and where its bytes are (``begin``,
    ``end``, counted from the first array's first byte)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def byte_chunks(array: np.ndarray) -> Iterator[memoryview]:
    """Yield the array's C-order little-endian bytes in chunks, copying only when it must."""
    if array.dtype.byteorder == ">" or not array.flags.c_contiguous:
        # Copy a slab of rows at a time so memory stays bounded for any array size.
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        rows = array.reshape(1, *array.shape) if array.ndim == 0 else array
        row_bytes = max(1, rows[0:1].nbytes)
        step = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, rows.shape[0], step):
            yield from byte_chunks(np.ascontiguousarray(rows[start : start + step], dtype=dtype))
        return
    flat = array.reshape(-1).view(np.uint8).data
    for start in range(0, len(flat), CHUNK_BYTES):
        yield flat[start : start + CHUNK_BYTES]


def _digest(data: memoryview, parts: Literal["both", "xxh3"]) -> PartDigest:
    """The digest :class:`Hasher` would give of ``data``, in one call per checksum."""
    sha256 = hashlib.sha256(data).hexdigest() if parts == "both" else ""
    return PartDigest(len(data), sha256, xxhash.xxh3_64_hexdigest(data))


def write_arrays(
    write: Callable[[memoryview], None],
    arrays: Sequence[np.ndarray],
    names: Sequence[str],
    parts: PartDigests,
    done_with: Callable[[str], None] | None = None,
    tails: Mapping[str, np.ndarray] | None = None,
) -> dict[str, PartDigest]:
    """Write the bytes of ``arrays`` back to back through ``write`` and return, with ``parts``,
    each one's digest by name (``"both"``: sha256 and xxh3-64, ``"xxh3"``: xxh3-64 only).

    Small C-contiguous little-endian arrays are copied into one buffer and written as one
    piece; any other array is written a chunk at a time, from its own memory where it can be.
    ``done_with(name)`` is called as soon as an array's memory is read for the last time.
    ``tails[name]`` (bytes, C-contiguous little-endian arrays only) holds the last bytes of
    that array, written from there: of the array's own memory only the bytes before are read.
    An :class:`~tiered_ckpt.io.off_host.OffHost` array (on a device) is copied to host
    memory a piece at a time as it is written.
    """
    buffer = memoryview(bytearray(GATHER_BYTES))
    filled = 0
    digests: dict[str, PartDigest] = {}
    tails = tails or {}
    for name, array in zip(names, arrays, strict=True):
        size = array.nbytes
        tail = tails.get(name)
        device = isinstance(array, OffHost)  # on a device: its pieces are copied to host as they are written
        if device and tail is not None:
            raise InvalidStateError(f"{name!r}: a tail is for an array in host memory, not one on a device")
        small = not device and tail is None and size <= SMALL_ARRAY_BYTES
        if small and array.flags.c_contiguous and array.dtype.byteorder != ">":
            data = (array if array.ndim == 1 else array.reshape(-1)).view(np.uint8).data
            if filled + size > GATHER_BYTES:
                write(buffer[:filled])
                filled = 0
            buffer[filled : filled + size] = data
            filled += size
            if parts is not None:
                digests[name] = _digest(data, parts)
            if done_with is not None:
                done_with(name)
            continue
        if filled:
            write(buffer[:filled])
            filled = 0
        part = None if parts is None else Hasher(None if parts == "both" else "fast")
        if tail is not None and not (array.flags.c_contiguous and array.dtype.byteorder != ">" and array.ndim):
            raise InvalidStateError(f"{name!r}: a tail is for a C-contiguous little-endian array, not this one")
        if isinstance(array, OffHost):
            head = array.chunks()
        else:
            head = byte_chunks(array if tail is None else array.reshape(-1).view(np.uint8)[: size - tail.size])
        for chunk in head:
            write(chunk)
            if part is not None:
                part.update(chunk)
        if done_with is not None:
            done_with(name)
        for chunk in byte_chunks(tail) if tail is not None else ():
            write(chunk)
            if part is not None:
                part.update(chunk)
        if part is not None:
            whole = part.digest()
            digests[name] = PartDigest(whole.size_bytes, whole.sha256, whole.xxh3_64)
    if filled:
        write(buffer[:filled])
    return digests


def read_arrays(stream: HashedStream, entries: Sequence[Placed]) -> dict[str, np.ndarray]:
    """New arrays holding the next bytes of ``stream``, laid out as ``entries`` (in file order,
    back to back), every byte hashed once as it is copied.

    Each array is writable, aligned for its dtype and shares no byte with another; a run of
    small arrays is filled as one block of up to :data:`GATHER_BYTES` and returned as views
    of it (so keeping one of them alive keeps at most that block), every other array is its own.
    """
    arrays: dict[str, np.ndarray] = {}
    run: list[Placed] = []

    def fill_run() -> None:
        start = run[0].begin
        block = np.empty(run[-1].end - start, np.uint8)
        stream.copy_into(block)
        for entry in run:
            arrays[entry.name] = block[entry.begin - start : entry.end - start].view(entry.dtype).reshape(entry.shape)
        run.clear()

    for entry in entries:
        size = entry.end - entry.begin
        if size <= SMALL_ARRAY_BYTES:
            # an offset that is not a multiple of the item size (another writer's file) gets its own array
            if run and (entry.end - run[0].begin > GATHER_BYTES or (entry.begin - run[0].begin) % entry.dtype.itemsize):
                fill_run()
            run.append(entry)
            continue
        if run:
            fill_run()
        array = new_array(entry.shape, entry.dtype)
        stream.copy_into(array.reshape(-1).view(np.uint8))
        arrays[entry.name] = array
    if run:
        fill_run()
    return arrays


def fill_arrays(stream: HashedStream, entries: Sequence[Placed], targets: Mapping[str, np.ndarray]) -> None:
    """Fill ``targets`` (C-contiguous, writable, each as its entry says) with the next bytes of
    ``stream``, laid out as ``entries`` (in file order, back to back), every byte hashed once.

    A run of small arrays is read as one block of up to :data:`GATHER_BYTES` and copied from
    there into each target (one more copy of their bytes, against a read and a hash call per
    array); the blocks not yet hashed behind it stay under :data:`_UNHASHED_BYTES`. Every other
    array, and any over an unnamed file (whose pieces must be handed over as they are filled:
    :func:`~tiered_ckpt.io.scratch.refilled`), is filled directly.
    """
    run: list[Placed] = []
    unhashed = 0

    def fill_run() -> None:
        nonlocal unhashed
        start = run[0].begin
        block = np.empty(run[-1].end - start, np.uint8)  # new each run: the hashing thread may still read the last
        stream.copy_into(block)
        view = block.data
        for entry in run:
            target = targets[entry.name]
            if entry.end > entry.begin:
                _bytes_of(target)[:] = view[entry.begin - start : entry.end - start]
        run.clear()
        unhashed += block.nbytes
        if unhashed >= _UNHASHED_BYTES:
            stream.settle()
            unhashed = 0

    for entry in entries:
        target = targets[entry.name]
        # a plain array of its own memory: not one over an unnamed file, nor a frombuffer view of one
        plain = type(target) is np.ndarray and not isinstance(target.base, memoryview)
        if plain and entry.end - entry.begin <= SMALL_ARRAY_BYTES:
            if run and entry.end - run[0].begin > GATHER_BYTES:
                fill_run()
            run.append(entry)
            continue
        if run:
            fill_run()
        stream.copy_into(target.reshape(-1).view(np.uint8))
    if run:
        fill_run()


def _bytes_of(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous, non-empty ``array`` as a writable view; a memoryview's cast is
    several times cheaper than numpy's reshape and view, and takes every dtype of numpy's own."""
    try:
        return array.data.cast("B")
    except (ValueError, TypeError):  # a dtype the buffer protocol cannot say (bf16, fp8)
        return array.reshape(-1).view(np.uint8).data
