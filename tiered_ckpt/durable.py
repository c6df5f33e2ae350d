"""Durable files: written whole or not at all, and still there after a power cut.

An atomic write, step by step:

1. create ``.<name>.<random>.tmp`` in the target directory (never an existing file);
2. write the bytes (starting writeback early, so the disk works while the CPU hashes),
   then ``fsync`` the file;
3. ``os.replace`` it onto its final name (or, create-only, ``os.link`` it there, which
   fails if the name exists);
4. ``fsync`` the directory, so the rename itself survives a power cut (callers that
   rename many files do this once, after the last one).

Both tiers that live on a file system use it: the local tier, and a remote tier on a
shared file system (``file://``, NFS, Lustre). It knows nothing of checkpoints.
"""

from __future__ import annotations

import ctypes
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar, cast

from .layout import temp_name

__all__ = ["fsync_directory", "atomic_write", "write_bytes", "write_all", "WRITEBACK_BYTES"]

T = TypeVar("T")

# Start writing dirty pages back after every 8 MiB, so the disk works while the CPU
# hashes the next chunk instead of idling until the final fsync. The os module has
# no sync_file_range, so it is called through libc (Linux only; a no-op elsewhere).
WRITEBACK_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


class _EagerWriteback(io.RawIOBase):
    """A write-only raw file that asks the kernel to start writeback as it goes.

    It only starts writeback early; durability still comes from the final fsync.
    """

    def __init__(self, raw: io.FileIO) -> None:
        super().__init__()
        self._raw = raw
        self._position = 0
        self._flushed_to = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def write(self, data) -> int:  # type: ignore[override]
        written = self._raw.write(data) or 0
        self._position += written
        if _sync_file_range is not None and self._position - self._flushed_to >= WRITEBACK_BYTES:
            # Best effort: a failure here shows up again, and is raised, at fsync.
            _sync_file_range(
                self._raw.fileno(), self._flushed_to, self._position - self._flushed_to, _SYNC_FILE_RANGE_WRITE
            )
            self._flushed_to = self._position
        return written


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
) -> T:
    """Write ``path`` through a temp file so that it holds either its old content or all of the new.

    ``write`` receives an unbuffered binary file. ``check``, if given, receives what
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
            result = write(cast(BinaryIO, _EagerWriteback(out)))
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
