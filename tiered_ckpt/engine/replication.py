"""The replication engine: steps committed in the first tier are committed in a later one, in order.

A :class:`Replicator` is the stage between this node's disk and one later tier (the writer
commits a step locally, or holds it in memory, and submits it here), as a
:class:`ReplicationPolicy` says. It owns what happens to a step after its local commit:

1. :meth:`Replicator.resume` (at start-up, collective; see :mod:`~tiered_ckpt.engine.resume`):
   queue the local steps a crash kept from their commit in the target, and remove what
   half-finished steps left there;
2. for each queued step, on the replicator's thread: land every shard of this process's
   ``ranks`` not already there intact, ``policy.concurrency`` at a time, each confirmed;
3. wait until every process has landed its ranks' shards (a collective on the replicator's
   own channel: a failure on any rank fails the step on every rank);
4. commit the step in the target (see :mod:`~tiered_ckpt.engine.sending`); every process
   writes the local receipt of a durable target's commit;
5. retention after the commit (:mod:`~tiered_ckpt.tiers.pruning`): the leader's of the
   target (a bucket's: not while another run's lease is live), every process's of its
   local tier, keeping the steps still queued for any replicator sharing the
   :class:`Backlog` (steps the target now holds are no longer protected).

A step whose landing or commit still fails for a transient reason (the target is
unreachable or failing) after the target's own retries is tried again as a whole, after
``policy.retry``'s capped backoff, until ``policy.deadline_seconds`` after it began;
shards already there intact are not sent again. Every failed try is logged (WARNING) and
shown by :meth:`Replicator.retrying` and ``last_error``. A step that misses its deadline
stays local-only, the queue moves on, and its :class:`UploadError` has ``transient=True``
(``wait(uploaded=True)`` raises it; ``save`` and ``close`` do not). Any other failure
(access denied, a local I/O error, a bug) has ``transient=False``, is logged at once and
raised by the owner's next call. Both go to the shared :class:`~tiered_ckpt.engine.background.ErrorBox`
(cause chained); the local copy is kept. The processes agree on every retry (one small
collective), so they try, wait and give up together.

:meth:`Replicator.submit` never waits for the bucket (a save never does): its queue is
bounded by superseding its oldest waiting steps, never by blocking, and holds more while the
bucket is failing (see :mod:`~tiered_ckpt.engine.upload_queue`). When the target does not
answer at start-up, it is set up in the background (see :mod:`~tiered_ckpt.engine.bucket_setup`).

The bucket's trouble shows at once: :meth:`Replicator.retrying` names the step being sent
from the first failed try of one of its requests (each one logged by the retry policy).

A best-effort ``policy`` (a partner's memory; a step it drops "is not in the peer tier")
logs its failures in ``last_error``, never in the error box, and never retries; a failure
that is not transient (a partner that gave no answer in time, seen by every process at
the same step) gives the target up for the run: every process proposes it with its next
step, and all drop their queues and send no later step (``given_up``).

After :meth:`Replicator.preempt` (a preemption notice: the job has seconds to minutes
left), the newest queued step goes next, the older queued ones are dropped (superseded),
and :meth:`Replicator.submit` no longer waits for room; a step being replicated is finished
first. The processes pick each next step together (one small collective): each proposes
its oldest queued step, or its newest once preempted, and the oldest proposal wins, so
every process replicates the same step while their queues and notices differ for a moment.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from tiered_ckpt.dist.coordination import Coordinator, SingleProcessCoordinator, gather
from tiered_ckpt.engine.background import ErrorBox
from tiered_ckpt.engine.bucket_setup import BackgroundSetup
from tiered_ckpt.engine.replication_policy import Backlog, ReplicationPolicy, WhenBehind
from tiered_ckpt.engine.sending import MemoryStep, Sender
from tiered_ckpt.engine.upload_queue import UploadQueue
from tiered_ckpt.errors import (
    RemoteError,
    Retryable,
    StorageError,
    UploadError,
    UsageError,
    as_upload_error,
)
from tiered_ckpt.tiers.abilities import leases_of, retries_of
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.remote.leases import Lease, OwnershipPolicy
from tiered_ckpt.tiers.remote.retry import RetryPolicy
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Replicator", "ReplicationPolicy", "WhenBehind"]

logger = logging.getLogger("tiered_ckpt")

RATE_WINDOW = 5  # remote commits the upload rate is measured over


class Replicator(UploadQueue, BackgroundSetup):
    """One background thread that lands and commits queued steps of ``store``'s first tier in ``target``.

    ``target`` is one of ``store``'s later tiers (default: the first with receipts, the bucket); ``ranks`` are the ranks
    whose shards this process sends (default: all); ``coordinator`` is a channel no other
    thread uses. Failures go to ``errors``; retention after each commit weighs the queues of
    every replicator sharing ``backlog`` (one per store). ``ownership`` says how the leader
    holds its lease on the bucket; ``clock`` (Unix times) dates leases and open uploads."""

    def __init__(
        self,
        store: TieredStore,
        target: Tier | None = None,
        *,
        policy: ReplicationPolicy | None = None,
        errors: ErrorBox | None = None,
        coordinator: Coordinator | None = None,
        ranks: Sequence[int] | None = None,
        ownership: OwnershipPolicy | None = None,
        clock: Callable[[], float] = time.time,
        backlog: Backlog | None = None,
    ) -> None:
        target = target or next((tier for tier in store.later if tier.capabilities.receipts), None)
        if target is None or target not in store.later:
            raise UsageError("a replicator needs a target among the store's later tiers (remote.url)")
        self._store = store
        self.target = target
        self._options = policy or ReplicationPolicy()
        self._retrying = retries_of(target)
        self._backoff = self._options.retry or (self._retrying.retry if self._retrying is not None else RetryPolicy())
        self.errors = errors or ErrorBox()
        self._coordinator = coordinator or SingleProcessCoordinator(1)
        self._ranks = ranks
        self._clock = clock
        leased = leases_of(target)  # the leader's lease, held from resume() or push()
        self._lease = Lease(leased, ownership, clock=clock) if leased is not None else None
        self._sender = Sender(store, target, self._coordinator, ranks, self._options.concurrency, self._lease)
        self._queue: deque[int] = deque()
        self._queued_at: dict[int, float] = {}  # when each queued step was queued (see bucket_setup)
        self._outcomes: dict[int, Future[None]] = {}  # see outcome(); settled ones are dropped
        self._held: dict[int, MemoryStep] = {}  # the steps queued from memory, until settled
        self._active: int | None = None
        self._closing = False
        self._preempted = False
        self._changed = threading.Condition()
        self.newest_committed: int | None = None  # the newest remote commit this uploader knows of
        self._commits: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)  # (bytes, seconds) of recent commits
        self.last_error: tuple[float, str] | None = None  # (Unix time, message) of the last failure
        self._failing = False  # a try failed for a transient reason and no commit succeeded since
        self._retry: tuple[int, int] | None = None  # (step, tries so far) of a step being retried
        self._giving_up = False  # see give_up_retries
        self._set_up_later = False  # resume() is left to the thread (see resume)
        self.given_up: str | None = None  # why a best-effort target gets no more steps (see _give_up)
        self._giving_up_on: str | None = None  # a failure that gives it up, not yet agreed
        self.backlog = backlog or Backlog()
        self.backlog.add(target.name, self.pending)
        bucket = target.capabilities.receipts  # the copy a later run resumes from: an upload
        self._what = "upload" if bucket else f"copy to the {target.name} tier"
        name = "tiered-ckpt-uploader" if bucket else f"tiered-ckpt-to-{target.name}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Replicator({self._store.local.url!r} -> {self.target.url!r})"

    # -- the owner's side -------------------------------------------------------------------

    def takes(self, step: int) -> bool:
        """Whether ``step`` goes to the target by the policy's ``every`` (the same on every process,
        whatever each has seen: a step submitted after the target was given up is settled at once)."""
        return step % self._options.every == 0

    def submit(self, step: int, *, bounded: bool = True, held: MemoryStep | None = None) -> None:
        """Queue ``step`` (committed locally, or ``held`` in memory) for upload; see
        :mod:`~tiered_ckpt.engine.upload_queue` for a full queue. ``bounded=False`` queues it
        whatever the queue holds (steps resumed at start-up).
        """
        one_process = len(self._coordinator.local_ranks) == self._coordinator.world_size
        with self._changed:
            if self._closing:
                raise UsageError(f"{self!r} is closed")
            if self.given_up is not None:
                return self._settle(step, self._not_sent(step))
            while bounded and not self._preempted and len(self._queue) >= self._room():
                if not one_process and not self._options.best_effort:
                    break  # processes of one rank each drop together (see _next_step and _agree_on_retry)
                waits = self._options.when_behind == "wait" and not (self._failing and one_process)
                if self._options.best_effort and waits:
                    self._changed.wait()
                    continue
                skipped = self._queue.popleft()
                why = self._behind()
                logger.warning("%s: step %d stays local-only, superseded by step %d", why, skipped, step)
                self._left_local([skipped], f"{why}, superseded by step {step}")
            self._queue.append(step)
            self._queued_at.setdefault(step, time.monotonic())
            if held is not None:
                self._held[step] = held
            self._changed.notify_all()

    def retrying(self) -> tuple[int, int] | None:
        """The step whose upload is being tried again after a transient failure (of the step, or of
        one of its requests, from the first one on), and the requests tried for it so far that
        failed (None: no step is)."""
        trouble = self._trouble()
        with self._changed:
            if self._retry is not None:
                step, tries = self._retry
                return step, tries + (trouble.failures if trouble is not None else 0)
            if self._active is not None and trouble is not None:
                return self._active, trouble.failures
            return None

    def last_failure(self) -> tuple[float, str] | None:
        """(Unix time, message) of the last failure: of a try of a step (:attr:`last_error`), or of
        one of the bucket's requests since it last answered, whichever came later."""
        trouble = self._trouble()
        failed = self.last_error
        if trouble is not None and (failed is None or failed[0] < trouble.since):
            tries = f"{trouble.failures} {'try' if trouble.failures == 1 else 'tries'} since its last answer"
            return trouble.since, f"the bucket is failing ({tries}): {trouble.last}"
        return failed

    def preempt(self) -> None:
        """From now on, upload the newest queued step first and drop the older ones (see the module doc)."""
        with self._changed:
            self._preempted = True
            self._changed.notify_all()

    def give_up_retries(self) -> None:
        """From now on a step whose try fails for a transient reason is not tried again (it stays
        local-only at once): a job leaving on an error does not wait for its bucket to come back."""
        with self._changed:
            self._giving_up = True
            self._changed.notify_all()

    def pending(self) -> list[int]:
        """Steps queued or being uploaded."""
        with self._changed:
            return ([self._active] if self._active is not None else []) + list(self._queue)

    def wait(self) -> None:
        """Block until every queued step is committed remotely or has failed."""
        with self._changed:
            while self._queue or self._active is not None:
                self._changed.wait()

    def close(self) -> None:
        """Finish every queued upload, then stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        with self._changed:
            unsettled = list(self._outcomes)
        self._left_local(unsettled, f"{self!r} closed before it was sent")
        if self._lease is not None:
            self._lease.release()

    # -- the uploader thread ----------------------------------------------------------------

    def upload_rate(self) -> float | None:
        """Bytes per second of the last remote commits (None before the first)."""
        with self._changed:
            commits = list(self._commits)
        seconds = sum(seconds for _bytes, seconds in commits)
        return round(sum(size for size, _seconds in commits) / seconds, 1) if commits and seconds > 0 else None

    def _failed(self, error: UploadError) -> None:
        self.last_error = (time.time(), str(error))
        if self._options.best_effort:
            logger.warning("%s", error)
            return
        if error.transient:
            logger.warning("%s", error)
        else:
            logger.error("%s", error)
        self.errors.put(error)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closing and not self._set_up_later:
                    self._changed.wait()
                set_up, self._set_up_later = self._set_up_later, False
            if set_up:
                self._set_up_in_background()
                continue
            with self._changed:
                if not self._queue:
                    return
                kept = self._oldest_kept()
                proposal = self._queue[-1] if self._preempted or kept is None else kept
            try:
                chosen = self._next_step(proposal)
            except BaseException as exc:  # the processes could not agree: every one records it, none goes on
                error = as_upload_error(proposal, exc, what=self._what)
                self._failed(error)
                with self._changed:
                    dropped = list(self._queue)
                    self._queue.clear()
                    self._changed.notify_all()
                for each in dropped:
                    self._settle(each, error)
                continue
            if chosen is None:
                continue
            step = chosen
            try:
                try:
                    self._upload(step)
                finally:
                    self._sender.forget(step)  # a step given up keeps nothing for the process's life
                self._settle(step, None)
            except BaseException as exc:  # a remote failure, a local I/O error or a bug: never lost silently
                error = as_upload_error(step, exc, what=self._what)
                self._failed(error)
                self._settle(step, error)
                permanent = isinstance(exc, StorageError) and isinstance(exc, Retryable) and not exc.transient
                if self._options.best_effort and permanent:
                    self._giving_up_on = str(error)  # proposed with the next step (see _next_step)
            finally:
                with self._changed:
                    self._active = None
                    self._retry = None
                    self._changed.notify_all()

    def _give_up(self, reason: str) -> None:
        """Stop sending to a best-effort target whose storage is gone for the run (a partner that
        gave no answer in time): the queue is dropped and no later step is taken."""
        logger.warning("%r: no more copies for the rest of the run: %s", self, reason)
        with self._changed:
            self.given_up = reason
            dropped = list(self._queue)
            self._queue.clear()
            self._changed.notify_all()
        for each in dropped:
            self._settle(each, self._not_sent(each))

    def _not_sent(self, step: int) -> UploadError:
        return UploadError(f"step {step} is not sent: {self.given_up}", step=step, tries=0, transient=True)

    def _next_step(self, proposal: int) -> int | None:
        """Agree with the other processes on the next step; take it (and the older ones it supersedes)
        off the queue. None: a process gave a best-effort target up, and every one does so now."""
        mine = _Proposal(proposal, self._giving_up_on)
        proposals = gather(self._coordinator, "next step", _Proposal, lambda: mine)
        reasons = [each.give_up for each in proposals if each.give_up is not None]
        if reasons:
            self._give_up(mine.give_up or f"another rank gave it up: {reasons[0]}")
            return None
        step = min(each.step for each in proposals)
        with self._changed:
            superseded = [each for each in self._queue if each < step]
            self._queue = deque(each for each in self._queue if each > step)
            self._active = step
            self._changed.notify_all()
        if superseded:
            why = "preemption" if self._preempted else self._behind()
            logger.warning("%s: steps %s stay local-only, superseded by step %d", why, superseded, step)
            self._left_local(superseded, f"{why}, superseded by step {step}")
        return step

    def _upload(self, step: int) -> None:
        """Put and commit ``step``, trying it again after transient failures until its deadline
        (see the module doc); raises :class:`UploadError` if it is not committed."""
        started = time.monotonic()
        limit = self._options.deadline_seconds
        deadline = started + limit if limit is not None else None
        tries = 0
        for attempt in itertools.count(1):
            try:
                self._put_and_commit(step, deadline)
            except RemoteError as exc:
                tries += exc.tries
                failure = exc
            else:
                with self._changed:
                    self._failing = False
                    self._changed.notify_all()
                return
            again, transient, superseded, delay = self._agree_on_retry(step, failure, attempt, deadline)
            if transient:
                with self._changed:
                    self._failing = True
                    self._retry = (step, tries)
                    self._changed.notify_all()
            self.last_error = (time.time(), f"upload of step {step}, try {attempt}: {failure}")
            if superseded:
                logger.warning(
                    "upload of step %d failed (%s); after the preemption notice it stays local-only, "
                    "superseded by a newer step",
                    step,
                    failure,
                )
                self._left_local([step], "preemption, superseded by a newer step")  # its future fails, not _run's
                return
            if not again:
                break
            left = f"its deadline in {deadline - time.monotonic():.0f} s" if deadline is not None else "no deadline"
            logger.warning(
                "upload of step %d failed (try %d, %d requests tried): %s; trying again in %.1f s (%s)",
                step,
                attempt,
                tries,
                failure,
                delay,
                left,
            )
            with self._changed:  # a preemption notice cuts the wait short (the step may be superseded)
                self._changed.wait_for(
                    lambda: self._giving_up or (self._preempted and any(s > step for s in self._queue)), delay
                )
        if not transient:
            raise as_upload_error(step, failure, tries)
        why = (
            "before the manager closed on an error"
            if self._giving_up
            else f"within its deadline of {limit} s (upload.deadline_seconds)"
        )
        raise UploadError(
            f"step {step} was not committed at {self._sender.where(step)} {why} "
            f"({time.monotonic() - started:.1f} s and {tries} tries since its upload began): "
            f"it stays local-only and the next step goes on; the last failure: {failure}",
            step=step,
            tries=tries,
            transient=True,
        ) from failure

    def _agree_on_retry(
        self, step: int, failure: RemoteError, attempt: int, deadline: float | None
    ) -> tuple[bool, bool, bool, float]:
        """After a failed try of ``step``, what every process does (one collective): whether to try
        again, whether every failure was transient (or the deadline's), whether a preemption
        notice superseded the step, and how long to wait (the leader's draw)."""
        delay = self._backoff.delay(attempt)
        transient = failure.transient or failure.deadline
        in_time = not self._giving_up and (deadline is None or time.monotonic() + delay < deadline)
        with self._changed:
            superseded = self._preempted and any(each > step for each in self._queue)
        again = failure.transient and not failure.deadline and in_time
        mine = _RetryView(again, transient, superseded, delay, self._oldest_kept() or 0)
        views = gather(self._coordinator, "retry", _RetryView, lambda: mine)
        self._supersede_below(min(view.keep_from for view in views))
        transient_everywhere = all(view.transient for view in views)
        return (
            all(view.again for view in views),
            transient_everywhere,
            transient_everywhere and any(view.superseded for view in views),
            float(views[0].delay),
        )

    def _put_and_commit(self, step: int, deadline: float | None) -> None:
        started = time.monotonic()
        with self._changed:
            held = self._held.get(step)
        sent = self._sender.send(step, deadline, held)
        self.newest_committed = max(self.newest_committed or 0, step)
        seconds = time.monotonic() - started
        with self._changed:
            self._commits.append((sent, seconds))
        logger.info(
            "step %d committed at %s: %d bytes from this process in %.2f s (%.1f MB/s)",
            step,
            self._sender.where(step),
            sent,
            seconds,
            sent / max(seconds, 1e-9) / 1e6,
        )
        self._sender.retain(step, self.backlog.pending())


@dataclass(frozen=True)
class _Proposal:
    """The step one process would upload next, and why it gives a best-effort target up (None: it does not)."""

    step: int
    give_up: str | None = None


@dataclass(frozen=True)
class _RetryView:
    """One process's view after a failed try (see :meth:`Replicator._agree_on_retry`); the leader's delay is used."""

    again: bool
    transient: bool
    superseded: bool
    delay: float
    keep_from: int = 0  # the oldest queued step this process keeps (0: all of them)
