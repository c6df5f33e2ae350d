"""Letting go of the pages of a map of a file once they are read: the file keeps them, the process does not.

A touched page of a map counts in the process's resident memory until the map is closed, so
reading or sending a large file through one map shows the whole file there. Advising
``MADV_DONTNEED`` drops a range's pages from the map: the page cache (or the file system, for
a memory file system) still holds their bytes, and a later read of the range faults them in
again. Only for a map of a file, and only for pages this process did not change in a private
map: an anonymous map's pages, or a private map's changed ones, would be lost.
"""

from __future__ import annotations

import mmap

__all__ = ["let_go"]

_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # Linux, macOS; elsewhere pages stay mapped


def let_go(mapped: mmap.mmap, start: int, stop: int) -> bool:
    """Drop from this process the pages of bytes ``start`` to ``stop`` of ``mapped`` (a map of a
    file; see the module doc), from the page holding byte ``start`` on.

    Returns False if the pages stay: the platform has no such advice, or the map refuses it
    (a locked map, under ``mlockall``); the caller need not ask again for that map.
    """
    if _DONTNEED is None:
        return False
    begin, end = start - start % mmap.PAGESIZE, min(stop, len(mapped))
    if end <= begin:
        return True
    try:
        mapped.madvise(_DONTNEED, begin, end - begin)
    except OSError:
        return False
    return True
