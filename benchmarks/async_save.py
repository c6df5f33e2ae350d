"""The ``async`` section of the benchmark: how long ``CheckpointManager.save(blocking=False)``
blocks next to ``np.copyto`` of the same arrays, and the memory its staging takes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import peak_rss_growth, show_ratio, timed
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.options import LocalOptions, RuntimeOptions

FULL = RuntimeOptions(incremental=False)  # every byte written: the incremental section measures references

__all__ = ["bench_async"]


def copy_time(states: list[dict[str, np.ndarray]], repeat: int) -> float:
    """Median seconds of np.copyto of every array into preallocated (already touched) buffers."""
    buffers = [{key: np.empty_like(array) for key, array in state.items()} for state in states]

    def copy_all() -> None:
        for source, target in zip(states, buffers, strict=True):
            for key, array in source.items():
                np.copyto(target[key], array)

    copy_all()  # fault the buffers in, as the manager's reused buffers are after its first save
    return statistics.median(timed(copy_all) for _ in range(repeat))


def bench_async(states: list[dict[str, np.ndarray]], root: Path, repeat: int) -> None:
    """How long CheckpointManager.save(blocking=False) blocks, and the memory its staging takes."""
    state_bytes = sum(a.nbytes for s in states for a in s.values())
    copy_seconds = copy_time(states, repeat)
    blocked: list[float] = []

    def ten_saves() -> None:
        with CheckpointManager(
            LocalOptions(root / "async", keep_last=2), world_size=len(states), runtime=FULL
        ) as manager:
            for step in range(10):
                manager.wait()  # time only what save itself blocks, not the previous write
                start = time.perf_counter()
                manager.save(step, states)
                if step > 0:  # the first save allocates the staging buffers
                    blocked.append(time.perf_counter() - start)

    growth = peak_rss_growth(ten_saves)
    save_time = statistics.median(blocked)
    print(f"  np.copyto into preallocated buffers   {copy_seconds * 1e3:8.1f} ms")
    print(f"  save(blocking=False) blocks           {save_time * 1e3:8.1f} ms  (median of {len(blocked)} saves)")
    print(f"  peak extra RSS over 10 async saves    {growth / 2**20:8.1f} MiB ({growth / state_bytes:.3f} x state)")
    print("ratios (target):")
    show_ratio("save(blocking=False) / np.copyto", save_time / copy_seconds, "<= 1.2")
    show_ratio("extra peak RSS / state size", growth / state_bytes, "<= 1.05")
