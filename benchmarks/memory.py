"""The ``memory`` section of the benchmark: a save's host memory against its budget.

For states of 2, 5 and 20 times a budget (``runtime.host_memory_bytes``), each in a fresh
process (``python -m benchmarks.memory DIR STATE_BYTES BUDGET|default ARRAYS [bucket]``): the
state is saved, then restored into arrays of the process's own (``into=``), from its disk or,
with ``bucket``, from a ``file://`` bucket by a manager whose disk lost the step. Before the
save and the restore the kernel's peak of the process's resident memory is reset
(``/proc/self/clear_refs``); what each added to it is read from ``VmHWM`` against ``VmRSS``
just before. Printed next to each: its target (the budget plus one staging slot), the
blocked time the ``SaveHandle`` reports against the time measured around the call (within
10 %), and what the budget cost the call (``throttled_seconds``). GPU figures need CUDA;
without it the section says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import show_ratio
from tiered_ckpt import CheckpointManager, RemoteOptions, RuntimeOptions
from tiered_ckpt.engine.staging import PIECE_BYTES

__all__ = ["SLOT_BYTES", "bench_memory", "measure", "run_measure"]

SLOT_BYTES = PIECE_BYTES  # the allowance past the budget: the write path's own buffers, the allocator's slack
MULTIPLES = (2, 5, 20)


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure, in bytes."""
    with open("/proc/self/status") as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M)
    assert found is not None, field
    return int(found.group(1)) * 1024


def _reset_peak() -> int:
    """Reset the process's peak resident memory to its current one; return the current one."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status("VmRSS")


def measure(directory: str, state_bytes: int, budget: int | None, count: int, bucket: bool) -> dict[str, Any]:
    """In this process: the save and the restore of a state of ``count`` float32 arrays of
    ``state_bytes`` in all (see the module doc), and what each added to the peak resident memory."""
    size = state_bytes // count // 4
    state = {f"layer{i}": np.random.default_rng(i).random(size, dtype=np.float32) for i in range(count)}
    into = {name: np.zeros_like(array) for name, array in state.items()}  # every page touched
    runtime = RuntimeOptions(host_memory_bytes=budget)
    remote = RemoteOptions(Path(directory, "bucket").as_uri()) if bucket else None
    local = Path(directory, "disk")
    with CheckpointManager(local, world_size=1, runtime=runtime, remote=remote) as manager:
        manager.save(0, {"warm": np.ones(16, np.float32)}, blocking=True)  # the threads and lazy imports, first
        manager.wait(uploaded=bucket)
        before = _reset_peak()
        started = time.monotonic()
        handle = manager.save(1, state)
        around = time.monotonic() - started
        handle.committed.result()
        save_peak = _status("VmHWM") - before
        manager.wait(uploaded=bucket)
        if not bucket:
            before = _reset_peak()
            result = manager.restore(into=into)
            restore_peak = _status("VmHWM") - before
    if bucket:
        shutil.rmtree(local)  # a new node: only the bucket holds the step
        with CheckpointManager(local, world_size=1, runtime=runtime, remote=remote) as manager:
            before = _reset_peak()
            result = manager.restore(into=into)
            restore_peak = _status("VmHWM") - before
        assert set(result.sources.values()) == {"remote"}
    exact = all(np.array_equal(into[name], array) for name, array in state.items())
    filled = all(result.state[name] is into[name] for name in state)
    return {
        "save_peak": save_peak,
        "restore_peak": restore_peak,
        "blocked_seconds": handle.blocked_seconds,
        "around": around,
        "staged_bytes": handle.staged_bytes,
        "throttled_bytes": handle.throttled_bytes,
        "throttled_seconds": handle.throttled_seconds,
        "exact": exact and filled,
    }


def run_measure(
    directory: Path, state_bytes: int, budget: int | None, count: int, bucket: bool = False, **env: str
) -> dict[str, Any]:
    """:func:`measure` in a fresh process (``env``: variables added to its environment)."""
    command = [sys.executable, "-m", "benchmarks.memory", str(directory), str(state_bytes), str(budget or "default")]
    command += [str(count), *(["bucket"] if bucket else [])]
    root = Path(__file__).resolve().parent.parent
    environ = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=environ, cwd=root, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.memory exited with {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def bench_memory(root: Path, repeat: int, budget: int = 64 << 20) -> None:
    """The sweep of the module doc, the largest peak of ``repeat`` runs of each."""
    mib = 1 << 20
    print(f"  budget {budget / mib:.0f} MiB, slot {SLOT_BYTES / mib:.0f} MiB; each state in 8 float32 arrays")
    for bucket in (False, True):
        for times in MULTIPLES if not bucket else MULTIPLES[1:2]:
            runs = []
            for run in range(repeat):
                directory = root / f"memory-{times}-{int(bucket)}-{run}"
                runs.append(run_measure(directory, times * budget, budget, 8, bucket))
                shutil.rmtree(directory, ignore_errors=True)
            save = max(each["save_peak"] for each in runs)
            restore = max(each["restore_peak"] for each in runs)
            off = max(abs(each["blocked_seconds"] - each["around"]) / each["around"] for each in runs)
            waited = sorted(each["throttled_seconds"] for each in runs)[len(runs) // 2]
            where = "bucket" if bucket else "disk"
            print(
                f"  state {times:2d}x ({times * budget / mib:5.0f} MiB), restore from {where}: peak save "
                f"+{save / mib:6.1f} MiB, restore +{restore / mib:6.1f} MiB; save waited {waited:6.3f} s for "
                f"the bytes past the budget; bit for bit: {all(each['exact'] for each in runs)}"
            )
            show_ratio(f"save peak / (budget + slot), {times}x", save / (budget + SLOT_BYTES), "<= 1.0")
            show_ratio(f"restore peak / (budget + slot), {times}x", restore / (budget + SLOT_BYTES), "<= 1.0")
            show_ratio(f"|reported - measured| / measured blocked, {times}x", off, "<= 0.10")
    print("  GPU staging: no CUDA here, not measured" if not _cuda() else "  GPU: see tests/torch (CUDA present)")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    directory, state_bytes, budget, count = sys.argv[1:5]
    chosen = None if budget == "default" else int(budget)
    print(json.dumps(measure(directory, int(state_bytes), chosen, int(count), sys.argv[5:] == ["bucket"])))
