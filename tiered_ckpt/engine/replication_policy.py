"""What a :class:`~tiered_ckpt.engine.replication.Replicator` is told: how to send steps to its
target (:class:`ReplicationPolicy`), and the steps every replicator of one store still has to
commit (:class:`Backlog`), which the first tier's retention keeps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tiered_ckpt.tiers.remote.retry import RetryPolicy

__all__ = ["Backlog", "ReplicationPolicy", "WhenBehind"]

WhenBehind = Literal["wait", "skip"]


@dataclass(frozen=True)
class ReplicationPolicy:
    """How a :class:`Replicator` sends steps to its target (see the module doc): ``concurrency``
    shards at a time; at most ``max_pending`` queued steps before ``when_behind`` applies; a
    step tried again after ``retry``'s backoff (None: the target's own policy, where it has
    one, as the bucket does) until ``deadline_seconds`` (None: no deadline). Only the steps
    divisible by ``every`` go to the target. ``best_effort``: a failure is logged (WARNING) and
    shown in ``last_error``, never raised by the owner (a partner's memory: the step is
    simply not in that tier)."""

    concurrency: int = 2
    max_pending: int = 2
    when_behind: WhenBehind = "wait"
    deadline_seconds: float | None = 3600.0
    retry: RetryPolicy | None = None
    every: int = 1
    best_effort: bool = False


class Backlog:
    """The steps each replicator of one store still has to commit, by its target's name: every
    retention pass of the first tier keeps them all, not only its own replicator's."""

    def __init__(self) -> None:
        self._queues: dict[str, Callable[[], list[int]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, pending: Callable[[], list[int]]) -> None:
        with self._lock:
            self._queues[name] = pending

    def pending(self) -> dict[str, list[int]]:
        with self._lock:
            queues = dict(self._queues)
        return {name: pending() for name, pending in queues.items()}
