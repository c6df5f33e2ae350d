"""Training states the tests save, and checks of what comes back."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

ZERO1_SHARDED_KEYS = ("param_fp16", "master_fp32", "exp_avg", "exp_avg_sq")


def split_sizes(total: int, world_size: int) -> list[int]:
    """Contiguous slice lengths of a flat vector of ``total`` elements over ``world_size`` ranks."""
    base, extra = divmod(total, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def zero1_states(world_size: int = 4, total_numel: int = 1003, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A ZeRO-1 training state sliced over ``world_size`` ranks, as a training job holds it.

    Per rank: the rank's fp16 slice of the flat parameter vector, fp32 master weights and
    Adam moments for the same slice, a replicated int64 step, a replicated bf16 matrix,
    a 0-d loss scale and an empty 1-D array (replicated, so the sharded keys must be named).
    """
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(total_numel, dtype=np.float32)
    exp_avg = rng.standard_normal(total_numel, dtype=np.float32) * 1e-3
    exp_avg_sq = rng.random(total_numel, dtype=np.float32) * 1e-6
    embedding = rng.standard_normal((8, 16), dtype=np.float32).astype(ml_dtypes.bfloat16)
    states, offset = [], 0
    for numel in split_sizes(total_numel, world_size):
        window = slice(offset, offset + numel)
        states.append(
            {
                "param_fp16": master[window].astype(np.float16),
                "master_fp32": master[window].copy(),
                "exp_avg": exp_avg[window].copy(),
                "exp_avg_sq": exp_avg_sq[window].copy(),
                "step": np.array(1234, dtype=np.int64),
                "embedding_bf16": embedding.copy(),
                "loss_scale": np.array(65536.0, dtype=np.float32),
                "empty": np.zeros(0, dtype=np.float32),
            }
        )
        offset += numel
    return states


def large_states(world_size: int, bytes_per_rank: int, version: int = 0) -> list[dict[str, np.ndarray]]:
    """Cheap-to-build states of about ``bytes_per_rank`` bytes per rank, distinct per rank and version."""
    numel = bytes_per_rank // 8
    return [
        {
            "master_fp32": np.arange(rank + version, rank + version + numel, dtype=np.float32),
            "exp_avg": np.arange(numel, dtype=np.float32) * (rank + 1 + version),
            "step": np.array(version, dtype=np.int64),
        }
        for rank in range(world_size)
    ]


def assert_states_equal(
    expected: Sequence[Mapping[str, np.ndarray]], actual: Sequence[Mapping[str, np.ndarray]]
) -> None:
    """Assert both lists hold the same keys, dtypes, shapes and bytes, rank by rank."""
    assert len(expected) == len(actual)
    for rank, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert sorted(want) == sorted(got), f"rank {rank}"
        for key in want:
            assert got[key].dtype == want[key].dtype, f"rank {rank} {key}"
            assert got[key].shape == want[key].shape, f"rank {rank} {key}"
            assert got[key].tobytes() == want[key].tobytes(), f"rank {rank} {key}"


def flip_byte(path: Path, offset: int) -> None:
    """Flip every bit of one byte of ``path`` on disk, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        (byte,) = f.read(1)
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def temp_files(directory: Path) -> list[str]:
    from tiered_ckpt.io.durable import is_temp_name

    return sorted(name for name in os.listdir(directory) if is_temp_name(name))


INCREMENTAL_ARRAYS = 6


def changed_at(step: int, index: int) -> int:
    """The last step at or before ``step`` at which array ``index`` of :func:`incremental_state`
    changed: each changes at step 1 and then at the steps where ``(step * 7 + index * 3) % 4 == 0``."""
    return max(s for s in range(1, step + 1) if s == 1 or (s * 7 + index * 3) % 4 == 0)


def incremental_state(step: int, versions: Mapping[int, int] | None = None) -> dict:
    """A state at ``step`` whose 16 KiB arrays change now and then (array ``i`` holds the values of
    version ``versions[i]``, by default :func:`changed_at`), beside a scalar that changes every step:
    the later steps of an incremental save reference the earlier files."""
    arrays = {}
    for index in range(INCREMENTAL_ARRAYS):
        version = versions[index] if versions is not None else changed_at(step, index)
        arrays[f"a{index}"] = np.random.default_rng((index, version)).standard_normal(4096).astype(np.float32)
    return {"arrays": arrays, "step": step}


def referenced_files_exist(root: Path) -> list[str]:
    """The referenced files that committed steps under ``root`` name and that are missing (none: [])."""
    import json

    missing = []
    for manifest in sorted(root.glob("step-*/manifest.json")):
        for shard in json.loads(manifest.read_text())["shards"]:
            for ref in shard.get("references", ()):
                path = root / f"step-{ref['step']:012d}" / ref["file"]["path"]
                if not path.exists():
                    path = root / f"kept-step-{ref['step']:012d}" / ref["file"]["path"]
                if not path.is_file() or path.stat().st_size != ref["file"]["size_bytes"]:
                    missing.append(f"{manifest.parent.name} -> {path}")
    return missing


def same_state(a, b) -> bool:
    """Whether two nested states are equal bit for bit: the same keys, and arrays of the same
    dtype and bytes (a restore of a checkpoint against what was saved)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b
