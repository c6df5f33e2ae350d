"""The ``memory`` section of the benchmark: a save's host memory against its budget.

For states of 2, 5 and 20 times a budget (``runtime.host_memory_bytes``), each in a fresh
process (``python -m benchmarks.memory DIR STATE_BYTES BUDGET|default ARRAYS [bucket] [paged]``): the
state is saved, then restored into arrays of the process's own (``into=``), from its disk or,
with ``bucket``, from a ``file://`` bucket by a manager whose disk lost the step; with
``paged``, into arrays over unnamed files (what a restore into CUDA tensors past the budget
reads into). Before the
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
from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions, RuntimeOptions
from tiered_ckpt.engine.staging import PIECE_BYTES
from tiered_ckpt.io.scratch import paged_array
from tiered_ckpt.torch.device_copies import pinned_bytes

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


def measure(
    directory: str, state_bytes: int, budget: int | None, count: int, bucket: bool, paged: bool = False
) -> dict[str, Any]:
    """In this process: the save and the restore of a state of ``count`` float32 arrays of
    ``state_bytes`` in all (see the module doc), and what each added to the peak resident memory.
    ``paged``: restored into arrays over unnamed files, as a restore into CUDA tensors past
    the budget reads them (their pages, touched by the read, count unless it lets them go)."""
    size = state_bytes // count // 4
    state = {f"layer{i}": np.random.default_rng(i).random(size, dtype=np.float32) for i in range(count)}
    if paged:
        Path(directory).mkdir(parents=True, exist_ok=True)
        into = {name: paged_array(Path(directory), array.nbytes).view(np.float32) for name, array in state.items()}
    else:
        into = {name: np.zeros_like(array) for name, array in state.items()}  # every page touched
    runtime = RuntimeOptions(host_memory_bytes=budget, incremental=False)  # every byte written
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
    directory: Path,
    state_bytes: int,
    budget: int | None,
    count: int,
    bucket: bool = False,
    paged: bool = False,
    **env: str,
) -> dict[str, Any]:
    """:func:`measure` in a fresh process (``env``: variables added to its environment)."""
    command = [sys.executable, "-m", "benchmarks.memory", str(directory), str(state_bytes), str(budget or "default")]
    command += [str(count), *(["bucket"] if bucket else []), *(["paged"] if paged else [])]
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
    times, paged = MULTIPLES[1], []
    for run in range(repeat):  # what a restore into CUDA tensors past the budget reads into
        directory = root / f"memory-paged-{run}"
        paged.append(run_measure(directory, times * budget, budget, 8, paged=True))
        shutil.rmtree(directory, ignore_errors=True)
    peak = max(each["restore_peak"] for each in paged)
    print(
        f"  state {times:2d}x ({times * budget / mib:5.0f} MiB), restore from disk into arrays over unnamed files: "
        f"peak +{peak / mib:6.1f} MiB; bit for bit: {all(each['exact'] for each in paged)}"
    )
    show_ratio(f"restore peak into unnamed files / (budget + slot), {times}x", peak / (budget + SLOT_BYTES), "<= 1.0")
    if not _cuda():
        print("  GPU staging: no CUDA device here, not measured")
        return
    bench_gpu(root / "memory-gpu", repeat)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def bench_gpu(root: Path, repeat: int, state_bytes: int = 1 << 30) -> None:
    """CUDA tensors (``state_bytes`` of fp32 and bf16): the stall of ``save()`` against a bare
    ``copy_(non_blocking=True)`` of the same bytes into pinned memory, the pinned and resident
    memory over 20 saves, and the step time of a small model saving every 10 steps against none."""
    import torch

    mib = 1 << 20
    quarter = state_bytes // 4
    state = {f"w{i}": torch.randn(quarter // 4, device="cuda") for i in range(2)}  # fp32: 4 bytes each
    state |= {f"h{i}": torch.randn(quarter // 2, device="cuda").to(torch.bfloat16) for i in range(2)}
    pinned = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True) for t in state.values()]
    bare = []
    for _ in range(max(3, repeat)):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for buffer, tensor in zip(pinned, state.values(), strict=True):
            buffer.copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()
        bare.append(time.perf_counter() - started)
    del pinned
    runtime = RuntimeOptions(host_memory_bytes=2 * state_bytes, incremental=False)
    stalls = []
    with CheckpointManager(LocalOptions(root, keep_last=1), world_size=1, runtime=runtime) as manager:
        for step in range(1, 21):
            torch.cuda.synchronize()
            started = time.perf_counter()
            handle = manager.save(step, state)
            stalls.append(time.perf_counter() - started)
            handle.committed.result()
            if step == 5:
                pinned_after_5, resident_after_5 = pinned_bytes(), _status("VmRSS")
        pinned_after_20, resident_after_20 = pinned_bytes(), _status("VmRSS")
    shutil.rmtree(root, ignore_errors=True)
    stall, copy = _median(stalls[5:]), _median(bare)
    print(
        f"  GPU {torch.cuda.get_device_name()}: {state_bytes / mib:.0f} MiB of CUDA tensors: save() stalled "
        f"{stall * 1e3:.1f} ms, a bare copy_(non_blocking=True) into pinned memory {copy * 1e3:.1f} ms "
        f"({state_bytes / copy / 1e9:.1f} GB/s); from save 5 to 20 pinned "
        f"{(pinned_after_20 - pinned_after_5) / mib:+.1f} MiB, resident "
        f"{(resident_after_20 - resident_after_5) / mib:+.1f} MiB"
    )
    show_ratio("GPU save stall / bare pinned copy", stall / copy, "<= 1.2")
    show_ratio("pinned growth from save 5 to 20 / state", (pinned_after_20 - pinned_after_5) / state_bytes, "<= 0.0")
    _step_times(root, every=None, steps=10)  # warms the kernels and the allocator for both runs
    without, with_saves = _step_times(root, every=None), _step_times(root, every=10)
    print(f"  training step: {without * 1e3:.2f} ms without saves, {with_saves * 1e3:.2f} ms saving every 10 steps")
    show_ratio("GPU step time, saving every 10 steps / none", with_saves / without, "report")


def _step_times(root: Path, every: int | None, steps: int = 60) -> float:
    """The mean time of a training step of a small MLP (and its AdamW state) on the GPU, saving
    its state every ``every`` steps (None: never)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(256, 4096, device="cuda")
    directory = root / f"steps-{every}"
    with CheckpointManager(
        LocalOptions(directory, keep_last=1), world_size=1, runtime=RuntimeOptions(incremental=False)
    ) as manager:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()
            if every is not None and step % every == 0:
                manager.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        torch.cuda.synchronize()
        took = (time.perf_counter() - started) / steps
        manager.wait()
    shutil.rmtree(directory, ignore_errors=True)
    return took


if __name__ == "__main__":
    directory, state_bytes, budget, count = sys.argv[1:5]
    chosen = None if budget == "default" else int(budget)
    flags = set(sys.argv[5:])
    print(json.dumps(measure(directory, int(state_bytes), chosen, int(count), "bucket" in flags, "paged" in flags)))
