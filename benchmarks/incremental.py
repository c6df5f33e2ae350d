"""The ``incremental`` section of the benchmark: what an incremental save writes and costs, and
what a restore of referenced bytes costs, next to the same work with ``runtime.incremental``
off, measured in the same run (interleaved rounds, one CheckpointManager per round and mode,
the local tier alone but for the bucket's bytes).

- **LoRA shape**: a frozen base of ``base_bytes`` in bf16 arrays of 32 MiB, and an adapter of
  16 MiB with its two Adam moments in fp32, which change every step. Per save after the
  first: the bytes written to disk (the step directory's files) next to the changed arrays'
  bytes plus the manifest (target <= 1.05); the save's background time (from ``save``'s
  return to the step's commit) next to a full save's (<= 0.2); the blocking stall (``save``'s
  own time) next to a full save's (<= 1.0, noise aside); the bytes each save adds to a bucket
  (a ``file://`` one: what it holds after the upload less what it held before) next to the
  changed arrays' bytes (<= 1.05).
- **pretraining shape**: every array changes every step (a quarter of ``base_bytes`` in fp32
  arrays of 16 MiB): a blocking save's time (the median of 11 saves after the first: a job's
  steady state) and a warm restore's, incremental over full (within 3 %), and the bytes each
  writes (within 1 %).
- **a step in 10 files**: 10 groups of arrays (``base_bytes / 8`` in all), group ``k``
  changed at step ``k + 1``, so that step 10's bytes sit in 10 steps' files: its warm restore
  next to a full step's of the same state (<= 1.10).
- **would chunks pay**: the share of a changed array's bytes that one real training step
  leaves unchanged in chunks of 64 KiB and 1 MiB (what a save referencing the unchanged
  chunks of a changed array would not write; no target: it decides whether to build that),
  for a dense state (a 4-layer transformer and its AdamW moments: pretraining, full
  fine-tuning) and for sparse rows (an embedding of 100,000 x 64 trained by plain SGD on 512
  rows a step: a recommender's table), each taken after a step and after the next (torch).

Run through ``python -m benchmarks --only incremental`` (``--size-gib`` sets ``base_bytes``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from benchmarks.harness import Target, cache, clear, show_ratio
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.options import LocalOptions, RemoteOptions, RuntimeOptions

__all__ = ["bench_incremental", "unchanged_share"]

MIB = 1 << 20
_STEPS = 6  # saves per LoRA round: the first writes everything, the medians of the others are taken
# Saves per pretraining round (the median of all but the first): a job's steady state, where an
# array that changed at each of two comparisons is hashed at two saves in 8 only (PROBE_EVERY).
_PRETRAINING_STEPS = 12


def _lora(base: dict[str, np.ndarray], step: int) -> dict:
    rng = np.random.default_rng(step)
    adapter = rng.standard_normal(4 * MIB, dtype=np.float32)  # 16 MiB
    moments = {name: rng.random(4 * MIB, dtype=np.float32) for name in ("exp_avg", "exp_avg_sq")}
    return {"model": {"base": base, "lora": adapter}, "optim": moments, "step": step}


def _step_bytes(root: Path, step: int) -> int:
    return sum(path.stat().st_size for path in (root / step_dir_name(step)).iterdir())


def _manager(directory: Path, incremental: bool) -> CheckpointManager:
    runtime = RuntimeOptions(incremental=incremental, stale_saves="off")
    return CheckpointManager(LocalOptions(directory, keep_last=None), world_size=1, runtime=runtime)


def _lora_round(base: dict[str, np.ndarray], directory: Path, incremental: bool) -> dict[str, float]:
    """Median stall, background seconds and bytes written of the saves after the first."""
    stalls, backgrounds, written = [], [], []
    with _manager(directory, incremental) as manager:
        for step in range(1, _STEPS + 1):
            state = _lora(base, step)
            start = time.perf_counter()
            manager.save(step, state)
            returned = time.perf_counter()
            manager.wait()
            if step > 1:
                stalls.append(returned - start)
                backgrounds.append(time.perf_counter() - returned)
                written.append(_step_bytes(directory, step))
    return {"stall": statistics.median(stalls), "background": statistics.median(backgrounds), "bytes": min(written)}


def _tree_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def _lora_bucket_bytes(base: dict[str, np.ndarray], directory: Path, incremental: bool) -> int:
    """The fewest bytes a save after the first added to a bucket (its uploads, manifests, marks)."""
    runtime = RuntimeOptions(incremental=incremental, stale_saves="off")
    bucket = directory / "bucket"
    remote = RemoteOptions(f"file://{bucket}")
    added = []
    with CheckpointManager(LocalOptions(directory / "local"), remote=remote, world_size=1, runtime=runtime) as manager:
        for step in range(1, 4):
            before = _tree_bytes(bucket) if bucket.exists() else 0
            manager.save(step, _lora(base, step))
            manager.wait(uploaded=True)
            if step > 1:
                added.append(_tree_bytes(bucket) - before)
    return min(added)


def _pretraining(total: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {f"layer{i}": rng.random(4 * MIB, dtype=np.float32) for i in range(max(1, total // (16 * MIB)))}


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _pretraining_round(total: int, directory: Path, incremental: bool) -> dict[str, float]:
    saves = []
    with _manager(directory, incremental) as manager:
        for step in range(1, _PRETRAINING_STEPS + 1):
            state = _pretraining(total, step)
            saves.append(_timed(lambda: manager.save(step, state, blocking=True)))  # noqa: B023
        last = _PRETRAINING_STEPS
        cache(list((directory / step_dir_name(last)).iterdir()))
        restore = min(_timed(lambda: manager.restore(step=last)) for _ in range(2))
    return {"save": statistics.median(saves[1:]), "restore": restore, "bytes": _step_bytes(directory, last)}


def _spread(total: int, step: int) -> dict[str, np.ndarray]:
    """10 groups of 2 arrays; group ``k`` takes new values at step ``k + 1`` (all of them at step 1)."""
    per_array = max(4096, total // 20) // 4
    return {
        f"group{k}/{i}": np.random.default_rng((k, i, step if step == k + 1 else 0)).random(per_array, dtype=np.float32)
        for k in range(10)
        for i in range(2)
    }


def _spread_restore(total: int, directory: Path, incremental: bool) -> float:
    """A warm restore of step 10: its bytes in 10 steps' files (incremental), or in its own."""
    with _manager(directory, incremental) as manager:
        state: dict[str, np.ndarray] = {}
        for step in range(1, 11):
            changed = _spread(total, step)
            state.update({name: array for name, array in changed.items() if step == 1 or f"group{step - 1}/" in name})
            manager.save(step, dict(state), blocking=True)
        cache([path for path in directory.rglob("rank-*")])
        return min(_timed(lambda: manager.restore(step=10)) for _ in range(3))


_CHUNK_SIZES = (64 << 10, 1 << 20)


def unchanged_share(before: dict[str, np.ndarray], after: dict[str, np.ndarray], chunk: int) -> float:
    """Of the bytes of the arrays that differ between ``before`` and ``after``, the share in
    ``chunk``-byte pieces (of each array's bytes, from its start) whose bytes are equal."""
    changed = same = 0
    for name, old in before.items():
        a, b = old.reshape(-1).view(np.uint8), after[name].reshape(-1).view(np.uint8)
        if np.array_equal(a, b):
            continue
        changed += a.size
        whole = a.size // chunk * chunk
        equal = np.all(a[:whole].reshape(-1, chunk) == b[:whole].reshape(-1, chunk), axis=1)
        same += int(equal.sum()) * chunk + (a.size - whole if np.array_equal(a[whole:], b[whole:]) else 0)
    return same / changed if changed else 0.0


def _state(model: object, optimizer: object) -> dict[str, np.ndarray]:
    found = {f"model/{name}": value.detach().numpy().copy() for name, value in model.state_dict().items()}
    for index, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if value.ndim:
                found[f"optim/{index}/{key}"] = value.numpy().copy()
    return found


def _dense() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(8192, 256), torch.nn.TransformerEncoder(layer, 4), torch.nn.Linear(256, 8192)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    states = []
    for step in range(2):
        tokens = torch.randint(0, 8192, (8, 64), generator=torch.Generator().manual_seed(step))
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 8192), tokens.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append(_state(model, optimizer))
    return states[0], states[1]


def _sparse_rows() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Embedding(100_000, 64, sparse=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    for step in range(2):
        rows = torch.randint(0, 100_000, (512,), generator=torch.Generator().manual_seed(step))
        model(rows).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append(_state(model, optimizer))
    return states[0], states[1]


def _chunk_study() -> dict[str, dict[int, float]]:
    """By state (see the module doc) and chunk size, :func:`unchanged_share` of one step; printed."""
    shares = {}
    print("  changed arrays' bytes in chunks one training step leaves unchanged (would chunks pay?):")
    for label, states in (("dense, AdamW", _dense), ("sparse rows, SGD", _sparse_rows)):
        before, after = states()
        shares[label] = {chunk: unchanged_share(before, after, chunk) for chunk in _CHUNK_SIZES}
        row = ", ".join(f"{chunk >> 10} KiB chunks {share:.2f}" for chunk, share in shares[label].items())
        print(f"    {label:<18} {row}")
    return shares


def bench_incremental(base_bytes: int, root: Path, repeat: int) -> list[Target]:
    """The three shapes (see the module doc), ``repeat`` interleaved rounds each; returns the
    ratios as the issue's item 6 rows."""
    count = max(1, base_bytes // (32 * MIB))
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    base = {f"layer{i}": rng.standard_normal(16 * MIB, dtype=np.float32).astype(bf16) for i in range(count)}
    changed = 3 * 16 * MIB  # the adapter and its two moments
    lora: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    uploaded: dict[bool, list[int]] = {True: [], False: []}
    pre: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    spread: dict[bool, list[float]] = {True: [], False: []}
    for run in range(repeat):
        for incremental in (True, False) if run % 2 == 0 else (False, True):
            directory = root / f"incremental-{run}-{incremental}"
            lora[incremental].append(_lora_round(base, directory / "lora", incremental))
            clear(directory / "lora")
            uploaded[incremental].append(_lora_bucket_bytes(base, directory / "bucket", incremental))
            clear(directory / "bucket")
            pre[incremental].append(_pretraining_round(base_bytes // 4, directory / "pre", incremental))
            spread[incremental].append(_spread_restore(base_bytes // 8, directory / "spread", incremental))
            clear(directory)

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    def paired(rows: dict[bool, list[dict[str, float]]], key: str) -> float:
        return statistics.median(on[key] / off[key] for on, off in zip(rows[True], rows[False], strict=True))

    on, off = lora[True], lora[False]
    print(f"  LoRA shape: a {base_bytes / 2**30:.2f} GiB bf16 base, a 16 MiB adapter and its 2 moments (fp32)")
    print(
        f"    per save after the first: {median(on, 'bytes') / MIB:8.1f} MiB written (full: "
        f"{median(off, 'bytes') / MIB:.1f}); background {median(on, 'background'):.3f} s (full: "
        f"{median(off, 'background'):.3f}); stall {median(on, 'stall'):.3f} s (full: {median(off, 'stall'):.3f})"
    )
    written = median(on, "bytes") / changed  # the manifest and records are in the step's bytes
    to_bucket = statistics.median(uploaded[True])
    print(
        f"    per save after the first, to the bucket: {to_bucket / MIB:8.1f} MiB "
        f"(full: {statistics.median(uploaded[False]) / MIB:.1f})"
    )
    targets = [
        Target(6, "LoRA: bytes written / changed arrays' bytes", written, 1.05, at_least=False),
        Target(6, "LoRA: bytes to the bucket / changed arrays' bytes", to_bucket / changed, 1.05, at_least=False),
        Target(6, "LoRA: background time / a full save's", paired(lora, "background"), 0.2, at_least=False),
        Target(6, "LoRA: blocking stall / a full save's", paired(lora, "stall"), 1.0, at_least=False),
        Target(6, "pretraining: save time / full", paired(pre, "save"), 1.03, at_least=False),
        Target(6, "pretraining: restore time / full", paired(pre, "restore"), 1.03, at_least=False),
        Target(6, "pretraining: bytes / full", paired(pre, "bytes"), 1.01, at_least=False),
    ]
    spread_ratio = statistics.median(a / b for a, b in zip(spread[True], spread[False], strict=True))
    targets.append(Target(6, "a step in 10 files: restore / a full step's", spread_ratio, 1.1, at_least=False))
    print(
        f"  pretraining shape ({base_bytes / 4 / 2**30:.2f} GiB, every array changes): save "
        f"{median(pre[True], 'save'):.3f} s (full {median(pre[False], 'save'):.3f}), restore "
        f"{median(pre[True], 'restore'):.3f} s (full {median(pre[False], 'restore'):.3f})"
    )
    print(
        f"  a step in 10 files ({base_bytes / 8 / 2**30:.2f} GiB): restore {statistics.median(spread[True]):.3f} s "
        f"(full {statistics.median(spread[False]):.3f})"
    )
    _chunk_study()
    print("ratios (target):")
    for target in targets:
        show_ratio(target.label, target.value, f"{target.goal}, {'met' if target.met else 'not met'}")
    return targets
