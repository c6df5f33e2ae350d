"""The ``fresh`` section of the benchmark: every method and every limit in a process of its own.

On the same state (``--size-gib`` over ``--ranks``), each measurement runs in a fresh
``python`` process (:mod:`benchmarks.fresh_worker`, parameters and results as JSON), so
no method inherits another's warm allocator, imported libraries or page-cache state:

- each method's durable save (tiered_ckpt ``save_sharded``: sha256 + xxh3 of every byte;
  safetensors ``save_file`` + fsync; ``torch.save`` + fsync; DCP ``FileSystemWriter``),
  with the CPU seconds the saving process spent (``resource.getrusage``), then its load
  into new arrays cold (the files evicted from the page cache first) and warm (read into
  it first), and for tiered_ckpt the load into the caller's arrays and the load verified
  by xxh3-64 (``verify="fast"``), cold and warm;
- the limits, in the same round: the same bytes written durably by plain code, one
  stream and several, O_DIRECT and buffered with writeback started every 8 MiB
  (``sync_file_range``) and the cache released behind it (``posix_fadvise(DONTNEED)``),
  the fastest being the disk's write limit; the disk's read limit cold and warm (the
  faster of one reader and a load's readers); sha256 on all cores (and its CPU seconds)
  and xxh3 alone;
- with boto3 and moto installed, the upload of tiered_ckpt's checkpoint to moto's S3
  server on loopback through the remote tier's defaults, next to boto3's ``upload_file``
  of the same shard files, each into a fresh bucket.

The blocks (limits, each method) rotate from round to round; every ratio is the median of
the rounds' own ratios, and each is printed next to its target of issue 45 as
:class:`~benchmarks.harness.Target` rows that ``benchmarks/__main__.py`` gathers with
other sections' into one summary.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import statistics
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness import Target, cache, clear, evict, moto_server, print_targets, run_process, show_ratio
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.io.parallel import default_workers

__all__ = ["METHODS", "bench_fresh"]

METHODS = ("tiered_ckpt", "safetensors", "torch.save", "dcp")
_NEEDS = {"safetensors": "safetensors", "torch.save": "torch", "dcp": "torch"}
GIB = 2**30
WRITE_LIMIT = "disk write limit (fastest plain write)"


class _Round:
    """One round's measurements: seconds and CPU seconds by name, each in its own process."""

    def __init__(self, worker: str, size: int, ranks: int) -> None:
        self.worker, self.size, self.ranks = worker, size, ranks
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def run(self, name: str, **task: Any) -> None:
        result = run_process(self.worker, {"size": self.size, "ranks": self.ranks, **task})
        self.seconds[name], self.cpu[name] = float(result["seconds"]), float(result["cpu_seconds"])


def _files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file())


def _limits(one: _Round, scratch: Path, run: int) -> None:
    """The plain writes (the order of the variants rotates by round), the reads, the hashes."""
    streams = sorted({1, min(2, one.ranks), one.ranks})
    variants = [(direct, count) for direct in (True, False) for count in streams]
    variants = variants[run % len(variants) :] + variants[: run % len(variants)]
    for index, (direct, count) in enumerate(variants):
        where = scratch / f"write-{index}"
        one.run(f"write {'O_DIRECT' if direct else 'buffered'}, {count} stream(s)", task="write",
                directory=str(where), direct=direct, streams=count)  # fmt: skip
        if index < len(variants) - 1:
            clear(where)
    files = _files(where)
    for temperature in ("cold", "warm"):
        for readers in sorted({1, default_workers(one.ranks)}):
            if temperature == "cold":
                evict(files)
            else:
                cache(files)
            one.run(f"read {temperature}, {readers} reader(s)", task="read", directory=str(where), streams=readers)
    clear(where)
    for kind in ("sha256", "xxh3"):
        one.run(kind, task=kind)


def _method(one: _Round, method: str, scratch: Path, upload: tuple[str, int] | None) -> None:
    """Save with ``method``, load it back cold and warm; tiered_ckpt also into the caller's
    arrays, and uploads next to boto3 when ``upload`` (endpoint, round) is given."""
    root = scratch / method
    directory = root / step_dir_name(1) if method == "tiered_ckpt" else root
    one.run(f"{method} save", task="save", method=method, directory=str(directory))
    files = _files(directory)
    loads = [method, "tiered_ckpt-into", "tiered_ckpt-fast"] if method == "tiered_ckpt" else [method]
    for temperature in ("cold", "warm"):
        for load in loads:
            if temperature == "cold":
                evict(files)
            else:
                cache(files)
            one.run(f"{load} load {temperature}", task="load", method=load, directory=str(directory))
    if upload is not None:
        endpoint, run = upload
        order = ("tiered_ckpt", "boto3") if run % 2 == 0 else ("boto3", "tiered_ckpt")
        for uploader in order:
            one.run(f"{uploader} upload", task="upload", method=uploader, directory=str(root),
                    endpoint=endpoint, bucket=f"fresh-{run}-{uploader.replace('_', '-')}")  # fmt: skip
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).read()
    clear(root)


def _rounds(worker: str, size: int, ranks: int, root: Path, repeat: int, endpoint: str | None) -> list[_Round]:
    methods = [method for method in METHODS if importlib.util.find_spec(_NEEDS.get(method, "numpy")) is not None]
    rounds = []
    for run in range(repeat):
        one = _Round(worker, size, ranks)
        scratch = root / f"fresh-{run}"
        blocks: list[Callable[[], None]] = [functools.partial(_limits, one, scratch, run)]
        for method in methods:
            upload = (endpoint, run) if endpoint is not None and method == "tiered_ckpt" else None
            blocks.append(functools.partial(_method, one, method, scratch, upload))
        shift = run % len(blocks)
        for block in blocks[shift:] + blocks[:shift]:
            block()
        clear(scratch)
        _derive_limits(one)
        rounds.append(one)
    return rounds


def _derive_limits(one: _Round) -> None:
    """Add the round's limits as seconds: the disk's write limit (its fastest plain write), its
    read limits (the faster number of readers) and each min(sha256, read) (the slower)."""
    one.seconds[WRITE_LIMIT] = min(seconds for name, seconds in one.seconds.items() if name.startswith("write "))
    for temperature in ("cold", "warm"):
        read = min(seconds for name, seconds in one.seconds.items() if name.startswith(f"read {temperature},"))
        one.seconds[f"disk read limit, {temperature}"] = read
        one.seconds[f"min(sha256, read {temperature})"] = max(read, one.seconds["sha256"])


def _median(values: Iterator[float]) -> float:
    return statistics.median(list(values))


def bench_fresh(
    size: int, ranks: int, root: Path, repeat: int, *, worker: str = "benchmarks.fresh_worker", upload: bool = True
) -> list[Target]:
    """Run the section (see the module doc), print its tables and targets, and return the targets."""
    with contextlib.ExitStack() as stack:
        served = upload and all(importlib.util.find_spec(name) for name in ("boto3", "moto"))
        endpoint = str(stack.enter_context(moto_server())[0]) if served else None
        rounds = _rounds(worker, size, ranks, root, repeat, endpoint)
    measured = rounds[0].seconds.keys()

    def rate(name: str) -> float:
        return size / statistics.median(one.seconds[name] for one in rounds) / 1e9

    def ratio(name: str, baseline: str) -> float:
        """Median of the rounds' own (rate of ``name``) / (rate of ``baseline``)."""
        return _median(one.seconds[baseline] / one.seconds[name] for one in rounds)

    def cpu_per_gib(name: str) -> float:
        return _median(one.cpu[name] / (size / GIB) for one in rounds)

    print(f"  {size / GIB:.2f} GiB over {ranks} ranks, each measurement in a fresh process, {repeat} round(s)")
    print("  every measurement: GB/s, median (min, max) of the rounds; CPU-s per GiB, median:")
    for name in measured:
        spread = [size / one.seconds[name] / 1e9 for one in rounds]
        cpu = f"{cpu_per_gib(name):6.2f} CPU-s/GiB" if name in rounds[0].cpu else ""
        print(f"    {name:<40} {rate(name):6.2f} GB/s ({min(spread):.2f}, {max(spread):.2f})  {cpu}")
    print(f"  {'method':<13} {'save':>6} {'CPU-s/GiB':>10} {'load cold':>10} {'load warm':>10}")
    methods = [method for method in METHODS if f"{method} save" in measured]
    for method in methods:
        print(
            f"  {method:<13} {rate(f'{method} save'):6.2f} {cpu_per_gib(f'{method} save'):10.2f} "
            f"{rate(f'{method} load cold'):10.2f} {rate(f'{method} load warm'):10.2f}"
        )
    if "tiered_ckpt save" in measured:
        for load, said in (("tiered_ckpt-into", "into arrays"), ("tiered_ckpt-fast", 'verify="fast"')):
            print(
                f"  {'  ' + said:<13} {'':>6} {'':>10} {rate(f'{load} load cold'):10.2f} "
                f"{rate(f'{load} load warm'):10.2f}"
            )
    for name in ("tiered_ckpt upload", "boto3 upload"):
        if name in measured:
            print(f"  {name:<36} {rate(name):6.2f} GB/s")
    targets = _targets(rounds, methods, ratio)
    print("targets of issue 45 (ratios: medians of each round's own):")
    print_targets(targets)
    return targets


def _targets(rounds: list[_Round], methods: list[str], ratio: Callable[[str, str], float]) -> list[Target]:
    measured = rounds[0].seconds.keys()
    if "tiered_ckpt save" not in measured:
        return []
    # Issue 45: item 5 (verified loads at the hash's limit, the writer's CPU), item 7 (saves ahead of every peer)
    show_ratio("save / best plain durable write", ratio("tiered_ckpt save", WRITE_LIMIT), "issue 26: >= 0.9")
    targets = []
    peers = [method for method in methods if method != "tiered_ckpt"]
    for peer in peers:
        targets.append(Target(7, f"save / {peer} save", ratio("tiered_ckpt save", f"{peer} save"), 1.0, strict=True))
    for temperature in ("warm", "cold"):
        for peer in peers:
            value = ratio(f"tiered_ckpt-fast load {temperature}", f"{peer} load {temperature}")
            label = f'verify="fast" load {temperature} / {peer} load (new arrays)'
            targets.append(Target(5, label, value, 1.0, strict=True))
    for temperature in ("warm", "cold"):
        value = ratio(f"tiered_ckpt-into load {temperature}", f"min(sha256, read {temperature})")
        label = f"into caller's arrays {temperature} / min(sha256 all cores, read {temperature})"
        targets.append(Target(5, label, value, 0.9))
    writer = _median(one.cpu["tiered_ckpt save"] / one.cpu["sha256"] for one in rounds)
    targets.append(Target(5, "writer CPU-s per GiB / sha256's own", writer, 1.3, at_least=False))
    if "tiered_ckpt upload" in measured:
        show_ratio("upload / boto3 upload_file, moto", ratio("tiered_ckpt upload", "boto3 upload"), "issue 26: >= 1.0")
    return targets
