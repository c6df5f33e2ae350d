"""Durable files: written whole or not at all, and still there after a power cut.

An atomic write, step by step:

1. create ``.<name>.<random>.tmp`` in the target directory (never an existing file);
2. write the bytes, staged in aligned blocks that a background thread writes while the
   caller hashes the next ones (bypassing the page cache where the file system allows
   it, else starting writeback early), then ``fsync`` the file;
3. ``os.replace`` it onto its final name (or, create-only, ``os.link`` it there, which
   fails if the name exists);
4. ``fsync`` the directory, so the rename itself survives a power cut (callers that
   rename many files do this once, after the last one).

Both tiers that live on a file system use it: the local tier, and a remote tier on a
shared file system (``file://``, NFS, Lustre). It knows nothing of checkpoints.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import mmap
import os
import queue
import re
import secrets
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar, cast

import numpy as np

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = [
    "temp_name",
    "is_temp_name",
    "temp_target",
    "fsync_directory",
    "atomic_write",
    "observe_writes",
    "write_bytes",
    "write_all",
    "aligned_block",
    "BLOCK_BYTES",
    "WRITEBACK_BYTES",
]

T = TypeVar("T")

# A temp name starts with a dot, which no committed name does (layout.is_plain_name), so a
# committed file is never taken for a temp file, and a temp file traces back to its target.
_TEMP = re.compile(r"\.(?P<target>[^/\\]+)\.[0-9a-f]{16}\.tmp")

# Through the page cache, start writing dirty pages back after every 8 MiB, so the disk
# works while the CPU hashes the next chunk instead of idling until the final fsync. The
# os module has no sync_file_range, so it is called through libc (Linux only).
WRITEBACK_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2

# Writes go out in blocks of 1 MiB, three per file (one being filled, up to two queued
# for the disk): the size at which this project's development disk wrote fastest with
# O_DIRECT and a writer per shard. Blocks are page-aligned and a multiple of 4096 bytes,
# as O_DIRECT requires of buffers, lengths and offsets on common devices.
BLOCK_BYTES = 1 << 20
_BLOCKS_PER_FILE = 3


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_block() -> np.ndarray:
    """A new block of :data:`BLOCK_BYTES` bytes that O_DIRECT can read or write: an anonymous
    mapping, so page-aligned."""
    return np.frombuffer(mmap.mmap(-1, BLOCK_BYTES), np.uint8)


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False if the file system refuses it."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError:
        return False
    return True


class _StagedFile(io.RawIOBase):
    """A write-only raw file that copies what it is given into aligned blocks and writes each
    full block from a thread of its own, while the caller goes on (hashing what it wrote,
    preparing the next bytes).

    With ``direct`` (and where the file system allows it) full blocks bypass the page cache
    (O_DIRECT): no kernel copy, no page-cache pages to allocate and write back, and a
    checkpoint does not push the training job's own files out of the cache. Otherwise,
    and for the last partial block, writes go through the page cache, with writeback
    started every :data:`WRITEBACK_BYTES`. Durability still comes from the final fsync.

    Call sequence: ``write`` any number of times, then :meth:`finish` (every byte is in
    the file, or the first write error is raised), and always :meth:`close`, which waits
    for the block being written. A file smaller than a block starts no thread.
    """

    def __init__(self, raw: io.FileIO, *, direct: bool) -> None:
        super().__init__()
        self._fd = raw.fileno()
        self._want_direct = direct and bool(_O_DIRECT)
        self._direct = False
        # Blocks go round: free -> filled by write() -> queued -> written by the thread -> free.
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._queued: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        self._blocks = 0
        self._block: np.ndarray | None = None
        self._fill = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._position = 0
        self._flushed_to = 0
        self.observer: Callable[[memoryview], None] | None = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data: ReadableBuffer) -> int:
        source = np.frombuffer(memoryview(data), np.uint8)  # numpy types a buffer as a union before 3.12
        taken = 0
        while taken < len(source):
            block = self._block if self._block is not None else self._next_block()
            count = min(BLOCK_BYTES - self._fill, len(source) - taken)
            piece = block[self._fill : self._fill + count]
            # numpy's copy releases the GIL, so other writers' threads run meanwhile.
            np.copyto(piece, source[taken : taken + count])
            if self.observer is not None:
                self.observer(piece.data)  # while the copy is still in the CPU's cache
            self._fill += count
            taken += count
            if self._fill == BLOCK_BYTES:
                self._queue(block)
        return taken

    def finish(self) -> None:
        """Write what is still staged and wait for every block: all bytes are in the file."""
        self._stop()
        if self._direct:
            _set_direct(self._fd, False)
            self._direct = False
        if self._block is not None and self._fill:
            self._write_block(self._block[: self._fill].data)
        self._block, self._fill = None, 0

    def close(self) -> None:
        try:
            self._stop(raise_error=False)
        finally:
            super().close()

    def _next_block(self) -> np.ndarray:
        """A block to fill: a new one while fewer than three exist, else the next the
        thread has written (raising the thread's error, if a write failed)."""
        if self._blocks < _BLOCKS_PER_FILE:
            self._blocks += 1
            block = aligned_block()
        else:
            block = self._free.get()
        if self._error is not None:
            raise self._error
        self._block = block
        return block

    def _queue(self, block: np.ndarray) -> None:
        if self._thread is None:
            self._direct = self._want_direct and _set_direct(self._fd, True)
            self._thread = threading.Thread(target=self._write_queued, name="tiered-ckpt-write", daemon=True)
            self._thread.start()
        self._queued.put(block)
        self._block, self._fill = None, 0

    def _write_queued(self) -> None:
        """The thread: write queued blocks in order; after a failure only hand them back."""
        while (block := self._queued.get()) is not None:
            if self._error is None:
                try:
                    self._write_block(block.data)
                except BaseException as error:  # raised in the caller's thread, by write() or finish()
                    self._error = error
            self._free.put(block)

    def _stop(self, raise_error: bool = True) -> None:
        """End the thread once it has written every queued block; raise its error if any."""
        if self._thread is not None:
            self._queued.put(None)
            self._thread.join()
            self._thread = None
        if raise_error and self._error is not None:
            raise self._error

    def _write_block(self, view: memoryview) -> None:
        """Write all of ``view`` (blocks are written one at a time, in order)."""
        while view:
            try:
                written = os.write(self._fd, view)
            except OSError as error:
                # Some file systems accept O_DIRECT and then refuse a write with it (or a
                # short write left the rest unaligned): go on through the page cache.
                if error.errno != errno.EINVAL or not self._direct:
                    raise
                self._direct = False
                _set_direct(self._fd, False)
                continue
            view = view[written:]
            self._position += written
        if not self._direct:
            self._start_writeback()

    def _start_writeback(self) -> None:
        if _sync_file_range is not None and self._position - self._flushed_to >= WRITEBACK_BYTES:
            # Best effort: a failure here shows up again, and is raised, at fsync.
            _sync_file_range(self._fd, self._flushed_to, self._position - self._flushed_to, _SYNC_FILE_RANGE_WRITE)
            self._flushed_to = self._position


def observe_writes(out: BinaryIO, observer: Callable[[memoryview], None]) -> bool:
    """Have ``observer`` see every byte written to ``out`` from now on, in order, right after
    ``out`` copied it into its staging block (so a checksum reads it from the CPU's cache);
    a ``write`` returns only after its bytes were observed.

    Returns False, and does nothing, if ``out`` is not a file :func:`atomic_write` gave:
    the caller then has to observe its own writes.
    """
    if not isinstance(out, _StagedFile):
        return False
    out.observer = observer
    return True


def temp_name(final_name: str) -> str:
    """Return a fresh temp name for a file that will be renamed to ``final_name``."""
    return f".{final_name}.{secrets.token_hex(8)}.tmp"


def is_temp_name(name: str) -> bool:
    """True if ``name`` was made by :func:`temp_name`."""
    return _TEMP.fullmatch(name) is not None


def temp_target(name: str) -> str | None:
    """Return the final name a temp name was made for, or None if it is not a temp name."""
    match = _TEMP.fullmatch(name)
    return match.group("target") if match else None


def fsync_directory(directory: Path) -> None:
    """Make the directory's entries (renames, creations, deletions) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path,
    write: Callable[[BinaryIO], T],
    *,
    sync_directory: bool = True,
    check: Callable[[T], None] | None = None,
    create_only: bool = False,
    direct: bool = True,
) -> T:
    """Write ``path`` through a temp file so that it holds either its old content or all of the new.

    ``write`` receives a binary file that stages what it is given and writes it from a
    background thread, bypassing the page cache where the file system allows it
    (``direct=False``: always through the page cache). ``check``, if given, receives what
    ``write`` returned and may raise to refuse the content. On success the file is
    fsynced and renamed onto ``path`` (and the directory fsynced unless
    ``sync_directory`` is False, for callers that fsync it once after many renames).
    On any failure the temp file is removed and ``path`` is untouched.

    ``create_only=True`` never replaces an existing ``path``: it raises
    :class:`FileExistsError` instead (the file is linked into place, which the file
    system refuses atomically when the name is taken, even by another host on NFS).
    """
    temp = path.with_name(temp_name(path.name))
    with open(temp, "xb", buffering=0) as out:
        try:
            with _StagedFile(out, direct=direct) as staged:
                result = write(cast(BinaryIO, staged))
                staged.finish()
            if check is not None:
                check(result)
            os.fsync(out.fileno())
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    try:
        if create_only:
            os.link(temp, path)
            temp.unlink()
        else:
            os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if sync_directory:
        fsync_directory(path.parent)
    return result


def write_all(out: BinaryIO, chunk: memoryview | bytes) -> None:
    """Write every byte of ``chunk`` to ``out`` (a raw stream may take fewer per call)."""
    view = memoryview(chunk)
    while view:
        written = out.write(view)
        if written is None:  # a non-blocking raw stream that would block: not a regular file
            raise OSError("stream refused the write")
        view = view[written:]


def write_bytes(path: Path, data: bytes, *, create_only: bool = False) -> None:
    """Atomically and durably write ``data`` as the whole of ``path`` (see :func:`atomic_write`)."""
    atomic_write(path, lambda out: write_all(out, data), create_only=create_only)
