"""The Lightning plugin (tiered_ckpt.lightning): a real ``lightning.Trainer`` (and ``Fabric``) on the CPU.

The resume tests run real training processes (tests/support/lightning_child.py), SIGKILL one mid-epoch
once a checkpoint is committed and in the bucket (moto's S3 server), resume it and compare
every step's loss and the final parameters, bit for bit, with a run that was never interrupted.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from tiered_ckpt import (
    CheckpointExistsError,
    CheckpointManager,
    InvalidStateError,
    LocalOptions,
    ManifestError,
    RemoteOptions,
    UsageError,
)
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.lightning import POINTER_FORMAT, TieredCheckpointIO, load_from_checkpoint

CHILD = Path(__file__).resolve().parent / "support" / "lightning_child.py"
EVERY, KILL_AT, MAX_STEPS, EPOCH = 10, 24, 40, 16  # the child's loader has 16 batches an epoch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


# --- training processes ----------------------------------------------------------------------


def child_config(root: Path, name: str, remote: tuple[str, dict] | None = None, **extra: Any) -> dict:
    """A run of the child under ``root`` (the manager's directory ``root/ckpt``, pointers in ``root/names``)."""
    config = {
        "local": str(root / "ckpt"),
        "names": str(root / "names"),
        "losses": str(root / f"{name}.losses.jsonl"),
        "params": str(root / f"{name}.params.npz"),
        "result": str(root / f"{name}.result.json"),
        "every": EVERY,
        "max_steps": MAX_STEPS,
        **extra,
    }
    if remote is not None:
        config["url"], config["options"] = remote
    return config


def start(config: dict, root: Path, name: str) -> subprocess.Popen:
    path = root / f"{name}.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(CHILD.parent.parent)}
    with open(root / f"{name}.stderr", "w") as stderr:
        return subprocess.Popen([sys.executable, str(CHILD), str(path)], stdout=subprocess.PIPE, stderr=stderr, env=env)


def run(config: dict, root: Path, name: str) -> dict:
    """Run the child to its end; return its result with its losses and parameters."""
    child = start(config, root, name)
    try:
        child.stdout.read()
        code = child.wait(timeout=600)  # a guard against a hang, not a timing
    finally:
        child.kill()
        child.stdout.close()
    assert code == 0, (root / f"{name}.stderr").read_text()[-5000:]
    return finished(config)


def run_until_killed(config: dict, root: Path, name: str) -> list[dict]:
    """Run the child until it says it reached ``kill_at`` (its checkpoint in the bucket), SIGKILL it
    there and return the losses it recorded."""
    child = start(config, root, name)
    said = b""
    try:
        while b"KILL ME\n" not in said:
            ready, _, _ = select.select([child.stdout], [], [], 600)  # a guard against a hang, not a timing
            chunk = os.read(child.stdout.fileno(), 65536) if ready else b""
            assert chunk, f"the child ended or hung before step {KILL_AT}: " + (root / f"{name}.stderr").read_text()
            said += chunk
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=600) == -signal.SIGKILL
    finally:
        child.kill()
        child.stdout.close()
    return losses(config)


def losses(config: dict) -> list[dict]:
    return [json.loads(line) for line in Path(config["losses"]).read_text().splitlines()]


def finished(config: dict) -> dict:
    result = json.loads(Path(config["result"]).read_text())
    with np.load(config["params"], allow_pickle=False) as params:
        result["params"] = {name: params[name] for name in params.files}
    result["losses"] = losses(config)
    return result


def assert_same_params(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> None:
    assert sorted(expected) == sorted(actual)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype and actual[name].tobytes() == expected[name].tobytes(), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The run that is never killed (local disk only: where checkpoints go does not change the training)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    result = run(child_config(root, "uninterrupted"), root, "uninterrupted")
    assert [each["step"] for each in result["losses"]] == list(range(MAX_STEPS))
    return result


def kill_mid_epoch(root: Path, remote: tuple[str, dict], uninterrupted: dict, **extra: Any) -> None:
    """Train until step KILL_AT (mid-epoch), with step 20 (mid-epoch too) committed and uploaded; SIGKILL."""
    config = child_config(root, "killed", remote, kill_at=KILL_AT, wait_for=20, **extra)
    assert 20 % EPOCH and KILL_AT % EPOCH and KILL_AT // EPOCH == 20 // EPOCH  # both inside epoch 1
    killed = run_until_killed(config, root, "killed")
    assert killed == uninterrupted["losses"][:KILL_AT]  # it trained past the checkpoint, then died


@pytest.mark.slow
@pytest.mark.parametrize("wrapped", [False, True], ids=["plugin", "async-wrapper"])
def test_a_run_killed_mid_epoch_resumes_from_last_to_the_losses_and_parameters_of_an_uninterrupted_run(
    tmp_path, s3_url, uninterrupted, wrapped
):
    kill_mid_epoch(tmp_path, s3_url, uninterrupted, **{"async": wrapped})
    resumed = run(
        child_config(tmp_path, "resumed", s3_url, ckpt_path="last", **{"async": wrapped}), tmp_path, "resumed"
    )
    assert (resumed["restored"], resumed["sources"]) == (20, {"0": "local"})
    assert resumed["losses"] == uninterrupted["losses"][20:]  # steps 20..39, each loss bit for bit
    assert_same_params(uninterrupted["params"], resumed["params"])
    assert resumed["global_step"] == MAX_STEPS and MAX_STEPS in resumed["remote_steps"]


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["last", "newest"])
def test_a_run_whose_disk_was_lost_resumes_from_the_bucket(tmp_path, s3_url, uninterrupted, resume):
    kill_mid_epoch(tmp_path, s3_url, uninterrupted)
    shutil.rmtree(tmp_path / "ckpt")  # the manager's disk is lost
    if resume == "newest":  # and the pointers with it: a new node asks the manager for its newest step
        shutil.rmtree(tmp_path / "names")
    resumed = run(child_config(tmp_path, "resumed", s3_url, ckpt_path=resume), tmp_path, "resumed")
    assert (resumed["restored"], resumed["sources"]) == (20, {"0": "remote"})
    assert resumed["losses"] == uninterrupted["losses"][20:]
    assert_same_params(uninterrupted["params"], resumed["params"])


# --- one process: the Trainer in this test --------------------------------------------------


class Capturing(TieredCheckpointIO):
    """The plugin, keeping a copy of the first checkpoint dict Lightning handed it for each step."""

    def __init__(self, manager: CheckpointManager, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.handed: dict[int, dict] = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.handed.setdefault(checkpoint["global_step"], copy.deepcopy(checkpoint))
        super().save_checkpoint(checkpoint, path, storage_options)


class Model(L.LightningModule):
    def __init__(self, lr: float = 0.01, betas: tuple = (0.9, 0.99), limits: dict | None = None, where: Any = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, betas=self.hparams.betas)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)  # holds best=inf until it steps
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss"}}


def batches() -> torch.utils.data.DataLoader:
    data = torch.Generator().manual_seed(3)
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=data), torch.randn(32, 2, generator=data))
    return torch.utils.data.DataLoader(dataset, batch_size=4)


def trainer(io: Any, names: Path, steps: int, **checkpoint: Any) -> L.Trainer:
    every = {"save_top_k": 0, "save_last": True, "every_n_train_steps": 2} | checkpoint
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=names, **every)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def pointer_step(path: Path) -> int:
    document = json.loads(path.read_text())
    assert document["format"] == POINTER_FORMAT
    return document["step"]


def assert_same(expected: Any, actual: Any, where: str = "checkpoint") -> None:
    """Equal values of equal types at every path (a dict subclass comes back a dict; floats by their bits)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert type(actual) is dict and list(actual) == list(expected), where
        for key in expected:
            assert type(next(k for k in actual if k == key)) is type(key), f"{where}[{key!r}]"
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
            assert_same(want, got, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert type(actual) is float and struct.pack(">d", actual) == struct.pack(">d", expected), where
    else:
        assert type(actual) is type(expected) and actual == expected, where


def test_a_trainer_checkpoint_comes_back_with_every_value_type_and_key_as_lightning_made_it(manager, tmp_path):
    io = Capturing(manager)
    torch.manual_seed(0)
    model = Model(limits={"max_norm": float("inf"), "clip": None, "layers": [1, 2]})
    checkpoints = {"monitor": "train_loss", "save_top_k": -1, "every_n_train_steps": 1, "save_last": False}
    trainer(io, tmp_path / "names", 3, **checkpoints).fit(model, batches())
    assert manager.steps() == [1, 2, 3]
    handed = io.handed[3]
    # what the dict holds that a plain state might not: int keys, tuples, inf, tensors in callbacks
    assert 0 in handed["optimizer_states"][0]["state"] and handed["lr_schedulers"][0]["best"] == float("inf")
    assert isinstance(handed["optimizer_states"][0]["param_groups"][0]["betas"], tuple)
    (names,) = [path for path in (tmp_path / "names").iterdir() if "step=3" in path.name]
    assert pointer_step(names) == 3
    restored = TieredCheckpointIO(manager).load_checkpoint(names)
    assert_same(handed, restored)


def test_a_value_that_cannot_be_stored_fails_the_save_naming_its_path_and_writes_nothing(manager, tmp_path):
    names = tmp_path / "names"
    with pytest.raises(InvalidStateError, match=r'state\["hyper_parameters"\]\["where"\] is a pathlib\.PosixPath'):
        trainer(TieredCheckpointIO(manager), names, 2).fit(Model(where=Path("/data")), batches())
    assert manager.steps() == [] and not list(names.glob("*.ckpt"))


def test_under_lightnings_async_wrapper_a_value_that_cannot_be_stored_still_fails_the_run(manager, tmp_path):
    io = AsyncCheckpointIO(TieredCheckpointIO(manager))
    with pytest.raises(InvalidStateError, match=r'state\["hyper_parameters"\]\["where"\]'):
        trainer(io, tmp_path / "names", 2).fit(Model(where=Path("/data")), batches())
    assert manager.steps() == []


def test_a_step_saved_under_two_names_is_saved_once_and_removing_a_name_keeps_the_step(manager, tmp_path):
    names = tmp_path / "names"
    io = Capturing(manager)
    trainer(io, names, 6, save_top_k=1).fit(Model(), batches())  # top-k file and last.ckpt at each step
    assert manager.steps() == [2, 4, 6] and sorted(io.handed) == [2, 4, 6]
    assert sorted(path.name for path in names.iterdir()) == ["epoch=0-step=6.ckpt", "last.ckpt"]  # top-k removed 2, 4
    assert pointer_step(names / "last.ckpt") == pointer_step(names / "epoch=0-step=6.ckpt") == 6
    io.remove_checkpoint(names / "last.ckpt")
    io.remove_checkpoint(names / "last.ckpt")  # gone already: nothing to do
    assert not (names / "last.ckpt").exists() and manager.steps() == [2, 4, 6]


def test_weights_changed_without_a_step_are_never_saved_as_a_pointer_to_the_old_ones(manager, tmp_path):
    names = tmp_path / "names"
    io = TieredCheckpointIO(manager)
    trainer(io, names, 4).fit(Model(), batches())
    finished = trainer(io, names, 4)  # the run is finished: fit loads step 4 and trains no further
    model = Model()
    finished.fit(model, batches(), ckpt_path="last")
    assert io.last_restore is not None and io.last_restore.step == 4 and finished.global_step == 4

    finished.save_checkpoint(tmp_path / "same.ckpt")  # the weights as loaded: the step holds these bytes
    assert pointer_step(tmp_path / "same.ckpt") == 4
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    for name, value in io.load_checkpoint(tmp_path / "same.ckpt")["state_dict"].items():
        assert value.dtype == weights[name].dtype and value.numpy().tobytes() == weights[name].numpy().tobytes()

    with torch.no_grad():
        model.net.weight.mul_(0.5)  # averaged with zeros: new weights, no optimizer step
    with pytest.raises(CheckpointExistsError, match=r"merged\.ckpt: step 4 is saved already with other contents in s"):
        finished.save_checkpoint(tmp_path / "merged.ckpt")
    assert not (tmp_path / "merged.ckpt").exists() and manager.steps() == [2, 4]
    stored = io.load_checkpoint(tmp_path / "same.ckpt")["state_dict"]  # the step keeps the weights it had
    assert stored["net.weight"].numpy().tobytes() == weights["net.weight"].numpy().tobytes()


def test_a_save_after_fit_names_the_step_the_callback_saved_though_the_epoch_ended_since(manager, tmp_path, caplog):
    names = tmp_path / "names"
    io = Capturing(manager)
    torch.manual_seed(0)
    start = Model().state_dict()
    uninterrupted = Model()
    uninterrupted.load_state_dict(start)
    with CheckpointManager(tmp_path / "other", world_size=1) as other:
        trainer(TieredCheckpointIO(other), tmp_path / "other-names", 12).fit(uninterrupted, batches())
    run = trainer(io, names, 8, save_top_k=0, save_last=True, every_n_train_steps=4)  # 8 batches: one epoch
    first = Model()
    first.load_state_dict(start)
    run.fit(first, batches())
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        run.save_checkpoint(tmp_path / "final.ckpt")  # the epoch ended, the scheduler stepped: no optimizer step
    assert pointer_step(tmp_path / "final.ckpt") == 8 and manager.steps() == [4, 8]
    assert "names step 8 as first saved, without this save's epoch, loops, lr_schedulers" in caplog.text
    stored = io.load_checkpoint(tmp_path / "final.ckpt")
    assert stored["epoch"] == io.handed[8]["epoch"] == 0  # the callback's save, before the epoch's end
    assert_same(io.handed[8]["state_dict"], stored["state_dict"])
    assert load_from_checkpoint(Model, tmp_path / "final.ckpt").hparams.lr == 0.01
    resumed = trainer(io, names, 12)
    resumed.fit(Model(), batches(), ckpt_path=tmp_path / "final.ckpt")  # the epoch's end runs again
    assert resumed.current_epoch == 2 and resumed.global_step == 12
    assert_same(dict(uninterrupted.state_dict()), dict(resumed.lightning_module.state_dict()))  # as if never stopped


def test_a_plugin_dropped_with_its_trainer_releases_the_steps_it_held(manager, tmp_path):
    import gc

    def fit() -> None:  # in a frame of its own: Lightning's save_hyperparameters keeps a snapshot of the caller's
        run = trainer(TieredCheckpointIO(manager), tmp_path / "names", 4, save_top_k=-1, every_n_train_steps=2)
        run.fit(Model(), batches())
        assert manager.store.held == {2, 4}

    fit()
    second = TieredCheckpointIO(manager)  # a later Trainer on the same manager (fit, then test)
    second.load_checkpoint(tmp_path / "names" / "epoch=0-step=2.ckpt")
    gc.collect()
    assert manager.store.held == {2}  # the first plugin is gone; the second holds what step 2's callback recorded
    del second
    gc.collect()
    assert manager.store.held == frozenset()  # no plugin left: retention alone decides


def test_last_resumes_the_newest_pointer_and_ckpt_path_a_given_step_from_either_tier(manager, tmp_path):
    names = tmp_path / "names"
    io = TieredCheckpointIO(manager)
    assert io.ckpt_path() is None  # nothing saved: a fresh start
    trainer(io, names, 4).fit(Model(), batches())
    assert manager.steps() == [2, 4] and pointer_step(names / "last.ckpt") == 4
    assert io.ckpt_path() == io.ckpt_path(4) == str(manager.root / step_dir_name(4))

    resumed = trainer(io, names, 6)
    resumed.fit(Model(), batches(), ckpt_path="last")
    assert io.last_restore is not None and io.last_restore.step == 4 and dict(io.last_restore.sources) == {0: "local"}
    assert manager.steps() == [2, 4, 6] and resumed.global_step == 6

    validated = trainer(io, names, 6)
    validated.validate(Model(), batches(), ckpt_path=io.ckpt_path(2), verbose=False)
    assert io.last_restore.step == 2 and io.last_restore.states == []  # its arrays are not kept


def test_resuming_an_older_step_than_the_newest_fails_at_the_first_committed_step_naming_the_fix(manager, tmp_path):
    names = tmp_path / "names"
    io = TieredCheckpointIO(manager)
    trainer(io, names, 6).fit(Model(), batches())
    behind = (
        r"step 4 is not newer .* step 6: this run is behind the manager's newest step .*ckpt_path=io\.ckpt_path\(\)"
    )
    with pytest.raises(CheckpointExistsError, match=behind):
        trainer(io, names, 6).fit(Model(), batches(), ckpt_path=io.ckpt_path(2))
    assert manager.steps() == [2, 4, 6] and pointer_step(names / "last.ckpt") == 6


def test_fabric_saves_and_loads_its_state_through_the_plugin(manager, tmp_path):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[TieredCheckpointIO(manager, step_key="step")])
    torch.manual_seed(0)
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    for x, y in batches():
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 8, "note": "adam"})
    assert manager.steps() == [8] and pointer_step(tmp_path / "fabric.ckpt") == 8

    fresh = fabric.setup_module(torch.nn.Linear(4, 2))
    fresh_optimizer = fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=0.1))
    state = {"model": fresh, "optimizer": fresh_optimizer}
    remainder = fabric.load(tmp_path / "fabric.ckpt", state)
    assert remainder == {"step": 8, "note": "adam"}
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert_same(optimizer.state_dict(), fresh_optimizer.state_dict())


def test_paths_and_arguments_that_name_no_step_of_this_manager_are_refused_naming_them(manager, tmp_path):
    io = TieredCheckpointIO(manager)
    state = {"global_step": 3, "state_dict": {"w": torch.ones(2)}}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "a.ckpt", map_location="cpu")["state_dict"]["w"].device.type == "cpu"

    with pytest.raises(UsageError, match=r"missing\.ckpt does not exist, and is not a step's directory"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    torch.save({"global_step": 3}, tmp_path / "torch.ckpt")
    with pytest.raises(UsageError, match=r"torch\.ckpt is not a pointer TieredCheckpointIO wrote \(a torch checkpoint"):
        io.load_checkpoint(tmp_path / "torch.ckpt")
    (tmp_path / "damaged.ckpt").write_text(f'{{"format": "{POINTER_FORMAT}", "step": 3, "step": 4}}')
    with pytest.raises(ManifestError, match=r"damaged\.ckpt.*duplicate key 'step'"):
        io.load_checkpoint(tmp_path / "damaged.ckpt")
    with CheckpointManager(tmp_path / "other", world_size=1) as other:
        with pytest.raises(UsageError, match=r"a\.ckpt points at step 3 of .*, not of this manager's .*other"):
            TieredCheckpointIO(other).load_checkpoint(tmp_path / "a.ckpt")

    with pytest.raises(UsageError, match=r"is not a pointer TieredCheckpointIO wrote \(it is not a file\)"):
        io.remove_checkpoint(manager.root / step_dir_name(3))  # a step's directory is never removed
    assert manager.steps() == [3]
    with pytest.raises(InvalidStateError, match=r"checkpoint\['global_step'\] must be the step.*the key is missing"):
        io.save_checkpoint({"epoch": 1}, tmp_path / "b.ckpt")
    with pytest.raises(UsageError, match=r"takes no storage_options"):
        io.save_checkpoint(state | {"global_step": 4}, tmp_path / "b.ckpt", storage_options={"acl": "private"})
    with pytest.raises(UsageError, match=r"writes its pointers on a local file system"):
        io.save_checkpoint(state | {"global_step": 4}, "s3://bucket/b.ckpt")
    with pytest.raises(UsageError, match=r"map_location must be None, a torch\.device or a device's name"):
        io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, location: storage)
    with pytest.raises(CheckpointExistsError, match=r"step 3 is saved already with the top-level keys"):
        io.save_checkpoint({"global_step": 3}, tmp_path / "weights-only.ckpt")
    assert manager.steps() == [3] and not (tmp_path / "b.ckpt").exists()
    with CheckpointManager(tmp_path / "four", world_size=4) as four:
        with pytest.raises(UsageError, match=r"needs a CheckpointManager of one rank in this process"):
            TieredCheckpointIO(four)


@pytest.mark.slow
def test_importing_tiered_ckpt_never_imports_lightning():
    code = "import sys, tiered_ckpt; assert not [m for m in sys.modules if m.startswith('lightning')]; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_missing_ckpt_path_fails_the_fit_with_a_file_not_found_error_and_the_plugin_is_never_pickled(
    manager, tmp_path, monkeypatch
):
    import io as streams

    from tiered_ckpt import CheckpointNotFoundError

    io = TieredCheckpointIO(manager)
    run = trainer(io, tmp_path / "names", steps=2)
    with pytest.raises(FileNotFoundError, match=r"Checkpoint file not found: .*missing\.ckpt \(") as caught:
        run.fit(Model(), batches(), ckpt_path=tmp_path / "missing.ckpt")  # Lightning's contract for a missing path
    assert isinstance(caught.value, CheckpointNotFoundError) and isinstance(caught.value, UsageError)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^Checkpoint file not found: not existing \("):
        run.fit(Model(), batches(), ckpt_path="not existing")  # the path as given first, as Lightning's own says
    with pytest.raises(UsageError, match=r"TieredCheckpointIO cannot be pickled: it holds a running CheckpointManager"):
        torch.save(trainer(io, tmp_path / "names", steps=2), streams.BytesIO())
    copied = copy.deepcopy(run.fit_loop)  # a copy of what holds the plugin shares it, and its manager
    assert copied.trainer is not run and copied.trainer.strategy.checkpoint_io is io and copy.copy(io) is io


class Gated(TieredCheckpointIO):
    """The plugin whose saves wait for ``gate``: under AsyncCheckpointIO every save stays queued
    while the loop goes on, and each removal of a checkpoint that fell out of the top k comes first."""

    def __init__(self, manager: CheckpointManager, gate: threading.Event) -> None:
        super().__init__(manager)
        self.gate = gate
        self.saved: list[int] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        assert self.gate.wait(timeout=120), "the training never ended"
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saved.append(checkpoint["global_step"])


class OpenGate(L.Callback):
    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.gate.set()


def test_under_async_checkpoint_io_a_removal_that_comes_before_its_queued_save_is_not_undone(manager, tmp_path):
    gate = threading.Event()
    names = tmp_path / "names"
    gated = Gated(manager, gate)
    run = trainer(
        AsyncCheckpointIO(gated), names, 6, save_top_k=2, save_last=False, every_n_train_steps=1, monitor="train_loss"
    )
    run.callbacks.append(OpenGate(gate))
    torch.manual_seed(0)
    run.fit(Model(), batches())
    kept = {Path(path).name for path in run.checkpoint_callback.best_k_models}
    assert len(kept) == 2 and {path.name for path in names.iterdir()} == kept  # as TorchCheckpointIO leaves them
    assert len(gated.saved) > 2  # some saves came after their pointers' removal
    assert manager.steps()[-1] == max(gated.saved)  # every save was made: the steps removed pointers named stay


def assert_module_of(checkpoint: dict, module: L.LightningModule) -> None:
    for name, value in checkpoint["state_dict"].items():
        assert torch.equal(module.state_dict()[name], value), name


def test_load_from_checkpoint_builds_the_module_lightning_would_from_a_pointer_or_a_step_directory(manager, tmp_path):
    from tiered_ckpt.lightning import load_from_checkpoint

    io = Capturing(manager)
    names = tmp_path / "names"
    trainer(io, names, 4, save_top_k=-1, save_last=False, every_n_train_steps=2).fit(Model(lr=0.05), batches())
    saved = io.handed[4]
    pointer = next(path for path in names.iterdir() if "step=4" in path.name)
    for path in (pointer, manager.root / step_dir_name(4)):  # the pointer, or the step's directory
        module = load_from_checkpoint(Model, path)
        assert type(module) is Model and module.hparams.lr == 0.05 and module.hparams.betas == (0.9, 0.99)
        assert_module_of(saved, module)
    overridden = load_from_checkpoint(Model, pointer, lr=0.5, map_location="cpu")  # as Lightning's kwargs do
    assert overridden.hparams.lr == 0.5 and overridden.net.weight.device.type == "cpu"
    assert_module_of(saved, overridden)
    with pytest.raises(FileNotFoundError, match=r"Checkpoint file not found: .*absent\.ckpt"):
        load_from_checkpoint(Model, tmp_path / "absent.ckpt")
    with pytest.raises(UsageError, match=r"not a LightningModule or LightningDataModule class"):
        load_from_checkpoint(dict, pointer)


def saved_to_the_bucket_alone(tmp_path: Path, s3_url: tuple[str, dict], lr: float) -> Capturing:
    """Two steps of a Trainer saved to the disk ``tmp_path/ckpt`` and the bucket, then the disk
    deleted (a serving machine has the bucket only); returns the plugin, with what it was handed."""
    url, options = s3_url
    with CheckpointManager(tmp_path / "ckpt", remote=RemoteOptions(url, storage_options=options), world_size=1) as job:
        io = Capturing(job)
        trainer(io, tmp_path / "names", 2).fit(Model(lr=lr), batches())
        job.wait(uploaded=True)
    shutil.rmtree(tmp_path / "ckpt")
    return io


def test_load_from_checkpoint_reads_a_step_from_the_bucket_alone_for_a_machine_without_the_disk(tmp_path, s3_url):
    from tiered_ckpt.lightning import load_from_checkpoint

    url, options = s3_url
    io = saved_to_the_bucket_alone(tmp_path, s3_url, 0.07)
    for path in (f"{url}/{step_dir_name(2)}", tmp_path / "names" / "last.ckpt"):  # the pointer names the bucket
        module = load_from_checkpoint(Model, path, storage_options=options)
        assert module.hparams.lr == 0.07
        assert_module_of(io.handed[2], module)


class Losses(L.Callback):
    """Each step's loss as the loop logged it (``train_loss``), by global step."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.by_step[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


def test_the_score_of_each_ranked_save_is_recorded(manager, tmp_path, caplog):
    top_k = {"save_top_k": 1, "save_last": True, "every_n_train_steps": 1, "monitor": "train_loss"}
    run = trainer(TieredCheckpointIO(manager), tmp_path / "names", 8, **top_k)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        run.fit(Model(), batches())
    assert "as first saved" not in caplog.text  # the top-k file and last.ckpt of a step: no news
    callback = run.checkpoint_callback
    best = pointer_step(Path(callback.best_model_path))
    assert manager.locate(best).metric("train_loss") == float(callback.best_model_score)
    assert manager.locate(8).metrics in ((), (("train_loss", float(callback.best_model_score)),))  # ranked, or not


def test_record_metrics_gives_every_save_its_loss_and_keep_best_keeps_the_true_best(tmp_path):
    from tiered_ckpt.lightning import RecordMetrics

    top_k = {"save_top_k": 1, "save_last": True, "every_n_train_steps": 1, "monitor": "train_loss"}
    local = LocalOptions(tmp_path / "ckpt", keep_last=1, keep_best=3, best_metric="train_loss")
    losses = Losses()
    with CheckpointManager(local, world_size=1) as manager:
        run = trainer(TieredCheckpointIO(manager), tmp_path / "names", 16, **top_k)
        run.callbacks.extend([RecordMetrics("train_loss", "not_logged"), losses])
        torch.manual_seed(0)
        run.fit(Model(), batches())
        manager.wait()
        manager.prune()  # the pass after the last save ran while last.ckpt still named step 15
        recorded = {step: manager.locate(step).metrics for step in manager.steps()}
        stored = TieredCheckpointIO(manager).load_checkpoint(tmp_path / "names" / "last.ckpt")
    lowest = sorted(losses.by_step, key=lambda step: (losses.by_step[step], -step))[:3]
    assert set(recorded) == set(lowest) | {16}  # the three lowest losses of all 16 steps, and the newest
    assert all(recorded[step] == (("train_loss", losses.by_step[step]),) for step in recorded)
    assert "tiered_ckpt_metrics" not in stored  # recorded in the manifest, not stored with the checkpoint
    with pytest.raises(UsageError, match="RecordMetrics takes the names of logged metrics"):
        RecordMetrics()


def test_every_step_a_top_k_pointer_names_stays_in_both_tiers_until_the_pointer_goes(tmp_path, s3_url):
    url, options = s3_url
    names = tmp_path / "names"
    top_k = {"save_top_k": 2, "save_last": False, "every_n_train_steps": 1, "monitor": "train_loss"}

    def job() -> CheckpointManager:  # one step kept by each tier's own policy: the newest
        remote = RemoteOptions(url, storage_options=options, keep_last=1)
        return CheckpointManager(LocalOptions(tmp_path / "ckpt", keep_last=1), remote=remote, world_size=1)

    with job() as manager:
        io = TieredCheckpointIO(manager)
        run = trainer(io, names, 6, **top_k)
        run.fit(Model(), batches())
        manager.wait(uploaded=True)
        named = {pointer_step(path) for path in names.iterdir()}
        assert len(named) == 2 and manager.store.held == named
        assert manager.steps() == sorted(named | {6}) and manager.remote_steps() == sorted(named | {6})
        best = run.checkpoint_callback.best_model_path
        assert io.load_checkpoint(best)["global_step"] == pointer_step(Path(best))  # the best is loadable
    with job() as manager:  # a restart resumes from the best: the pointers its callback recorded are held again
        io = TieredCheckpointIO(manager)
        again = trainer(io, names, 9, **top_k)
        again.fit(Model(), batches(), ckpt_path=best)
        manager.wait(uploaded=True)
        named = {pointer_step(path) for path in names.iterdir()}
        assert manager.store.held == named and set(named) <= set(manager.steps()) & set(manager.remote_steps())
        newest = max(manager.steps())
        assert set(manager.steps()) == named | {newest}  # the others went, as the policy says
