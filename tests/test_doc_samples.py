"""Every python sample of the guides in docs/, run as printed (as tests/test_readme.py runs the README's).

Each sample runs in a process of its own (under ``torchrun`` where it needs one process per
rank) after a prelude that defines what it takes from its context, against moto's S3 server
on loopback reached through ``AWS_ENDPOINT_URL``; ``/nvme/ckpt`` becomes a temp directory.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import test_readme
from test_readme import TRAINING, committed, run, script

from tiered_ckpt.format.layout import step_dir_name

DOCS = Path(__file__).resolve().parent.parent / "docs"

bucket = test_readme.bucket  # the fixture: moto with the samples' bucket, and the environment to reach it

# (guide, a string only its sample holds)
MARKERS = {
    "per_rank": ("guides/distributed.md", 'LocalOptions(f"/nvme/ckpt/rank-{rank}", keep_last=3)'),
    "fsdp2": ("guides/distributed.md", "restored = manager.restore(into="),
    "dcp": ("guides/distributed.md", "TieredWriter(manager, step)"),
    "oneshot": ("guides/one-shot.md", "tiered_ckpt.save_sharded(states_per_rank"),
    "two_tier": ("guides/remote-tier.md", "keep_last=10, keep_every=1000"),
    "lag": ("guides/remote-tier.md", "lag = manager.lag()\nif lag.steps_behind"),
    "use": ("guides/saving-and-restoring.md", "def training_state(step):"),
    "partial": ("guides/saving-and-restoring.md", 'manager.restore(paths=["model"])'),
    "best": ("guides/saving-and-restoring.md", 'keep_best=2, best_metric="val_loss"'),
    "export": ("guides/exporting.md", 'export_safetensors("/nvme/ckpt/run"'),
    "memory": ("guides/memory.md", "RuntimeOptions(host_memory_bytes=8 << 20)"),
    "peer": ("guides/peer-tier.md", "peer=PeerOptions(every=10"),
    "lightning": ("guides/lightning.md", "trainer.fit(model, train_dataloaders, ckpt_path=io.ckpt_path())"),
    "fabric": ("guides/lightning.md", 'TieredCheckpointIO(manager, step_key="step")'),
    "lightning_ddp": ("guides/lightning.md", "strategy=TieredDDPStrategy()"),
    "lightning_fsdp2": ("guides/lightning.md", "TieredModelParallelStrategy(data_parallel_size=2"),
    "lightning_load": ("guides/lightning.md", 'load_from_checkpoint(Model, "checkpoints/last.ckpt")'),
}


def samples(guide: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", guide.read_text(), flags=re.DOTALL | re.MULTILINE)


def sample(name: str) -> str:
    guide, marker = MARKERS[name]
    found = [text for text in samples(DOCS / guide) if marker in text]
    assert len(found) == 1, f"{len(found)} samples of {guide} contain {marker!r}"
    return found[0]


def run_twice(path: Path, env: dict, cwd: Path) -> list[str]:
    """What ``path`` printed in a run and in a second one after it (a resume), each succeeding."""
    outputs = []
    for _ in range(2):
        result = run(path, env, cwd)
        assert result.returncode == 0, result.stderr[-5000:]
        outputs.append(result.stdout)
    return outputs


def test_every_python_sample_of_the_docs_is_run_here():
    claimed = {(guide, marker) for guide, marker in MARKERS.values()}
    for guide in sorted(DOCS.rglob("*.md")):
        name = str(guide.relative_to(DOCS))
        for text in samples(guide):
            owners = [marker for each, marker in claimed if each == name and marker in text]
            assert len(owners) == 1, f"a python sample of docs/{name} is run by {len(owners)} tests here:\n{text}"


PER_RANK_PRELUDE = """
    import torch
    total_steps = 400
    model = torch.nn.Linear(8, 8)

    def train_one_step():
        pass
"""


@pytest.mark.slow
def test_the_one_process_per_rank_guide_saves_every_rank_and_resumes(tmp_path, bucket):
    server, env = bucket
    epilogue = "print(f'rank {rank}: restored', restored and restored.step)\n"
    path = script(tmp_path, "per_rank", PER_RANK_PRELUDE, sample("per_rank"), epilogue)
    first = run(path, env, tmp_path, ranks=2)
    assert first.returncode == 0, first.stderr[-5000:]
    assert "rank 0: restored None" in first.stdout and committed(server) == [200, 400]
    again = run(path, env, tmp_path, ranks=2)
    assert again.returncode == 0, again.stderr[-5000:]
    assert "rank 0: restored 400" in again.stdout and "rank 1: restored 400" in again.stdout


FSDP_PRELUDE = """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import tiered_ckpt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    manager = tiered_ckpt.CheckpointManager(
        f"/nvme/ckpt/rank-{rank}", remote="s3://my-bucket/run-42", coordinator=tiered_ckpt.TorchDistributedCoordinator()
    )
    step = 1
"""


@pytest.mark.slow
def test_the_fsdp2_and_dcp_samples_save_and_restore_a_sharded_model(tmp_path, bucket):
    server, env = bucket
    between = "\nstep = 2\nstate = {'model': model_sd, 'optim': optim_sd}\n"
    epilogue = """
        manager.wait(uploaded=True)
        print(f"rank {rank}: steps {manager.steps()}")  # one write: the ranks share stdout
        manager.close()
        dist.destroy_process_group()
    """
    path = script(tmp_path, "fsdp2", FSDP_PRELUDE.replace("/nvme/ckpt", str(tmp_path / "nvme")), sample("fsdp2"))
    path.write_text(path.read_text() + between + sample("dcp") + epilogue.replace("\n        ", "\n"))
    result = run(path, env, tmp_path, ranks=2)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "rank 0: steps [1, 2]" in result.stdout and "rank 1: steps [1, 2]" in result.stdout
    assert committed(server) == [1, 2]


@pytest.mark.slow
def test_the_remote_tier_lag_and_oneshot_samples_run(tmp_path, bucket):
    server, env = bucket
    two_tier = script(tmp_path, "two_tier", "", sample("two_tier"), "manager.close()\nprint(manager.options.remote)\n")
    lag_prelude = """
        import tiered_ckpt
        alerts = []
        alert = alerts.append
        manager = tiered_ckpt.CheckpointManager("ckpt", world_size=1, remote="s3://my-bucket/run-42")
    """
    lag = script(tmp_path, "lag", lag_prelude, sample("lag"), "print('behind', lag.steps_behind, alerts)\n")
    oneshot_prelude = """
        import numpy as np
        states_per_rank = [{"w": np.full(8, rank, np.float32), "step": np.array(1200)} for rank in range(4)]
        my_buffers = [{"w": np.zeros(8, np.float32), "step": np.array(0)} for _ in range(4)]
    """
    oneshot_epilogue = "assert all(int(b['step']) == 1200 and b['w'][0] == r for r, b in enumerate(my_buffers))\n"
    oneshot = script(tmp_path, "oneshot", oneshot_prelude, sample("oneshot"), oneshot_epilogue)
    outputs = {}
    for path in (two_tier, lag, oneshot):
        result = run(path, env, tmp_path)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"
        outputs[path.stem] = result.stdout
    assert "keep_last=10, keep_every=1000" in outputs["two_tier"]
    assert "behind 0 []" in outputs["lag"]
    assert (tmp_path / "ckpt" / step_dir_name(1200) / "manifest.json").is_file()


@pytest.mark.slow
def test_the_saving_guide_trains_saves_to_the_bucket_and_resumes(tmp_path, bucket):
    server, env = bucket
    path = script(tmp_path, "use", TRAINING, sample("use"), 'print("restored", restored and restored.step)')
    outputs = run_twice(path, env, tmp_path)
    assert "restored None" in outputs[0] and "restored 400" in outputs[1]
    assert committed(server) == [200, 400]


def test_the_partial_restore_sample_restores_the_model_alone(tmp_path, bucket):
    _server, env = bucket
    path = script(tmp_path, "partial", "", sample("partial"), 'print("model", sorted(model_only["model"]))')
    result = run(path, env, tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "model ['layers', 'w']" in result.stdout


def test_the_keep_best_sample_keeps_the_two_lowest_losses_and_the_newest(tmp_path, bucket):
    _server, env = bucket
    path = script(tmp_path, "best", "", sample("best"))
    result = run(path, env, tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.splitlines() == ["[1, 3, 5]", "0.3"]
    kept = sorted(each.name for each in (tmp_path / "nvme" / "best").iterdir() if each.name.startswith("step-"))
    assert kept == [step_dir_name(step) for step in (1, 3, 5)]


def test_the_export_sample_writes_full_tensors(tmp_path, bucket):
    _server, env = bucket
    path = script(tmp_path, "export", "", sample("export"), 'print("files", len(result.files))')
    result = run(path, env, tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "files 1" in result.stdout and "model.safetensors" in result.stdout


PEER_PRELUDE = """
    import os
    import torch
    os.environ["GROUP_RANK"] = os.environ["RANK"]  # each rank stands for a node of its own
    total_steps = 120
    model = torch.nn.Linear(8, 8)

    def train_one_step():
        pass
"""


@pytest.mark.slow
def test_the_peer_tier_guide_keeps_steps_in_partner_memory_and_restores_the_newest(tmp_path, bucket):
    server, env = bucket
    text = sample("peer").replace("/dev/shm/tiered_ckpt", str(tmp_path / "shm"))
    epilogue = "print(f'rank {rank}: restored', restored and (restored.step, dict(restored.sources)))\n"
    path = script(tmp_path, "peer", PEER_PRELUDE, text, epilogue)
    first = run(path, env, tmp_path, ranks=2)
    assert first.returncode == 0, first.stderr[-5000:]
    assert "rank 0: restored None" in first.stdout
    assert sorted(p.name for p in (tmp_path / "nvme" / "rank-0").glob("step-*")) == [step_dir_name(100)]
    again = run(path, env, tmp_path, ranks=2)  # every process restarted; the partners' memory is intact
    assert again.returncode == 0, again.stderr[-5000:]
    assert "rank 0: restored (120, {0: 'peer'})" in again.stdout
    assert "rank 1: restored (120, {1: 'peer'})" in again.stdout
    assert committed(server) == []  # the bucket's cadence (500) took no step of 120


LIGHTNING_PRELUDE = """
    import lightning as L
    import torch

    total_steps = 200
    torch.manual_seed(0)

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    model = Model()
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    train_dataloaders = torch.utils.data.DataLoader(data, batch_size=8)

    def train_one_step(fabric, model, optimizer):
        fabric.backward(model(torch.randn(8, 8)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
"""


@pytest.mark.slow
def test_the_lightning_guide_resumes_a_trainer_from_the_bucket_and_fabric_from_its_newest_step(tmp_path, bucket):
    server, env = bucket
    sources = "print('sources', io.last_restore and dict(io.last_restore.sources))\n"
    trainer = script(tmp_path, "trainer_sample", LIGHTNING_PRELUDE, sample("lightning"), sources)
    first = run(trainer, env, tmp_path)
    assert first.returncode == 0, first.stderr[-5000:]
    assert "restored step None" in first.stdout and committed(server) == [100, 200]
    assert json.loads((tmp_path / "checkpoints" / "last.ckpt").read_text())["step"] == 200
    shutil.rmtree(tmp_path / "nvme")  # a new node: the steps are in the bucket only
    again = run(trainer, env, tmp_path)
    assert again.returncode == 0, again.stderr[-5000:]
    assert "restored step 200" in again.stdout and "sources {0: 'remote'}" in again.stdout
    shutil.rmtree(tmp_path / "nvme")  # a serving machine: the pointer's bucket alone
    shown = "print('loaded', type(model).__name__, model.net.weight.shape)\n"
    shown += "print('exported', Model.load_from_checkpoint('model.ckpt').net.weight.shape)\n"
    loaded = run(script(tmp_path, "load_sample", LIGHTNING_PRELUDE, sample("lightning_load"), shown), env, tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-5000:]
    assert "loaded Model torch.Size([1, 8])" in loaded.stdout and "exported torch.Size([1, 8])" in loaded.stdout

    epilogue = "print('fabric', io.last_restore and io.last_restore.step, state['step'])\n"
    fabric = script(tmp_path, "fabric_sample", LIGHTNING_PRELUDE, sample("fabric"), epilogue)
    outputs = run_twice(fabric, env, tmp_path)
    assert "fabric None 200" in outputs[0] and "fabric 200 200" in outputs[1]
    assert sorted(path.name for path in (tmp_path / "checkpoints").glob("fabric-*")) == [
        "fabric-100.ckpt",
        "fabric-200.ckpt",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lightning_ddp", "lightning_fsdp2"])
def test_the_lightning_ddp_and_fsdp2_samples_save_on_both_ranks_and_resume_both_from_last(tmp_path, bucket, name):
    server, env = bucket
    path = script(tmp_path, name, LIGHTNING_PRELUDE, sample(name))
    first = run(path, env, tmp_path, ranks=2)
    assert first.returncode == 0, first.stderr[-5000:]
    assert "rank 0: restored None" in first.stdout and "rank 1: restored None" in first.stdout
    assert committed(server) == [100, 200]
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir()) == ["rank-0", "rank-1"]
    again = run(path, env, tmp_path, ranks=2)
    assert again.returncode == 0, again.stderr[-5000:]
    assert "rank 0: restored 200" in again.stdout and "rank 1: restored 200" in again.stdout


def test_the_memory_guide_saves_a_state_past_its_budget(tmp_path, bucket):
    _server, env = bucket
    path = script(tmp_path, "memory", "", sample("memory"))
    result = run(path, env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "staged 8388608, written from the caller's memory 20971520" in result.stdout
    assert "throttled by runtime.host_memory_bytes=8388608" in result.stderr  # the WARNING, once
    assert (tmp_path / "nvme" / "run" / step_dir_name(1) / "manifest.json").is_file()
