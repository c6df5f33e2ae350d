"""The ``peers`` section of the benchmark: the same state through this library and its peers.

In one process, in interleaved rounds (the order of the methods rotates each round), each
method saves the same state of ``ranks`` shards durably (fsync) into a directory of its
own, loads it back warm (from the page cache) and cold (after evicting its files), and,
where it has one, saves asynchronously, timing how long that call blocks the caller:

- ``tiered_ckpt``: ``save_sharded`` (sha256 + xxh3 of every byte, atomic commit),
  ``load_sharded`` into new arrays (every byte verified), ``CheckpointManager.save(blocking=False)``;
- ``safetensors``: ``save_file`` per shard + fsync, one thread per shard like the others,
  ``load_file`` (nothing verified);
- ``torch.save``: one file per shard + fsync, ``torch.load`` (pickle; nothing verified);
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (2 threads) of a
  state holding every shard, ``dcp.load`` into it (nothing verified), ``dcp.async_save``.

Peak extra RSS is that of the save (blocking), above the RSS before it. A round's files
are removed after it. Beside them the
same run measures the limits: write + fsync with as many writers as shards and writeback
started every few MiB, raw sequential reads warm and cold, sha256 on all cores.
Every figure is a median of the rounds.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    COLD_READ,
    DISK_LIMIT,
    SHA256_LIMIT,
    Timings,
    cache,
    clear,
    evict,
    fsync_tree,
    measure_limits,
    peak_rss_growth,
    per_shard,
    timed,
)
from tiered_ckpt.io.parallel import default_workers

__all__ = ["PeerRow", "PeerTable", "bench_peers", "plot"]


@dataclass(frozen=True)
class PeerRow:
    """One method's medians: GB/s of save, warm and cold load; seconds an async save blocks
    (None: it has none); peak extra RSS of a save in bytes."""

    method: str
    save: float
    load_warm: float
    load_cold: float
    async_stall: float | None
    peak_rss: int


@dataclass(frozen=True)
class PeerTable:
    """The rows, this library's first, and the limits (GB/s) measured in the same run."""

    total_bytes: int
    rows: tuple[PeerRow, ...]
    limits: dict[str, float] = field(default_factory=dict)


States = list[dict[str, Any]]


@dataclass(frozen=True)
class _Method:
    """How one peer saves ``states`` into a directory and loads them from it (``states`` only
    give the shapes to a peer that loads in place), and saves asynchronously: returning the
    seconds the call blocked and a function that waits for the save to end."""

    name: str
    save: Callable[[States, Path], object]
    load: Callable[[States, Path], object]
    async_save: Callable[[States, Path], tuple[float, Callable[[], None]]] | None = None


def _filesper_shard(directory: Path, shards: int, write: Callable[[int, Path], object], suffix: str) -> None:
    """``write(rank, path)`` each shard's file in ``directory``, one thread per shard, then fsync them all."""
    directory.mkdir(parents=True)
    per_shard(lambda rank: write(rank, directory / f"{rank}{suffix}"), shards)
    fsync_tree(directory)


def _ours() -> _Method:
    from tiered_ckpt.manager import CheckpointManager
    from tiered_ckpt.oneshot import load_sharded, save_sharded
    from tiered_ckpt.options import LocalOptions, RuntimeOptions

    def async_save(states: States, directory: Path) -> tuple[float, Callable[[], None]]:
        full = RuntimeOptions(incremental=False)  # step 2 saves step 1's arrays: written again, as the peers do
        manager = CheckpointManager(LocalOptions(directory, keep_last=None), world_size=len(states), runtime=full)
        manager.save(1, states)  # allocates the staging buffers, which a job's later saves reuse
        manager.wait()
        return timed(lambda: manager.save(2, states, blocking=False)), manager.close

    return _Method(
        "tiered_ckpt",
        lambda states, directory: save_sharded(states, directory, step=1),
        lambda states, directory: load_sharded(directory, len(states)),
        async_save,
    )


def _safetensors() -> _Method | None:
    try:
        from safetensors.numpy import load_file, save_file
    except ImportError:
        return None

    def save(states: States, directory: Path) -> None:
        _filesper_shard(directory, len(states), lambda rank, path: save_file(states[rank], str(path)), ".safetensors")

    def load(states: States, directory: Path) -> object:
        return per_shard(lambda rank: load_file(str(directory / f"{rank}.safetensors")), len(states))

    return _Method("safetensors", save, load)


def _tensors(states: States) -> States:
    import torch

    return [{key: torch.from_numpy(np.asarray(value)) for key, value in state.items()} for state in states]


def _torch_save() -> _Method | None:
    try:
        import torch
    except ImportError:
        return None

    def save(states: States, directory: Path) -> None:
        tensors = _tensors(states)
        _filesper_shard(directory, len(states), lambda rank, path: torch.save(tensors[rank], path), ".pt")

    def load(states: States, directory: Path) -> object:
        return per_shard(lambda rank: torch.load(directory / f"{rank}.pt", weights_only=True), len(states))

    return _Method("torch.save", save, load)


def _dcp() -> _Method | None:
    try:
        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return None

    def flat(states: States) -> dict[str, Any]:
        return {f"{rank}/{key}": value for rank, state in enumerate(_tensors(states)) for key, value in state.items()}

    def writer(directory: Path) -> Any:
        return dcp.FileSystemWriter(str(directory), thread_count=2)

    def load(states: States, directory: Path) -> object:
        target = {key: torch.empty_like(value) for key, value in flat(states).items()}  # dcp loads in place
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(directory)))
        return target

    def async_save(states: States, directory: Path) -> tuple[float, Callable[[], None]]:
        state = flat(states)
        futures: list[Any] = []  # a Future (CPU, no staging option given)
        stall = timed(lambda: futures.append(dcp.async_save(state, storage_writer=writer(directory))))
        return stall, lambda: futures[0].result()

    return _Method(
        "dcp", lambda states, directory: dcp.save(flat(states), storage_writer=writer(directory)), load, async_save
    )


def _limits(states: States, scratch: Path) -> dict[str, float]:
    """The limits :func:`~benchmarks.harness.measure_limits` measures now, as GB/s by label."""
    timings = Timings(sum(array.nbytes for state in states for array in state.values()))
    measure_limits(states, scratch, timings)
    labels = {DISK_LIMIT: f"write+fsync, {default_workers(len(states))} writers", COLD_READ: "read, cold"}
    labels |= {"raw read, warm": "read, warm", SHA256_LIMIT: "sha256, all cores"}
    return {label: timings.rate(name) for name, label in labels.items()}


def bench_peers(states: list[dict[str, np.ndarray]], root: Path, repeat: int) -> PeerTable:
    """Run the section (see the module doc) and print its table."""
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    methods = [method for method in (_ours(), _safetensors(), _torch_save(), _dcp()) if method is not None]
    total = sum(array.nbytes for state in states for array in state.values())
    seconds: dict[tuple[str, str], list[float]] = {}
    rss: dict[str, list[int]] = {}
    measured_limits: dict[str, list[float]] = {}
    for run in range(repeat):
        scratch = root / f"peers-{run}"
        scratch.mkdir()
        for name, value in _limits(states, scratch / "limits").items():
            measured_limits.setdefault(name, []).append(value)
        shift = run % len(methods)
        for method in methods[shift:] + methods[:shift]:
            _one_round(method, states, scratch, seconds, rss)
        clear(scratch)

    def rate(name: str, kind: str) -> float:
        return total / statistics.median(seconds[(name, kind)]) / 1e9

    rows = tuple(
        PeerRow(
            method.name,
            rate(method.name, "save"),
            rate(method.name, "warm"),
            rate(method.name, "cold"),
            statistics.median(seconds[(method.name, "stall")]) if method.async_save is not None else None,
            max(0, int(statistics.median(rss[method.name]))),
        )
        for method in methods
    )
    table = PeerTable(total, rows, {name: statistics.median(rates) for name, rates in measured_limits.items()})
    print_table(table)
    return table


def _one_round(
    method: _Method,
    states: States,
    scratch: Path,
    seconds: dict[tuple[str, str], list[float]],
    rss: dict[str, list[int]],
) -> None:
    """Save, load cold, load warm and save asynchronously with ``method``, recording the times."""
    directory = scratch / method.name
    started = time.perf_counter()
    rss.setdefault(method.name, []).append(peak_rss_growth(lambda: method.save(states, directory)))
    seconds.setdefault((method.name, "save"), []).append(time.perf_counter() - started)
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    evict(files)
    for kind in ("cold", "warm"):
        if kind == "warm":
            cache(files)  # a cold load of this library's leaves the files out of the page cache
        seconds.setdefault((method.name, kind), []).append(timed(lambda: method.load(states, directory)))
    if method.async_save is not None:
        stall, finish = method.async_save(states, scratch / f"{method.name}-async")
        seconds.setdefault((method.name, "stall"), []).append(stall)
        finish()


def print_table(table: PeerTable) -> None:
    print(f"  {table.total_bytes / 2**30:.2f} GiB state; GB/s, durable (fsync); medians of the rounds")
    print(
        f"  {'method':<13} {'save':>6} {'load warm':>10} {'load cold':>10} {'async stall':>12} {'peak extra RSS':>15}"
    )
    for row in table.rows:
        stall = f"{row.async_stall:10.2f} s" if row.async_stall is not None else f"{'-':>12}"
        print(
            f"  {row.method:<13} {row.save:6.2f} {row.load_warm:10.2f} {row.load_cold:10.2f} {stall} "
            f"{row.peak_rss / 2**20:11.0f} MiB"
        )
    print("  limits in the same run:")
    for name, value in table.limits.items():
        print(f"    {name:<40} {value:6.2f} GB/s")


def plot(table: PeerTable, path: Path) -> None:
    """Draw ``table`` into ``path`` (PNG): per method, bars of save / load warm / load cold GB/s,
    and the limits as horizontal lines. Needs matplotlib (``pip install -e '.[bench]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = (("save", "save"), ("load_warm", "load warm"), ("load_cold", "load cold"))
    figure, axes = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(kinds)
    positions = np.arange(len(table.rows))
    for index, (attribute, label) in enumerate(kinds):
        values = [getattr(row, attribute) for row in table.rows]
        axes.bar(positions + (index - 1) * width, values, width, label=label)
    tallest = max((max(row.save, row.load_warm, row.load_cold) for row in table.rows), default=1.0)
    shown = {name: value for name, value in table.limits.items() if value <= 2 * tallest}
    styles = (("tab:red", "--"), ("tab:purple", ":"), ("tab:gray", "-."), ("black", "--"))
    for (name, value), (color, style) in zip(shown.items(), styles * 2, strict=False):
        axes.axhline(value, color=color, linestyle=style, linewidth=1.2, label=f"limit: {name} ({value:.2f})")
    off_chart = [f"{name} {value:.2f}" for name, value in table.limits.items() if name not in shown]
    if off_chart:  # a limit far above every bar (a warm read) would flatten them
        axes.annotate(
            "limits above the chart: " + ", ".join(off_chart),
            (0.01, 0.97),
            xycoords="axes fraction",
            fontsize="small",
            va="top",
        )
    axes.set_xticks(positions, [row.method for row in table.rows])
    axes.set_ylabel("GB/s")
    axes.set_title(
        f"{table.total_bytes / 2**30:.2f} GiB state, {os.cpu_count()} cores: "
        "each method next to the limits measured in the same run"
    )
    axes.legend(fontsize="small", loc="upper right")
    axes.set_ylim(0, max([tallest, *shown.values()]) * 1.35)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
