"""Preemption notices: signal handlers that only note the signal, for the training loop to ask about.

On spot or preemptible capacity a job is sent a signal (SIGTERM, usually) and given a
grace period. A handler runs between two bytecodes of the main thread, wherever the
training loop is, so it must not save, log or take a lock there (the loop may hold
that lock, or be halfway through a collective): :class:`PreemptionNotice` only records
the signal. :meth:`CheckpointManager.reached_preemption` reads it at a step boundary.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .coordination import Coordinator, exchange
from .errors import UsageError

__all__ = ["PreemptionNotice", "PreemptionWatch"]

logger = logging.getLogger("tiered_ckpt")


class PreemptionNotice:
    """Handlers for ``signals`` that record the first one received.

    The handler a signal had before is called after ours when it is a Python function
    (so a framework's own handler still runs); the default action and "ignore" are
    not (the point is to survive the signal and save). :meth:`close` puts the previous
    handlers back, unless something else replaced ours since. Handlers can only be
    installed from the main thread (:class:`UsageError` otherwise).
    """

    def __init__(self, signals: Iterable[int | signal.Signals] = ()) -> None:
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        chosen = [_as_signal(each) for each in signals]
        if chosen and threading.current_thread() is not threading.main_thread():
            raise UsageError("preemption_signals: signal handlers can only be installed from the main thread")
        try:
            for each in chosen:
                self._previous[each] = signal.signal(each, self._handle)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        names = ", ".join(each.name for each in self._previous)
        return f"PreemptionNotice([{names}], received={self.received.name if self.received else None})"

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        return tuple(self._previous)

    @property
    def received(self) -> signal.Signals | None:
        """The first signal received since the handlers were installed, or None."""
        return self._received

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._received is None:
            self._received = signal.Signals(signum)
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    def close(self) -> None:
        """Put back the handlers that were installed before ours (where ours is still installed)."""
        previous, self._previous = self._previous, {}
        for each, handler in previous.items():
            try:
                if signal.getsignal(each) == self._handle:
                    signal.signal(each, handler if handler is not None else signal.SIG_DFL)
            except ValueError:  # not the main thread: ours stays installed, and only notes a signal
                pass


@dataclass(frozen=True)
class _Report:
    """One process's answer at a step boundary: the step it is at, and the signal it received."""

    step: int
    signal: str | None


class PreemptionWatch:
    """Turns a :class:`PreemptionNotice` into the step at which every rank stops.

    With one process per rank, :meth:`reached` is a collective on ``coordinator`` (a
    channel of its own, so it never meets the writer's or the training loop's
    collectives): one small all-gather per call.
    """

    def __init__(self, notice: PreemptionNotice, coordinator: Coordinator, on_reached: Callable[[int], None]) -> None:
        self._notice = notice
        self._coordinator = coordinator
        self._on_reached = on_reached
        self.step: int | None = None

    def reached(self, step: int) -> bool:
        """True on every rank, at the same call, once any rank has received a preemption signal.

        Stays True once it was. Raises :class:`UsageError` on every rank if the ranks
        asked at different steps.
        """
        if self.step is not None:
            return True
        received = self._notice.received
        reports = exchange(self._coordinator, _Report, lambda: _Report(step, received.name if received else None))
        steps = sorted({report.step for report in reports})
        if len(steps) > 1:
            raise UsageError(f"reached_preemption: the ranks asked at different steps {steps}")
        signalled = {rank: report.signal for rank, report in enumerate(reports) if report.signal is not None}
        if not signalled:
            return False
        self.step = step
        logger.warning("preemption (%s): every rank stops at step %d", signalled, step)
        self._on_reached(step)
        return True


def _as_signal(value: int | signal.Signals) -> signal.Signals:
    try:
        if isinstance(value, bool):
            raise ValueError
        chosen = signal.Signals(value)
    except (ValueError, TypeError):
        raise UsageError(f"preemption_signals: {value!r:.40} is not a signal number") from None
    if chosen in (signal.SIGKILL, signal.SIGSTOP):
        raise UsageError(f"preemption_signals: {chosen.name} cannot be caught")
    return chosen
