"""Quickstart: the original lesson's main.py on tiered_ckpt.

Builds a ZeRO-1 training state sliced over 4 ranks (fp16 parameters, fp32 master
weights, Adam moments, a replicated step and bf16 matrix), saves it as 4 shard files
plus a manifest, loads it back with sha256 verification and checks byte equality. Then
it shows the three failure modes the manifest exists to catch, each failing loudly.

Run: python examples/quickstart.py [DIRECTORY]   (default: a new temp directory)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

import tiered_ckpt
from tiered_ckpt.format.layout import MANIFEST_NAME


def zero1_state(world_size: int, total_numel: int) -> list[dict[str, np.ndarray]]:
    """Each rank holds a contiguous slice of the flat parameter vector and its Adam state."""
    rng = np.random.default_rng(0)
    master = rng.standard_normal(total_numel, dtype=np.float32)
    embedding = rng.standard_normal((64, 32), dtype=np.float32).astype(ml_dtypes.bfloat16)
    bounds = np.linspace(0, total_numel, world_size + 1).astype(int)
    return [
        {
            "param_fp16": master[lo:hi].astype(np.float16),
            "master_fp32": master[lo:hi].copy(),
            "exp_avg": rng.standard_normal(hi - lo, dtype=np.float32) * 1e-3,
            "exp_avg_sq": rng.random(hi - lo, dtype=np.float32) * 1e-6,
            "step": np.array(1234, dtype=np.int64),
            "embedding_bf16": embedding,
        }
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def byte_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


def expect_failure(title: str, action, error_type: type[Exception]) -> None:
    try:
        action()
    except error_type as exc:
        print(f"  {title}: {type(exc).__name__}: {exc}")
    else:
        raise SystemExit(f"{title}: expected {error_type.__name__}, but loading succeeded")


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="tiered-ckpt-quickstart-"))
    directory = root / "step-000000001234"
    world_size = 4
    states = zero1_state(world_size, total_numel=1_000_003)

    manifest = tiered_ckpt.save_sharded(states, directory, step=1234)
    print(f"saved step {manifest.step} of {world_size} ranks to {directory}")
    for record in manifest.shards:
        print(
            f"  {record.path}  {record.size_bytes / 1e6:6.2f} MB  sha256 {record.sha256[:16]}...  "
            f"params [{record.param_shard_offset}, {record.param_shard_offset + record.param_shard_numel})"
        )
    print(f"  {MANIFEST_NAME} (written last: the commit marker)")

    loaded = tiered_ckpt.load_sharded(directory, expected_world_size=world_size)
    if not all(byte_equal(want, got) for want, got in zip(states, loaded, strict=True)):
        raise SystemExit("round trip changed some bytes")
    print(f"loaded and verified {world_size} shards: every array byte-for-byte equal")

    print("the three failure modes, each caught loudly:")
    expect_failure(
        "world size changed",
        lambda: tiered_ckpt.load_sharded(directory, expected_world_size=8),
        tiered_ckpt.WorldSizeMismatchError,
    )
    broken = root / "shard-count"
    shutil.copytree(directory, broken)
    document = json.loads((broken / MANIFEST_NAME).read_text())
    document["shards"].pop()
    (broken / MANIFEST_NAME).write_text(json.dumps(document))
    expect_failure(
        "shard count mismatch",
        lambda: tiered_ckpt.load_sharded(broken, expected_world_size=world_size),
        tiered_ckpt.ShardCountMismatchError,
    )
    partial = root / "partial-write"
    shutil.copytree(directory, partial)
    shard = partial / manifest.shard(2).path
    os.truncate(shard, shard.stat().st_size // 2)
    expect_failure(
        "partial write",
        lambda: tiered_ckpt.load_sharded(partial, expected_world_size=world_size),
        tiered_ckpt.IncompleteCheckpointError,
    )
    print(f"done; files are in {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
