"""One rank of a job saving through ``TieredCheckpointIO`` without a Trainer: ``python
lightning_ranks_child.py ROOT RANK``, two ranks joined through a file store in ``ROOT``.

Each rank saves step 1 (``a.ckpt``), then saves step 1 again (``last.ckpt``) with a value of its
own changed on rank 1 only, as a save after the step's bookkeeping moved on there would; then
step 2. It writes what each save raised (``[class name, message]``, or null) and its steps to
``ROOT/result-<RANK>.json``.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tiered_ckpt import CheckpointError, CheckpointManager, TorchDistributedCoordinator
from tiered_ckpt.lightning import TieredCheckpointIO


def main() -> None:
    root, rank = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 2), rank=rank, world_size=2,
                            timeout=timedelta(minutes=2))  # fmt: skip
    io = TieredCheckpointIO(lambda: CheckpointManager(root / f"rank-{rank}", coordinator=TorchDistributedCoordinator()))
    io.saves_on_every_rank = True  # as TieredDDPStrategy sets it
    checkpoint = {"global_step": 1, "state_dict": {"w": torch.ones(4)}, "position": torch.tensor([rank])}
    raised = []
    for step, name, position in [(1, "a.ckpt", rank), (1, "last.ckpt", 7 if rank == 1 else rank), (2, "b.ckpt", rank)]:
        try:
            io.save_checkpoint({**checkpoint, "global_step": step, "position": torch.tensor([position])}, root / name)
            raised.append(None)
        except CheckpointError as exc:
            raised.append([type(exc).__name__, str(exc)])
    result = {"raised": raised, "steps": io.manager.steps()}
    io.manager.close()
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
