"""Benchmark: save and load+verify speed next to this machine's limits, measured in the same run.

Usage: ``python -m tiered_ckpt.bench [--size-gib 2] [--ranks 4] [--repeat 5] [--dir DIR]
[--only SECTION ...] [--peers] [--plot FILE.png]``

Prints the median GB/s of each measurement over ``--repeat`` rounds and the ratios the
project targets (see shared notes/limits.md), each the median of the rounds' own ratios
(the disk's speed swings within a minute, so a figure is only compared with the limit
measured in the same round):

- save (sha256, xxh3, fsync, atomic commit) / min(the disk's write limit, sha256 on all
  cores), the disk's limit being plain code writing the same bytes with as many writers
  as the save, paced like it (a thread per file writing 1 MiB blocks, fsync), the faster
  of bypassing the page cache (O_DIRECT, as a save does) and going through it (writeback
  started every few MiB);
- load and the manager's restore into new arrays, and a load into the caller's arrays,
  warm / sha256 on all cores and cold / the raw cold sequential read (before a warm load
  the files are read into the page cache: neither a save nor a cold load leaves them
  there).

``--peers`` adds the peers section (:mod:`tiered_ckpt.bench_peers`: safetensors,
``torch.save``, DCP on the same state); ``--plot FILE.png`` draws its table (needs
matplotlib: ``pip install 'tiered-ckpt[plot]'``).

Loading into arrays it allocates itself is printed too ("new arrays"): it pays the
page faults of fresh memory on top.

The ``dist`` section (needs torch) saves the same total state from 1, 2 and 4 rank
processes under ``torch.distributed`` (gloo, one process per rank, each with its own
directory on the one disk) and prints the aggregate GB/s of a blocking save, from a
barrier before it to a barrier after every rank committed, next to the same processes
writing the same bytes to plain files with fsync and hashing them (sha256, a thread
each: a shard's sha256 is one stream), measured just before each save (so both see the
disk at the same moment; the ratio printed, save / the slower of the two, is the median
of each run's ratio). One untimed save first allocates the staging buffers, as in a training run's
steady state.

Cold reads evict the files from the page cache with ``posix_fadvise(DONTNEED)`` first.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.io.durable import atomic_write, write_all
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.io.parallel import default_workers
from tiered_ckpt.oneshot import load_sharded, save_sharded

__all__ = ["main"]

CHUNK = 1 << 20


def make_states(total_bytes: int, ranks: int) -> list[dict[str, np.ndarray]]:
    """ZeRO-1-like states: per rank an fp16 slice, fp32 master and two fp32 moments."""
    return [make_rank_state(total_bytes, ranks, rank) for rank in range(ranks)]


def make_rank_state(total_bytes: int, ranks: int, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s part of :func:`make_states`."""
    numel = total_bytes // ranks // 14  # 2 + 4 + 4 + 4 bytes per element
    rng = np.random.default_rng(rank)
    return {
        "param_fp16": rng.standard_normal(numel, dtype=np.float32).astype(np.float16),
        "master_fp32": rng.standard_normal(numel, dtype=np.float32),
        "exp_avg": rng.standard_normal(numel, dtype=np.float32),
        "exp_avg_sq": rng.random(numel, dtype=np.float32),
        "step": np.array(1, dtype=np.int64),
    }


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


def cache(paths: Sequence[Path]) -> None:
    """Read the files through the page cache, so that the next read finds them there: a save
    writes, and a load of an uncached file reads, past the page cache, so neither leaves it
    there."""
    raw_read(paths)


def raw_write(directory: Path, states: list[dict[str, np.ndarray]], writers: int, *, direct: bool = True) -> float:
    """The disk's write limit as plain code reaches it: each rank's arrays to a file of its own,
    ``writers`` files at a time, paced like a save (:func:`~tiered_ckpt.durable.atomic_write`:
    blocks written by a thread per file, bypassing the page cache, or with ``direct=False``
    through it with writeback started every few MiB; fsync, rename), nothing hashed."""

    def write(rank: int) -> None:
        def arrays(out: BinaryIO) -> None:
            for array in states[rank].values():
                view = memoryview(array.reshape(-1).view(np.uint8))
                for start in range(0, len(view), CHUNK):
                    write_all(out, view[start : start + CHUNK])

        atomic_write(directory / f"raw-{rank}", arrays, direct=direct)

    start = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(len(states))))
    return time.perf_counter() - start


def raw_read(paths: Sequence[Path]) -> float:
    """Read the files sequentially into reused buffers, as many at a time as a load of as many
    shards reads (:func:`~tiered_ckpt.io.parallel.default_workers`)."""

    def read(path: Path) -> None:
        buffer = bytearray(CHUNK * 8)
        with open(path, "rb", buffering=0) as source:
            while source.readinto(buffer):
                pass

    start = time.perf_counter()
    with ThreadPoolExecutor(default_workers(len(paths))) as pool:
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


class Timings:
    """Seconds per named measurement over repeated runs; reports medians as GB/s."""

    def __init__(self, total_bytes: int) -> None:
        self.total = total_bytes
        self.seconds: dict[str, list[float]] = {}

    def record(self, name: str, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)

    def rate(self, name: str) -> float:
        return self.total / statistics.median(self.seconds[name]) / 1e9

    def print_ratio(self, label: str, name: str, baseline: str, target: str) -> None:
        """Print the rate of ``name`` over the rate of ``baseline``, with its target."""
        show_ratio(label, self.rate(name) / self.rate(baseline), target)

    def print_paired_ratio(self, label: str, name: str, baseline: str, target: str) -> None:
        """Print the median over runs of each run's ``name`` rate over its ``baseline`` rate.

        For measurements taken back to back in each run: on a disk whose speed swings,
        the ratio of two medians can pair a fast moment with a slow one.
        """
        pairs = zip(self.seconds[baseline], self.seconds[name], strict=True)
        show_ratio(label, statistics.median(base / seconds for base, seconds in pairs), target)

    def print_rates(self) -> None:
        for name, values in self.seconds.items():
            spread = [self.total / t / 1e9 for t in values]
            print(f"  {name:<31} {self.rate(name):6.2f} GB/s   (min {min(spread):.2f}, max {max(spread):.2f})")


def clear(directory: Path) -> None:
    """Remove a round's files once it is measured, and let the disk settle before the next: on
    a disk mounted with discard the deletion's discards go out at the journal's commit,
    which ``sync`` forces now rather than in the middle of the next round. (Keeping every
    round's files instead fills the disk: a 2 GiB state, 5 rounds, 4 peers.)"""
    shutil.rmtree(directory, ignore_errors=True)
    os.sync()


def timed(action: Callable[[], object]) -> float:
    """Seconds ``action`` takes; what it returns is freed after the clock stops (a caller keeps
    what a load returns: freeing gigabytes is not part of loading them)."""
    start = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - start
    del result
    return seconds


def show_ratio(name: str, value: float, target: str) -> None:
    print(f"  {name:<46} {value:5.2f}  ({target})")


CACHED_WRITE = "write+fsync, page cache"
DIRECT_WRITE = "write+fsync, O_DIRECT"
DISK_LIMIT = "disk limit: the faster write"
SHA256_LIMIT = "sha256, all cores"
LIMIT = "min(disk limit, sha256)"
COLD_READ = "raw read, cold"


def measure_limits(states: list[dict[str, np.ndarray]], scratch: Path, timings: Timings) -> None:
    """Record the limits of a save and a load on this machine now: the disk's write limit with as
    many writers as a save of ``states`` uses, its cold and warm sequential reads, sha256 on
    all cores, and the lower of write and hash limits (as seconds: the slower of the two)."""
    scratch.mkdir(parents=True, exist_ok=True)
    writers = default_workers(len(states))
    cached_seconds = raw_write(scratch, states, writers, direct=False)
    clear(scratch)
    scratch.mkdir()
    direct_seconds = raw_write(scratch, states, writers)
    timings.record(CACHED_WRITE, cached_seconds)
    timings.record(DIRECT_WRITE, direct_seconds)
    write_seconds = min(cached_seconds, direct_seconds)
    timings.record(DISK_LIMIT, write_seconds)
    raw_files = sorted(scratch.glob("raw-*"))
    evict(raw_files)
    timings.record(COLD_READ, raw_read(raw_files))
    timings.record("raw read, warm", raw_read(raw_files))
    sha_seconds = sha256_all_cores(states)
    timings.record(SHA256_LIMIT, sha_seconds)
    timings.record(LIMIT, max(write_seconds, sha_seconds))


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
        with CheckpointManager(root / "async", world_size=len(states), keep_last=2) as manager:
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
            with CheckpointManager(directory, world_size=len(states), keep_last=keep_last) as manager:
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


RANK_PROCESSES = (1, 2, 4)


def bench_dist(total_bytes: int, root: Path, repeat: int) -> None:
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        print("  skipped: needs torch (pip install 'tiered-ckpt[torch]')")
        return
    timings = Timings(total_bytes)
    for processes in RANK_PROCESSES:
        directory = root / f"dist-{processes}"
        for raw_seconds, sha_seconds, save_seconds in _rank_processes(total_bytes, processes, directory, repeat):
            timings.record(_label("raw write+fsync", processes), raw_seconds)
            timings.record(_label("sha256", processes), sha_seconds)
            timings.record(_label("min(raw, sha256)", processes), max(raw_seconds, sha_seconds))
            timings.record(_label("save", processes), save_seconds)
        shutil.rmtree(directory)  # 2 x size x (repeat + 1) bytes: more than some disks hold three times over
        os.sync()
    print(f"  state {total_bytes / 2**30:.2f} GiB in total, split over the rank processes")
    timings.print_rates()
    print("ratios (target):")
    for processes in RANK_PROCESSES:
        timings.print_paired_ratio(
            _label("save / min(raw, sha256)", processes),
            _label("save", processes),
            _label("min(raw, sha256)", processes),
            ">= 0.90, must >= 0.75",
        )


def _label(what: str, processes: int) -> str:
    return f"{what}, {processes} process{'es' if processes > 1 else ''}"


def _rank_processes(total_bytes: int, processes: int, root: Path, repeat: int) -> list[tuple[float, float]]:
    """Run ``processes`` rank processes that each write and save their part ``repeat`` times.

    Returns rank 0's (raw write seconds, sha256 seconds, save seconds) of each run.
    """
    command = [sys.executable, "-m", "tiered_ckpt.bench", "--rank-process"]
    timings = run_rank_processes(command, root, processes, "dist", total_bytes=total_bytes, repeat=repeat)
    return [(float(raw), float(sha), float(save)) for raw, sha, save in timings]


def run_rank_processes(command: list[str], root: Path, processes: int, section: str, **settings: Any) -> Any:
    """Run ``processes`` rank processes (``command CONFIG RANK``) joined through a file store in
    ``root`` (created here), with a config of ``settings`` plus the store, ``root``, the process
    count and where rank 0 writes its timings; return those timings (JSON)."""
    root.mkdir()
    config = root / "config.json"
    results = root / "timings.json"
    paths = {"store": str(root / "store"), "root": str(root), "results": str(results)}
    config.write_text(json.dumps({**paths, "processes": processes, **settings}))
    children = [subprocess.Popen([*command, str(config), str(rank)]) for rank in range(processes)]
    codes = [child.wait() for child in children]
    if any(codes):
        raise RuntimeError(f"rank processes of the {section} benchmark exited with {codes}")
    return json.loads(results.read_text())


def rank_process(config_path: Path, rank: int) -> None:
    """One rank process of the ``dist`` section: write, hash, then save this rank's part ``repeat`` times."""
    import torch.distributed as dist

    from tiered_ckpt.dist.coordination import TorchDistributedCoordinator

    config = json.loads(config_path.read_text())
    processes = config["processes"]
    dist.init_process_group("gloo", init_method=f"file://{config['store']}", rank=rank, world_size=processes)
    state = make_rank_state(config["total_bytes"], processes, rank)
    coordinator = TorchDistributedCoordinator()
    directory = Path(config["root"]) / f"rank-{rank}"

    def timed(action: Callable[[], object]) -> float:
        coordinator.barrier()
        start = time.perf_counter()
        action()
        coordinator.barrier()  # every rank is done
        return time.perf_counter() - start

    timings = []
    # keep_last=None: deleting the previous step inside the timed save would time the deletion too.
    with CheckpointManager(directory, coordinator=coordinator, keep_last=None) as manager:
        manager.save(0, state, blocking=True)
        for step in range(1, config["repeat"] + 1):
            raw = directory / f"raw-{step}"
            raw.mkdir()
            raw_seconds = timed(lambda: raw_write(raw, [state], 1))  # noqa: B023 (called at once)
            sha_seconds = timed(lambda: sha256_all_cores([state]))  # noqa: B023 (one thread: one state)
            save_seconds = timed(lambda: manager.save(step, state, blocking=True))  # noqa: B023
            timings.append((raw_seconds, sha_seconds, save_seconds))
    if rank == 0:
        Path(config["results"]).write_text(json.dumps(timings))
    dist.destroy_process_group()


def _check_plotting(path: Path) -> None:
    """Fail before measuring anything if ``path`` cannot be drawn: no matplotlib, or no such directory."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'tiered-ckpt[plot]'") from None
    if not path.parent.resolve().is_dir():
        raise SystemExit(f"--plot {path}: no directory {path.parent}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiered_ckpt.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="total state size (default 2)")
    parser.add_argument("--ranks", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    parser.add_argument(
        "--only",
        choices=["sync", "async", "retention", "dist", "train", "remote", "structure", "fsdp", "peers"],
        action="append",
        help="run only these sections (repeatable)",
    )
    parser.add_argument("--peers", action="store_true", help="add the peers section (safetensors, torch.save, DCP)")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw the peers section's table (implies --peers)"
    )
    parser.add_argument("--train-steps", type=int, default=200, help="training loop steps (default 200)")
    parser.add_argument("--remote-size-gib", type=float, default=1.0, help="checkpoint size for 'remote' (default 1)")
    parser.add_argument("--params", type=int, default=10_000, help="parameter tensors for 'structure' (default 10000)")
    parser.add_argument("--rank-process", nargs=2, metavar=("CONFIG", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_process is not None:  # a child of the dist section
        rank_process(Path(args.rank_process[0]), int(args.rank_process[1]))
        return 0
    sections = args.only or ["sync", "async", "retention", "dist", "train", "remote", "structure", "fsdp"]
    if args.peers or args.plot:
        sections = [*sections, "peers"]
    if args.plot is not None:
        _check_plotting(args.plot)

    in_memory = {"sync", "async", "retention", "peers"}
    states = make_states(int(args.size_gib * 2**30), args.ranks) if in_memory & set(sections) else []
    total = int(args.size_gib * 2**30)
    print(
        f"state: {total / 2**30:.2f} GiB over {args.ranks} ranks, medians of {args.repeat} runs, cpus={os.cpu_count()}"
    )
    # Sections that write many gigabytes remove each round's files after it (see clear()).
    root = Path(tempfile.mkdtemp(prefix="tiered-ckpt-bench-", dir=args.dir))
    try:
        if "sync" in sections:
            print("save_sharded / load_sharded:")
            bench_sync(states, root, args.repeat)
        if "async" in sections:
            print("CheckpointManager async save:")
            bench_async(states, root, args.repeat)
        if "retention" in sections:
            print("CheckpointManager blocking save, with and without local retention (interleaved):")
            bench_retention(states, root, args.repeat)
        if "dist" in sections:
            print("rank processes under torch.distributed (gloo), each saving its part to the same disk:")
            bench_dist(int(args.size_gib * 2**30), root, args.repeat)
        if "remote" in sections:
            print("remote tier (upload and download, against boto3 on the same server):")
            from tiered_ckpt.bench_remote import bench_remote

            bench_remote(args.remote_size_gib, args.ranks, root, args.repeat)
        if "structure" in sections:
            print("the structure document of a nested optimizer state (save_sharded / load_sharded, warm):")
            from tiered_ckpt.bench_structure import bench_structure

            bench_structure(args.params, total, root, args.repeat)
        if "fsdp" in sections:
            from tiered_ckpt.bench_fsdp import bench_fsdp

            print("FSDP2 state from rank processes (gloo), next to torch.distributed.checkpoint on the same disk:")
            bench_fsdp(total, root, args.repeat)
        if "peers" in sections:
            from tiered_ckpt.bench_peers import bench_peers, plot

            print("peers: the same state saved and loaded by each (interleaved rounds):")
            table = bench_peers(states, root, args.repeat)
            if args.plot is not None:
                plot(table, args.plot)
                print(f"  plot written to {args.plot}")
        if "train" in sections:
            del states
            print("training loop (numpy matmuls, checkpoint every 20 steps):")
            from tiered_ckpt.bench_train import bench_train

            bench_train(root, args.ranks, args.train_steps, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
