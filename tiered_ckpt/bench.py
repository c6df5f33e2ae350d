"""Benchmark: save and load+verify speed next to this machine's raw limits, measured in one run.

Usage: ``python -m tiered_ckpt.bench [--size-gib 2] [--ranks 4] [--repeat 5] [--dir DIR]``

Prints the median GB/s of each measurement over ``--repeat`` runs and the ratios the
project targets (see shared notes/limits.md):

- save (sha256, xxh3, fsync, atomic commit) / raw write+fsync with two writers;
- warm load+verify into preallocated arrays / sha256 on all cores;
- cold load+verify into preallocated arrays / raw cold sequential read.

Loading into arrays it allocates itself is printed too ("new arrays"): it pays the
page faults of fresh memory on top.

Cold reads evict the files from the page cache with ``posix_fadvise(DONTNEED)`` first.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .sharded import load_sharded, save_sharded

__all__ = ["main"]

CHUNK = 1 << 20


def make_states(total_bytes: int, ranks: int) -> list[dict[str, np.ndarray]]:
    """ZeRO-1-like states: per rank an fp16 slice, fp32 master and two fp32 moments."""
    numel = total_bytes // ranks // 14  # 2 + 4 + 4 + 4 bytes per element
    rng = np.random.default_rng(0)
    return [
        {
            "param_fp16": rng.standard_normal(numel, dtype=np.float32).astype(np.float16),
            "master_fp32": rng.standard_normal(numel, dtype=np.float32),
            "exp_avg": rng.standard_normal(numel, dtype=np.float32),
            "exp_avg_sq": rng.random(numel, dtype=np.float32),
            "step": np.array(1, dtype=np.int64),
        }
        for _ in range(ranks)
    ]


def evict(paths: Sequence[Path]) -> None:
    """Drop the files' (clean) pages from the page cache, so the next read comes from disk."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(directory: Path, states: list[dict[str, np.ndarray]], writers: int) -> float:
    """Write each rank's arrays to a plain file with fsync, ``writers`` files at a time."""

    def write(rank: int) -> None:
        with open(directory / f"raw-{rank}", "wb", buffering=0) as out:
            for array in states[rank].values():
                view = memoryview(array.reshape(-1).view(np.uint8))
                for start in range(0, len(view), CHUNK):
                    out.write(view[start : start + CHUNK])
            os.fsync(out.fileno())

    start = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(len(states))))
    return time.perf_counter() - start


def raw_read(paths: Sequence[Path]) -> float:
    """Read the files sequentially, two at a time, into a reused buffer."""

    def read(path: Path) -> None:
        buffer = bytearray(CHUNK * 8)
        with open(path, "rb", buffering=0) as source:
            while source.readinto(buffer):
                pass

    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(read, paths))
    return time.perf_counter() - start


def sha256_all_cores(states: list[dict[str, np.ndarray]]) -> float:
    """sha256 of every rank's bytes in memory, one thread per core."""

    def digest(state: dict[str, np.ndarray]) -> str:
        hasher = hashlib.sha256()
        for array in state.values():
            view = memoryview(array.reshape(-1).view(np.uint8))
            for start in range(0, len(view), CHUNK):
                hasher.update(view[start : start + CHUNK])
        return hasher.hexdigest()

    start = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(digest, states))
    return time.perf_counter() - start


def peak_rss_growth(action: Callable[[], object]) -> int:
    """Bytes by which the process's peak RSS rose above its RSS before ``action`` (Linux)."""

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not in /proc/self/status")

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    action()
    return status("VmHWM") - before


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiered_ckpt.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="total state size (default 2)")
    parser.add_argument("--ranks", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    args = parser.parse_args(argv)

    states = make_states(int(args.size_gib * 2**30), args.ranks)
    total = sum(a.nbytes for s in states for a in s.values())
    # Every run's files stay until the end (2 x size x repeat on disk): on a disk mounted
    # with discard, deleting gigabytes slows reads and writes for seconds afterwards.
    root = Path(tempfile.mkdtemp(prefix="tiered-ckpt-bench-", dir=args.dir))
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    rss = []
    try:
        for run in range(args.repeat):
            scratch = root / f"run-{run}"
            scratch.mkdir()
            record("raw write+fsync, 1 writer", raw_write(scratch, states, 1))
            record("raw write+fsync, 2 writers", raw_write(scratch, states, 2))
            raw_files = sorted(scratch.glob("raw-*"))
            evict(raw_files)
            record("raw read, cold", raw_read(raw_files))
            record("raw read, warm", raw_read(raw_files))
            record("sha256, all cores", sha256_all_cores(states))

            directory = scratch / "ckpt"
            start = time.perf_counter()
            rss.append(peak_rss_growth(lambda: save_sharded(states, directory, step=run)))
            record("save_sharded", time.perf_counter() - start)
            shards = sorted(directory.glob("rank-*"))
            evict(shards)
            buffers = [{key: np.ones_like(array) for key, array in state.items()} for state in states]
            start = time.perf_counter()
            load_sharded(directory, args.ranks, into=buffers)
            record("load+verify, cold", time.perf_counter() - start)
            start = time.perf_counter()
            load_sharded(directory, args.ranks, into=buffers)
            record("load+verify, warm", time.perf_counter() - start)
            del buffers
            start = time.perf_counter()
            load_sharded(directory, args.ranks)
            record("load+verify, warm, new arrays", time.perf_counter() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rate = {name: total / statistics.median(values) / 1e9 for name, values in times.items()}
    print(f"state: {total / 2**30:.2f} GiB over {args.ranks} ranks, median of {args.repeat} runs, cpus={os.cpu_count()}")
    for name, value in rate.items():
        spread = [total / t / 1e9 for t in times[name]]
        print(f"  {name:<31} {value:6.2f} GB/s   (min {min(spread):.2f}, max {max(spread):.2f})")
    print(f"  save_sharded peak extra RSS      {statistics.median(rss) / 2**20:6.1f} MiB")
    print("ratios (target):")
    print(f"  save / raw write+fsync 2 writers    {rate['save_sharded'] / rate['raw write+fsync, 2 writers']:.2f}  (>= 0.95)")
    print(f"  warm load+verify / sha256 all cores {rate['load+verify, warm'] / rate['sha256, all cores']:.2f}  (>= 0.90)")
    print(f"  cold load+verify / raw cold read    {rate['load+verify, cold'] / rate['raw read, cold']:.2f}  (>= 0.85)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
