"""A shard file read front to back, a block at a time.

A file whose first block is in the page cache (a read that must not wait, ``RWF_NOWAIT``,
tells) is read through a memory map of it: copying out of the cache is one copy. Any other
is read ahead in blocks by a thread of its own, through the page cache with the kernel's
sequential readahead, and what has been read is released from the cache behind it
(``POSIX_FADV_DONTNEED``): restoring a checkpoint holds a few MiB of its file in the cache
at a time and does not push the training job's own files out of it. Read past the cache
(``O_DIRECT``) instead, a thread keeps one request in flight and waits out each one's
latency: a cold load ran at half the disk's rate.

Call sequence: ``with read_blocks(fd, size) as blocks:``, then iterate: each view is valid
until the next one is asked for. Leaving the ``with`` stops the thread.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from tiered_ckpt.io.durable import BLOCK_BYTES, aligned_block
from tiered_ckpt.io.pages import blocks_of

__all__ = ["BLOCK_BYTES", "read_blocks"]

# Blocks of durable.BLOCK_BYTES (1 MiB); three per file keep two reads ahead while the
# caller copies and hashes the third.
_BLOCKS_PER_FILE = 3
_RELEASE_BYTES = 8 << 20  # what was read is let go from the page cache this many bytes at a time
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


_SEQUENTIAL = getattr(os, "POSIX_FADV_SEQUENTIAL", None)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


def _advise(fd: int, offset: int, length: int, advice: int | None) -> None:
    """``posix_fadvise``, where the platform and the file system take it (a hint: nothing fails without)."""
    if advice is None:
        return
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except OSError:
        pass


class _Reader:
    """The thread's side: fill free blocks with the file's bytes, in order, and queue them."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.free: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        self.filled: queue.SimpleQueue[tuple[np.ndarray, int] | BaseException | None] = queue.SimpleQueue()
        for _ in range(_BLOCKS_PER_FILE):
            self.free.put(aligned_block())

    def run(self) -> None:
        _advise(self.fd, 0, self.size, _SEQUENTIAL)
        released = 0
        try:
            for offset in range(0, self.size, BLOCK_BYTES):
                block = self.free.get()
                if block is None:  # the consumer stopped
                    return
                self.filled.put((block, self._fill(block, offset, min(BLOCK_BYTES, self.size - offset))))
                if offset - released >= _RELEASE_BYTES:  # copied out already: the cache need not keep it
                    _advise(self.fd, released, offset - released, _DONTNEED)
                    released = offset
            self.filled.put(None)
        except BaseException as error:  # raised in the consumer's thread
            self.filled.put(error)
        finally:
            _advise(self.fd, released, 0, _DONTNEED)  # to the end of the file, readahead included

    def _fill(self, block: np.ndarray, offset: int, wanted: int) -> int:
        got = 0
        while got < wanted:
            count = os.preadv(self.fd, [block[got:wanted].data], offset + got)
            if count == 0:
                raise OSError(errno.EIO, f"file ended at byte {offset + got}, {self.size} were expected")
            got += count
        return wanted


def _cached(fd: int, size: int) -> bool:
    """Whether the page cache holds the file's first block (asked without waiting for the disk;
    asking starts the kernel's readahead of the file's first few hundred KiB if it does not).
    True where the file system cannot tell (tmpfs: its files are memory)."""
    wanted = min(BLOCK_BYTES, size)
    try:
        return os.preadv(fd, [bytearray(wanted)], 0, _RWF_NOWAIT) == wanted
    except BlockingIOError:  # not cached
        return False
    except OSError:  # EOPNOTSUPP, EINVAL: cannot tell
        return True


def _mapped(fd: int, size: int) -> Iterator[memoryview]:
    """The file's bytes through a memory map of the page cache, a block at a time. The map
    is unmapped once no view of it is left.

    Each block's pages are dropped from the map once the next block is asked for: the page
    cache keeps them, but a mapped page counts in the process's resident memory, and a
    restore of a large cached shard would otherwise show the whole shard there."""
    if size:
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        data = memoryview(mapped)
        if len(data) < size:
            raise OSError(errno.EIO, f"file ended at byte {len(data)}, {size} were expected")
        yield from blocks_of(data[:size], BLOCK_BYTES, mapped)


@contextmanager
def read_blocks(fd: int, size: int) -> Iterator[Iterator[memoryview]]:
    """The first ``size`` bytes of the open file ``fd``, in order, as views of blocks of up to
    :data:`BLOCK_BYTES`, each valid until the next is asked for.

    A file whose first block is in the page cache (or whose file system cannot tell without
    waiting: tmpfs, some network ones) is read through a memory map: copying out of the cache
    costs one copy. Any other is read ahead by a thread, and let go from the cache behind it.
    A read error (or a file shorter than ``size``) is raised, as OSError, where the failed
    block would have been yielded.
    """
    if not size or not _RWF_NOWAIT or _cached(fd, size):  # without RWF_NOWAIT, none can tell
        yield _mapped(fd, size)
        return
    reader = _Reader(fd, size)
    thread = threading.Thread(target=reader.run, name="tiered-ckpt-read", daemon=True)
    thread.start()

    def blocks() -> Iterator[memoryview]:
        while (item := reader.filled.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            block, count = item
            yield block[:count].data
            reader.free.put(block)

    try:
        yield blocks()
    finally:
        reader.free.put(None)
        thread.join()
