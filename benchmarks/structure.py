"""The ``structure`` section of the benchmark: what a nested state's structure document costs.

One rank's model + AdamW state of ``params`` parameter tensors, as ``state_dict()`` nests
them, is saved and loaded with ``save_sharded`` / ``load_sharded``; the flattening and
document writing, and the parsing and rebuilding, are also timed on their own. Run
through ``python -m benchmarks`` (``--only structure``).
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import show_ratio, timed
from tiered_ckpt.format.state import flatten
from tiered_ckpt.format.structure import Structure
from tiered_ckpt.oneshot import load_sharded, save_sharded

__all__ = ["bench_structure", "optimizer_state"]


def optimizer_state(params: int, total_bytes: int) -> dict[str, Any]:
    """A model and AdamW state of ``params`` parameter tensors, as ``state_dict()`` nests them."""
    numel = max(1, total_bytes // (params * 3 * 4))
    rng = np.random.default_rng(0)
    template = rng.standard_normal(numel, dtype=np.float32)
    return {
        "model": {f"layers.{i}.weight": template.copy() for i in range(params)},
        "optim": {
            "state": {
                i: {"step": np.array(100.0, np.float32), "exp_avg": template.copy(), "exp_avg_sq": template.copy()}
                for i in range(params)
            },
            "param_groups": [{"params": list(range(params)), "lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8}],
        },
        "epoch": 3,
    }


def bench_structure(params: int, total_bytes: int, root: Path, repeat: int) -> None:
    """What the structure document of a nested state costs next to saving and loading its arrays."""
    state = optimizer_state(params, total_bytes)
    flat = flatten(state)
    document = flat.structure.to_json()
    size = sum(array.nbytes for array in flat.arrays.values())
    timings: dict[str, list[float]] = {name: [] for name in ("flatten", "parse", "save", "load")}
    for run in range(repeat):
        timings["flatten"].append(timed(lambda: flatten(state).structure.to_json()))
        timings["parse"].append(timed(lambda: Structure.from_json(document, flat.arrays, "bench").build(flat.arrays)))
        directory = root / f"structure-{run}"
        timings["save"].append(timed(functools.partial(save_sharded, [state], directory, step=run, sharded_keys=())))
        timings["load"].append(timed(functools.partial(load_sharded, directory, 1)))
    median = {name: statistics.median(values) for name, values in timings.items()}
    print(
        f"  {params} parameter tensors: {len(flat.arrays)} arrays of {size / 2**20:.1f} MiB, "
        f"a structure document of {len(document) / 2**20:.2f} MiB"
    )
    print(f"  flatten + document {median['flatten']:7.3f} s  of save_sharded {median['save']:7.3f} s")
    print(f"  parse + rebuild    {median['parse']:7.3f} s  of load_sharded {median['load']:7.3f} s")
    print("ratios (target):")
    show_ratio("structure / save_sharded", median["flatten"] / median["save"], "small")
    show_ratio("structure / load_sharded", median["parse"] / median["load"], "small")
