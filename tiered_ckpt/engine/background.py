"""Background plumbing: where background threads leave their failures until a caller's thread
raises them (:class:`ErrorBox`), and the futures whose errors count as raised once a caller
has seen them (:class:`ReportedFuture`)."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from concurrent.futures import Future
from typing import TypeVar

from tiered_ckpt.errors import CheckpointError, UploadError

__all__ = ["ErrorBox", "ReportedFuture"]

_T = TypeVar("_T")


class ReportedFuture(Future[_T]):
    """A future whose error, once raised by :meth:`result`, counts as raised for ``box``: the
    manager's next call does not raise it a second time."""

    def __init__(self, box: ErrorBox) -> None:
        super().__init__()
        self._box = box

    def result(self, timeout: float | None = None) -> _T:
        try:
            return super().result(timeout)
        except CheckpointError as error:
            # Only one waiting in the box: a future's error was put there first, or never is
            # (a step left local-only by the queue), and asking twice is no second report.
            self._box.mark_raised(error, expected=False)
            raise


class ErrorBox:
    """Where background threads leave their failures until a caller's thread raises them.

    Each failure is raised once: :meth:`raise_first` raises the oldest one not yet
    raised. A failure raised by another path (``SaveHandle.wait``, or another rank's copy
    raised inside a collective) is passed to :meth:`mark_raised`: it is then dropped if
    it is waiting here, or, if it has not arrived yet, dropped when it arrives. Two
    errors are the same failure when they are the same object, or upload failures of
    the same step. Thread-safe; never calls back into its owner.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[CheckpointError] = []
        self._expected: set[Hashable] = set()  # raised already; their own copy is still to come

    @staticmethod
    def _key(error: CheckpointError) -> Hashable:
        return ("upload", error.step) if isinstance(error, UploadError) else id(error)

    def put(self, error: CheckpointError) -> None:
        """Record a background failure."""
        with self._lock:
            key = self._key(error)
            if key in self._expected:
                self._expected.discard(key)
            else:
                self._errors.append(error)

    def mark_raised(self, error: CheckpointError, *, expected: bool = True) -> None:
        """Note that ``error`` reached the caller another way, so it is not raised here again:
        it is forgotten if it waits here, else (an :class:`UploadError`, with ``expected``) it
        is not taken when it comes."""
        with self._lock:
            key = self._key(error)
            waiting = [pending for pending in self._errors if self._key(pending) == key]
            if waiting:
                self._errors.remove(waiting[0])
            elif expected and isinstance(error, UploadError):
                self._expected.add(key)

    def raise_first(self, *, transient: bool = True) -> None:
        """Raise the oldest failure not yet raised, if any (and forget it); ``transient=False``
        passes over the upload failures that only missed their deadline (see :class:`UploadError`)."""
        with self._lock:
            chosen = [error for error in self._errors if transient or not _missed_deadline(error)]
            if chosen:
                self._errors.remove(chosen[0])
        if chosen:
            raise chosen[0]

    def take_transient(self) -> list[UploadError]:
        """Remove and return the upload failures that only missed their deadline, oldest first."""
        with self._lock:
            taken = [error for error in self._errors if _missed_deadline(error)]
            self._errors = [error for error in self._errors if not _missed_deadline(error)]
        return taken  # type: ignore[return-value]


def _missed_deadline(error: CheckpointError) -> bool:
    return isinstance(error, UploadError) and error.transient
