"""Benchmark: save and load+verify speed next to this machine's raw limits, measured in one run.

Usage: ``python -m tiered_ckpt.bench [--size-gib 2] [--ranks 4] [--repeat 5] [--dir DIR]``

Prints the median GB/s of each measurement over ``--repeat`` runs and the ratios the
project targets (see shared notes/limits.md):

- save (sha256, xxh3, fsync, atomic commit) / raw write+fsync with two writers;
- warm load+verify into preallocated arrays / sha256 on all cores;
- cold load+verify into preallocated arrays / raw cold sequential read.

Loading into arrays it allocates itself is printed too ("new arrays"): it pays the
page faults of fresh memory on top.

The ``dist`` section (needs torch) saves the same total state from 1, 2 and 4 rank
processes under ``torch.distributed`` (gloo, one process per rank, each with its own
directory on the one disk) and prints the aggregate GB/s of a blocking save, from a
barrier before it to a barrier after every rank committed, next to the same processes
writing the same bytes to plain files with fsync, measured just before each save (so
both see the disk at the same moment; the ratio printed is the median of each run's
ratio). One untimed save first allocates the staging buffers, as in a training run's
steady state.

Cold reads evict the files from the page cache with ``posix_fadvise(DONTNEED)`` first.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .layout import step_dir_name
from .manager import CheckpointManager
from .manifest import ShardManifest
from .sharded import load_sharded, run_parallel, save_sharded

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
        _ratio(label, self.rate(name) / self.rate(baseline), target)

    def print_paired_ratio(self, label: str, name: str, baseline: str, target: str) -> None:
        """Print the median over runs of each run's ``name`` rate over its ``baseline`` rate.

        For measurements taken back to back in each run: on a disk whose speed swings,
        the ratio of two medians can pair a fast moment with a slow one.
        """
        pairs = zip(self.seconds[baseline], self.seconds[name], strict=True)
        _ratio(label, statistics.median(base / seconds for base, seconds in pairs), target)

    def print_rates(self) -> None:
        for name, values in self.seconds.items():
            spread = [self.total / t / 1e9 for t in values]
            print(f"  {name:<31} {self.rate(name):6.2f} GB/s   (min {min(spread):.2f}, max {max(spread):.2f})")


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _ratio(name: str, value: float, target: str) -> None:
    print(f"  {name:<46} {value:5.2f}  ({target})")


def bench_sync(states: list[dict[str, np.ndarray]], root: Path, repeat: int) -> None:
    """save_sharded / load_sharded next to the raw limits of the same disk."""
    timings = Timings(sum(a.nbytes for s in states for a in s.values()))
    rss = []
    for run in range(repeat):
        scratch = root / f"sync-{run}"
        scratch.mkdir()
        timings.record("raw write+fsync, 1 writer", raw_write(scratch, states, 1))
        timings.record("raw write+fsync, 2 writers", raw_write(scratch, states, 2))
        raw_files = sorted(scratch.glob("raw-*"))
        evict(raw_files)
        timings.record("raw read, cold", raw_read(raw_files))
        timings.record("raw read, warm", raw_read(raw_files))
        timings.record("sha256, all cores", sha256_all_cores(states))

        directory = scratch / "ckpt"
        start = time.perf_counter()
        rss.append(peak_rss_growth(functools.partial(save_sharded, states, directory, step=run)))
        timings.record("save_sharded", time.perf_counter() - start)
        evict(sorted(directory.glob("rank-*")))
        buffers = [{key: np.ones_like(array) for key, array in state.items()} for state in states]
        load = functools.partial(load_sharded, directory, len(states))
        timings.record("load+verify, cold", _timed(functools.partial(load, into=buffers)))
        timings.record("load+verify, warm", _timed(functools.partial(load, into=buffers)))
        del buffers
        timings.record("load+verify, warm, new arrays", _timed(load))
    timings.print_rates()
    print(f"  save_sharded peak extra RSS      {statistics.median(rss) / 2**20:6.1f} MiB")
    print("ratios (target):")
    timings.print_ratio("save / raw write+fsync 2 writers", "save_sharded", "raw write+fsync, 2 writers", ">= 0.95")
    timings.print_ratio("warm load+verify / sha256 all cores", "load+verify, warm", "sha256, all cores", ">= 0.90")
    timings.print_ratio("cold load+verify / raw cold read", "load+verify, cold", "raw read, cold", ">= 0.85")


def copy_time(states: list[dict[str, np.ndarray]], repeat: int) -> float:
    """Median seconds of np.copyto of every array into preallocated (already touched) buffers."""
    buffers = [{key: np.empty_like(array) for key, array in state.items()} for state in states]

    def copy_all() -> None:
        for source, target in zip(states, buffers, strict=True):
            for key, array in source.items():
                np.copyto(target[key], array)

    copy_all()  # fault the buffers in, as the manager's reused buffers are after its first save
    return statistics.median(_timed(copy_all) for _ in range(repeat))


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
    _ratio("save(blocking=False) / np.copyto", save_time / copy_seconds, "<= 1.2")
    _ratio("extra peak RSS / state size", growth / state_bytes, "<= 1.05")


def bench_retention(states: list[dict[str, np.ndarray]], root: Path, repeat: int) -> None:
    """A blocking save with keep_last=1 next to one without retention, in interleaved rounds.

    Each round saves 4 steps with each manager (the first untimed: it allocates the staging
    buffers), alternating which goes first; the figure is the median over rounds of each
    round's ratio of median save times. Files stay until the end, as in the other
    sections: deleting gigabytes between measurements would slow whichever comes next.
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
    timings.print_rates()
    print("ratios (target):")
    timings.print_paired_ratio("keep_last=1 / no retention (throughput)", names[1], names[None], ">= 0.91")


TRAIN_DIM, TRAIN_LAYERS = 1024, 3


def _train(steps: int, ranks: int, manager: CheckpointManager | None, every: int = 20) -> float:
    """Run a small MLP-like training loop; return its wall time. Checkpoints every ``every`` steps."""
    rng = np.random.default_rng(0)
    dim, layers, batch = TRAIN_DIM, TRAIN_LAYERS, 512
    master = rng.standard_normal(dim * dim * layers, dtype=np.float32) * 0.01
    exp_avg, exp_avg_sq = np.zeros_like(master), np.zeros_like(master)
    weights = master.reshape(layers, dim, dim)
    inputs = rng.standard_normal((batch, dim), dtype=np.float32)
    slices = np.array_split(np.arange(master.size), ranks)
    views = [slice(int(s[0]), int(s[-1]) + 1) for s in slices]
    start = time.perf_counter()
    for step in range(1, steps + 1):
        hidden = inputs
        for layer in range(layers):
            hidden = np.tanh(hidden @ weights[layer])
        grad = np.concatenate([(inputs.T @ hidden).ravel() * 1e-6 for _ in range(layers)])
        exp_avg *= 0.9
        exp_avg += 0.1 * grad
        exp_avg_sq *= 0.999
        exp_avg_sq += 0.001 * grad * grad
        master -= 1e-3 * exp_avg / (np.sqrt(exp_avg_sq) + 1e-8)
        if manager is not None and step % every == 0:
            manager.save(
                step,
                [
                    {
                        "master_fp32": master[v],
                        "exp_avg": exp_avg[v],
                        "exp_avg_sq": exp_avg_sq[v],
                        "step": np.array(step, dtype=np.int64),
                    }
                    for v in views
                ],
            )
    if manager is not None:
        manager.wait()
    return time.perf_counter() - start


def bench_train(root: Path, ranks: int, steps: int, repeat: int) -> None:
    """Slowdown of a training loop that checkpoints every 20 steps, against the same loop without."""
    plain: list[float] = []
    checkpointed: list[float] = []
    for run in range(repeat):  # interleaved, so drift in the machine's speed hits both alike
        plain.append(_train(steps, ranks, None))
        with CheckpointManager(root / f"train-{run}", world_size=ranks, keep_last=2) as manager:
            checkpointed.append(_train(steps, ranks, manager))
    state_bytes = 3 * 4 * TRAIN_DIM * TRAIN_DIM * TRAIN_LAYERS  # fp32 master weights and two moments
    base, with_ckpt = statistics.median(plain), statistics.median(checkpointed)
    print(
        f"  state {state_bytes / 2**20:.0f} MiB, {steps} steps of {base / steps * 1e3:.0f} ms, "
        f"{steps // 20} checkpoints"
    )
    print(f"  without checkpoints  {base:7.2f} s")
    print(f"  with checkpoints     {with_ckpt:7.2f} s")
    print(f"  slowdown             {100 * (with_ckpt / base - 1):7.1f} %   (target <= 2 %)")


def _start_moto(port: int) -> subprocess.Popen[bytes]:
    """moto's S3 server in its own process (so it does not share this process's GIL)."""
    return subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _remote_run(
    bucket: str,
    client: Any,
    options: dict[str, Any],
    source: Path,
    manifest: ShardManifest,
    target: Path,
    timings: Timings,
) -> None:
    """One run of the remote benchmark: ours and boto3's, up and down, into one fresh bucket."""
    from .local import LocalTier
    from .remote import RemoteTier
    from .store import TieredStore
    from .uploader import Uploader

    client.create_bucket(Bucket=bucket)
    tier = RemoteTier(f"s3://{bucket}/ours", options)
    source_store = TieredStore(LocalTier(source), tier)
    with source_store.local.lock(), contextlib.closing(Uploader(source_store)) as uploader:
        timings.record("tiered_ckpt upload", _timed(lambda: uploader.push(manifest.step)))
    target_store = TieredStore(LocalTier(target), tier)
    with target_store.local.lock():
        target_store.local.new_step_dir(manifest.step)
        download = functools.partial(target_store.download_shard, manifest.step)
        timings.record("tiered_ckpt download+verify", _timed(lambda: run_parallel(download, manifest.shards, None)))
    shard_files = [source / step_dir_name(manifest.step) / record.path for record in manifest.shards]
    timings.record(
        "boto3 upload_file",
        _timed(lambda: [client.upload_file(str(path), bucket, f"boto3/{path.name}") for path in shard_files]),
    )
    timings.record(
        "boto3 download_file",
        _timed(
            lambda: [
                client.download_file(bucket, f"boto3/{path.name}", str(target / f"boto3-{path.name}"))
                for path in shard_files
            ]
        ),
    )
    shutil.rmtree(target)


def bench_remote(size_gib: float, ranks: int, root: Path, repeat: int) -> None:
    """Upload and download GB/s to a local moto S3 server, next to boto3's upload_file/download_file."""
    try:
        import boto3
    except ImportError:
        print("  skipped: needs boto3 and moto (pip install 'tiered-ckpt[test]')")
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = _start_moto(port)
    endpoint = f"http://127.0.0.1:{port}"
    credentials = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}
    client = boto3.client("s3", endpoint_url=endpoint, **credentials)
    for _ in range(600):  # readiness poll: go on as soon as the server answers
        try:
            client.list_buckets()
            break
        except Exception:
            time.sleep(0.1)
    options = {
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    try:
        source = root / "remote-source"
        manifest = save_sharded(make_states(int(size_gib * 2**30), ranks), source / step_dir_name(1), step=1)
        timings = Timings(manifest.total_bytes)
        for run in range(repeat):
            _remote_run(f"tiered-bench-{run}", client, options, source, manifest, root / f"download-{run}", timings)
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).read()
        print(f"  checkpoint {manifest.total_bytes / 2**30:.2f} GiB in {ranks} shards, moto S3 server on loopback")
        timings.print_rates()
        print("ratios (target):")
        timings.print_ratio("upload / boto3 upload_file", "tiered_ckpt upload", "boto3 upload_file", ">= 1.0")
        timings.print_ratio(
            "download+verify / boto3 download_file", "tiered_ckpt download+verify", "boto3 download_file", ">= 1.0"
        )
    finally:
        server.terminate()
        server.wait()


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
        for raw_seconds, save_seconds in _rank_processes(total_bytes, processes, directory, repeat):
            timings.record(_raw_label(processes), raw_seconds)
            timings.record(_save_label(processes), save_seconds)
        shutil.rmtree(directory)  # 2 x size x (repeat + 1) bytes: more than some disks hold three times over
        os.sync()
    print(f"  state {total_bytes / 2**30:.2f} GiB in total, split over the rank processes")
    timings.print_rates()
    print("ratios (target):")
    for processes in RANK_PROCESSES:
        timings.print_paired_ratio(
            f"save / raw, {processes} rank process{'es' if processes > 1 else ''}",
            _save_label(processes),
            _raw_label(processes),
            ">= 0.95",
        )


def _save_label(processes: int) -> str:
    return f"save, {processes} rank process{'es' if processes > 1 else ''}"


def _raw_label(processes: int) -> str:
    return f"raw write+fsync, {processes} process{'es' if processes > 1 else ''}"


def _rank_processes(total_bytes: int, processes: int, root: Path, repeat: int) -> list[tuple[float, float]]:
    """Run ``processes`` rank processes that each write and save their part ``repeat`` times.

    Returns rank 0's (raw write seconds, save seconds) of each run.
    """
    command = [sys.executable, "-m", "tiered_ckpt.bench", "--rank-process"]
    timings = run_rank_processes(command, root, processes, "dist", total_bytes=total_bytes, repeat=repeat)
    return [(float(raw), float(save)) for raw, save in timings]


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
    """One rank process of the ``dist`` section: write, then save, this rank's part ``repeat`` times."""
    import torch.distributed as dist

    from .coordination import TorchDistributedCoordinator

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
            timings.append((raw_seconds, timed(lambda: manager.save(step, state, blocking=True))))  # noqa: B023
    if rank == 0:
        Path(config["results"]).write_text(json.dumps(timings))
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiered_ckpt.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="total state size (default 2)")
    parser.add_argument("--ranks", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    parser.add_argument(
        "--only",
        choices=["sync", "async", "retention", "dist", "train", "remote", "structure", "fsdp"],
        action="append",
        help="run only these sections (repeatable)",
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

    in_memory = {"sync", "async", "retention"}
    states = make_states(int(args.size_gib * 2**30), args.ranks) if in_memory & set(sections) else []
    total = int(args.size_gib * 2**30)
    print(
        f"state: {total / 2**30:.2f} GiB over {args.ranks} ranks, medians of {args.repeat} runs, cpus={os.cpu_count()}"
    )
    # Every run's files stay until the end (2 x size x repeat on disk): on a disk mounted
    # with discard, deleting gigabytes slows reads and writes for seconds afterwards.
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
            bench_remote(args.remote_size_gib, args.ranks, root, args.repeat)
        if "structure" in sections:
            print("the structure document of a nested optimizer state (save_sharded / load_sharded, warm):")
            from .bench_structure import bench_structure

            bench_structure(args.params, total, root, args.repeat)
        if "fsdp" in sections:
            from .bench_fsdp import bench_fsdp

            print("FSDP2 state from rank processes (gloo), next to torch.distributed.checkpoint on the same disk:")
            bench_fsdp(total, root, args.repeat)
        if "train" in sections:
            del states
            print("training loop (numpy matmuls, checkpoint every 20 steps):")
            bench_train(root, args.ranks, args.train_steps, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
