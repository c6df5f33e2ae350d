"""Train a small torch model with DDP on the CPU, checkpointing its whole training state through tiered_ckpt.

    torchrun --standalone --nproc-per-node 4 examples/torch_ddp_train.py --config configs/local.toml

Each rank saves one nested state: its ZeRO-1 slice of the flat parameters and of AdamW's
moments (so the checkpoint is sharded across ranks, and can be resharded when the job
restarts with another number of processes: --reshard), AdamW's param groups and step,
the LR scheduler, the torch, numpy and python RNG states, and the data sampler's position.
A resumed run continues bit for bit as if it had never stopped.

- Kill it (``kill -9`` any rank: torchrun then stops the others) and run the same command
  again: every rank resumes from the newest step that all ranks hold on their own disk
  or the bucket holds.
- Send SIGTERM to any rank (a preemption notice): every rank stops at the same step,
  saves it, waits until the bucket has it and exits 0. A new node with an empty disk
  resumes from the bucket.

Each rank writes its checkpoints to ``<config's local dir>/rank-<r>``, as if each were on
its own node. Without --config, TIERED_CKPT_LOCAL_DIR (and TIERED_CKPT_REMOTE_URL for a
bucket) say where checkpoints go. Every rank seeds its RNGs alike (the RNG states are
then replicated, which resharding requires of every value that is not a flat slice).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

import tiered_ckpt

FEATURES, HIDDEN, BATCH, SAMPLES = 32, 64, 16, 1024
# The arrays that are each rank's slice of a flat vector: named by their paths in the state.
SHARDED = [("model", "params"), ("optim", "exp_avg"), ("optim", "exp_avg_sq")]


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    return inputs, torch.sin(inputs.sum(dim=1, keepdim=True))


def slice_of(numel: int, world_size: int, rank: int) -> slice:
    """This rank's slice of a flat vector (tiered_ckpt's rule: the first numel % world_size ranks get one more)."""
    sizes = tiered_ckpt.partition_sizes(numel, world_size)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, data: dict[str, int], mine: slice
) -> dict[str, Any]:
    """This rank's checkpoint: one nested state of tensors, arrays and plain values."""
    params = list(model.parameters())
    moments = [optimizer.state[p] for p in params]
    return {
        "model": {"params": torch.cat([p.detach().reshape(-1) for p in params])[mine]},
        "optim": {
            "exp_avg": torch.cat([m["exp_avg"].reshape(-1) for m in moments])[mine],
            "exp_avg_sq": torch.cat([m["exp_avg_sq"].reshape(-1) for m in moments])[mine],
            "step": moments[0]["step"],
            "param_groups": optimizer.state_dict()["param_groups"],  # floats, ints, the betas tuple
        },
        "sched": scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "data": dict(data),
    }


def gather(piece: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's slice of a flat vector, concatenated in rank order (slices differ in length by one)."""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([piece.numel()]))
    padded = torch.zeros(int(max(lengths)), dtype=piece.dtype)
    padded[: piece.numel()] = piece
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([part[: int(n)] for part, n in zip(parts, lengths, strict=True)])


def load_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any], world_size: int
) -> dict[str, int]:
    """Put a restored state back (each flat vector gathered from every rank's slice); return the data position."""
    flat = {name: gather(state[part][name], world_size) for part, name in SHARDED}
    offset, per_param = 0, {}
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            window = slice(offset, offset + param.numel())
            param.copy_(flat["params"][window].view_as(param))
            per_param[index] = {
                "step": state["optim"]["step"].clone(),
                "exp_avg": flat["exp_avg"][window].view_as(param).clone(),
                "exp_avg_sq": flat["exp_avg_sq"][window].view_as(param).clone(),
            }
            offset += param.numel()
    optimizer.load_state_dict({"state": per_param, "param_groups": state["optim"]["param_groups"]})
    scheduler.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state["data"]


def next_batch(sampler: DistributedSampler, data: dict[str, int], inputs: torch.Tensor, targets: torch.Tensor):
    """The batch at the data position, which then moves on (to the next epoch at the end of one)."""
    batches = len(sampler) // BATCH
    if data["batch"] >= batches:
        data["epoch"], data["batch"] = data["epoch"] + 1, 0
    sampler.set_epoch(data["epoch"])
    indices = list(sampler)[data["batch"] * BATCH : (data["batch"] + 1) * BATCH]
    data["batch"] += 1
    noise = torch.from_numpy(np.random.normal(0.0, 0.01, (BATCH, FEATURES)).astype(np.float32))  # numpy RNG
    scale = 1.0 + 0.01 * random.random()  # python RNG
    return (inputs[indices] + noise) * scale, targets[indices]


def say(line: str) -> None:
    """Print ``line`` in one write: every rank shares the terminal (print() writes the text and
    the newline apart, so with unbuffered output another rank's line could land in between)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="a config file (see configs/)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
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
    say(f"rank {rank}: pid {os.getpid()}")
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Dropout(0.1), nn.Linear(HIDDEN, 1))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.5)
    inputs, targets = dataset()
    # One warm-up step, the same on every run, before anything is restored: DDP re-lays
    # its gradient buckets after its first step, and with more than two ranks the order
    # of a ring all-reduce's sums (so the last bits) follows that layout. Run it here and
    # a resumed run sums exactly as an uninterrupted one. (The restore overwrites what it changed.)
    model(inputs[:BATCH]).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    sampler = DistributedSampler(range(SAMPLES), num_replicas=world_size, rank=rank, shuffle=True, seed=7)
    data = {"epoch": 0, "batch": 0}
    numel = sum(p.numel() for p in model.parameters())
    mine = slice_of(numel, world_size, rank)

    config = tiered_ckpt.load_config(args.config)
    coordinator = tiered_ckpt.TorchDistributedCoordinator()  # a gloo group of its own: saves never race DDP
    local_dir = Path(config.local.dir) / f"rank-{rank}"
    # The config's runtime options, with this model's flat slices and SIGTERM as the preemption notice.
    runtime = dataclasses.replace(config.runtime, sharded_keys=SHARDED, preemption_signals=[signal.SIGTERM])
    with tiered_ckpt.CheckpointManager.from_config(
        config, local=local_dir, coordinator=coordinator, runtime=runtime
    ) as manager:
        start, preempted = 0, False
        # Collective: every rank gets the same step, or None if no rank and no bucket has one yet.
        restored = manager.restore(reshard=args.reshard, missing_ok=True)
        if restored is not None:
            data = load_training_state(model.module, optimizer, scheduler, restored.torch_state(), world_size)
            start = restored.step
            say(f"rank {rank}: resumed from step {start}; shards from {restored.sources}")
        for step in range(start + 1, args.steps + 1):
            if step == args.kill_at_step:  # (for tests) a kill after every rank committed the last save
                manager.wait()
                dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            batch_inputs, batch_targets = next_batch(sampler, data, inputs, targets)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(batch_inputs), batch_targets)
            loss.backward()  # DDP all-reduces the gradients on the default group
            optimizer.step()
            scheduler.step()
            if step % args.every == 0:  # returns once staged; written and uploaded in the background
                manager.save(step, training_state(model.module, optimizer, scheduler, data, mine))
            if rank == 0 and step % args.log_every == 0:
                say(f"step {step}: loss {loss.item():.6f}")
            if manager.reached_preemption(step):  # the same step on every rank, once any rank got SIGTERM
                if step % args.every != 0:
                    manager.save(step, training_state(model.module, optimizer, scheduler, data, mine), blocking=True)
                manager.wait(uploaded=True)
                say(f"rank {rank}: preempted at step {step}; step {step} is committed")
                preempted = True
                break
        manager.wait(uploaded=True)
    if rank == 0 and not preempted:
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        say(f"final parameters sha256 {hashlib.sha256(params.numpy().tobytes()).hexdigest()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
