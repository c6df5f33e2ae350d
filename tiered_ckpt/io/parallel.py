"""The thread pool that reads and writes the shard files of a step in parallel."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["default_workers", "run_parallel"]

T = TypeVar("T")
R = TypeVar("R")


def default_workers(tasks: int) -> int:
    """Threads for ``tasks`` file writes or reads.

    Twice the cores: while one thread waits on the disk (fsync, a cold read) another
    hashes, which keeps every core and the disk busy.
    """
    return max(1, min(tasks, 2 * (os.cpu_count() or 1)))


def run_parallel(function: Callable[[T], R], items: Sequence[T], max_workers: int | None) -> list[R]:
    """Apply ``function`` to every item on a thread pool; return results in order.

    The first failure (in item order) is raised once every started call has ended, so
    no thread is still writing when the caller sees the error.
    """
    if not items:
        return []
    if len(items) == 1:  # a pool's thread would only add its start and a hand-over to the call
        return [function(items[0])]
    with ThreadPoolExecutor(max_workers or default_workers(len(items)), thread_name_prefix="tiered-ckpt") as pool:
        futures = [pool.submit(function, item) for item in items]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
