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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from tiered_ckpt.dist.coordination import Coordinator, gather
from tiered_ckpt.errors import UsageError

__all__ = ["Preemption", "PreemptionNotice", "PreemptionWatch"]

logger = logging.getLogger("tiered_ckpt")


class _Dispatcher:
    """The one handler of one signal in this process, shared by every notice of that signal.

    Installed when the first notice registers, over the handler the signal had then
    (``previous``); put back when the last one goes, whatever order the notices went in.
    Handling a signal, it notes it in every registered notice, then chains to
    ``previous`` if that is a Python function of someone else's; not to the default
    action (``SIG_DFL``, or SIGINT's ``KeyboardInterrupt``): a notice replaces it.
    With no notice left (the last one closed off the main thread, or a handler
    installed over ours since chains to us), it acts as ``previous`` would have.
    """

    def __init__(self, signum: signal.Signals) -> None:
        self.signum = signum
        self.previous: Any = signal.SIG_DFL
        self.notices: tuple[PreemptionNotice, ...] = ()  # replaced whole, never mutated: the handler reads it unlocked

    def handle(self, signum: int, frame: FrameType | None) -> None:
        notices = self.notices
        for notice in notices:
            notice._note(self.signum)
        previous = self.previous
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)
        elif not notices:
            _act_as(previous, signum, frame)


def _act_as(handler: Any, signum: int, frame: FrameType | None) -> None:
    """Do what ``handler`` (a signal's handler before ours) does with the signal, from a handler (the main thread)."""
    if handler is signal.SIG_IGN:
        return
    if callable(handler):  # SIGINT's default_int_handler: KeyboardInterrupt
        handler(signum, frame)
        return
    current = signal.signal(signum, signal.SIG_DFL)
    try:
        signal.raise_signal(signum)  # the default action: for SIGTERM the process ends here, killed by the signal
    finally:
        signal.signal(signum, current)  # a signal whose default is to stop or to do nothing gets back its handler


# One dispatcher per signal, process-wide; changed (under the lock) only by registering and
# closing notices. Signal handlers never take the lock: they run on the main thread, which may hold it.
_dispatchers: dict[signal.Signals, _Dispatcher] = {}
_lock = threading.Lock()


def _register(notice: PreemptionNotice, signum: signal.Signals) -> None:
    with _lock:
        dispatcher = _dispatchers.get(signum)
        if dispatcher is None:
            dispatcher = _Dispatcher(signum)
            previous = signal.signal(signum, dispatcher.handle)
            stale = getattr(previous, "__self__", None)
            if isinstance(stale, _Dispatcher):  # left installed by a close off the main thread: take its place
                previous = stale.previous
            dispatcher.previous = previous if previous is not None else signal.SIG_DFL  # None: set from C
            _dispatchers[signum] = dispatcher
        dispatcher.notices = (*dispatcher.notices, notice)


def _unregister(notice: PreemptionNotice, signum: signal.Signals) -> None:
    with _lock:
        dispatcher = _dispatchers.get(signum)
        if dispatcher is None or notice not in dispatcher.notices:
            return
        dispatcher.notices = tuple(each for each in dispatcher.notices if each is not notice)
        if dispatcher.notices:
            return
        del _dispatchers[signum]  # a later notice installs a dispatcher of its own
        try:
            if signal.getsignal(signum) == dispatcher.handle:
                signal.signal(signum, dispatcher.previous)
        except ValueError:  # not the main thread: ours stays installed, and acts as the previous handler
            pass


class PreemptionNotice:
    """Notes the first of ``signals`` this process receives, for the training loop to ask about.

    Every notice of a signal shares one process-wide handler, installed over the handler
    the signal had before the first notice and put back once the last notice is closed,
    in whatever order notices are closed (unless something else replaced ours since: that
    handler is left alone). The handler a signal had before is called after ours when it
    is a Python function of someone else's (so a framework's own handler still runs);
    the default action (``SIG_DFL``, SIGINT's ``KeyboardInterrupt``) and "ignore" are not:
    the point is to survive the signal and save. Handlers can only be installed from the
    main thread (:class:`UsageError` otherwise).
    """

    def __init__(self, signals: Iterable[signal.Signals] = ()) -> None:
        self._received: signal.Signals | None = None
        self._signals: tuple[signal.Signals, ...] = ()
        chosen = list(dict.fromkeys(signals))  # checked by RuntimeOptions
        if chosen and threading.current_thread() is not threading.main_thread():
            raise UsageError("preemption_signals: signal handlers can only be installed from the main thread")
        try:
            for each in chosen:
                _register(self, each)
                self._signals = (*self._signals, each)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        names = ", ".join(each.name for each in self._signals)
        return f"PreemptionNotice([{names}], received={self.received.name if self.received else None})"

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        """The signals this notice is registered for (none once closed)."""
        return self._signals

    @property
    def received(self) -> signal.Signals | None:
        """The first signal received since the handlers were installed, or None."""
        return self._received

    def _note(self, signum: signal.Signals) -> None:
        if self._received is None:
            self._received = signum

    def close(self) -> None:
        """Stop noting signals; the last notice of a signal to close puts its previous handler back. Idempotent."""
        signals, self._signals = self._signals, ()
        for each in signals:
            _unregister(self, each)


@dataclass(frozen=True)
class _Report:
    """One process's answer at a step boundary: the step it is at, and the signal it received."""

    step: int
    signal: str | None


@dataclass(frozen=True)
class Preemption:
    """What :meth:`PreemptionWatch.reached` found at a step boundary, the same on every rank.

    ``stop``: every rank stops at this step (and at every later call). ``new``: this is the
    call that found the notice (the caller acts on it once, e.g. puts the newest upload
    first). ``signals``: by rank, the signal each received (at that call; empty before it
    and after it).
    """

    stop: bool
    new: bool = False
    signals: Mapping[int, str] = field(default_factory=dict)


class PreemptionWatch:
    """Turns a :class:`PreemptionNotice` into the step at which every rank stops.

    With one process per rank, :meth:`reached` is a collective on ``coordinator`` (a
    channel of its own, so it never meets the writer's or the training loop's
    collectives): one small all-gather per call.
    """

    def __init__(self, notice: PreemptionNotice, coordinator: Coordinator) -> None:
        self._notice = notice
        self._coordinator = coordinator
        self.step: int | None = None

    def reached(self, step: int) -> Preemption:
        """Whether every rank stops at ``step``: at the same call on every rank, once any rank
        has received a preemption signal; from then on at every call, without a collective.

        Raises :class:`UsageError` on every rank if the ranks asked at different steps.
        """
        if self.step is not None:
            return Preemption(stop=True)
        received = self._notice.received
        report = _Report(step, received.name if received else None)
        reports = gather(self._coordinator, "reached_preemption", _Report, lambda: report)
        steps = sorted({report.step for report in reports})
        if len(steps) > 1:
            raise UsageError(f"reached_preemption: the ranks asked at different steps {steps}")
        signalled = {rank: report.signal for rank, report in enumerate(reports) if report.signal is not None}
        if not signalled:
            return Preemption(stop=False)
        self.step = step
        logger.warning("preemption (%s): every rank stops at step %d", signalled, step)
        return Preemption(stop=True, new=True, signals=signalled)
