"""The ``sync`` section of the benchmark: save and load+verify speed next to this machine's limits.

In each round, ``save_sharded`` (sha256, xxh3, fsync, atomic commit) is held to min(the
disk's write limit, sha256 on all cores), the disk's limit being plain code writing the
same bytes with as many writers as the save, paced like it (a thread per file writing
1 MiB blocks, fsync), the faster of bypassing the page cache (O_DIRECT, as a save does)
and going through it (writeback started every few MiB); ``load_sharded`` and the
manager's restore into new arrays, and a load into the caller's arrays, warm / sha256 on
all cores and cold / the raw cold sequential read (before a warm load the files are read
into the page cache: neither a save nor a cold load leaves them there). Loading into
arrays it allocates itself is printed too ("new arrays"): it pays the page faults of
fresh memory on top. Ratios are the medians of each round's own.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.harness import (
    COLD_READ,
    LIMIT,
    SHA256_LIMIT,
    Timings,
    cache,
    clear,
    evict,
    measure_limits,
    peak_rss_growth,
    timed,
)
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.io.parallel import default_workers
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.oneshot import load_sharded, save_sharded

__all__ = ["bench_sync"]


def _save_and_loads(states: list[dict[str, np.ndarray]], scratch: Path, timings: Timings, run: int) -> int:
    """One round of save_sharded and its loads (into arrays, into new arrays, the manager's
    restore; cold and warm); returns the save's peak extra RSS.

    Which of load_sharded and the manager's restore goes first alternates by round: on a
    VM whose guest returns freed memory to the host (virtio-balloon free page reporting),
    the first load into new arrays faults its memory in from the host, the one after it
    reuses the pages the first one's arrays just freed."""
    root = scratch / "ckpt"
    directory = root / step_dir_name(1)
    start = time.perf_counter()
    rss = peak_rss_growth(functools.partial(save_sharded, states, directory, step=1))
    timings.record("save_sharded", time.perf_counter() - start)
    files = sorted(directory.glob("rank-*"))
    buffers = [{key: np.ones_like(array) for key, array in state.items()} for state in states]
    load = functools.partial(load_sharded, directory, len(states))
    with CheckpointManager(root, world_size=len(states)) as manager:
        for temperature in ("cold", "warm"):
            new_arrays: list[tuple[str, Callable[[], object]]] = [
                ("load_sharded", load),
                ("manager restore", functools.partial(manager.restore, 1)),
            ]
            if temperature == "warm":
                cache(files)
            for name, action in [("load_sharded into arrays", functools.partial(load, into=buffers))] + (
                new_arrays if run % 2 == 0 else new_arrays[::-1]
            ):
                if temperature == "cold":
                    evict(files)
                timings.record(f"{name}, {temperature}", timed(action))
    return rss


def bench_sync(states: list[dict[str, np.ndarray]], root: Path, repeat: int) -> None:
    """save_sharded, load_sharded and the manager's restore next to the limits measured in the
    same rounds (which go first alternates); ratios are medians of each round's own ratio."""
    timings = Timings(sum(a.nbytes for s in states for a in s.values()))
    rss = []
    for run in range(repeat):
        scratch = root / f"sync-{run}"
        if run % 2:
            rss.append(_save_and_loads(states, scratch, timings, run))
            measure_limits(states, scratch / "limits", timings)
        else:
            measure_limits(states, scratch / "limits", timings)
            rss.append(_save_and_loads(states, scratch, timings, run))
        clear(scratch)
    print(f"  {len(states)} ranks, {default_workers(len(states))} writers; loads into new arrays unless said")
    timings.print_rates()
    print(f"  save_sharded peak extra RSS      {statistics.median(rss) / 2**20:6.1f} MiB")
    print("ratios, medians of each round's (target):")
    ratios = (
        ("save / min(disk limit, sha256 all cores)", "save_sharded", LIMIT, ">= 0.90, must >= 0.75"),
        ("load_sharded warm / sha256 all cores", "load_sharded, warm", SHA256_LIMIT, ">= 0.85"),
        ("manager restore warm / sha256 all cores", "manager restore, warm", SHA256_LIMIT, ">= 0.85"),
        ("load_sharded cold / raw cold read", "load_sharded, cold", COLD_READ, ">= 0.85"),
        ("manager restore cold / raw cold read", "manager restore, cold", COLD_READ, ">= 0.85"),
        ("manager restore / load_sharded, warm", "manager restore, warm", "load_sharded, warm", ">= 1.0"),
        ("into arrays, warm / sha256 all cores", "load_sharded into arrays, warm", SHA256_LIMIT, ">= 0.90"),
        ("into arrays, cold / raw cold read", "load_sharded into arrays, cold", COLD_READ, ">= 0.85"),
    )
    for label, name, baseline, target in ratios:
        timings.print_paired_ratio(label, name, baseline, target)
