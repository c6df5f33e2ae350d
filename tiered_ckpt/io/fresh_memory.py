"""New arrays for a load's bytes, in memory the kernel can hand out without compacting it first.

Why not ``np.empty``: numpy asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on
every allocation of 4 MiB or more, and with the kernel's usual THP setting (``defrag``:
``madvise``) a fault in such memory compacts memory on the spot until a 2 MiB page is
free. On a node whose memory is fragmented, as a page cache full of the job's files leaves
it, a load into new arrays then spends most of its time in the kernel, compacting. An
anonymous mapping without the advice is faulted in 4 KiB pages, which never wait for it.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

__all__ = ["new_array", "MAPPED_BYTES"]

MAPPED_BYTES = 4 << 20  # numpy's own threshold for the advice; below it, np.empty is used

_MAPPED = sys.platform.startswith("linux")  # the advice and the compaction are Linux's


def new_array(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised, writable, C-contiguous array of ``shape`` and ``dtype`` (page-aligned
    when mapped), freed when the last array or view of it is; as ``np.empty`` but never
    advised to use huge pages."""
    dtype = np.dtype(dtype)
    size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if not _MAPPED or size < MAPPED_BYTES:
        return np.empty(shape, dtype)
    mapped = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapped, dtype).reshape(shape)
