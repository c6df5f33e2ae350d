"""Room on a disk for bytes a process receives and must not hold in its memory: a file with no name.

A restore that fetches a shard from a partner's memory receives it here rather than into
anonymous memory: written through a shared map of the file, a piece at a time, each
piece's pages let go once written (:func:`~tiered_ckpt.io.pages.let_go`), the file (the
page cache, then the disk) keeps the bytes and the process holds a piece of them. The
file is unlinked from the start (``O_TMPFILE`` where the file system has it; else created
and unlinked at once): the file system frees it when its last map is gone, or the process
dies, so nothing is ever left behind to clean up.

A restore into CUDA tensors past the host memory budget fills such a file as an array
(:func:`paged_array`): the reads that fill it hand each piece over once it is written and
verified (:meth:`Pages.filled`: its xxh3-64 is kept and its pages let go; :func:`pages_of`
tells them which arrays are such), and the copy to the device reads it back a piece at a
time with ``pread`` (:meth:`Pages.reader`), each filled piece checked against its
xxh3-64 again: the page cache may have written the bytes to the disk and dropped them
meanwhile, and a failing disk then answers EIO (an error) or other bytes (found), where a
read through the map would kill the process (SIGBUS).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import xxhash

from tiered_ckpt.errors import StorageError
from tiered_ckpt.io.files import pread_exactly
from tiered_ckpt.io.pages import let_go

__all__ = ["Pages", "Paged", "paged_array", "pages_of", "refilled", "unnamed_map"]


@contextmanager
def _unnamed_file(directory: Path, size: int) -> Iterator[IO[bytes]]:
    with tempfile.TemporaryFile(dir=directory) as file:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(file.fileno(), 0, size)
        else:  # macOS: a sparse file; the room is taken as it is written
            os.ftruncate(file.fileno(), size)
        yield file


def unnamed_map(directory: Path, size: int) -> mmap.mmap:
    """A writable shared map of ``size`` (> 0) bytes of a new, unnamed file on ``directory``'s
    file system (see the module doc), its blocks allocated first: a disk without room for it
    raises OSError (ENOSPC) here, not SIGBUS on a write through the map later."""
    with _unnamed_file(directory, size) as file:
        return mmap.mmap(file.fileno(), size, access=mmap.ACCESS_WRITE)  # the map keeps the file


@dataclass(eq=False)
class _Backing:
    """An unnamed file, its shared map, and the pieces filled and let go: by offset in the
    file, their length and xxh3-64 (written by the threads that fill distinct ranges)."""

    file: IO[bytes]
    mapped: mmap.mmap
    origin: int  # the address of the map's first byte
    directory: Path
    filled: dict[int, tuple[int, int]] = field(default_factory=dict)
    letting_go: bool = True  # False once the map refused (a locked map): its pages stay


class Paged(np.ndarray):
    """An array over a map of an unnamed file (:func:`paged_array`), and its views: whoever
    fills it may let the pages it filled go (:func:`pages_of`). A subclass rather than a
    registry of addresses: the file travels with every view numpy makes of it, and an array
    that merely inherits the class (a ufunc's result) lies outside the map and is refused."""

    _backing: _Backing | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._backing = getattr(obj, "_backing", None)


def paged_array(directory: Path, nbytes: int) -> Paged:
    """A uint8 array of ``nbytes`` (> 0) over :func:`unnamed_map` on ``directory``'s file
    system: the page cache and the disk hold its bytes, the process only the pages it
    touches and has not let go. The file goes with the array's last view. Raises OSError
    as :func:`unnamed_map` does."""
    with _unnamed_file(directory, nbytes) as file:
        mapped = mmap.mmap(file.fileno(), nbytes, access=mmap.ACCESS_WRITE)
        kept = os.fdopen(os.dup(file.fileno()), "rb", buffering=0)  # for the reader's pread
    array = np.frombuffer(mapped, np.uint8).view(Paged)
    array._backing = backing = _Backing(kept, mapped, array.ctypes.data, directory)
    weakref.finalize(backing, kept.close)  # with the last view, not at the collector's leisure
    return array


@dataclass(frozen=True)
class Pages:
    """Where an array over an unnamed file (:func:`pages_of`) lies in it: ``nbytes`` from byte ``offset``."""

    backing: _Backing
    offset: int
    nbytes: int

    def refill(self) -> None:
        """Forget what was handed over of this array: a read starts filling it (again, after
        a copy that failed to verify), and its pieces may be cut elsewhere this time."""
        first, end = self.offset, self.offset + self.nbytes
        filled = self.backing.filled
        for at in [at for at in list(filled) if first <= at < end]:
            filled.pop(at, None)

    def filled(self, start: int, piece: memoryview) -> None:
        """Hand over ``piece``, the array's bytes from ``start``, written and verified: its
        xxh3-64 is kept for :meth:`reader` and its pages are let go (the file keeps them),
        unless the map refused that once (a locked map: its pages stay)."""
        where, backing = self.offset + start, self.backing
        backing.filled[where] = (len(piece), xxhash.xxh3_64_intdigest(piece))
        if backing.letting_go:
            backing.letting_go = let_go(backing.mapped, where, where + len(piece))

    def reader(self) -> _ReadBack:
        """A reader of the array's bytes in order (:meth:`_ReadBack.read_into`)."""
        return _ReadBack(self)


class _ReadBack:
    """The bytes of an array over an unnamed file, read back in order with ``pread``, every
    piece handed over by :meth:`Pages.filled` checked against its xxh3-64 as it is read."""

    def __init__(self, pages: Pages) -> None:
        self._pages = pages
        first, end = pages.offset, pages.offset + pages.nbytes  # the file may hold other arrays' pieces too
        pieces = list(pages.backing.filled.items())
        self._pieces = sorted((at, size, digest) for at, (size, digest) in pieces if first <= at < end)
        self._next = 0
        self._hasher: Any = None

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Fill ``out`` (1-D uint8) with the array's bytes from ``start`` (each call starting
        where the last ended). Raises :class:`StorageError` naming the file's directory if
        the disk fails to read them or a piece differs from what was handed over."""
        backing, where = self._pages.backing, self._pages.offset + start
        what = f"restore into CUDA tensors: an unnamed file in {backing.directory}"
        try:
            pread_exactly(backing.file.fileno(), out.data, where)
        except OSError as exc:
            raise StorageError(f"{what} could not be read back: {exc.strerror or exc}") from exc
        end = where + out.size
        while self._next < len(self._pieces):
            at, size, digest = self._pieces[self._next]
            if at >= end:
                break
            begin, stop = max(at, where), min(at + size, end)
            if begin < stop:
                self._hasher = self._hasher or xxhash.xxh3_64()
                self._hasher.update(out[begin - where : stop - where].data)
            if at + size > end:
                break  # the piece goes on in the next read
            if self._hasher is None or self._hasher.intdigest() != digest:
                raise StorageError(
                    f"{what}: bytes {at}-{at + size} differ from those verified when they were read "
                    "(the disk or the page cache lost them)"
                )
            self._hasher, self._next = None, self._next + 1


def refilled(target: np.ndarray) -> Pages | None:
    """Where ``target`` lies in an unnamed file (:func:`pages_of`), what was handed over of it
    before forgotten (:meth:`Pages.refill`): for a read that starts filling it; None for any
    other target."""
    paged = pages_of(target)
    if paged is not None:
        paged.refill()
    return paged


def pages_of(array: np.ndarray) -> Pages | None:
    """Where ``array`` lies in an unnamed file it views (made by :func:`paged_array`, or
    ``np.frombuffer`` of a view of one), whose pieces are handed over once filled
    (:meth:`Pages.filled`); None for any other array."""
    owner = array
    if not isinstance(owner, Paged) and isinstance(owner.base, memoryview):
        owner = owner.base.obj  # ``np.frombuffer`` of a view of one, as ranged reads take their target
    backing = owner._backing if isinstance(owner, Paged) else None
    if backing is None or backing.mapped.closed:
        return None
    offset = array.ctypes.data - backing.origin
    if offset < 0 or offset + array.nbytes > len(backing.mapped):
        return None
    return Pages(backing, offset, array.nbytes)
