"""The ``dist`` section of the benchmark: rank processes under ``torch.distributed`` saving to one disk.

The same total state is saved from 1, 2 and 4 rank processes (``--dist-processes``) (gloo, one process per rank,
each with its own directory on the one disk); printed: the aggregate GB/s of a blocking
save, from a barrier before it to a barrier after every rank committed, next to the same
processes writing the same bytes to plain files with fsync and hashing them (sha256, a
thread each: a shard's sha256 is one stream), measured just before each save (so both see
the disk at the same moment; the ratio printed, save / the slower of the two, is the
median of each run's ratio). One untimed save first allocates the staging buffers, as in
a training run's steady state. A rank process is ``python -m benchmarks.dist CONFIG RANK``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.harness import Timings, make_rank_state, raw_write, run_rank_processes, sha256_all_cores
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.options import LocalOptions, RuntimeOptions

FULL = RuntimeOptions(incremental=False)  # every byte written: the incremental section measures references

__all__ = ["bench_dist", "rank_process"]


RANK_PROCESSES = (1, 2, 4)


def bench_dist(total_bytes: int, root: Path, repeat: int, counts: Sequence[int] = RANK_PROCESSES) -> None:
    """Print the section's figures for each of ``counts`` rank processes (see the module doc)."""
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        print("  skipped: needs torch (pip install 'tiered-ckpt[torch]')")
        return
    timings = Timings(total_bytes)
    for processes in counts:
        directory = root / f"dist-{processes}"
        for raw_seconds, sha_seconds, save_seconds in _rank_processes(total_bytes, processes, directory, repeat):
            timings.record(_label("raw write+fsync", processes), raw_seconds)
            timings.record(_label("sha256", processes), sha_seconds)
            timings.record(_label("min(raw, sha256)", processes), max(raw_seconds, sha_seconds))
            timings.record(_label("save", processes), save_seconds)
        shutil.rmtree(directory)  # 2 x size x (repeat + 1) bytes: more than some disks hold three times over
        os.sync()
    print(f"  state {total_bytes / 2**30:.2f} GiB in total, split over the rank processes")
    timings.print_rates()
    print("ratios (target):")
    for processes in counts:
        timings.print_paired_ratio(
            _label("save / min(raw, sha256)", processes),
            _label("save", processes),
            _label("min(raw, sha256)", processes),
            ">= 0.90, must >= 0.75",
        )


def _label(what: str, processes: int) -> str:
    return f"{what}, {processes} process{'es' if processes > 1 else ''}"


def _rank_processes(total_bytes: int, processes: int, root: Path, repeat: int) -> list[tuple[float, float, float]]:
    """Run ``processes`` rank processes that each write and save their part ``repeat`` times.

    Returns rank 0's (raw write seconds, sha256 seconds, save seconds) of each run.
    """
    command = [sys.executable, "-m", "benchmarks.dist"]
    timings = run_rank_processes(command, root, processes, "dist", total_bytes=total_bytes, repeat=repeat)
    return [(float(raw), float(sha), float(save)) for raw, sha, save in timings]


def rank_process(config_path: Path, rank: int) -> None:
    """One rank process of the ``dist`` section: write, hash, then save this rank's part ``repeat`` times."""
    import torch.distributed as dist

    from tiered_ckpt.dist.coordination import TorchDistributedCoordinator

    config = json.loads(config_path.read_text())
    processes = config["processes"]
    dist.init_process_group("gloo", init_method=f"file://{config['store']}", rank=rank, world_size=processes)
    state = make_rank_state(config["total_bytes"], processes, rank)
    coordinator = TorchDistributedCoordinator()
    directory = Path(config["root"]) / f"rank-{rank}"

    def timed(action: Callable[[], object]) -> float:
        coordinator.barrier()
        start = time.perf_counter()
        action()
        coordinator.barrier()  # every rank is done
        return time.perf_counter() - start

    timings = []
    # keep_last=None: deleting the previous step inside the timed save would time the deletion too.
    with CheckpointManager(LocalOptions(directory, keep_last=None), coordinator=coordinator, runtime=FULL) as manager:
        manager.save(0, state, blocking=True)
        for step in range(1, config["repeat"] + 1):
            raw = directory / f"raw-{step}"
            raw.mkdir()
            raw_seconds = timed(lambda: raw_write(raw, [state], 1))  # noqa: B023 (called at once)
            sha_seconds = timed(lambda: sha256_all_cores([state]))  # noqa: B023 (one thread: one state)
            save_seconds = timed(lambda: manager.save(step, state, blocking=True))  # noqa: B023
            timings.append((raw_seconds, sha_seconds, save_seconds))
    if rank == 0:
        Path(config["results"]).write_text(json.dumps(timings))
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_process(Path(sys.argv[1]), int(sys.argv[2]))
