"""Room on a disk for bytes a process receives and must not hold in its memory: a file with no name.

A restore that fetches a shard from a partner's memory receives it here rather than into
anonymous memory: written through a shared map of the file, a piece at a time, each
piece's pages let go once written (:func:`~tiered_ckpt.io.pages.let_go`), the file (the
page cache, then the disk) keeps the bytes and the process holds a piece of them. The
file is unlinked from the start (``O_TMPFILE`` where the file system has it; else created
and unlinked at once): the file system frees it when its last map is gone, or the process
dies, so nothing is ever left behind to clean up.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

__all__ = ["unnamed_map"]


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
