"""The ``parts`` section of the benchmark: a partial restore and an export, next to a full restore.

A model + AdamW state (``model``: a third of the bytes, as in training) over ``ranks``
simulated ranks is saved once by a manager; then, in interleaved rounds, warm (the shards
in the page cache, so the figures are the library's, not the disk's): a full
``restore()``, ``restore(paths=["model"])``, and ``export_safetensors(only="model")``, whose
peak RSS growth is measured next to its largest tensor. Run through ``python -m
benchmarks`` (``--only parts``).
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import numpy as np

from benchmarks.harness import cache, clear, peak_rss_growth, show_ratio, timed
from tiered_ckpt import CheckpointManager, export_safetensors

__all__ = ["bench_parts"]


def _states(total_bytes: int, ranks: int, params: int) -> list[dict]:
    """Per rank, ``params`` model tensors and their AdamW moments (each rank its own slice)."""
    numel = max(1, total_bytes // (ranks * params * 3 * 4))
    rng = np.random.default_rng(0)
    return [
        {
            "model": {f"layers.{i}.weight": rng.standard_normal(numel, dtype=np.float32) for i in range(params)},
            "optim": {
                "state": {
                    i: {
                        "exp_avg": rng.standard_normal(numel, dtype=np.float32),
                        "exp_avg_sq": rng.standard_normal(numel, dtype=np.float32),
                    }
                    for i in range(params)
                }  # fmt: skip
            },
        }
        for _rank in range(ranks)
    ]


def bench_parts(total_bytes: int, ranks: int, root: Path, repeat: int, params: int = 16) -> None:
    """Print the time and bytes of a partial restore next to a full one, and an export's speed and peak."""
    directory = root / "parts"
    with CheckpointManager(directory / "ckpt", world_size=ranks) as manager:
        manager.save(1, _states(total_bytes, ranks, params), blocking=True)
        shards = sorted((directory / "ckpt").rglob("rank-*.safetensors"))
        seconds: dict[str, list[float]] = {"full": [], "model": [], "export": []}
        read = {"full": manager.restore().bytes_read, "model": manager.restore(paths=["model"]).bytes_read}
        export = functools.partial(export_safetensors, directory / "ckpt", directory / "export", only="model")
        exported = export()
        peaks = []
        for _run in range(repeat):
            cache(shards)
            seconds["full"].append(timed(manager.restore))
            seconds["model"].append(timed(functools.partial(manager.restore, paths=["model"])))
            seconds["export"].append(timed(export))
            clear(directory / "export")
            peaks.append(peak_rss_growth(export))
            clear(directory / "export")
    largest = exported.largest_tensor_bytes
    model_bytes = sum(f.size_bytes for f in exported.files)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"  {ranks} ranks, {params} model tensors of {largest / 2**20:.1f} MiB each (the model a third of the state)")
    print(f"  full restore        {median['full']:7.3f} s  {read['full'] / 2**20:9.1f} MiB read")
    print(f"  restore(model)      {median['model']:7.3f} s  {read['model'] / 2**20:9.1f} MiB read")
    print(f"  export(model)       {median['export']:7.3f} s  {model_bytes / median['export'] / 1e9:6.2f} GB/s written")
    print("ratios (target):")
    show_ratio("restore(model) / full restore: bytes read", read["model"] / read["full"], "the model's share, 0.33")
    show_ratio("restore(model) / full restore: time", median["model"] / median["full"], "<= its bytes' share")
    show_ratio("export peak RSS growth / largest tensor", statistics.median(peaks) / largest, "about 1")
