"""One rank of a real ``lightning.Trainer`` under ``TieredDDPStrategy`` on the CPU (gloo):
``python lightning_ddp_child.py CONFIG_JSON RANK``; with ``"strategy": "fsdp2"``, under
``TieredModelParallelStrategy``, the model sharded with ``fully_shard`` over the ranks; with
``"fsdp1"``, under ``TieredFSDPStrategy``, the model wrapped in ``FullyShardedDataParallel``;
with ``"hsdp"``, the same sharded over half the ranks and replicated over two such halves.

The ranks join one job through a file store (no ports to pick; Lightning finds the process
group up and uses it) and train the model of ``lightning_child.py`` on their own part of each
batch (rank r of w takes every w-th sample of it) for ``max_steps``, with a ``ModelCheckpoint``
every ``every`` steps whose pointers go to ``names``, through a ``TieredCheckpointIO`` whose
manager (made on first use) is this rank's: ``<local_root>/rank-<RANK>`` and the bucket
``url`` with ``options``, if given. Each rank appends its step's loss to
``<out>/losses-<RANK>.jsonl``, writes its parameters at the end to ``<out>/params-<RANK>.npz``,
those it starts training from to ``<out>/start-<RANK>.npz`` and what it saw to
``<out>/result-<RANK>.json``.

With ``validate_from`` P, the ranks run ``trainer.validate(model, ckpt_path=P)`` instead of
training. ``ckpt_path``: "last" (Lightning's) or null (a fresh start). With ``top_k`` K, the
callback keeps the K steps of highest "score" (the step modulo 7, logged alike on every rank)
beside ``last``, and each rank's manager keeps ``keep_last`` steps (default 3) beyond those its
pointers hold. With "async", the plugin is wrapped in Lightning's ``AsyncCheckpointIO`` (each
rank's saves run on a thread of its own). With ``kill_at`` K, once step K has trained and the
checkpoint of ``wait_for`` is committed and in the bucket on every rank, rank 0 prints "KILL ME"
and every rank blocks: the parent sends SIGKILL to each.
"""

import json
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_child import Batches, Model, deterministic_trainer, outcome
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType, fully_shard
from torch.distributed.tensor import DTensor

from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions, TorchDistributedCoordinator
from tiered_ckpt.lightning import (
    TieredCheckpointIO,
    TieredDDPStrategy,
    TieredFSDPStrategy,
    TieredModelParallelStrategy,
)


class RankBatches(Batches):
    """This rank's part of each batch of the one-process loader: every ``world``-th sample."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world

    def __iter__(self):
        for x, y in super().__iter__():
            yield x[self.rank :: self.world], y[self.rank :: self.world]


class DDPModel(Model):
    def __init__(self, losses: str, hidden: int = 16) -> None:
        super().__init__(losses, hidden)

    def training_step(self, batch, batch_idx):
        self.log("score", float(self.global_step % 7))  # what a top-k callback ranks by, alike on every rank
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return RankBatches(self.global_rank, self.trainer.world_size)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def val_dataloader(self):
        data = RankBatches(self.global_rank, self.trainer.world_size)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x, data.y), batch_size=4)


class ShardedModel(DDPModel):
    """The model, each linear layer and the whole sharded over the ranks (FSDP2)."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class CpuFSDPStrategy(TieredFSDPStrategy):
    """``TieredFSDPStrategy`` on the CPU: FSDP1 takes the CPU only as an explicit ``device_id``,
    which Lightning's ``FSDPStrategy`` gives as the device's index (none for the CPU)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        strategy = self.sharding_strategy  # Lightning keeps it apart from the other arguments for FSDP
        return FullyShardedDataParallel(model, device_id=self.root_device, sharding_strategy=strategy, **self.kwargs)


def params_of(module: torch.nn.Module, strategy: object) -> dict[str, np.ndarray]:
    """The whole parameters (a DTensor gathered: every rank calls this at the same point)."""
    root = getattr(strategy, "model", None)
    if isinstance(root, FullyShardedDataParallel):  # FSDP1 gives its shards only through its root
        with FullyShardedDataParallel.state_dict_type(root, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
            state = root.state_dict()
    else:
        state = module.state_dict()
    whole = {name: value.full_tensor() if isinstance(value, DTensor) else value for name, value in state.items()}
    return {name: value.detach().numpy().copy() for name, value in whole.items()}


class Observe(Callback):
    """Writes the parameters training starts from; with ``kill_at``, stops there for the SIGKILL."""

    def __init__(self, out: Path, rank: int, io: TieredCheckpointIO, kill_at: int | None, wait_for: int | None) -> None:
        self.out, self.rank, self.io, self.kill_at, self.wait_for = out, rank, io, kill_at, wait_for

    def on_train_start(self, trainer, pl_module):
        np.savez(self.out / f"start-{self.rank}.npz", **params_of(pl_module, trainer.strategy))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.kill_at:
            return
        manager = self.io.manager
        if isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
            trainer.strategy.checkpoint_io.teardown()  # its queued saves done (the next save starts a new thread)
        assert self.wait_for in manager.steps(), manager.steps()  # saved by the callback before this step
        manager.wait(uploaded=True)
        dist.barrier()  # every rank's shard of it committed and uploaded
        if self.rank == 0:
            print("KILL ME", flush=True)
        threading.Event().wait()


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(sys.argv[2]), config["world_size"]
    out = Path(config["out"])
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world)})
    store = dist.FileStore(config["store"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(minutes=5))
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    remote = RemoteOptions(config["url"], storage_options=config["options"]) if config.get("url") else None

    def manager() -> CheckpointManager:  # this rank's, once the process group is up
        local = Path(config["local_root"]) / f"rank-{dist.get_rank()}"
        options = LocalOptions(local, keep_last=config.get("keep_last", 3))
        return CheckpointManager(options, remote=remote, coordinator=TorchDistributedCoordinator())

    io = TieredCheckpointIO(manager)
    kind = config.get("strategy", "ddp")
    callbacks: list[Callback] = [
        ModelCheckpoint(
            dirpath=config["names"],
            save_top_k=config.get("top_k", 0),
            monitor="score" if config.get("top_k") else None,
            mode="max",
            save_last=True,
            every_n_train_steps=config["every"],
        ),
        Observe(out, rank, io, config.get("kill_at"), config.get("wait_for")),
    ]
    strategy = {
        "ddp": lambda: TieredDDPStrategy(process_group_backend="gloo"),
        "fsdp2": lambda: TieredModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        "fsdp1": lambda: CpuFSDPStrategy(process_group_backend="gloo"),
        "hsdp": lambda: CpuFSDPStrategy(
            process_group_backend="gloo",
            sharding_strategy="HYBRID_SHARD",
            device_mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicas", "shards")),
        ),
    }[kind]()
    model = (ShardedModel if kind == "fsdp2" else DDPModel)(str(out / f"losses-{rank}.jsonl"))
    if config.get("validate_from"):  # Lightning's validate(ckpt_path=...): a load without optimizers
        trainer = deterministic_trainer(io, config, [], devices=world, strategy=strategy, limit_val_batches=1)
        trainer.validate(model, ckpt_path=config["validate_from"])
        np.savez(out / f"start-{rank}.npz", **params_of(model, strategy))
    else:
        trainer = deterministic_trainer(io, config, callbacks, devices=world, strategy=strategy)
        trainer.fit(model, ckpt_path=config.get("ckpt_path"))
    with io.manager as manager:
        manager.wait(uploaded=remote is not None)
        result = {**outcome(io, trainer), "held": sorted(set(io._named.values()))}
    np.savez(out / f"params-{rank}.npz", **params_of(model, strategy))
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
