"""A replicator's setup in its target: at start-up, or in the background while the target does not answer.

:meth:`BackgroundSetup.resume` queues what a crash left unsent and cleans half-finished
steps (see :mod:`~tiered_ckpt.engine.resume`). When the target fails for a transient reason
at start-up (or did not answer a check just now), the manager still starts: the setup is
left to the replicator's thread, tried again after the policy's backoff until it succeeds,
the processes agreeing on each retry, while saves go on and queue their steps.

:class:`BackgroundSetup` is the part of :class:`~tiered_ckpt.engine.replication.Replicator`
that does this; the replicator's thread runs :meth:`BackgroundSetup._set_up_in_background`
before any step it sends.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from tiered_ckpt.dist.coordination import Coordinator, gather
from tiered_ckpt.engine.resume import resume_steps
from tiered_ckpt.errors import CheckpointError, ErrorBox, RemoteError
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.owners import Lease
from tiered_ckpt.tiers.retry import RetryPolicy
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["BackgroundSetup"]

logger = logging.getLogger("tiered_ckpt")


class BackgroundSetup:
    """Resuming a replicator's ``target`` (see the module doc); its state is the replicator's,
    guarded by ``_changed``."""

    target: Tier
    errors: ErrorBox
    last_error: tuple[float, str] | None
    newest_committed: int | None
    _store: TieredStore
    _coordinator: Coordinator
    _lease: Lease | None
    _clock: Callable[[], float]
    _backoff: RetryPolicy
    _changed: threading.Condition
    _queue: deque[int]
    _closing: bool
    _giving_up: bool
    _set_up_later: bool
    takes: Callable[[int], bool]  # whether the target takes a step (the replicator's policy)

    def resume(self, *, later: bool = False) -> list[int]:
        """Queue what a crash left unsent and clean half-finished steps (see :mod:`~tiered_ckpt.engine.resume`);
        return the steps queued. Call once, before any :meth:`submit`, on every process (it is collective).

        A transient failure of the target (or ``later``: it did not answer a check just now)
        leaves this to the replicator's thread, before any step it sends: tried again after
        the policy's backoff until it succeeds (each failure logged and shown in
        :attr:`last_error`), while :meth:`submit` queues steps as usual; no step is returned.
        """
        if not later:
            try:
                return self._resume()
            except RemoteError as exc:  # raised on every process (the collectives say so)
                if not exc.transient:
                    raise
                self.last_error = (time.time(), f"setting up {self.target.url}: {exc}")
                logger.warning("%s could not be set up at start-up (%s): trying again in the background", self, exc)
        with self._changed:
            self._set_up_later = True
            self._changed.notify_all()
        return []

    def _resume(self) -> list[int]:
        self.newest_committed, resumed = resume_steps(
            self._store, self.target, self._coordinator, self._lease, self._clock, self.takes
        )
        with self._changed:
            self._queue = deque(sorted(set(self._queue).union(resumed)))
            self._changed.notify_all()
        return resumed

    def _set_up(self) -> None:
        """Thread: :meth:`resume`, tried until it succeeds, the processes agreeing on each retry;
        given up (logged) on a failure that is not transient, or once the owner closes or gives
        up retries (the queued steps are then tried as usual)."""
        for attempt in itertools.count(1):
            try:
                self._resume()
                logger.warning("%s is set up: uploads go on", self)
                return
            except RemoteError as exc:
                failure = exc
            self.last_error = (time.time(), f"setting up {self.target.url}, try {attempt}: {failure}")
            with self._changed:
                again = failure.transient and not self._closing and not self._giving_up
            mine = _SetupView(again, failure.transient, self._backoff.delay(attempt))
            views = gather(self._coordinator, "resume: retry", _SetupView, partial(_same, mine))
            if not all(view.again for view in views):
                if failure.transient:
                    logger.warning("%s: its setup is given up (%s); queued steps are still sent", self, failure)
                else:  # access denied, no such bucket, another run's lease refused: raised by the next call
                    logger.error("%s could not be set up: %s", self, failure)
                    self.errors.put(failure)
                return
            logger.warning(
                "%s could not be set up (try %d): %s; trying again in %.1f s (saves go on meanwhile)",
                self, attempt, failure, views[0].delay,
            )  # fmt: skip
            with self._changed:
                self._changed.wait_for(lambda: self._closing or self._giving_up, views[0].delay)

    def _set_up_in_background(self) -> None:
        """Thread: :meth:`_set_up`, with any failure it raises (the processes could not agree, a
        local failure, a bug) logged and put in the error box: never lost."""
        try:
            self._set_up()
        except Exception as exc:
            failed = f"setting up {self.target.url} failed: {type(exc).__name__}: {exc}"
            error = exc if isinstance(exc, CheckpointError) else RemoteError(failed, transient=False)
            error.__cause__ = exc if error is not exc else exc.__cause__
            logger.error("%s could not be set up: %s", self, error)
            self.errors.put(error)


def _same(view: _SetupView) -> _SetupView:
    return view


@dataclass(frozen=True)
class _SetupView:
    """One process's view after a failed setup try; the leader's delay is used."""

    again: bool
    transient: bool
    delay: float
