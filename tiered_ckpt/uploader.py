"""The background upload queue: locally committed steps go to the remote tier, in order.

For each queued step, the uploader thread:

1. reads the step's local manifest;
2. uploads every shard of its ``ranks`` not already in the bucket intact (several at a
   time), each confirmed by size and stored sha256 — so a step resumed after a crash
   sends only what is missing;
3. waits until every process's uploader has confirmed its ranks' shards (a collective
   on the uploader's own ``coordinator`` channel; a failure on any rank fails the step
   on every rank);
4. the leader commits the remote manifest (create-only) and moves ``latest``; every
   process then writes the local receipt (``remote-commit.json``) and calls
   ``on_committed``.

Transient errors are retried with exponential backoff and full jitter, up to
``max_tries`` tries per request; a permanent error, or a transient one that outlasts its
tries, becomes :class:`UploadError` (tries counted, cause chained) that the owner raises
on its next call. The step's local copy is kept either way.

``concurrency`` shards of a step are uploaded at once (2 by default: the backend already
sends a large shard's parts concurrently, and more requests in flight slowed uploads to
the 2-core test server; raise it for many small shards).

When uploads fall behind, at most ``max_pending`` steps wait in the queue. Beyond that
``when_behind="wait"`` makes :meth:`Uploader.submit` block until there is room, and
``"skip"`` drops the oldest waiting step (it stays local-only and is superseded by the
newer one).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, TypeVar

from .coordination import Coordinator, SingleProcessCoordinator, agree, leader_decides
from .errors import CheckpointError, RemoteError, UploadError
from .layout import step_dir_name
from .local import atomic_write, read_manifest
from .manifest import RemoteManifest, ShardManifest
from .remote import RemoteTier
from .sharded import run_parallel
from .shardfile import write_all

__all__ = ["Uploader", "RECEIPT_NAME", "read_receipt", "write_receipt", "with_retries", "WhenBehind"]

logger = logging.getLogger("tiered_ckpt")

RECEIPT_NAME = "remote-commit.json"
WhenBehind = Literal["wait", "skip"]
T = TypeVar("T")


def write_receipt(directory: Path, url: str, remote: RemoteManifest) -> None:
    """Record in a local step directory that the step is committed at ``url``."""
    data = json.dumps({"url": url, "step": remote.manifest.step, "committed_at": remote.committed_at}).encode()
    atomic_write(directory / RECEIPT_NAME, lambda out: write_all(out, data))


def read_receipt(directory: Path, url: str) -> bool:
    """True if the step in ``directory`` has a receipt of its commit at ``url``."""
    try:
        document = json.loads((directory / RECEIPT_NAME).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and document.get("url") == url


class Uploader:
    """One background thread that uploads and commits queued steps of ``local_root`` to ``remote``.

    ``ranks`` are the ranks whose shards this process uploads (default: every rank of
    each step); ``coordinator`` must be a channel no other thread uses.
    """

    def __init__(
        self,
        local_root: Path,
        remote: RemoteTier,
        *,
        on_committed: Callable[[RemoteManifest], None],
        coordinator: Coordinator | None = None,
        ranks: Sequence[int] | None = None,
        concurrency: int = 2,
        max_tries: int = 5,
        backoff_seconds: float = 0.5,
        max_backoff_seconds: float = 30.0,
        max_pending: int = 2,
        when_behind: WhenBehind = "wait",
    ) -> None:
        if when_behind not in ("wait", "skip"):
            raise ValueError(f"when_behind must be 'wait' or 'skip', got {when_behind!r}")
        if max_tries < 1 or max_pending < 1 or concurrency < 1:
            raise ValueError("max_tries, max_pending and concurrency must be >= 1")
        self._root = local_root
        self._remote = remote
        self._on_committed = on_committed
        self._coordinator = coordinator or SingleProcessCoordinator(1)
        self._ranks = ranks
        self._concurrency = concurrency
        self._max_tries = max_tries
        self._backoff = backoff_seconds
        self._max_backoff = max_backoff_seconds
        self._max_pending = max_pending
        self._when_behind = when_behind
        self._queue: deque[int] = deque()
        self._active: int | None = None
        self._errors: list[UploadError] = []
        self._closing = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tiered-ckpt-uploader", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Uploader({str(self._root)!r} -> {self._remote.url!r})"

    # -- the owner's side -------------------------------------------------------------------

    def submit(self, step: int, *, bounded: bool = True) -> None:
        """Queue ``step`` (committed locally) for upload; see the module doc for a full queue.

        ``bounded=False`` queues it whatever the queue holds (steps resumed at start-up).
        """
        with self._changed:
            if self._closing:
                raise RuntimeError("the uploader is closed")
            while bounded and len(self._queue) >= self._max_pending:
                if self._when_behind == "skip":
                    skipped = self._queue.popleft()
                    logger.warning("uploads behind: step %d stays local-only, superseded by step %d", skipped, step)
                else:
                    self._changed.wait()
            self._queue.append(step)
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

    def pop_error(self) -> UploadError | None:
        """The oldest upload failure not yet handed out, or None."""
        with self._changed:
            return self._errors.pop(0) if self._errors else None

    def close(self) -> None:
        """Finish every queued upload, then stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

    # -- the uploader thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if not self._queue:
                    return
                step = self._queue.popleft()
                self._active = step
                self._changed.notify_all()
            try:
                self._upload(step)
            except UploadError as error:
                logger.error("%s", error)
                with self._changed:
                    self._errors.append(error)
            except BaseException as exc:  # a bug or a local I/O error: never lose it silently
                error = UploadError(f"upload of step {step} failed: {exc}", step=step, tries=1)
                error.__cause__ = exc
                with self._changed:
                    self._errors.append(error)
            finally:
                with self._changed:
                    self._active = None
                    self._changed.notify_all()

    def _upload(self, step: int) -> None:
        directory = self._root / step_dir_name(step)
        manifest = read_manifest(directory)

        def upload(rank: int) -> None:
            record = manifest.shard(rank)
            what = f"rank {rank} shard of step {step}"
            if self._retrying(what, step, lambda: self._remote.shard_is_uploaded(step, record)):
                return  # uploaded intact before a crash: not sent again

            def put_and_confirm() -> None:
                # Each request has its own retries; a confirmation that finds the wrong
                # object is itself a transient error that puts the shard again.
                self.retrying(what, lambda: self._remote.upload_shard(step, directory / record.path, record))
                self.retrying(what, lambda: self._remote.confirm_shard(step, record))

            self._retrying(what, step, put_and_confirm)

        ranks = range(manifest.world_size) if self._ranks is None else self._ranks
        agree(self._coordinator, lambda: run_parallel(upload, ranks, self._concurrency) and None)
        remote = RemoteManifest.from_json(
            leader_decides(self._coordinator, lambda: self._commit(step, manifest).to_json()),
            source=self._remote.location(step),
        )
        write_receipt(directory, self._remote.url, remote)
        logger.info("step %d committed at %s", step, self._remote.location(step))
        try:
            self._on_committed(remote)
        except CheckpointError as exc:
            raise UploadError(
                f"step {step} is committed at {self._remote.location(step)}, but what follows a commit "
                f"(retention) failed: {exc}",
                step=step,
                tries=getattr(exc, "tries", 1),
            ) from exc

    def _commit(self, step: int, manifest: ShardManifest) -> RemoteManifest:
        remote = self._retrying(f"commit of step {step}", step, lambda: self._remote.commit(manifest))
        self._retrying(f"latest pointer of step {step}", step, lambda: self._remote.set_latest(step))
        return remote

    def retrying(self, what: str, action: Callable[[], T]) -> T:
        """Run ``action`` with this uploader's retry policy (see :func:`with_retries`)."""
        return with_retries(action, what, self._max_tries, self._backoff, self._max_backoff)

    def _retrying(self, what: str, step: int, action: Callable[[], T]) -> T:
        try:
            return self.retrying(what, action)
        except RemoteError as exc:
            tries = getattr(exc, "tries", 1)
            raise UploadError(
                f"upload of step {step} failed: {what}: after {tries} {'try' if tries == 1 else 'tries'}: {exc}",
                step=step,
                tries=tries,
            ) from exc


def with_retries(action: Callable[[], T], what: str, max_tries: int, backoff: float, max_backoff: float) -> T:
    """Return ``action()``, retrying transient :class:`RemoteError` with exponential backoff and full jitter.

    A permanent error is raised at once, a transient one after ``max_tries`` tries; the
    error raised carries ``tries``, the number of tries made.
    """
    for attempt in range(1, max_tries + 1):
        try:
            return action()
        except RemoteError as exc:
            if not exc.transient or attempt == max_tries:
                exc.tries = attempt  # type: ignore[attr-defined]
                raise
            delay = min(max_backoff, backoff * 2 ** (attempt - 1)) * random.random()
            logger.warning("%s: transient error (try %d of %d), retrying: %s", what, attempt, max_tries, exc)
            time.sleep(delay)
    raise AssertionError("unreachable")
