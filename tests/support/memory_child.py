"""Child process for tests/engine/test_memory_budget.py: a save and a restore of a large state
under a host memory budget, in a fresh process, with what each added to its peak resident memory.

Usage: python memory_child.py DIRECTORY STATE_BYTES BUDGET|default ARRAYS [bucket]

Builds a state of ARRAYS float32 arrays of STATE_BYTES in all (every page touched), saves it
as step 1 with ``runtime.host_memory_bytes`` BUDGET (``default``: the option left unset), and
restores it into arrays of its own (``into=``); with ``bucket``, the save also goes to a
``file://`` bucket in DIRECTORY, and the restore is from there, by a new manager whose disk
lost the step. Before each, the kernel's peak of the process's resident memory is reset
(``/proc/self/clear_refs``): what the save and the restore added to it is read from
``VmHWM``, against ``VmRSS`` just before. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiered_ckpt import CheckpointManager, RemoteOptions, RuntimeOptions  # noqa: E402


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure, in bytes."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M).group(1)) * 1024  # type: ignore[union-attr]


def _reset_peak() -> int:
    """Reset the process's peak resident memory to its current one; return the current one."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status("VmRSS")


def main(directory: str, state_bytes: int, budget: int | None, count: int, bucket: bool) -> dict[str, object]:
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


if __name__ == "__main__":
    directory, state_bytes, budget, count = sys.argv[1:5]
    chosen = None if budget == "default" else int(budget)
    print(json.dumps(main(directory, int(state_bytes), chosen, int(count), sys.argv[5:] == ["bucket"])))
