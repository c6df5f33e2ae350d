"""How the remote tier makes a request: under its one retry policy and the caller's deadline,
every backend error translated to :class:`~tiered_ckpt.errors.RemoteError`.

An operation is tried at most ``max_tries`` times, with exponential backoff and full
jitter, and no new try starts once ``max_seconds`` have passed since the first; each
request times out after ``timeout_seconds`` (see :class:`~tiered_ckpt.tiers.retry.RetryPolicy`).
An error leaves as :class:`RemoteError`, its ``transient`` flag set when trying again may
help (throttling, 5xx, resets, timeouts), ``tries`` counting the tries made, the original
exception chained; a :class:`~tiered_ckpt.errors.CheckpointError` passes as it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from tiered_ckpt.errors import CheckpointError, RemoteError
from tiered_ckpt.tiers.retry import RetryPolicy, is_transient

__all__ = ["LimitedReader", "Requests"]

T = TypeVar("T")


class Requests:
    """Operations under ``retry``, each with the deadline of the thread running it (uploads of
    several shards run at once)."""

    def __init__(self, retry: RetryPolicy) -> None:
        self.retry = retry
        self._context = threading.local()

    @property
    def deadline(self) -> float | None:
        """The ``time.monotonic()`` deadline of the operation running on this thread, if any."""
        return getattr(self._context, "at", None)

    @contextmanager
    def translated(self, what: str) -> Iterator[None]:
        """Backend errors raised inside as :class:`RemoteError` saying ``what`` was being done."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            transient = is_transient(exc)
            kind = "transient" if transient else "permanent"
            raise RemoteError(f"{what}: {kind} error {type(exc).__name__}: {exc}", transient=transient) from exc

    def run(self, what: str, action: Callable[[], T], deadline: float | None = None) -> T:
        """``action`` under the retry policy, its backend errors translated; with a ``deadline``
        (a ``time.monotonic()`` time), no try starts after it and a request still running
        then is cut short (see :meth:`timeout`)."""

        def once() -> T:
            with self.translated(what):
                return action()

        self._context.at = deadline
        try:
            return self.retry.run(what, once, deadline=deadline)
        finally:
            self._context.at = None

    def timeout(self) -> float | None:
        """The seconds left before this thread's deadline, for a backend to cut a request short
        at (None: no deadline); raises :class:`RemoteError` (``deadline`` set) once it has passed."""
        deadline = self.deadline
        if deadline is None:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            error = RemoteError("the deadline passed before this request could start", transient=False)
            error.deadline = True
            raise error
        return remaining


class LimitedReader:
    """A read-only stream whose backend errors become :class:`RemoteError` (reads are remote
    requests), ending after ``limit`` bytes: an object longer than its record is never read
    past one byte more than the record (enough to tell it is longer)."""

    def __init__(self, source: Any, requests: Requests, what: str, limit: int) -> None:
        self._source, self._requests, self._what = source, requests, what
        self._left = limit

    def read(self, size: int = -1) -> bytes:
        size = self._left if size is None or size < 0 else min(size, self._left)
        if size == 0:
            return b""
        with self._requests.translated(self._what):
            data: bytes = self._source.read(size)
        self._left -= len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: self._left]
        if not len(view):
            return 0
        with self._requests.translated(self._what):
            count: int = self._source.readinto(view)
        self._left -= count
        return count
