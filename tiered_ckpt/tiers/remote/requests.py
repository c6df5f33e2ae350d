"""How the remote tier makes a request: under its one retry policy and the caller's deadline,
every backend error translated to :class:`~tiered_ckpt.errors.RemoteError`.

An operation is tried at most ``max_tries`` times, with exponential backoff and full
jitter, and no new try starts once ``max_seconds`` have passed since the first; each
request times out after ``timeout_seconds`` (see :class:`~tiered_ckpt.tiers.remote.retry.RetryPolicy`).
An error leaves as :class:`RemoteError`, its ``transient`` flag set when trying again may
help (throttling, 5xx, resets, timeouts), ``tries`` counting the tries made, the original
exception chained; a :class:`~tiered_ckpt.errors.CheckpointError` passes as it is.

:meth:`Requests.trouble` says whether the store is failing now: a try that failed for a
transient reason (a hung request included, once its timeout cut it short) since the last
request it answered. The uploader shows it as a step being retried as soon as it happens,
not once the operation's tries are spent.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from tiered_ckpt.errors import CheckpointError, RemoteError
from tiered_ckpt.tiers.remote.retry import RetryPolicy, is_transient

__all__ = ["LimitedReader", "Requests", "Trouble", "is_missing"]

T = TypeVar("T")


def is_missing(exc: BaseException) -> bool:
    """True for an error a request raised because the object is not there (the backend's
    ``FileNotFoundError``, chained as :class:`RemoteError` chains what it translates)."""
    return isinstance(exc.__cause__, FileNotFoundError)


@dataclass(frozen=True)
class Trouble:
    """The store failing now: ``failures`` tries failed for a transient reason since the last
    answer, the first at ``since`` (Unix time), the last with ``last`` (its message)."""

    since: float
    failures: int
    last: str


class Requests:
    """Operations under ``retry``, each with the deadline of the thread running it (uploads of
    several shards run at once)."""

    def __init__(self, retry: RetryPolicy) -> None:
        self.retry = retry
        self._context = threading.local()
        self._lock = threading.Lock()
        self._trouble: Trouble | None = None

    def trouble(self) -> Trouble | None:
        """The store's failing tries since it last answered (None: it answered the last one)."""
        with self._lock:
            return self._trouble

    def _answered(self, error: RemoteError | None) -> None:
        """Record a try's outcome: an answer (``error`` None or not transient) ends the trouble."""
        if error is not None and error.deadline:  # cut short by the caller's deadline: no word of the store
            return
        with self._lock:
            if error is None or not error.transient:
                self._trouble = None
            elif self._trouble is None:
                self._trouble = Trouble(time.time(), 1, str(error))
            else:
                self._trouble = Trouble(self._trouble.since, self._trouble.failures + 1, str(error))

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

    def run(self, what: str, action: Callable[[], T], deadline: float | None = None, *, once: bool = False) -> T:
        """``action`` under the retry policy (``once``: one try only), its backend errors
        translated; with a ``deadline`` (a ``time.monotonic()`` time), no try starts after it
        and a request still running then is cut short (see :meth:`timeout`). An operation run
        inside another keeps the outer one's deadline, or its own if earlier, and gives it back."""

        def one_try() -> T:
            try:
                with self.translated(what):
                    result = action()
            except RemoteError as exc:
                self._answered(exc)
                raise
            self._answered(None)
            return result

        outer = self.deadline
        if outer is not None:
            deadline = outer if deadline is None else min(deadline, outer)
        self._context.at = deadline
        try:
            policy = dataclasses.replace(self.retry, max_tries=1) if once else self.retry
            return policy.run(what, one_try, deadline=deadline)
        finally:
            self._context.at = outer

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
