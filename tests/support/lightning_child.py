"""One training run of a real ``lightning.Trainer`` on the CPU: ``python lightning_child.py CONFIG_JSON``.

The run trains a small deterministic model (``deterministic=True``, one thread, no dataloader
workers, a resumable loader) for ``max_steps`` with a ``ModelCheckpoint`` every ``every`` steps
whose pointers go to ``names``, through a ``TieredCheckpointIO`` on a manager of ``local`` (and
the bucket ``url`` with ``options``, if given), wrapped in ``AsyncCheckpointIO`` with "async".
It appends each step's loss (``{"step": S, "loss": float.hex}``) to ``losses``, and at the end
writes the parameters to ``params`` (.npz) and what the run saw to ``result`` (JSON).

``ckpt_path``: "last" (Lightning's), "newest" (``io.ckpt_path()``), or null (a fresh start).
With ``kill_at`` K, once step K has trained and the checkpoint of ``wait_for`` (a step before K)
is committed and in the bucket, it prints "KILL ME" and blocks: the parent sends SIGKILL.
"""

import json
import sys
import threading
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from tiered_ckpt import CheckpointManager, RemoteOptions
from tiered_ckpt.lightning import TieredCheckpointIO

SAMPLES, BATCH = 64, 4


class Batches:
    """A loader Lightning can resume mid-epoch: epoch e's batches are a permutation seeded by e,
    and its state says which batch is next. With a length, Lightning fetches no batch ahead."""

    def __init__(self) -> None:
        data = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, 8, generator=data)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))
        self.sampler = self  # Lightning sets each epoch through the sampler's set_epoch
        self.epoch = 0
        self.position = 0
        self.resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return SAMPLES // BATCH

    def __iter__(self):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + self.epoch))
        start = self.resume[1] if self.resume is not None and self.resume[0] == self.epoch else 0
        self.resume = None
        for batch in range(start, len(self)):
            self.position = batch + 1
            index = order[batch * BATCH : (batch + 1) * BATCH]
            yield self.x[index], self.y[index]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.resume = (state["epoch"], state["position"])


class Model(L.LightningModule):
    def __init__(self, losses: str, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.losses = open(losses, "a")  # noqa: SIM115 -- for the whole run

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.write(json.dumps({"step": self.global_step, "loss": loss.item().hex()}) + "\n")
        self.losses.flush()
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def train_dataloader(self):
        return Batches()


class Recording(TieredCheckpointIO):
    """The plugin, telling the run when each step's save has returned (from whichever thread saved it)."""

    def __init__(self, manager: CheckpointManager) -> None:
        super().__init__(manager)
        self.saved: dict[int, threading.Event] = {}
        self.guard = threading.Lock()

    def event(self, step: int) -> threading.Event:
        with self.guard:
            return self.saved.setdefault(step, threading.Event())

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        self.event(checkpoint["global_step"]).set()


class KillPoint(Callback):
    def __init__(self, io: Recording, at: int, wait_for: int) -> None:
        self.io, self.at, self.wait_for = io, at, wait_for

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.at:
            return
        self.io.event(self.wait_for).wait()
        self.io.manager.wait(uploaded=True)
        print("KILL ME", flush=True)
        threading.Event().wait()


def deterministic_trainer(io: TieredCheckpointIO, config: dict, callbacks: list[Callback], **kwargs) -> L.Trainer:
    """A quiet, deterministic CPU ``Trainer`` of ``config["max_steps"]`` saving through ``io`` (in
    ``AsyncCheckpointIO`` with ``config["async"]``); ``kwargs`` are more of its arguments."""
    return L.Trainer(
        accelerator="cpu",
        max_steps=config["max_steps"],
        deterministic=True,
        plugins=[AsyncCheckpointIO(io) if config.get("async") else io],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def outcome(io: TieredCheckpointIO, trainer: L.Trainer) -> dict:
    """What a run saw: the step it restored and where from, the steps of its manager's tiers, its last step."""
    restored, manager = io.last_restore, io.manager
    return {
        "restored": None if restored is None else restored.step,
        "sources": None if restored is None else {str(rank): tier for rank, tier in restored.sources.items()},
        "steps": manager.steps(),
        "remote_steps": manager.remote_steps(),
        "global_step": trainer.global_step,
    }


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    remote = RemoteOptions(config["url"], storage_options=config["options"]) if config.get("url") else None
    with CheckpointManager(config["local"], remote=remote, world_size=1) as manager:
        io = Recording(manager)
        callbacks: list[Callback] = [
            ModelCheckpoint(dirpath=config["names"], save_top_k=0, save_last=True, every_n_train_steps=config["every"])
        ]
        if config.get("kill_at") is not None:
            callbacks.append(KillPoint(io, config["kill_at"], config["wait_for"]))
        trainer = deterministic_trainer(io, config, callbacks, devices=1)
        ckpt_path = io.ckpt_path() if config.get("ckpt_path") == "newest" else config.get("ckpt_path")
        model = Model(config["losses"])
        trainer.fit(model, ckpt_path=ckpt_path)
        manager.wait(uploaded=remote is not None)
        result = outcome(io, trainer)
    params = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    np.savez(config["params"], **params)
    Path(config["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
