"""Letting go of the pages of a map of a file once they are read: the file keeps them, the process does not.

A touched page of a map counts in the process's resident memory until the map is closed, so
reading or sending a large file through one map shows the whole file there. Advising
``MADV_DONTNEED`` drops a range's pages from the map: the page cache (or the file system, for
a memory file system) still holds their bytes, and a later read of the range faults them in
again. Only for a map of a file, and only for pages this process did not change in a private
map: an anonymous map's pages, or a private map's changed ones, would be lost.

:func:`blocks_of` reads a buffer a block at a time, letting each block's pages go once it is
read where the buffer is a whole map of a file (:func:`whole_map`).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

__all__ = ["FOLIO_BYTES", "blocks_of", "let_go", "whole_map"]

_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # Linux, macOS; elsewhere pages stay mapped


FOLIO_BYTES = 4 << 20
"""How far before a range :func:`let_go` drops pages again: the page cache holds a file in
folios of up to a few MiB, and a fault on one page of a folio may map all of it, pages
already let go included (a piece that starts in a page the last piece ended in, or a
folio across the two). Callers go forward, so dropping those again costs a walk of
page tables already empty."""


def let_go(mapped: mmap.mmap, start: int, stop: int) -> bool:
    """Drop from this process the pages of bytes ``start`` to ``stop`` of ``mapped`` (a map of a
    file; see the module doc), from the page holding byte ``start`` on, and those of the
    :data:`FOLIO_BYTES` before it, which the fault of a later page may have mapped again.

    Returns False if the pages stay: the platform has no such advice, or the map refuses it
    (a locked map, under ``mlockall``); the caller need not ask again for that map.
    """
    if _DONTNEED is None:
        return False
    start = max(0, start - FOLIO_BYTES)
    begin, end = start - start % mmap.PAGESIZE, min(stop, len(mapped))
    if end <= begin:
        return True
    try:
        mapped.madvise(_DONTNEED, begin, end - begin)
    except OSError:
        return False
    return True


def whole_map(data: memoryview) -> mmap.mmap | None:
    """The map of a file that ``data`` views whole, from its first byte (``memoryview(a_map)``),
    whose pages may be let go; None for any other buffer."""
    mapped = data.obj
    return mapped if isinstance(mapped, mmap.mmap) and data.nbytes == len(mapped) else None


def blocks_of(data: memoryview, block_bytes: int, mapped: mmap.mmap | None = None) -> Iterator[memoryview]:
    """``data``'s bytes in order, as views of up to ``block_bytes`` each, valid until the next
    one is asked for. ``mapped``: the map of a file ``data`` is, from its first byte (never one
    whose pages this process changed privately): each block's pages are let go once the next
    block is asked for, and after the last, so reading it all holds one block of it resident."""
    letting_go = mapped is not None
    for start in range(0, len(data), block_bytes):
        yield data[start : start + block_bytes]
        if letting_go:  # a locked map (mlockall) refuses it: its pages stay, the read goes on
            letting_go = let_go(mapped, start, start + block_bytes)  # type: ignore[arg-type]
