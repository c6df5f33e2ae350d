"""Train a small transformer-like model with FSDP2 on the CPU, checkpointing its sharded state through tiered_ckpt.

    torchrun --standalone --nproc-per-node 2 examples/torch_fsdp2_train.py --config configs/local.toml

The model is sharded with ``fully_shard`` over a CPU device mesh (gloo). Every N steps
each rank saves, asynchronously, ``get_state_dict(model, optimizer)`` (its DTensor
chunks of the parameters and AdamW moments), the LR scheduler and the step. Kill it
(``kill -9`` any rank) and run it again: it resumes bit for bit. Run it with another
``--nproc-per-node`` and ``--reshard``: every rank fills its new chunks from the saved
chunks that overlap them (its own disk, else the bucket), and the loss goes on. With
``--compare-dcp DIR`` every checkpoint is also written by DCP's own ``FileSystemWriter``
into DIR, and a resumed run checks that DCP's own load of that copy (its planner, its
resharding) gives exactly the state tiered_ckpt restored.
Without --config, TIERED_CKPT_LOCAL_DIR (and TIERED_CKPT_REMOTE_URL for a bucket) say
where checkpoints go; each rank uses ``rank-<r>`` under the local directory.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tiered_ckpt

VOCAB, WIDTH, HEADS, LENGTH, BATCH = 64, 32, 4, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.reshape(-1, WIDTH))  # 2-D logits: not a view of a 3-D result


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step`` (the same on every run): predict the next token of a noisy pattern."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    tokens = (start + 3 * torch.arange(LENGTH + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def sharded_model(world_size: int) -> Model:
    """A new model, each block and the whole sharded with FSDP2 over a CPU mesh of ``world_size``."""
    model = Model()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def same_as_dcp_load(model: nn.Module, directory: Path, world_size: int) -> bool:
    """True if DCP's own load of ``directory`` into a fresh model (this world size) equals ``model``."""
    with torch.random.fork_rng():  # leave the training run's RNG as it was
        torch.manual_seed(1234)
        other = sharded_model(world_size)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    ours = model.state_dict()
    return all(torch.equal(ours[name].full_tensor(), tensor.full_tensor()) for name, tensor in state["model"].items())


def say(line: str) -> None:
    """Print ``line`` in one write: every rank shares the terminal (print() writes the text and
    the newline apart, so with unbuffered output another rank's line could land in between)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="a config file (see configs/)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--reshard", action="store_true", help="resume a checkpoint of another world size")
    parser.add_argument("--kill-at-step", type=int, help="(for tests) rank 1 kills itself with SIGKILL at this step")
    parser.add_argument("--compare-dcp", type=Path, help="also save with DCP's FileSystemWriter here, and compare")
    args = parser.parse_args()

    torch.set_num_threads(1)  # bit-for-bit repeatable arithmetic
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    say(f"rank {rank}: pid {os.getpid()}")  # e.g. to kill -9 one rank and watch the run resume
    torch.manual_seed(0)
    model = sharded_model(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
    # get_state_dict creates AdamW's state (a step with lr 0): done on every run, resumed or
    # not, so that both go through the same operations.
    model_state, optim_state = get_state_dict(model, optimizer)

    config = tiered_ckpt.load_config(args.config)
    coordinator = tiered_ckpt.TorchDistributedCoordinator()
    local_dir = Path(config.local.dir) / f"rank-{rank}"
    with tiered_ckpt.CheckpointManager.from_config(config, local=local_dir, coordinator=coordinator) as manager:
        start = 0
        into = {"model": model_state, "optim": optim_state, "sched": scheduler.state_dict(), "step": 0}
        restored = manager.restore(into=into, reshard=args.reshard, missing_ok=True)
        if restored is not None:  # every DTensor of model_state and optim_state is filled in place
            saved = restored.torch_state()
            optim_state["param_groups"] = saved["optim"]["param_groups"]
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
            scheduler.load_state_dict(saved["sched"])
            start = saved["step"]
            say(f"rank {rank}: resumed from step {start}; shards from {restored.sources}")
            if args.compare_dcp is not None:
                same = same_as_dcp_load(model, args.compare_dcp / f"step-{start}", world_size)
                say(f"rank {rank}: restored state equals DCP's own load of step {start}: {same}")
        for step in range(start + 1, args.steps + 1):
            if step == args.kill_at_step:
                manager.wait()
                dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            inputs, targets = batch(step, rank)
            loss = nn.functional.cross_entropy(model(inputs), targets.reshape(-1))
            loss.backward()  # FSDP2 reduce-scatters the gradients into each rank's chunks
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if step % args.every == 0:
                model_state, optim_state = get_state_dict(model, optimizer)
                state = {"model": model_state, "optim": optim_state, "sched": scheduler.state_dict(), "step": step}
                manager.save(step, state)  # returns once this rank's chunks are staged
                if args.compare_dcp is not None:
                    dcp.save({"model": model_state}, checkpoint_id=args.compare_dcp / f"step-{step}")
                if rank == 0:  # staged: in memory; committed: on disk with its manifest, written in the background
                    committed = manager.steps()
                    newest = f"step {committed[-1]}" if committed else "none yet"
                    say(f"step {step}: loss {loss.item():.6f}, checkpoint staged; newest committed on disk: {newest}")
        manager.wait(uploaded=True)
        if rank == 0:
            where = "on disk and in the bucket" if config.remote is not None else "on disk"
            say(f"every checkpoint committed {where}; newest step {manager.latest_step()}")
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():  # full_tensor() is a collective: every rank calls it
        digest.update(name.encode() + tensor.full_tensor().numpy().tobytes())
    if rank == 0:
        say(f"final parameters sha256 {digest.hexdigest()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
