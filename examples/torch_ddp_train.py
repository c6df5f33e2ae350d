"""Train a small torch model with DDP on the CPU, checkpointing through tiered_ckpt; resume after a kill.

    torchrun --standalone --nproc-per-node 4 examples/torch_ddp_train.py --config configs/local.toml

Kill it (``kill -9`` any rank: torchrun then stops the others) and run the same command
again: every rank resumes from the newest step that all ranks hold on their own disk or
the bucket holds. Each rank writes its checkpoints to ``<config's local dir>/rank-<r>``,
as if each were on its own node.

The model is replicated by DDP, so each rank saves only its slice (ZeRO-1 style) of the
flat parameters and Adam moments, plus the replicated step counter: the checkpoint is
sharded across ranks and can be resharded when the job restarts with another number of
processes (--reshard). Without --config, TIERED_CKPT_LOCAL_DIR (and TIERED_CKPT_REMOTE_URL
for a bucket) say where checkpoints go.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tiered_ckpt

FEATURES, HIDDEN, BATCH = 32, 64, 64


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: the same on every run, so a resumed run sees the same data."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    return inputs, torch.sin(inputs.sum(dim=1, keepdim=True))


def slice_of(numel: int, world_size: int, rank: int) -> slice:
    """This rank's slice of a flat vector (tiered_ckpt's rule: the first numel % world_size ranks get one more)."""
    sizes = tiered_ckpt.partition_sizes(numel, world_size)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def flat_state(model: nn.Module, optimizer: torch.optim.Adam) -> dict[str, torch.Tensor]:
    """The flat parameters and Adam moments, and Adam's step count, of the whole model."""
    params = list(model.parameters())
    moments = [optimizer.state[p] for p in params]
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in params]),
        "exp_avg": torch.cat([m["exp_avg"].reshape(-1) for m in moments]),
        "exp_avg_sq": torch.cat([m["exp_avg_sq"].reshape(-1) for m in moments]),
        "adam_step": moments[0]["step"].reshape(1, 1),  # 2-D: replicated, not a flat slice
    }


def load_flat_state(model: nn.Module, optimizer: torch.optim.Adam, flat: dict[str, torch.Tensor]) -> None:
    """Put whole flat vectors (gathered from every rank's slice) back into the model and Adam."""
    offset = 0
    state = {}
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            numel = param.numel()
            param.copy_(flat["params"][offset : offset + numel].view_as(param))
            state[index] = {
                "step": flat["adam_step"].reshape(()).clone(),
                "exp_avg": flat["exp_avg"][offset : offset + numel].view_as(param).clone(),
                "exp_avg_sq": flat["exp_avg_sq"][offset : offset + numel].view_as(param).clone(),
            }
            offset += numel
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def gather_flat(shard: dict[str, torch.Tensor], world_size: int) -> dict[str, torch.Tensor]:
    """Every rank's slice of each flat vector, concatenated in rank order (slices differ in length by one)."""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([shard["params"].numel()]))
    longest = int(max(lengths))
    whole = {}
    for key in ("params", "exp_avg", "exp_avg_sq"):
        padded = torch.zeros(longest, dtype=shard[key].dtype)
        padded[: shard[key].numel()] = shard[key]
        parts = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(parts, padded)
        whole[key] = torch.cat([part[: int(n)] for part, n in zip(parts, lengths, strict=True)])
    whole["adam_step"] = shard["adam_step"]
    return whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="a config file (see configs/)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--reshard", action="store_true", help="resume a checkpoint of another world size")
    parser.add_argument(
        "--kill-at-step",
        type=int,
        help="(for tests) at this step, once every rank has committed its last checkpoint, rank 1 kills itself "
        "with SIGKILL",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per rank, and bit-for-bit repeatable arithmetic
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer.zero_grad()
    model(batch(0, rank)[0]).sum().backward()
    optimizer.step()  # one warm-up step at step 0 so Adam's state exists; the same on every run

    config = tiered_ckpt.load_config(args.config)
    coordinator = tiered_ckpt.TorchDistributedCoordinator()  # a gloo group of its own: saves never race DDP
    local_dir = Path(config.local.dir) / f"rank-{rank}"
    with tiered_ckpt.CheckpointManager.from_config(config, local_dir=local_dir, coordinator=coordinator) as manager:
        start = 0
        # Collective: every rank gets the same step, or None if no rank and no bucket has one yet.
        restored = manager.restore(reshard=args.reshard, missing_ok=True)
        if restored is not None:
            load_flat_state(model.module, optimizer, gather_flat(restored.torch_state(), world_size))
            start = restored.step
            print(f"rank {rank}: resumed from step {start}; shards from {restored.sources}", flush=True)
        numel = sum(p.numel() for p in model.parameters())
        for step in range(start + 1, args.steps + 1):
            if step == args.kill_at_step:  # (for tests) a kill after every rank committed the last save
                manager.wait()
                dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            inputs, targets = batch(step, rank)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()  # DDP all-reduces the gradients on the default group
            optimizer.step()
            if step % args.every == 0:
                mine = slice_of(numel, world_size, rank)
                flat = flat_state(model.module, optimizer)
                shard = {key: (value[mine] if key != "adam_step" else value) for key, value in flat.items()}
                manager.save(step, shard)  # returns once staged; written and uploaded in the background
                if rank == 0:
                    print(f"step {step}: loss {loss.item():.6f}, checkpoint saved", flush=True)
        manager.wait(uploaded=True)
    if rank == 0:
        params = flat_state(model.module, optimizer)["params"]
        print(f"final parameters sha256 {hashlib.sha256(params.numpy().tobytes()).hexdigest()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
