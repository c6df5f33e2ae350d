"""The ``retention`` section of the benchmark: a blocking save with ``keep_last=1`` next to one
without retention, in interleaved rounds."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import Timings, clear
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.options import LocalOptions, RuntimeOptions

FULL = RuntimeOptions(incremental=False)  # every byte written: the incremental section measures references

__all__ = ["bench_retention"]


def bench_retention(states: list[dict[str, np.ndarray]], root: Path, repeat: int) -> None:
    """A blocking save with keep_last=1 next to one without retention, in interleaved rounds.

    Each round saves 4 steps with each manager (the first untimed: it allocates the staging
    buffers), alternating which goes first; the figure is the median over rounds of each
    round's ratio of median save times. A round's files are removed after it (see
    :func:`clear`).
    """
    timings = Timings(sum(a.nbytes for s in states for a in s.values()))
    names = {None: "blocking save, keep_last=None", 1: "blocking save, keep_last=1"}
    for run in range(repeat):
        order = [None, 1] if run % 2 == 0 else [1, None]
        for keep_last in order:
            seconds = []
            directory = root / f"retention-{run}-{keep_last}"
            with CheckpointManager(
                LocalOptions(directory, keep_last=keep_last), world_size=len(states), runtime=FULL
            ) as manager:
                for step in range(4):
                    start = time.perf_counter()
                    manager.save(step, states, blocking=True)
                    seconds.append(time.perf_counter() - start)
            timings.record(names[keep_last], statistics.median(seconds[1:]))
        for keep_last in order:
            clear(root / f"retention-{run}-{keep_last}")
    timings.print_rates()
    print("ratios (target):")
    timings.print_paired_ratio("keep_last=1 / no retention (throughput)", names[1], names[None], ">= 0.91")
