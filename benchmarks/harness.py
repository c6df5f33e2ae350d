"""What the benchmark's sections share: the state they save, the clock, this machine's limits,
rank processes, moto's S3 server, the printed figures and the command line.

A figure is only compared with a limit measured in the same round (the disk's speed swings
within a minute): :func:`measure_limits` records the limits of a save and a load now, and
:class:`Timings` prints medians as GB/s and ratios as the median of each round's own ratio.
Cold reads evict the files from the page cache with ``posix_fadvise(DONTNEED)`` first.
The harness imports no section: ``benchmarks/__main__.py`` picks them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tiered_ckpt.dist.coordination import decode_gathered
from tiered_ckpt.format.layout import shard_name
from tiered_ckpt.io.durable import atomic_write, write_all
from tiered_ckpt.io.parallel import default_workers

__all__ = [
    "CACHED_WRITE",
    "COLD_READ",
    "DIRECT_WRITE",
    "DISK_LIMIT",
    "LIMIT",
    "SHA256_LIMIT",
    "SimulatedRanks",
    "Target",
    "Timings",
    "barrier_timed",
    "cache",
    "check_plotting",
    "clear",
    "evict",
    "fsync_tree",
    "make_rank_state",
    "make_states",
    "measure_limits",
    "ModelledBucket",
    "modelled_bucket",
    "moto_server",
    "s3_options",
    "parser",
    "peak_rss_growth",
    "per_shard",
    "positive",
    "print_targets",
    "raw_read",
    "raw_write",
    "run_process",
    "run_rank_processes",
    "sha256_all_cores",
    "show_ratio",
    "timed",
]

CHUNK = 1 << 20
REPOSITORY = Path(__file__).resolve().parent.parent  # holds benchmarks/: rank processes import it from there


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
    ``writers`` files at a time, paced like a save (:func:`~tiered_ckpt.io.durable.atomic_write`:
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

    def print_ratio(self, label: str, name: str, baseline: str, target: str) -> float:
        """Print the rate of ``name`` over the rate of ``baseline``, with its target; return it."""
        value = self.rate(name) / self.rate(baseline)
        show_ratio(label, value, target)
        return value

    def print_paired_ratio(self, label: str, name: str, baseline: str, target: str) -> float:
        """Print the median over runs of each run's ``name`` rate over its ``baseline`` rate.

        For measurements taken back to back in each run: on a disk whose speed swings,
        the ratio of two medians can pair a fast moment with a slow one. Returns it.
        """
        pairs = zip(self.seconds[baseline], self.seconds[name], strict=True)
        value = statistics.median(base / seconds for base, seconds in pairs)
        show_ratio(label, value, target)
        return value

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


def run_rank_processes(
    command: list[str],
    root: Path,
    processes: int,
    section: str,
    environment: Mapping[str, str] | None = None,
    **settings: Any,
) -> Any:
    """Run ``processes`` rank processes (``command CONFIG RANK``, with ``environment`` added to
    this process's) joined through a file store in ``root`` (created here), with a config of
    ``settings`` plus the store, ``root``, the process count and where rank 0 writes its
    timings; return those timings (JSON)."""
    root.mkdir()
    config = root / "config.json"
    results = root / "timings.json"
    paths = {"store": str(root / "store"), "root": str(root), "results": str(results)}
    config.write_text(json.dumps({**paths, "processes": processes, **settings}))
    # The repository first on the path: ``python -m benchmarks.<section>`` works from any directory.
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, **(environment or {}), "PYTHONPATH": path}
    children = [subprocess.Popen([*command, str(config), str(rank)], env=environment) for rank in range(processes)]
    codes = [child.wait() for child in children]
    if any(codes):
        raise RuntimeError(f"rank processes of the {section} benchmark exited with {codes}")
    return json.loads(results.read_text())


def run_process(module: str, task: Mapping[str, Any]) -> Any:
    """Run ``python -m module TASK_JSON`` in a fresh interpreter (the repository first on its
    path) and return the JSON it prints last on stdout; its exit status and stderr in the
    error if it fails."""
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", module, json.dumps(dict(task))],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{module} {task} exited with {result.returncode}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Target:
    """One ratio an issue targets, as measured: ``value`` against ``bound`` (at least, or with
    ``at_least=False`` at most; ``strict``: more than), under its ``item`` of the issue."""

    item: int
    label: str
    value: float
    bound: float
    at_least: bool = True
    strict: bool = False

    @property
    def met(self) -> bool:
        if self.at_least:
            return self.value > self.bound if self.strict else self.value >= self.bound
        return self.value < self.bound if self.strict else self.value <= self.bound

    @property
    def goal(self) -> str:
        return ("> " if self.strict else ">= ") + f"{self.bound:.2f}" if self.at_least else f"<= {self.bound:.2f}"


def print_targets(targets: Sequence[Target], unmeasured: Mapping[int, str] | None = None) -> None:
    """Print each target's ratio next to its goal, "met" or "not met", by item; then the items
    no section of this run measured (``unmeasured``: item -> what measures it)."""
    for target in sorted(targets, key=lambda target: target.item):
        verdict = "met" if target.met else "not met"
        print(f"  item {target.item}: {target.label:<60} {target.value:6.2f}  {target.goal:<8} {verdict}")
    for item, what in sorted((unmeasured or {}).items()):
        if all(target.item != item for target in targets):
            print(f"  item {item}: not measured in this run ({what})")


MOTO_KEYS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}


@contextlib.contextmanager
def moto_server() -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """moto's S3 server in its own process (so it does not share this process's GIL) on a free
    loopback port, once it answers: yields its endpoint, a boto3 client of it and the
    ``storage_options`` of a remote tier on it; stops it afterwards. Needs moto and boto3."""
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, **MOTO_KEYS)
        for _ in range(600):  # readiness poll: go on as soon as the server answers
            try:
                client.list_buckets()
                break
            except Exception:
                time.sleep(0.1)
        yield endpoint, client, s3_options(endpoint)
    finally:
        server.terminate()
        server.wait()


def s3_options(endpoint: str) -> dict[str, Any]:
    """The ``storage_options`` of a remote tier on the moto server (or the bucket model) at ``endpoint``."""
    return {
        "key": MOTO_KEYS["aws_access_key_id"],
        "secret": MOTO_KEYS["aws_secret_access_key"],
        "client_kwargs": {"endpoint_url": endpoint, "region_name": MOTO_KEYS["region_name"]},
        "skip_instance_cache": True,
    }


BUCKET_MODEL_SCALE = 10.0
"""How many times slower than S3 the modelled bucket runs (:func:`modelled_bucket`): see
``benchmarks/bucket_model.py``'s ``BucketModel.scaled``."""

S3_FIGURES = {"bandwidth": 85e6, "latency": 0.03, "writes": 3500.0, "reads": 5500.0}
"""S3's published figures: about 85 MB/s a connection (AWS's performance guidelines reach 100
Gb/s with about 140 connections), tens of ms to the first byte, 3,500 writes and 5,500 reads
a second a partitioned key prefix."""


@dataclass
class ModelledBucket:
    """A bucket model's proxy: its ``endpoint``, a boto3 ``client`` and the ``options`` of a remote
    tier through it, its ``model`` (``BucketModel``'s fields, as it runs them) and, once it
    stopped, the requests it ``refused`` with 503 SlowDown."""

    endpoint: str
    client: Any
    options: dict[str, Any]
    model: dict[str, Any]
    refused: int = 0


@contextlib.contextmanager
def modelled_bucket(
    upstream: str,
    module: str,
    *,
    scale: float = BUCKET_MODEL_SCALE,
    rate_limit: bool = True,
    rate_share: float = 1.0,
) -> Iterator[ModelledBucket]:
    """The bucket model (``python -m`` ``module``: ``benchmarks.bucket_model``, a process of its own)
    in front of the moto server at ``upstream``: S3's figures slowed ``scale`` times, answering 503
    SlowDown past its request rates unless ``rate_limit`` is False, the rates multiplied by
    ``rate_share`` (the share of a bucket's rates a job's ranks leave these). Stopped when the
    context ends."""
    import boto3
    from botocore.config import Config

    told = json.dumps({"scale": scale, "rate_limit": rate_limit, "rate_share": rate_share})
    command = [sys.executable, "-m", module, upstream, told]
    proxy = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPOSITORY)
    assert proxy.stdin is not None and proxy.stdout is not None
    try:
        started = json.loads(proxy.stdout.readline() or "null")
        if not isinstance(started, dict):
            raise RuntimeError("the bucket model did not start")
        endpoint = started["endpoint"]
        # boto3's standard retries (3 tries, backoff) answer the model's 503s, as against S3
        client = boto3.client("s3", endpoint_url=endpoint, config=Config(retries={"mode": "standard"}), **MOTO_KEYS)
        bucket = ModelledBucket(endpoint, client, s3_options(endpoint), started["model"])
    except BaseException:
        proxy.kill()
        proxy.wait()
        raise
    try:
        yield bucket
    finally:
        proxy.stdin.close()
        ended = proxy.stdout.read().strip()
        proxy.wait()
        bucket.refused = json.loads(ended.splitlines()[-1])["refused"] if ended else 0


def check_plotting(path: Path) -> None:
    """Fail before measuring anything if ``path`` cannot be drawn: no matplotlib, or no such directory."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from None
    if not path.parent.resolve().is_dir():
        raise SystemExit(f"--plot {path}: no directory {path.parent}")


def positive(text: str) -> int:
    """An integer of at least 1, for argparse."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def parser(sections: Sequence[str], description: str) -> argparse.ArgumentParser:
    """The benchmark's command line; ``--only`` picks among ``sections`` (repeatable)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=description)
    parser.add_argument("--size-gib", type=float, default=2.0, help="total state size (default 2)")
    parser.add_argument("--ranks", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    parser.add_argument("--only", choices=list(sections), action="append", help="run only these sections (repeatable)")
    parser.add_argument("--peers", action="store_true", help="add the peers section (safetensors, torch.save, DCP)")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw the peers section's table (implies --peers)"
    )
    parser.add_argument("--train-steps", type=int, default=200, help="training loop steps (default 200)")
    parser.add_argument(
        "--remote-size-gib", type=float, default=1.0, help="checkpoint size for 'remote' and 'compression' (default 1)"
    )
    parser.add_argument("--params", type=int, default=10_000, help="parameter tensors for 'structure' (default 10000)")
    parser.add_argument(
        "--small-arrays", type=positive, default=40_000, help="arrays of the 'small-arrays' shard (default 40000)"
    )
    parser.add_argument(
        "--small-arrays-mib", type=positive, default=256, help="bytes of the 'small-arrays' shard, MiB (default 256)"
    )
    return parser


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory under ``directory``, and ``directory`` itself."""
    for path in [*directory.rglob("*"), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def per_shard(function: Callable[[int], object], shards: int) -> list[object]:
    """``function`` of each shard index, one thread per shard, in order."""
    with ThreadPoolExecutor(shards) as pool:
        return list(pool.map(function, range(shards)))


def barrier_timed(coordinator: Any, action: Callable[[], object]) -> float:
    """Seconds of ``action`` on every rank, from a barrier before it to a barrier after it."""
    coordinator.barrier()
    start = time.perf_counter()
    action()
    coordinator.barrier()
    return time.perf_counter() - start


class SimulatedRanks:
    """A coordinator of ``world_size`` ranks in one process, which holds rank 0 and leads: each
    collective gives it every rank's payload, made from its own by :meth:`renumber`, sent
    through JSON as :class:`~tiered_ckpt.dist.coordination.TorchDistributedCoordinator` sends it.
    Enough for a save's and a restore's collectives from ranks that all hold the same state."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.local_ranks = (0,)
        self.is_leader = True
        self.sending = 0.0  # CPU seconds spent making the other ranks' payloads

    def barrier(self) -> None:
        return None

    def all_gather(self, payload: Any) -> list[Any]:
        start = time.process_time()  # the other ranks' work, not the leader's: not counted
        sent = [json.dumps(self.renumber(payload, rank)).encode() for rank in range(self.world_size)]
        self.sending += time.process_time() - start
        return decode_gathered(sent)

    def broadcast(self, payload: Any) -> Any:
        return json.loads(json.dumps(payload))

    def broadcast_array(self, array: np.ndarray, source: int) -> None:
        raise NotImplementedError("a simulated rank holds no other rank's arrays")

    def new_channel(self) -> SimulatedRanks:
        return self

    def renumber(self, payload: Any, rank: int) -> Any:
        """Rank 0's payload as rank ``rank`` would send it: its shard records renumbered."""
        if not isinstance(payload, dict) or not isinstance(payload.get("result"), dict):
            return payload
        shards = payload["result"].get("shards")
        if not isinstance(shards, (list, tuple)) or rank == 0:
            return payload
        renumbered = [
            {
                **shard,
                "rank": rank,
                "path": shard_name(rank, self.world_size),
                "param_shard_offset": shard["param_shard_numel"] * rank,
            }
            for shard in shards
        ]
        return {**payload, "result": {**payload["result"], "shards": renumbered}}
