"""The ``scale`` section of the benchmark: what a save costs beyond its bytes as the ranks grow.

1. Per-save overhead with many rank processes (``--scale-processes``, gloo, one process per
   rank, each with its own directory on the one disk): a blocking save of a small state
   (256 KiB per rank) from a barrier before it to a barrier after every rank committed, next
   to ``dcp.save`` of the same tensors (each rank's under keys of its own, so each rank writes
   its own) in the same rounds, alternated; printed: medians, the ratio save / dcp.save
   (target <= 1.0) and the gloo operations one save ran (each a step every process waits for).
2. The leader's work at 256, 1024 and 4,096 simulated ranks, in this process: a coordinator
   of ``N`` ranks of which this process holds rank 0 and is the leader hands it, in each
   collective, every rank's payload (rank 0's own, renumbered, parsed from JSON as the real
   coordinator parses what it gathered). A blocking save then runs everything a real
   leader runs: the call check over ``N`` reports, the manifest built and validated from
   ``N`` records, serialized, written and committed; and a restore parses it back. Printed:
   CPU seconds per save and per rank, the growth time(4096)/time(1024) (4.0 is linear), and
   the manifest's bytes. A rank process is ``python -m benchmarks.scale CONFIG RANK``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import SimulatedRanks, Target, barrier_timed, run_rank_processes
from tiered_ckpt.format.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.options import LocalOptions, RuntimeOptions

FULL = RuntimeOptions(incremental=False)  # every byte written, as dcp.save writes them

__all__ = ["bench_scale", "rank_process"]

RANK_PROCESSES = (4, 8, 16)
SIMULATED = (256, 1024, 4096)
LEADER_SAVES = 9  # at least: one save's CPU time varies by a fifth from save to save, and each takes < 1 s
BYTES_PER_RANK = 256 * 1024


def bench_scale(root: Path, repeat: int, counts: Sequence[int] = RANK_PROCESSES) -> list[Target]:
    """Print the section's figures (see the module doc); return them as issue 45's item 7 rows."""
    targets = []
    try:
        import torch.distributed.checkpoint  # noqa: F401
    except ImportError:
        print("  per-save overhead skipped: needs torch (pip install 'tiered-ckpt[torch]')")
    else:
        targets += _overhead(root, repeat, counts)
    return targets + _leader(root, repeat)


def _overhead(root: Path, repeat: int, counts: Sequence[int]) -> list[Target]:
    print(f"  per-save overhead, {BYTES_PER_RANK // 1024} KiB per rank, blocking, barrier to barrier (medians):")
    targets = []
    command = [sys.executable, "-m", "benchmarks.scale"]
    for processes in counts:
        directory = root / f"scale-{processes}"
        result = run_rank_processes(command, directory, processes, "scale", repeat=repeat)
        shutil.rmtree(directory)
        ours, theirs = statistics.median(result["save"]), statistics.median(result["dcp.save"])
        print(
            f"    {processes:>3} processes: save {ours:.3f} s, dcp.save {theirs:.3f} s, "
            f"{result['operations']} gloo operations per save; save / dcp.save {ours / theirs:5.2f}  (<= 1.0)"
        )
        targets.append(Target(7, f"per-save overhead / dcp.save's, {processes} processes", ours / theirs, 1.0, False))
    return targets


def rank_process(config_path: Path, rank: int) -> None:
    """One rank process of the overhead measure: alternate a blocking save and a ``dcp.save``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tiered_ckpt.dist.coordination import TorchDistributedCoordinator

    config = json.loads(config_path.read_text())
    processes, root = config["processes"], Path(config["root"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{config['store']}", rank=rank, world_size=processes)
    rng = np.random.default_rng(rank)
    state = {name: rng.random(BYTES_PER_RANK // 4 // 4, dtype=np.float32) for name in ("w", "b", "m", "v")}
    tensors = {f"rank{rank}.{name}": torch.from_numpy(array) for name, array in state.items()}
    coordinator = TorchDistributedCoordinator()
    calls = _count_operations(dist)

    def timed(action: Callable[[], object]) -> float:
        return barrier_timed(coordinator, action)

    figures: dict[str, Any] = {"save": [], "dcp.save": []}
    local = LocalOptions(root / f"rank-{rank}", keep_last=2)
    with CheckpointManager(local, coordinator=coordinator, runtime=FULL) as manager:
        manager.save(0, state, blocking=True)  # staging buffers allocated
        dcp.save(tensors, checkpoint_id=root / "dcp-warm")
        before = calls[0]
        manager.save(1, state, blocking=True)
        figures["operations"] = calls[0] - before
        for run in range(2, config["repeat"] + 2):
            figures["save"].append(timed(lambda: manager.save(run, state, blocking=True)))  # noqa: B023
            figures["dcp.save"].append(timed(lambda: dcp.save(tensors, checkpoint_id=root / f"dcp-{run}")))  # noqa: B023
    if rank == 0:
        Path(config["results"]).write_text(json.dumps(figures))
    dist.destroy_process_group()


def _count_operations(dist: Any) -> list[int]:
    """Count the gloo operations the manager's coordinator runs (each a step every process joins;
    a gather round is two: a gather to the leader and its broadcast)."""
    calls = [0]
    for name in ("all_gather", "gather", "broadcast", "barrier"):
        original = getattr(dist, name)

        def counted(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            calls[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def _leader(root: Path, repeat: int) -> list[Target]:
    print("  the leader's work per save at N simulated ranks (CPU seconds of every thread, medians; one process):")
    state = {"param": np.zeros(64, dtype=np.float32), "exp_avg": np.zeros(64, dtype=np.float32)}
    seconds: dict[int, float] = {}
    for ranks in SIMULATED:
        directory = root / f"leader-{ranks}"
        saves, parses = [], []
        simulated = SimulatedRanks(ranks)
        with CheckpointManager(LocalOptions(directory, keep_last=2), coordinator=simulated, runtime=FULL) as manager:
            manager.save(0, state, blocking=True)
            for step in range(1, max(repeat, LEADER_SAVES) + 1):
                start, sending = time.process_time(), simulated.sending
                manager.save(step, state, blocking=True)
                saves.append(time.process_time() - start - (simulated.sending - sending))
                text = (directory / step_dir_name(step) / MANIFEST_NAME).read_bytes()
                start = time.process_time()
                ShardManifest.from_json(text, source="manifest")
                parses.append(time.process_time() - start)
        shutil.rmtree(directory)
        save, parse = statistics.median(saves), statistics.median(parses)
        seconds[ranks] = save + parse
        print(
            f"    {ranks:>5} ranks: save {save:.4f} s + parse on restore {parse:.4f} s "
            f"= {(save + parse) / ranks * 1e6:6.1f} us per rank; manifest {len(text):,} bytes"
        )
    growth = seconds[SIMULATED[-1]] / seconds[SIMULATED[-2]]
    factor = SIMULATED[-1] / SIMULATED[-2]
    print(f"    growth time({SIMULATED[-1]}) / time({SIMULATED[-2]}) {growth:5.2f}  (<= {factor:.1f}: linear)")
    label = f"leader's work per save, time({SIMULATED[-1]}) / time({SIMULATED[-2]}) simulated ranks"
    return [Target(7, label, growth, factor, False)]


if __name__ == "__main__":
    rank_process(Path(sys.argv[1]), int(sys.argv[2]))
