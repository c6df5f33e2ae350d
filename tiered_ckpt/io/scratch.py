"""Room on a disk for bytes a process receives and must not hold in its memory: a file with no name.

A restore that fetches a shard from a partner's memory receives it here rather than into
anonymous memory: written through a shared map of the file, a piece at a time, each
piece's pages let go once written (:func:`~tiered_ckpt.io.pages.let_go`), the file (the
page cache, then the disk) keeps the bytes and the process holds a piece of them. The
file is unlinked from the start (``O_TMPFILE`` where the file system has it; else created
and unlinked at once): the file system frees it when its last map is gone, or the process
dies, so nothing is ever left behind to clean up.

A restore into CUDA tensors past the host memory budget fills such a file as an array
(:func:`paged_array`): the reads that fill it let each piece's pages go once it is written
and hashed (:func:`pages_of` tells them which arrays they may do that to), and the copy to
the device reads it back a piece at a time.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Paged", "paged_array", "pages_of", "unnamed_map"]


def unnamed_map(directory: Path, size: int) -> mmap.mmap:
    """A writable shared map of ``size`` (> 0) bytes of a new, unnamed file on ``directory``'s
    file system (see the module doc), its blocks allocated first: a disk without room for it
    raises OSError (ENOSPC) here, not SIGBUS on a write through the map later."""
    with tempfile.TemporaryFile(dir=directory) as file:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(file.fileno(), 0, size)
        else:  # macOS: a sparse file; the room is taken as it is written
            os.ftruncate(file.fileno(), size)
        return mmap.mmap(file.fileno(), size, access=mmap.ACCESS_WRITE)  # the map keeps the file


class Paged(np.ndarray):
    """An array over a map of an unnamed file (:func:`paged_array`), and its views: whoever
    fills it may let the pages it filled go (:func:`pages_of`). A subclass rather than a
    registry of addresses: the map travels with every view numpy makes of it, and an array
    that merely inherits the class (a ufunc's result) lies outside the map and is refused."""

    _map: mmap.mmap | None = None
    _origin: int = 0

    def __array_finalize__(self, obj: Any) -> None:
        self._map = getattr(obj, "_map", None)
        self._origin = getattr(obj, "_origin", 0)


def paged_array(directory: Path, nbytes: int) -> Paged:
    """A uint8 array of ``nbytes`` (> 0) over :func:`unnamed_map` on ``directory``'s file
    system: the page cache and the disk hold its bytes, the process only the pages it
    touches and has not let go. Raises OSError as :func:`unnamed_map` does."""
    mapped = unnamed_map(directory, nbytes)
    array = np.frombuffer(mapped, np.uint8).view(Paged)
    array._map, array._origin = mapped, array.ctypes.data
    return array


def pages_of(array: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """The shared map of an unnamed file that ``array`` views (made by :func:`paged_array`,
    or ``np.frombuffer`` of a view of one) and the offset of its first byte in it, whose pages may be let go once filled
    (:func:`~tiered_ckpt.io.pages.let_go`); None for any other array."""
    owner = array
    if not isinstance(owner, Paged) and isinstance(owner.base, memoryview):
        owner = owner.base.obj  # ``np.frombuffer`` of a view of one, as ranged reads take their target
    if not isinstance(owner, Paged) or owner._map is None or owner._map.closed:
        return None
    mapped = owner._map
    offset = array.ctypes.data - owner._origin
    if offset < 0 or offset + array.nbytes > len(mapped):
        return None
    return mapped, offset
