"""The ``small-arrays`` section of the benchmark: a shard of many small arrays next to few large ones.

One rank's state of ``count`` float32 arrays (40,000 by default, of ~6.5 KiB each in
256 MiB) and one of the same bytes in four arrays are saved with ``save_sharded``
(sha256, xxh3, fsync, atomic commit) and loaded with ``load_sharded`` into new arrays and
into given ones (``into=``, every byte verified), cold (the files evicted from the page
cache) and warm (read into it first), the two states alternating in every round. Printed:
the medians of GB/s and of the CPU seconds of each, and the medians of each round's
many-small / few-large rate ratio next to the target (>= 0.8). Run through
``python -m benchmarks`` (``--only small-arrays``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.harness import Target, cache, clear, evict, show_ratio
from tiered_ckpt.oneshot import load_sharded, save_sharded

__all__ = ["bench_small_arrays", "split_state"]

LARGE_ARRAYS = 4
TARGET = ">= 0.8"


def split_state(total_bytes: int, count: int) -> dict[str, np.ndarray]:
    """``count`` float32 arrays of together about ``total_bytes`` (random values), named as a model's layers are."""
    numel = max(1, total_bytes // 4 // count)
    values = np.random.default_rng(0).standard_normal(numel * count, dtype=np.float32)
    return {f"layers.{i}.weight": values[i * numel : (i + 1) * numel].copy() for i in range(count)}


def _measure(action: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (every thread of the process) of ``action``; what it returns
    is freed after both clocks stop."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = action()
    seconds = time.perf_counter() - wall, time.process_time() - cpu
    del result
    return seconds


def bench_small_arrays(total_bytes: int, count: int, root: Path, repeat: int) -> list[Target]:
    """Save and load rates of ``count`` small arrays next to ``LARGE_ARRAYS`` large ones of the same
    bytes; returns the rate ratios as issue 45's item 4 rows."""
    states = {"small": split_state(total_bytes, count), "large": split_state(total_bytes, LARGE_ARRAYS)}
    size = sum(array.nbytes for array in states["small"].values())
    targets = {kind: {name: np.empty_like(array) for name, array in state.items()} for kind, state in states.items()}
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for run in range(repeat):
        for kind in ("small", "large") if run % 2 == 0 else ("large", "small"):
            directory = root / f"small-arrays-{kind}-{run}"
            state = states[kind]
            measured = {
                "save": _measure(lambda: save_sharded([state], directory, step=run, sharded_keys=())),  # noqa: B023
            }
            files = sorted(directory.glob("rank-*"))
            evict(files)
            measured["load, cold"] = _measure(lambda: load_sharded(directory, 1))  # noqa: B023
            cache(files)
            measured["load, warm"] = _measure(lambda: load_sharded(directory, 1))  # noqa: B023
            measured["into, warm"] = _measure(lambda: load_sharded(directory, 1, into=[targets[kind]]))  # noqa: B023
            evict(files)
            measured["into, cold"] = _measure(lambda: load_sharded(directory, 1, into=[targets[kind]]))  # noqa: B023
            for what, (seconds, cpu_seconds) in measured.items():
                wall.setdefault(f"{what} {kind}", []).append(seconds)
                cpu.setdefault(f"{what} {kind}", []).append(cpu_seconds)
            clear(directory)
    print(
        f"  {count:,} arrays of {size / count / 2**10:.1f} KiB next to {LARGE_ARRAYS} of "
        f"{size / LARGE_ARRAYS / 2**20:.1f} MiB ({size / 2**20:.0f} MiB, one shard)"
    )
    for name in wall:
        rate = size / statistics.median(wall[name]) / 1e9
        print(f"  {name:<20} {rate:6.2f} GB/s   CPU {statistics.median(cpu[name]):6.3f} s")
    print("ratios (target):")
    rows = []
    for what in ("save", "load, cold", "load, warm", "into, cold", "into, warm"):
        pairs = zip(wall[f"{what} small"], wall[f"{what} large"], strict=True)
        ratio = statistics.median(b / a for a, b in pairs)
        show_ratio(f"many small / few large arrays: {what}", ratio, TARGET)
        rows.append(Target(4, f"{count:,} small / {LARGE_ARRAYS} large arrays: {what}", ratio, 0.8))
        cpus = zip(cpu[f"{what} small"], cpu[f"{what} large"], strict=True)
        show_ratio(f"  CPU s, many small / few large: {what}", statistics.median(a / b for a, b in cpus), "1.0 ideal")
    return rows
