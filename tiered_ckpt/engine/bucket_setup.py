"""A replicator's setup in its target: at start-up, or in the background while the target does not answer.

:meth:`BackgroundSetup.resume` queues what a crash left unsent and cleans half-finished
steps (see :mod:`~tiered_ckpt.engine.resume`). When the target fails for a transient reason
at start-up (or did not answer a check just now), the manager still starts: the setup is
left to the replicator's thread, tried again after the policy's backoff until it succeeds,
the processes agreeing on each retry, while saves go on and queue their steps. Each retry's
agreement bounds the queue as an upload's retries do (see :mod:`~tiered_ckpt.engine.upload_queue`:
every process keeps the steps from the oldest one any process keeps, never the newest
dropped), and settles the queued steps past their ``policy.deadline_seconds``, counted from
when each was queued: each stays local-only with a transient :class:`UploadError`, as an
upload past its deadline does, so ``wait(uploaded=True)`` returns while the setup retries.
A step still queued when the setup succeeds gets its whole deadline for its upload.

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
from tiered_ckpt.engine.background import ErrorBox
from tiered_ckpt.engine.replication_policy import ReplicationPolicy
from tiered_ckpt.engine.resume import resume_steps
from tiered_ckpt.errors import CheckpointError, RemoteError, UploadError
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.remote.leases import Lease
from tiered_ckpt.tiers.remote.retry import RetryPolicy
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
    _queued_at: dict[int, float]  # when each queued step was queued (time.monotonic)
    _options: ReplicationPolicy
    _closing: bool
    _giving_up: bool
    _set_up_later: bool
    takes: Callable[[int], bool]  # whether the target takes a step (the replicator's policy)
    _failed: Callable[[UploadError], None]  # logs a step's failure and puts it in the error box
    _settle: Callable[[int, CheckpointError | None], None]  # see UploadQueue
    _oldest_kept: Callable[[], int | None]  # see UploadQueue
    _supersede_below: Callable[[int], None]  # see UploadQueue

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
            now = time.monotonic()
            for step in resumed:
                self._queued_at.setdefault(step, now)
            self._changed.notify_all()
        return resumed

    def _set_up(self) -> None:
        """Thread: :meth:`resume`, tried until it succeeds, the processes agreeing on each retry;
        given up (logged) on a failure that is not transient, or once the owner closes or gives
        up retries (the queued steps are then tried as usual)."""
        for attempt in itertools.count(1):
            if attempt > 1 and self._stopping():
                logger.warning("%s: its setup is given up (closing); queued steps are still sent", self)
                return
            try:
                self._resume()
                logger.warning("%s is set up: uploads go on", self)
                return
            except RemoteError as exc:
                failure = exc
            self.last_error = (time.time(), f"setting up {self.target.url}, try {attempt}: {failure}")
            with self._changed:
                again = failure.transient and not self._closing and not self._giving_up
            mine = _SetupView(
                again, failure.transient, self._backoff.delay(attempt), self._oldest_kept() or 0, self._overdue()
            )
            views = gather(self._coordinator, "resume: retry", _SetupView, partial(_same, mine))
            self._miss_deadlines(max(view.overdue for view in views), failure)
            self._supersede_below(min(view.keep_from for view in views))
            if not all(view.again for view in views):
                if failure.transient:
                    logger.warning("%s: its setup is given up (%s); queued steps are still sent", self, failure)
                else:  # access denied, no such bucket, another run's lease refused: raised by the next call
                    logger.error("%s could not be set up: %s", self, failure)
                    self.errors.put(failure)
                return
            logger.warning(
                "%s could not be set up (try %d): %s; trying again in %.1f s (saves go on meanwhile)",
                self,
                attempt,
                failure,
                views[0].delay,
            )
            with self._changed:
                self._changed.wait_for(lambda: self._closing or self._giving_up, views[0].delay)

    def _stopping(self) -> bool:
        """Whether any process is closing or giving up retries (one collective, so that every
        process skips the next try together: a close during the backoff starts no new try)."""
        with self._changed:
            mine = _Stopping(self._closing or self._giving_up)
        return any(view.stopping for view in gather(self._coordinator, "resume: stop", _Stopping, lambda: mine))

    def _overdue(self) -> int:
        """The newest queued step past its deadline, counted from when it was queued (0: none)."""
        limit = self._options.deadline_seconds
        with self._changed:
            now = time.monotonic()
            late = [step for step in self._queue if limit is not None and now - self._queued_at.get(step, now) >= limit]
        return max(late, default=0)

    def _miss_deadlines(self, through: int, failure: RemoteError) -> None:
        """Settle the queued steps up to ``through`` (which every process agreed is past its
        deadline) as an upload past its deadline is: local-only, a transient :class:`UploadError`."""
        with self._changed:
            missed = [step for step in self._queue if step <= through]
        for step in missed:
            error = UploadError(
                f"step {step} was not committed at {self.target.url} within its deadline of "
                f"{self._options.deadline_seconds} s (upload.deadline_seconds) while the bucket could not "
                f"be set up: it stays local-only and the next step goes on; the last failure: {failure}",
                step=step,
                tries=0,
                transient=True,
            )
            error.__cause__ = failure
            self._failed(error)
            self._settle(step, error)
        with self._changed:  # once their errors are in the box: a wait(uploaded=True) woken now raises them
            self._queue = deque(step for step in self._queue if step > through)
            self._changed.notify_all()

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
    keep_from: int = 0  # the oldest queued step this process keeps (0: all of them)
    overdue: int = 0  # the newest queued step past its deadline (0: none)


@dataclass(frozen=True)
class _Stopping:
    """Whether one process is closing (or giving up retries) before the setup's next try."""

    stopping: bool
