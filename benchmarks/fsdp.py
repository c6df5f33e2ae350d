"""The ``fsdp`` section of the benchmark: an FSDP2 state saved and loaded next to DCP's own.

Rank processes (gloo, a CPU device mesh) hold a model of ``total_bytes`` of parameters and
AdamW state, sharded with ``fully_shard``. In interleaved rounds, each times (from a
barrier before to a barrier after every rank finished): ``CheckpointManager.save``
(blocking) next to ``dcp.save`` with DCP's ``FileSystemWriter``; ``restore(into=...)``
(every chunk verified by its sha256, and with ``verify="fast"`` by its xxh3-64) next to
``dcp.load`` with ``FileSystemReader`` (nothing verified), all warm; and how long each
blocks the training loop when asynchronous: ``save(blocking=False)`` next to
``dcp.async_save``. Run through ``python -m benchmarks`` (``--only fsdp``); a rank process
is ``python -m benchmarks.fsdp CONFIG RANK``; the figures are rank 0's, medians of the rounds.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from benchmarks.harness import barrier_timed, run_rank_processes

__all__ = ["bench_fsdp", "rank_process"]

RANK_PROCESSES = (2, 4)
WIDTH = 2048  # one layer: 4 Mi parameters, 48 MiB with AdamW's two moments
MEASURES = ("save", "dcp.save", "load", "load fast", "dcp.load", "stall", "dcp.async_save stall")


def bench_fsdp(total_bytes: int, root: Path, repeat: int, counts: Sequence[int] = RANK_PROCESSES) -> None:
    """Print the section's figures for each of ``counts`` rank processes (2 and 4 unless told)."""
    try:
        import torch.distributed.fsdp  # noqa: F401
    except ImportError:
        print("  skipped: needs torch (pip install 'tiered-ckpt[torch]')")
        return
    layers = max(1, total_bytes // (WIDTH * WIDTH * 12))
    print(f"  state {layers * WIDTH * WIDTH * 12 / 2**30:.2f} GiB ({layers} layers of {WIDTH}x{WIDTH}, AdamW)")
    for processes in counts:
        directory = root / f"fsdp-{processes}"
        rounds = _run(directory, processes, layers, repeat)
        shutil.rmtree(directory)
        median = {name: statistics.median(r[name] for r in rounds) for name in MEASURES}
        size = layers * WIDTH * WIDTH * 12
        print(f"  {processes} rank processes:")
        for name in ("save", "dcp.save", "load", "load fast", "dcp.load"):
            print(f"    {name:<22} {size / median[name] / 1e9:6.2f} GB/s  ({median[name]:.2f} s)")
        print(f"    {'save(blocking=False) blocks':<22} {median['stall']:6.3f} s")
        print(f"    {'dcp.async_save blocks':<22} {median['dcp.async_save stall']:6.3f} s")
        print("  ratios (target):")
        print(f"    {'save / dcp.save (throughput)':<44} {median['dcp.save'] / median['save']:5.2f}  (>= 1.0)")
        print(f"    {'load+verify / dcp.load (throughput)':<44} {median['dcp.load'] / median['load']:5.2f}  (>= 1.0)")
        fast = median["dcp.load"] / median["load fast"]
        print(f"    {'load+verify fast / dcp.load (throughput)':<44} {fast:5.2f}  (>= 1.0)")
        stall = median["stall"] / median["dcp.async_save stall"]
        print(f"    {'stall: save(blocking=False) / dcp.async_save':<44} {stall:5.2f}  (<= 0.20)")


def _run(root: Path, processes: int, layers: int, repeat: int) -> list[dict[str, float]]:
    command = [sys.executable, "-m", "benchmarks.fsdp"]
    rounds: list[dict[str, float]] = run_rank_processes(command, root, processes, "fsdp", layers=layers, repeat=repeat)
    return rounds


def rank_process(config_path: Path, rank: int) -> None:
    """One rank: build and shard the model, then time each measure once per round."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tiered_ckpt.dist.coordination import TorchDistributedCoordinator
    from tiered_ckpt.manager import CheckpointManager
    from tiered_ckpt.options import LocalOptions

    config = json.loads(config_path.read_text())
    processes = config["processes"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{config['store']}", rank=rank, world_size=processes)
    mesh = init_device_mesh("cpu", (processes,))
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(config["layers"])))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for param in model.parameters():
            cast(Any, param).to_local().uniform_(-0.01, 0.01, generator=generator)  # a DTensor
    optimizer = torch.optim.AdamW(model.parameters())
    model_state, optim_state = get_state_dict(model, optimizer)  # creates AdamW's state
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    coordinator = TorchDistributedCoordinator()
    root = Path(config["root"])

    def timed(action: Callable[[], object]) -> float:
        return barrier_timed(coordinator, action)

    rounds = []
    # keep_last=None: deleting older steps inside a timed save would time the deletion too
    local = LocalOptions(root / f"rank-{rank}", keep_last=None)
    with CheckpointManager(local, coordinator=coordinator) as manager:
        manager.save(0, state, blocking=True)  # warm-up: staging buffers allocated
        for run in range(1, config["repeat"] + 1):
            step, theirs = 2 * run, root / f"dcp-{run}"
            figures = {
                "save": timed(lambda: manager.save(step, state, blocking=True)),  # noqa: B023
                "dcp.save": timed(lambda: dcp.save(state, checkpoint_id=theirs)),  # noqa: B023
                "load": timed(lambda: manager.restore(step, into=state, reshard=True)),  # noqa: B023
                "load fast": timed(lambda: manager.restore(step, into=state, reshard=True, verify="fast")),  # noqa: B023
                "dcp.load": timed(lambda: dcp.load(state, checkpoint_id=theirs)),  # noqa: B023
            }
            coordinator.barrier()
            start = time.perf_counter()
            manager.save(step + 1, state)
            figures["stall"] = time.perf_counter() - start
            manager.wait()
            coordinator.barrier()
            start = time.perf_counter()
            pending = dcp.async_save(state, checkpoint_id=root / f"dcp-async-{run}")
            figures["dcp.async_save stall"] = time.perf_counter() - start
            completion: Any = getattr(pending, "upload_completion", pending)  # a Future, or an AsyncSaveResponse
            completion.result()
            coordinator.barrier()
            if rank == 0:  # DCP's copies are not kept: a run of 5 rounds of 2 GiB would fill a small disk
                shutil.rmtree(theirs)
                shutil.rmtree(root / f"dcp-async-{run}")
            rounds.append(figures)
    if rank == 0:
        Path(config["results"]).write_text(json.dumps(rounds))
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_process(Path(sys.argv[1]), int(sys.argv[2]))
