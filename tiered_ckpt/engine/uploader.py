"""The background upload queue: locally committed steps go to the remote tier, in order.

The uploader owns everything that happens to a step after its local commit:

1. :meth:`Uploader.resume` (at start-up): take this run's lease on the URL (see
   :mod:`~tiered_ckpt.tiers.owners`), queue the local steps a crash kept from their remote
   commit (mending lost receipts), and, unless another live run holds a lease there,
   remove half-uploaded steps from the bucket and abort multipart uploads left open past
   the orphan age (the leader does, once every rank agreed which steps resume);
2. for each queued step, on the uploader's thread: put every shard of this process's
   ``ranks`` not already in the bucket intact, ``concurrency`` at a time, each
   confirmed (:meth:`RemoteTier.land_shard`);
3. wait until every process's uploader has confirmed its ranks' shards (a collective on
   the uploader's own coordinator channel: a failure on any rank fails the step on every
   rank);
4. the leader confirms every shard's object once more (HEAD: size, stored sha256, the
   store's checksum) and only then commits the remote manifest (create-only) and moves
   ``latest``; every process writes the local receipt;
5. retention: the leader prunes the bucket (not while another run's lease is live),
   every process its local tier (steps the bucket now holds are no longer protected).

Each request is retried by the remote tier's one retry policy. A step whose upload still
fails for a transient reason (connection refused, timeouts, 5xx, throttling: the bucket
is unreachable or failing) is tried again as a whole, after the policy's capped backoff,
until its deadline (``deadline_seconds`` after its upload began); shards already in the
bucket intact are not sent again. Every failed try is logged (WARNING, with the step and
the cause) and shown by :meth:`Uploader.retrying` and ``last_error``. A step that misses
its deadline so stays local-only (the local tier is the safety net), the queue moves
on, and its :class:`UploadError` has ``transient=True`` (``wait(uploaded=True)`` raises
it; ``save`` and ``close`` do not). Any other failure (a permanent remote error such as
access denied, a local I/O error, a bug) becomes a :class:`UploadError` with
``transient=False``, logged at once and raised by the owner's next call. Both go to the
shared :class:`~tiered_ckpt.errors.ErrorBox` with ``tries`` counted and the cause
chained; the step's local copy is kept. With one process per rank the processes agree
on every retry (one small collective), so they try, wait and give up together.

At most ``max_pending`` steps wait in the queue. Beyond that ``when_behind="wait"``
makes :meth:`Uploader.submit` block until there is room, and ``"skip"`` drops the
oldest waiting step (it stays local-only, superseded by the newer one). While the
bucket is failing (a try failed and no commit has succeeded since), the queue takes up
to the local tier's ``max_awaiting_upload`` steps without blocking, so saves go on;
beyond that, one process holding every rank drops the oldest waiting step (local-only;
local retention may then delete it), while with one process per rank (whose queues
must stay the same) :meth:`Uploader.submit` waits for room.

After :meth:`Uploader.preempt` (a preemption notice: the job has seconds to minutes
left), the newest queued step goes next and the older queued ones are dropped (they
stay local-only, superseded), and :meth:`Uploader.submit` no longer waits for room. A
step already being uploaded is finished first. The processes pick each next step
together (one small collective): every one proposes its oldest queued step, or its
newest once preempted, and the oldest proposal wins, so every process uploads the same
step even while their queues and notices differ for a moment.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered_ckpt.dist.coordination import Attempt, Coordinator, SingleProcessCoordinator, gather, leader_decides
from tiered_ckpt.errors import (
    CheckpointError,
    ErrorBox,
    IncompleteCheckpointError,
    RemoteError,
    UploadError,
    UsageError,
)
from tiered_ckpt.format.manifest import RemoteManifest, ShardManifest, ShardRecord
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.options import UploadOptions
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.owners import Lease, OwnershipPolicy
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Uploader"]

logger = logging.getLogger("tiered_ckpt")

RATE_WINDOW = 5  # remote commits the upload rate is measured over


@dataclass(frozen=True)
class _RemoteListing:
    """The leader's listing of the bucket at start-up, and the other live runs writing there."""

    committed: tuple[int, ...]
    uncommitted: tuple[int, ...]
    other_runs: tuple[str, ...] = ()


@dataclass(frozen=True)
class _ResumeReport:
    """The local steps one process could resume."""

    steps: tuple[int, ...]


class Uploader:
    """One background thread that uploads and commits queued steps of ``store``'s local tier.

    ``ranks`` are the ranks whose shards this process uploads (default: every rank of
    each step); ``coordinator`` must be a channel no other thread uses. Failures go to
    ``errors``; ``local_retention`` and ``remote_retention`` are applied after each
    remote commit. ``ownership`` says how the leader holds its lease on the URL;
    ``clock`` (Unix times) dates the lease and judges others' leases and open uploads.
    """

    def __init__(
        self,
        store: TieredStore,
        *,
        options: UploadOptions | None = None,
        errors: ErrorBox | None = None,
        coordinator: Coordinator | None = None,
        ranks: Sequence[int] | None = None,
        local_retention: RetentionPolicy | None = None,
        remote_retention: RetentionPolicy | None = None,
        ownership: OwnershipPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if store.remote is None:
            raise UsageError("an uploader needs a store with a remote tier")
        self._store = store
        self._remote = store.remote
        self._options = options or UploadOptions()
        self.errors = errors or ErrorBox()
        self._coordinator = coordinator or SingleProcessCoordinator(1)
        self._ranks = ranks
        self._local_retention = local_retention or RetentionPolicy()
        self._remote_retention = remote_retention or RetentionPolicy()
        self._clock = clock
        self._lease = Lease(self._remote, ownership, clock=clock)  # the leader's, held from resume() or push()
        self._queue: deque[int] = deque()
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
        self._thread = threading.Thread(target=self._run, name="tiered-ckpt-uploader", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Uploader({str(self._store.local.root)!r} -> {self._remote.url!r})"

    # -- the owner's side -------------------------------------------------------------------

    def resume(self) -> list[int]:
        """Queue what a crash left unuploaded and clean half-uploaded steps; return the steps queued.

        Call once, before any :meth:`submit`, on every process (it is collective).
        """
        listing = leader_decides(self._coordinator, "resume: list", _RemoteListing, self._clean_and_list)
        self.newest_committed = listing.committed[-1] if listing.committed else None
        resumable = Attempt.run(lambda: _ResumeReport(self._resumable(listing.committed)))
        reports = gather(self._coordinator, "resume", _ResumeReport, lambda: resumable.value)
        mine = resumable.value
        resumed = sorted(set(reports[0].steps).intersection(*(report.steps for report in reports[1:])))
        for step in sorted(set(mine.steps) - set(resumed)):
            logger.warning("step %d is committed locally but not on every rank: it cannot be uploaded", step)
        leftover = [step for step in listing.uncommitted if step not in resumed]
        if self._coordinator.is_leader and leftover:
            others = list(listing.other_runs) or self._other_runs()  # asked again: one may have started since
            if others:
                logger.warning(
                    "half-uploaded steps %s stay in %s: run(s) %s may be uploading them",
                    leftover, self._remote.url, ", ".join(others),
                )  # fmt: skip
            for step in [] if others else leftover:
                logger.warning("removing half-uploaded step %d from %s", step, self._remote.url)
                self._remote.delete_step(step)
        for step in resumed:
            logger.warning("resuming the upload of step %d to %s", step, self._remote.url)
            self.submit(step, bounded=False)
        return resumed

    def _clean_and_list(self) -> _RemoteListing:
        """Leader, while every process waits for it (so no upload of this job is running): take
        the lease; unless another live run holds one, abort the multipart uploads a failed or
        killed upload left open past the orphan age; then list the bucket."""
        others = self._lease.hold()
        if others == []:
            self._remote.abort_orphans(self._lease.policy.orphan_age_seconds, now=self._clock())
        committed, uncommitted = self._remote.list_steps()
        other_runs = ("(leases unreadable)",) if others is None else tuple(other.run_id for other in others)
        return _RemoteListing(tuple(committed), tuple(uncommitted), other_runs)

    def _resumable(self, remote_steps: Sequence[int]) -> tuple[int, ...]:
        """Local steps whose remote commit a crash prevented (lost receipts are mended on the way)."""
        resumed = []
        for step in self._store.local.steps():
            if self._store.receipted(step):
                continue
            if step in remote_steps:  # committed remotely, the receipt lost in a crash
                committed = self._remote.read_manifest(step)
                if committed.manifest.shards == self._store.local.manifest(step).shards:
                    self._store.local.write_receipt(step, self._remote.url, committed)
                    continue
            if self.newest_committed is None or step > self.newest_committed:
                resumed.append(step)
        return tuple(resumed)

    def submit(self, step: int, *, bounded: bool = True) -> None:
        """Queue ``step`` (committed locally) for upload; see the module doc for a full queue.

        ``bounded=False`` queues it whatever the queue holds (steps resumed at start-up).
        """
        one_process = len(self._coordinator.local_ranks) == self._coordinator.world_size
        with self._changed:
            if self._closing:
                raise RuntimeError("the uploader is closed")
            while bounded and not self._preempted and len(self._queue) >= self._room():
                if self._options.when_behind == "skip" or (self._failing and one_process):
                    skipped = self._queue.popleft()
                    why = "the bucket is failing" if self._failing else "uploads behind"
                    logger.warning("%s: step %d stays local-only, superseded by step %d", why, skipped, step)
                else:
                    self._changed.wait()
            self._queue.append(step)
            self._changed.notify_all()

    def _room(self) -> float:
        """How many steps the queue holds before ``when_behind`` applies (see the module doc)."""
        if not self._failing:
            return self._options.max_pending
        bound = self._local_retention.max_awaiting_upload
        return float("inf") if bound is None else max(bound, self._options.max_pending)

    def retrying(self) -> tuple[int, int] | None:
        """The step whose upload is being tried again after a transient failure, and the tries
        made of it so far (None: no step is)."""
        with self._changed:
            return self._retry

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

    def push(self, step: int | None = None) -> list[int]:
        """Upload ``step`` (default: every local step without a remote commit) now, and wait for it.

        Returns the steps uploaded; raises :class:`UploadError` if one fails.
        """
        local = self._store.local.steps()
        if step is not None and step not in local:
            raise IncompleteCheckpointError(f"{self._store.local.root}: step {step} is not committed locally")
        unreceipted = [each for each in local if not self._store.receipted(each)]
        chosen = [step] if step is not None else unreceipted
        for each in chosen:
            if each in unreceipted and each not in self.pending():
                self.submit(each, bounded=False)
        self.wait()
        self.errors.raise_first()
        return [each for each in chosen if each in unreceipted]

    def close(self) -> None:
        """Finish every queued upload, then stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
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
        if error.transient:
            logger.warning("%s", error)
        else:
            logger.error("%s", error)
        self.errors.put(error)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if not self._queue:
                    return
                proposal = self._queue[-1] if self._preempted else self._queue[0]
            try:
                step = self._next_step(proposal)
            except BaseException as exc:  # the processes could not agree: every one records it, none goes on
                self._failed(_as_upload_error(proposal, exc))
                with self._changed:
                    self._queue.clear()
                    self._changed.notify_all()
                continue
            try:
                self._upload(step)
            except BaseException as exc:  # a remote failure, a local I/O error or a bug: never lost silently
                self._failed(_as_upload_error(step, exc))
            finally:
                self._remote.forget_landed(step)  # a step given up keeps nothing for the process's life
                with self._changed:
                    self._active = None
                    self._retry = None
                    self._changed.notify_all()

    def _next_step(self, proposal: int) -> int:
        """Agree with the other processes on the next step; take it (and the older ones it supersedes) off the queue."""
        step = min(each.step for each in gather(self._coordinator, "next step", _Proposal, lambda: _Proposal(proposal)))
        with self._changed:
            superseded = [each for each in self._queue if each < step]
            self._queue = deque(each for each in self._queue if each > step)
            self._active = step
            self._changed.notify_all()
        if superseded:
            logger.warning("preemption: steps %s stay local-only, superseded by step %d", superseded, step)
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
                    "superseded by a newer step", step, failure,
                )  # fmt: skip
                return
            if not again:
                break
            left = f"its deadline in {deadline - time.monotonic():.0f} s" if deadline is not None else "no deadline"
            logger.warning(
                "upload of step %d failed (try %d, %d requests tried): %s; trying again in %.1f s (%s)",
                step, attempt, tries, failure, delay, left,
            )  # fmt: skip
            with self._changed:  # a preemption notice cuts the wait short (the step may be superseded)
                self._changed.wait_for(
                    lambda: self._giving_up or (self._preempted and any(s > step for s in self._queue)), delay
                )
        if not transient:
            raise _as_upload_error(step, failure, tries)
        why = (
            "before the manager closed on an error"
            if self._giving_up
            else f"within its deadline of {limit} s (upload_deadline_seconds)"
        )
        raise UploadError(
            f"step {step} was not committed at {self._remote.location(step)} {why} "
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
        delay = self._remote.retry.delay(attempt)  # the policy the tier's requests are tried under
        transient = failure.transient or failure.deadline
        in_time = not self._giving_up and (deadline is None or time.monotonic() + delay < deadline)
        with self._changed:
            superseded = self._preempted and any(each > step for each in self._queue)
        again = failure.transient and not failure.deadline and in_time
        mine = _RetryView(again, transient, superseded, delay)
        views = gather(self._coordinator, "retry", _RetryView, lambda: mine)
        transient_everywhere = all(view.transient for view in views)
        return (
            all(view.again for view in views),
            transient_everywhere,
            transient_everywhere and any(view.superseded for view in views),
            float(views[0].delay),
        )

    def _put_and_commit(self, step: int, deadline: float | None) -> None:
        store = self._store
        manifest = store.local.manifest(step)
        started = time.monotonic()
        ranks = range(manifest.world_size) if self._ranks is None else self._ranks

        def put(rank: int) -> None:
            record = manifest.shard(rank)
            source = ShardSource(path=store.local.shard_path(step, record))
            self._remote.land_shard(step, record, source, deadline=deadline)

        def put_mine() -> _Put:
            if self._coordinator.is_leader and not self._lease.held:  # push() without resume()
                self._lease.hold()
            run_parallel(put, ranks, self._options.concurrency)
            return _Put(tuple(sorted(self._remote.take_landed_checksums(step).items())))

        landed = gather(self._coordinator, "put", _Put, put_mine)  # the store's checksums of every rank's shards
        if self._coordinator.is_leader:  # the one that commits
            for part in landed:
                self._remote.add_landed_checksums(step, dict(part.checksums))
        remote = leader_decides(
            self._coordinator, "commit", _Committed, lambda: _Committed(self._commit(manifest, deadline).to_json())
        )
        committed = RemoteManifest.from_json(remote.document, source=self._remote.location(step))
        store.local.write_receipt(step, self._remote.url, committed)
        self.newest_committed = max(self.newest_committed or 0, step)
        seconds = time.monotonic() - started
        sent = sum(manifest.shard(rank).size_bytes for rank in ranks)
        with self._changed:
            self._commits.append((sent, seconds))
        logger.info(
            "step %d committed at %s: %d bytes from this process in %.2f s (%.1f MB/s)",
            step, self._remote.location(step), sent, seconds, sent / max(seconds, 1e-9) / 1e6,
        )  # fmt: skip
        try:
            if self._coordinator.is_leader:
                self._retain_remote()
            store.retain_local(self._local_retention, self.pending())
        except RemoteError as exc:
            if not exc.transient:
                raise UploadError(
                    f"step {step} is committed at {self._remote.location(step)}, but the retention that follows "
                    f"failed: {exc}",
                    step=step,
                    tries=exc.tries,
                ) from exc
            # Retention runs again after the next commit; a bucket failing now is no error of this step.
            logger.warning("step %d is committed; the remote retention that follows failed (%s)", step, exc)
        except CheckpointError as exc:
            raise UploadError(
                f"step {step} is committed at {self._remote.location(step)}, but the retention that follows "
                f"failed: {exc}",
                step=step,
                tries=getattr(exc, "tries", 1),
            ) from exc

    def _other_runs(self) -> list[str]:
        """The other live runs under the URL now (their leases unreadable counts as one)."""
        try:
            return [other.run_id for other in self._lease.others()]
        except RemoteError as exc:
            return [f"(leases unreadable: {exc})"]

    def _retain_remote(self) -> None:
        """The bucket's retention, unless another live run writes there (its steps are not ours to delete)."""
        others = self._other_runs()
        if others:
            logger.warning(
                "remote retention of %s skipped: run(s) %s also write there",
                self._remote.url, ", ".join(others),
            )  # fmt: skip
            return
        self._store.retain_remote(self._remote_retention)

    def _commit(self, manifest: ShardManifest, deadline: float | None) -> RemoteManifest:
        """Confirm every shard's object once more, then commit; a commit over an object missing or
        changed since it was confirmed is never written (:class:`RemoteError`, not transient)."""
        step = manifest.step

        def confirm(record: ShardRecord) -> str | None:
            return self._remote.confirm_shard(step, record, deadline=deadline)

        problems = [problem for problem in run_parallel(confirm, manifest.shards, self._options.concurrency) if problem]
        if problems:
            raise RemoteError(
                f"step {step} was not committed at {self._remote.location(step)}: {len(problems)} of its objects "
                f"changed after their upload was confirmed (deleted or replaced by someone else?): "
                + "; ".join(problems[:5]),
                transient=False,
            )
        remote = self._remote.commit(manifest, deadline=deadline)
        self._remote.set_latest(manifest.step)
        return remote


@dataclass(frozen=True)
class _Committed:
    """The leader's remote manifest, as every process records it."""

    document: str


@dataclass(frozen=True)
class _Proposal:
    """The step one process would upload next."""

    step: int


@dataclass(frozen=True)
class _RetryView:
    """One process's view after a failed try (see :meth:`Uploader._agree_on_retry`); the leader's delay is used."""

    again: bool
    transient: bool
    superseded: bool
    delay: float


@dataclass(frozen=True)
class _Put:
    """The checksums the bucket computed for one process's shards, as (shard path, checksum) pairs."""

    checksums: tuple[tuple[str, str], ...]


def _as_upload_error(step: int, exc: BaseException, tries: int | None = None) -> UploadError:
    """``exc`` as the :class:`UploadError` of ``step`` (as it is, if it already is one)."""
    if isinstance(exc, UploadError):
        return exc
    tries = tries if tries is not None else exc.tries if isinstance(exc, RemoteError) else 1
    message = f"upload of step {step} failed after {tries} {'try' if tries == 1 else 'tries'}: {exc}"
    error = UploadError(message, step=step, tries=tries)
    error.__cause__ = exc
    return error
