"""The ``train`` section of the benchmark: how much a checkpoint every 20 steps slows a training loop.

A small numpy MLP-like loop (matmuls on every core, AdamW-like updates of fp32 master
weights and two moments) runs without checkpoints, with a ``CheckpointManager`` saving
asynchronously every 20 steps, and with its background writer pinned to one CPU, in
interleaved rounds. Run through ``python -m benchmarks`` (``--only train``).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.options import LocalOptions, RuntimeOptions

__all__ = ["bench_train"]

TRAIN_DIM, TRAIN_LAYERS = 1024, 3


def _train(steps: int, ranks: int, manager: CheckpointManager | None, every: int = 20) -> tuple[float, float]:
    """Run a small MLP-like training loop, checkpointing every ``every`` steps; return its wall
    time and the seconds its save calls blocked it."""
    rng = np.random.default_rng(0)
    dim, layers, batch = TRAIN_DIM, TRAIN_LAYERS, 512
    master = rng.standard_normal(dim * dim * layers, dtype=np.float32) * 0.01
    exp_avg, exp_avg_sq = np.zeros_like(master), np.zeros_like(master)
    weights = master.reshape(layers, dim, dim)
    inputs = rng.standard_normal((batch, dim), dtype=np.float32)
    slices = np.array_split(np.arange(master.size), ranks)
    views = [slice(int(s[0]), int(s[-1]) + 1) for s in slices]
    start, blocked = time.perf_counter(), 0.0
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
            save_started = time.perf_counter()
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
            blocked += time.perf_counter() - save_started
    if manager is not None:
        manager.wait()
    return time.perf_counter() - start, blocked


def bench_train(root: Path, ranks: int, steps: int, repeat: int) -> None:
    """Slowdown of a training loop that checkpoints every 20 steps, against the same loop without,
    and with the background writer pinned to one CPU (``writer_cpus``, Linux), in interleaved
    rounds (the order rotates each round); slowdowns are medians of each round's own. Also
    printed: the share of the loop's time its save calls blocked it (the staging copy),
    a figure the machine's noise hardly moves."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    variants: dict[str, RuntimeOptions | None] = {"without checkpoints": None, "with checkpoints": RuntimeOptions()}
    if len(cpus) > 1:
        variants[f"writer on CPU {cpus[-1]} only"] = RuntimeOptions(writer_cpus={cpus[-1]})
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    blocked: list[float] = []
    for run in range(repeat):
        names = list(variants)
        for name in names[run % len(names) :] + names[: run % len(names)]:
            runtime = variants[name]
            if runtime is None:
                seconds[name].append(_train(steps, ranks, None)[0])
                continue
            directory = root / f"train-{run}-{0 if runtime.writer_cpus is None else 1}"
            with CheckpointManager(LocalOptions(directory, keep_last=2), world_size=ranks, runtime=runtime) as manager:
                wall, save_calls = _train(steps, ranks, manager)
            seconds[name].append(wall)
            blocked.append(save_calls / wall)
    state_bytes = 3 * 4 * TRAIN_DIM * TRAIN_DIM * TRAIN_LAYERS  # fp32 master weights and two moments
    plain = seconds.pop("without checkpoints")
    print(
        f"  state {state_bytes / 2**20:.0f} MiB, {steps} steps of {statistics.median(plain) / steps * 1e3:.0f} ms, "
        f"{steps // 20} checkpoints"
    )
    print(f"  {'without checkpoints':<28} {statistics.median(plain):7.2f} s")
    for name, values in seconds.items():
        print(f"  {name:<28} {statistics.median(values):7.2f} s")
    print(f"  save calls blocked the loop  {100 * statistics.median(blocked):7.1f} % of its time")
    for name, values in seconds.items():
        slowdown = statistics.median(wall / base for base, wall in zip(plain, values, strict=True))
        print(f"  slowdown, {name:<18} {100 * (slowdown - 1):7.1f} %   (target <= 2 %)")
