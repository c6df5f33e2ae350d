"""A large object read in order over several connections: ranged reads run ahead of the reader.

An object store serves each connection at a bounded rate (S3: about 85-90 MB/s), so one
stream per shard leaves a restore at that rate, however fast the node. :class:`ReadAhead`
reads the object as consecutive ranges of ``part_bytes``, ``window`` of them in flight at
once ahead of where the reader is, and hands them over in order: its reader (a sha256
over the stream, a landing on disk) still sees one sequential stream. It holds at most
``window + 1`` ranges. Written here because fsspec's read caches fetch at most one block
ahead, on one connection.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["ReadAhead"]


class ReadAhead(io.RawIOBase):
    """The ``size`` bytes of an object, read in order, from ``fetch(start, stop)`` (its bytes
    ``[start, stop)``) called for consecutive ranges of ``part_bytes``, ``window`` at a time
    ahead of the reader, each on a thread of the stream's own. A failed range raises, to the
    reader, when the reader reaches it, and every read after it raises it again; a range
    shorter than asked ends the stream after it, so the reader finds it short. Closing the
    stream drops the ranges not yet read (those in flight finish on their threads) and
    closes ``closing``, if given (the file whose fetch it reads through)."""

    def __init__(
        self,
        fetch: Callable[[int, int], bytes],
        size: int,
        part_bytes: int,
        window: int,
        *,
        closing: Any = None,
    ) -> None:
        super().__init__()
        self._closing = closing
        self._failed: BaseException | None = None
        self.size = size
        self._fetch, self._part_bytes = fetch, part_bytes
        self._pool = ThreadPoolExecutor(max(1, window), thread_name_prefix="tiered-ckpt-read")
        self._window = max(1, window)
        self._ahead: deque[tuple[int, Future[bytes]]] = deque()  # each range's length, and its bytes
        self._scheduled = 0  # the offset the next range starts at
        self._current = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        """Fill ``buffer`` whole, unless the object ends first (as a buffered file does: a reader
        asking for a header's 8 bytes gets 8): the number of bytes put there."""
        self._checkClosed()  # io's own ValueError for a read of a closed file
        if self._failed is not None:
            raise self._failed
        view, count = memoryview(buffer).cast("B"), 0
        while count < len(view):
            if not self._current and not self._next():
                break
            taken = min(len(view) - count, len(self._current))
            view[count : count + taken] = self._current[:taken]
            self._current, count = self._current[taken:], count + taken
        return count

    def _next(self) -> bool:
        """Make the next range the current one (False: the object has ended)."""
        self._fill()
        if not self._ahead:
            return False
        asked, future = self._ahead.popleft()
        try:
            self._current = memoryview(future.result())
        except BaseException as exc:
            self._failed = exc
            self._drop()
            raise
        if len(self._current) < asked:
            self._drop()
            self._scheduled = self.size  # nothing after a short range
        else:
            self._fill()
        return True

    def _fill(self) -> None:
        while len(self._ahead) < self._window and self._scheduled < self.size:
            start, stop = self._scheduled, min(self.size, self._scheduled + self._part_bytes)
            self._ahead.append((stop - start, self._pool.submit(self._fetch, start, stop)))
            self._scheduled = stop

    def _drop(self) -> None:
        for _asked, future in self._ahead:
            future.cancel()
        self._ahead.clear()

    def close(self) -> None:
        if not self.closed:
            self._drop()
            self._current = memoryview(b"")
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self._closing is not None:
                self._closing.close()
        super().close()
