"""The Lightning plugin under DDP, FSDP2 and FSDP1 (tiered_ckpt.lightning_strategies): real ``Trainer`` ranks on gloo.

Each run starts one process per rank (tests/support/lightning_ddp_child.py), each with a manager
of its own directory and the bucket (moto's S3 server). A run killed with SIGKILL mid-epoch
resumes from ``last`` to the losses and parameters of a run never interrupted, bit for bit, on
every rank; a step saved by 2 ranks resumes on 3 from the bucket; under DDP each array is stored
once, under FSDP2 and FSDP1 each rank's chunks are its own.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from support.lightning_child import Model
from tiered_ckpt import CheckpointManager, IncompleteCheckpointError, TorchDistributedCoordinator, UsageError
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.lightning import TieredCheckpointIO, TieredDDPStrategy, TieredFSDPStrategy, load_from_checkpoint

CHILD = Path(__file__).resolve().parent / "support" / "lightning_ddp_child.py"
EVERY, KILL_AT, MAX_STEPS = 10, 12, 30  # the loader has 16 batches an epoch: the kill and step 10 in epoch 0

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


def ddp_config(root: Path, name: str, world: int, remote: tuple[str, dict] | None, **extra: Any) -> dict:
    """A run of ``world`` ranks under ``root`` (their directories in ``root/nodes``, pointers in ``root/names``)."""
    out = root / name
    out.mkdir(parents=True)
    config = {
        "world_size": world,
        "store": str(out / "store"),
        "out": str(out),
        "local_root": str(root / "nodes"),
        "names": str(root / "names"),
        "every": EVERY,
        "max_steps": MAX_STEPS,
        **extra,
    }
    if remote is not None:
        config["url"], config["options"] = remote
    return config


def start(config: dict) -> list[subprocess.Popen]:
    out = Path(config["out"])
    (out / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(CHILD.parent.parent)}
    ranks = []
    for rank in range(config["world_size"]):
        with open(out / f"stderr-{rank}", "w") as stderr:
            command = [sys.executable, str(CHILD), str(out / "config.json"), str(rank)]
            ranks.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, env=env))
    return ranks


def stderr(config: dict) -> str:
    out = Path(config["out"])
    return "\n".join((out / f"stderr-{rank}").read_text()[-3000:] for rank in range(config["world_size"]))


def losses(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"losses-{rank}.jsonl").read_text().splitlines()]


def params(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as loaded:
        return {name: loaded[name] for name in loaded.files}


def run(config: dict) -> list[dict]:
    """Run every rank to its end; return each rank's result with its losses and parameters."""
    ranks = start(config)
    try:
        codes = [rank.wait(timeout=600) for rank in ranks]  # a guard against a hang, not a timing
    finally:
        for rank in ranks:
            rank.kill()
            rank.stdout.close()
    assert codes == [0] * len(ranks), stderr(config)
    out, results = Path(config["out"]), []
    for rank in range(config["world_size"]):
        result = json.loads((out / f"result-{rank}.json").read_text())
        result.update(losses=losses(out, rank), params=params(out / f"params-{rank}.npz"))
        result["start"] = params(out / f"start-{rank}.npz")
        results.append(result)
    return results


def run_until_killed(config: dict) -> list[list[dict]]:
    """Run every rank until rank 0 says the checkpoint is in the bucket; SIGKILL each; return their losses."""
    ranks = start(config)
    said = b""
    try:
        while b"KILL ME\n" not in said:
            ready, _, _ = select.select([ranks[0].stdout], [], [], 600)  # a guard against a hang, not a timing
            chunk = os.read(ranks[0].stdout.fileno(), 65536) if ready else b""
            assert chunk, "the ranks ended or hung before the kill: " + stderr(config)
            said += chunk
        for rank in ranks:
            os.kill(rank.pid, signal.SIGKILL)
        assert [rank.wait(timeout=600) for rank in ranks] == [-signal.SIGKILL] * len(ranks)
    finally:
        for rank in ranks:
            rank.kill()
            rank.stdout.close()
    return [losses(Path(config["out"]), rank) for rank in range(config["world_size"])]


def assert_same_params(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> None:
    assert sorted(expected) == sorted(actual)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype and actual[name].tobytes() == expected[name].tobytes(), name


def test_the_strategy_refuses_another_checkpoint_io_and_the_plugin_makes_its_manager_on_first_use(tmp_path):
    strategy = TieredDDPStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(UsageError, match=r"the Trainer's CheckpointIO is a TorchCheckpointIO"):
        strategy.save_checkpoint({"global_step": 1}, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()

    made: list[CheckpointManager] = []
    io = TieredCheckpointIO(lambda: made.append(CheckpointManager(tmp_path / "ckpt", world_size=1)) or made[-1])
    assert made == [] and "TieredCheckpointIO(<function" in repr(io)  # not made until used
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, tmp_path / "b.ckpt")
    with made[0]:
        assert len(made) == 1 and io.manager is made[0] and made[0].steps() == [1]
        assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.ones(2))

    early = TieredCheckpointIO(lambda: CheckpointManager(tmp_path / "early", coordinator=TorchDistributedCoordinator()))
    with pytest.raises(UsageError, match=r'makes its manager on first use.*resume with ckpt_path="last"'):
        early.ckpt_path()  # before Lightning set up the process group
    two = CheckpointManager(tmp_path / "two", world_size=2)
    for wrong, why in [(lambda: "a path", "a path"), (lambda: two, r"holding ranks \[0, 1\]")]:
        plugin = TieredCheckpointIO(wrong)
        with pytest.raises(UsageError, match=rf"needs a CheckpointManager of one rank in this process: .*{why}"):
            plugin.save_checkpoint({"global_step": 1}, tmp_path / "c.ckpt")
    with pytest.raises(UsageError, match=r"takes a CheckpointManager or a function making one"):
        TieredCheckpointIO(str(tmp_path))  # type: ignore[arg-type]
    assert not (tmp_path / "c.ckpt").exists()
    two.close()


def test_the_fsdp1_strategy_saves_each_ranks_shards_on_a_mesh_and_refuses_what_would_not(tmp_path):
    assert TieredFSDPStrategy()._state_dict_type == "sharded"  # Lightning's FSDPStrategy defaults to "full"
    with pytest.raises(UsageError, match=r"saves each rank's shards \(state_dict_type='sharded'\), not 'full'"):
        TieredFSDPStrategy(state_dict_type="full")
    with pytest.raises(UsageError, match=r"shards over a device mesh, not a process_group"):
        TieredFSDPStrategy(process_group=object())
    with pytest.raises(UsageError, match=r"sharding_strategy='HYBRID_SHARD' needs device_mesh=\(replicas, shards"):
        TieredFSDPStrategy(sharding_strategy="HYBRID_SHARD")
    with pytest.raises(UsageError, match=r"TieredFSDPStrategy saves through a tiered_ckpt.lightning.TieredCheck"):
        TieredFSDPStrategy(checkpoint_io=TorchCheckpointIO()).save_checkpoint({"global_step": 1}, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()


_RUNS: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Ranks never killed (two, or ``world``), under a strategy ("ddp", "fsdp2", ...), each run once (local disk only:
    where checkpoints go does not change the training)."""

    def of(strategy: str, world: int = 2) -> list[dict]:
        if strategy not in _RUNS:
            root = tmp_path_factory.mktemp(f"{strategy}-uninterrupted")
            results = run(ddp_config(root, "run", world, None, strategy=strategy))
            for result in results:
                assert [each["step"] for each in result["losses"]] == list(range(MAX_STEPS))
                assert_same_params(results[0]["params"], result["params"])  # the ranks' (gathered) models agree
            assert results[0]["losses"] != results[-1]["losses"]  # each rank trained on its own part of the batches
            _RUNS[strategy] = results
        return _RUNS[strategy]

    return of


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, wrapped",
    [("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True), ("fsdp1", False)],
    ids=["ddp", "ddp-async", "fsdp2", "fsdp2-async", "fsdp1"],
)
def test_two_ranks_killed_mid_epoch_resume_from_last_bit_for_bit(tmp_path, s3_url, uninterrupted, strategy, wrapped):
    expected = uninterrupted(strategy)
    options = {"async": wrapped, "strategy": strategy}
    killed = run_until_killed(ddp_config(tmp_path, "killed", 2, s3_url, kill_at=KILL_AT, wait_for=EVERY, **options))
    for rank in range(2):
        assert killed[rank] == expected[rank]["losses"][:KILL_AT]  # trained past the checkpoint, then died

    resumed = run(ddp_config(tmp_path, "resumed", 2, s3_url, ckpt_path="last", **options))
    for rank, result in enumerate(resumed):
        assert (result["restored"], result["sources"]) == (EVERY, {str(rank): "local"})
        assert result["losses"] == expected[rank]["losses"][EVERY:]  # each loss after step 10, bit for bit
        assert_same_params(expected[rank]["params"], result["params"])
        assert result["global_step"] == MAX_STEPS and MAX_STEPS in result["remote_steps"]

    step_dir = tmp_path / "nodes" / "rank-0" / step_dir_name(EVERY)
    manifest = ShardManifest.from_json((step_dir / "manifest.json").read_text())
    stored = [{chunk.name for chunk in record.chunks} for record in manifest.shards]
    weights = [{name for name in names if name.startswith(("state_dict/", "optimizer_states/"))} for names in stored]
    if strategy != "ddp":  # each rank its own chunks of every parameter and moment, Adam's steps once
        steps = {name for name in weights[0] | weights[1] if name.endswith("/step")}
        assert weights[0] - steps == weights[1] - steps and len(weights[0] - steps) == 12
        assert len(steps) == 4 and not steps & weights[0] & weights[1]
        chunks = {c.name: c for c in manifest.shards[1].chunks}
        assert chunks["state_dict/net.0.weight"].offsets != (0, 0)  # rank 1's half, not a copy of rank 0's
        return
    # DDP, stored once: each weight and moment is in one rank's shard; the other's record names its writer.
    assert len(weights[0] | weights[1]) == 16  # 4 parameters, each with Adam's step and 2 moments
    assert weights[0] and weights[1] and not weights[0] & weights[1]  # both ranks wrote, neither twice
    for rank, record in enumerate(manifest.shards):
        assert weights[1 - rank] <= {name for name, writer in record.replicas if writer == 1 - rank}


@pytest.mark.slow
def test_hybrid_sharding_writes_each_chunk_once_and_resumes_bit_for_bit_and_on_two_ranks(
    tmp_path, s3_url, uninterrupted
):
    expected = uninterrupted("hsdp", world=4)  # FSDP1 over 2 ranks, replicated over 2 such pairs
    options = {"strategy": "hsdp"}
    killed = run_until_killed(ddp_config(tmp_path, "killed", 4, s3_url, kill_at=KILL_AT, wait_for=EVERY, **options))
    assert killed == [result["losses"][:KILL_AT] for result in expected]
    resumed = run(ddp_config(tmp_path, "resumed", 4, s3_url, ckpt_path="last", **options))
    for rank, result in enumerate(resumed):
        assert (result["restored"], result["losses"]) == (EVERY, expected[rank]["losses"][EVERY:])
        assert_same_params(expected[rank]["params"], result["params"])

    step_dir = tmp_path / "nodes" / "rank-0" / step_dir_name(EVERY)
    manifest = ShardManifest.from_json((step_dir / "manifest.json").read_text())
    written = [(chunk.name, chunk.offsets) for record in manifest.shards for chunk in record.chunks]
    assert len(written) == len(set(written))  # a chunk its replica pair holds alike is written once
    assert {name for name, _ in written if name.startswith("state_dict/")} == {
        f"state_dict/{n}" for n in expected[0]["params"]
    }
    assert all(record.replicas for record in manifest.shards)  # each rank's record names the other writers

    # Two new ranks under plain FSDP1 start from the four ranks' last step, resharded, from the bucket.
    two = run(
        ddp_config(
            tmp_path / "two",
            "run",
            2,
            s3_url,
            strategy="fsdp1",
            ckpt_path=str(tmp_path / "names" / "last.ckpt"),
            max_steps=MAX_STEPS + 4,
        )
    )
    for result in two:
        assert result["restored"] == MAX_STEPS and set(result["sources"].values()) == {"remote"}
        assert_same_params(expected[0]["params"], result["start"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1"])
def test_a_step_of_two_ranks_resumes_on_three_from_the_bucket(tmp_path, s3_url, uninterrupted, strategy):
    expected = uninterrupted(strategy)
    saved = run(ddp_config(tmp_path, "two", 2, s3_url, strategy=strategy))
    for rank in range(2):
        assert saved[rank]["losses"] == expected[rank]["losses"]
    last = tmp_path / "names" / "last.ckpt"

    # Three new ranks (new disks): each starts from the step of the two, through the bucket.
    config = ddp_config(tmp_path / "three", "run", 3, s3_url, ckpt_path=str(last), max_steps=MAX_STEPS + 8)
    three = run({**config, "strategy": strategy})
    for result in three:
        assert result["restored"] == MAX_STEPS and set(result["sources"].values()) == {"remote"}
        assert_same_params(expected[0]["params"], result["start"])
        assert result["global_step"] == MAX_STEPS + 8
        assert_same_params(three[0]["params"], result["params"])

    # Lightning's validate(ckpt_path=...) on two new processes: a load without optimizers.
    validated = run(ddp_config(tmp_path, "validate", 2, s3_url, strategy=strategy, validate_from=str(last)))
    for result in validated:
        assert result["restored"] == MAX_STEPS
        assert_same_params(expected[0]["params"], result["params"])

    # For evaluation and serving: the module Lightning's load_from_checkpoint would build, from the pointer.
    if strategy == "ddp":
        module = load_from_checkpoint(Model, last, storage_options=s3_url[1])
        assert_same_params(expected[0]["params"], {k: v.numpy() for k, v in module.state_dict().items()})
    else:
        with pytest.raises(UsageError, match=r"holds the shards of 2 ranks \(a state of DTensors\)"):
            load_from_checkpoint(Model, last, storage_options=s3_url[1])


@pytest.mark.slow
def test_a_save_refused_on_one_rank_is_refused_on_every_rank_and_the_job_goes_on(tmp_path):
    child = CHILD.parent / "lightning_ranks_child.py"
    env = {**os.environ, "PYTHONPATH": str(CHILD.parent.parent)}
    ranks = [subprocess.Popen([sys.executable, str(child), str(tmp_path), str(rank)], env=env) for rank in (0, 1)]
    try:
        assert [rank.wait(timeout=300) for rank in ranks] == [0, 0]  # a guard against a hang, not a timing
    finally:
        for rank in ranks:
            rank.kill()
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, result in enumerate(results):
        first, again, after = result["raised"]
        assert first is None and after is None and result["steps"] == [1, 2]
        assert (
            again[0] == "CheckpointExistsError"
            and "step 1 is saved already with other contents in position" in again[1]
        )
        assert ("rank 1" in again[1]) == (rank == 0)  # rank 0 raises rank 1's refusal, naming it
    assert json.loads((tmp_path / "a.ckpt").read_text())["step"] == 1 and not (tmp_path / "last.ckpt").exists()


def test_read_checkpoint_refuses_a_step_of_ranks_that_are_not_data_parallel_and_names_a_missing_shard(tmp_path):
    from tiered_ckpt.lightning_load import read_checkpoint

    flat = [{"params": np.arange(6.0) + 6 * rank, "epoch": 1} for rank in range(2)]
    alike = [{"state_dict": {"w": np.ones(4), "b": np.zeros(2)}, "epoch": 1} for _rank in range(2)]
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(1, flat, blocking=True)  # each rank its own slice
        manager.save(2, alike, blocking=True, replicated=True)
    with pytest.raises(UsageError, match=r"step 1 was saved by 2 ranks, each its own state \(not data parallel\)"):
        read_checkpoint(tmp_path / step_dir_name(1))
    assert read_checkpoint(tmp_path / step_dir_name(2))["state_dict"]["b"].tolist() == [0.0, 0.0]
    manifest = ShardManifest.from_json((tmp_path / step_dir_name(2) / "manifest.json").read_text())
    assert manifest.shard(0).replicas  # rank 0's state has arrays in rank 1's shard
    (tmp_path / step_dir_name(2) / manifest.shard(1).path).unlink()  # rank 1's disk, not this one
    with pytest.raises(IncompleteCheckpointError, match=r"rank 1 wrote \d+ arrays of this data-parallel step"):
        read_checkpoint(tmp_path / step_dir_name(2))


@pytest.mark.slow
def test_every_rank_keeps_the_steps_of_rank_0s_top_k_pointers_and_no_other(tmp_path, s3_url):
    from tiered_ckpt.lightning_load import read_checkpoint

    results = run(ddp_config(tmp_path, "top-k", 2, s3_url, every=3, top_k=2, keep_last=1))
    names = sorted(path.name for path in (tmp_path / "names").iterdir())
    pointed = {json.loads((tmp_path / "names" / name).read_text())["step"] for name in names}
    assert len(names) == 3 and results[0]["held"] == results[1]["held"] == sorted(pointed)
    for result in results:  # the steps the pointers name, and none that rank 0 released, on both disks
        assert result["steps"] == sorted(pointed)
    for name in names:  # every pointer loads: both ranks' shards of its step are kept
        assert read_checkpoint(tmp_path / "names" / name, storage_options=s3_url[1])["global_step"] in pointed
