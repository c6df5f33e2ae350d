"""A replicator's queue of waiting steps: how far it grows, which steps it supersedes, each one's outcome.

:meth:`~tiered_ckpt.engine.replication.Replicator.submit` never waits for the bucket (a save
never does): the queue is bounded by superseding its oldest waiting steps (they stay
local-only, logged, their :meth:`~UploadQueue.outcome` a transient :class:`UploadError`),
never by blocking. It holds up to ``policy.max_pending`` waiting steps with
``when_behind="skip"`` while the bucket answers; with ``"wait"``, or while the bucket is
failing (a try failed for a transient reason since its last answer, a request that got no
answer within its timeout included), up to the local tier's ``max_awaiting_upload`` (None:
every step), so that every step reaches the bucket once it answers again while they fit.
One process holding every rank drops at once in ``submit``; processes of one rank each
(whose queues must stay the same) drop together where they agree anyway (the next step,
each retry: every process keeps the steps from the oldest one any process keeps), so
between two of those points their queues may hold more. A best-effort target keeps the
older rule: ``"wait"`` blocks ``submit`` until there is room.

:class:`UploadQueue` is the part of :class:`~tiered_ckpt.engine.replication.Replicator`
that holds this policy and settles the steps' futures; the replicator's thread decides when.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from tiered_ckpt.engine.background import ErrorBox, ReportedFuture
from tiered_ckpt.engine.replication_policy import ReplicationPolicy
from tiered_ckpt.engine.sending import MemoryStep
from tiered_ckpt.errors import CheckpointError, UploadError
from tiered_ckpt.tiers.abilities import RetryingTier
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.remote.requests import Trouble
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["UploadQueue"]

logger = logging.getLogger("tiered_ckpt")


class UploadQueue:
    """The waiting steps of a replicator (``_queue``, guarded by ``_changed``), their futures
    (``_outcomes``) and the steps held in memory until settled (``_held``)."""

    target: Tier
    errors: ErrorBox
    _store: TieredStore
    _options: ReplicationPolicy
    _retrying: RetryingTier | None  # the target, if its storage fails transiently
    _changed: threading.Condition
    _queue: deque[int]
    _outcomes: dict[int, Future[None]]
    _held: dict[int, MemoryStep]
    _queued_at: dict[int, float]
    _failing: bool
    _what: str

    def outcome(self, step: int) -> Future[None]:
        """The future of ``step``'s commit in the target (call it before submitting the step).

        Its result is None once the target holds the step; its exception is the step's
        :class:`UploadError` when it will not (failed, missed its deadline, superseded, or
        this replicator closed first), or what :meth:`abandon` gave.
        """
        with self._changed:
            return self._outcomes.setdefault(step, ReportedFuture(self.errors))

    def abandon(self, step: int, error: CheckpointError) -> None:
        """``step`` will never be submitted (its save failed): its :meth:`outcome` fails with ``error``."""
        self._settle(step, error)

    def _settle(self, step: int, error: CheckpointError | None) -> None:
        with self._changed:
            future = self._outcomes.pop(step, None)
            self._held.pop(step, None)
            self._queued_at.pop(step, None)
        if future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _left_local(self, steps: Sequence[int], why: str) -> None:
        left = "stays local-only" if self._what == "upload" else f"is not in the {self.target.name} tier"
        for each in steps:
            self._settle(each, UploadError(f"step {each} {left}: {why}", step=each, tries=0, transient=True))

    def _room(self) -> float:
        """How many steps the queue holds before its oldest are superseded (see the module doc)."""
        failing = self._failing or self._trouble() is not None
        grows = failing or (not self._options.best_effort and self._options.when_behind == "wait")
        if not grows:
            return self._options.max_pending
        bound = self._store.policy(self._store.local).max_awaiting_upload
        return float("inf") if bound is None else max(bound, self._options.max_pending)

    def _behind(self) -> str:
        """Why the queue is over its room, for messages."""
        return "the bucket is failing" if self._failing or self._trouble() is not None else "uploads behind"

    def _trouble(self) -> Trouble | None:
        """The target's failing tries since its last answer (None: it answers, or its storage never
        fails transiently)."""
        return self._retrying.trouble() if self._retrying is not None else None

    def _oldest_kept(self) -> int | None:
        """Of the queue, the oldest step its room keeps (None: empty); the older ones are to be superseded."""
        with self._changed:
            room = self._room()
            if not self._queue:
                return None
            return self._queue[-int(room)] if len(self._queue) > room else self._queue[0]

    def _supersede_below(self, keep_from: int) -> None:
        """Drop the queued steps older than ``keep_from``, which every process agreed on (each
        process keeps the steps from its own queue's oldest kept one: none is dropped on one
        process and sent by another)."""
        with self._changed:
            dropped = [each for each in self._queue if each < keep_from]
            self._queue = deque(each for each in self._queue if each >= keep_from)
            self._changed.notify_all()
        if dropped:
            why = self._behind()
            logger.warning("%s: steps %s stay local-only, superseded by step %d", why, dropped, keep_from)
            self._left_local(dropped, f"{why}, superseded by step {keep_from}")
