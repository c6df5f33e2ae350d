"""DTensor (FSDP2) state saved by N rank processes and restored into M, through both tiers;
and torch/dtensor's reading of one DTensor, on a one-rank mesh in this process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from support.processes import launch_ranks
from support.states import flip_byte
from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.layout import shard_name, step_dir_name
from tiered_ckpt.format.state import flatten
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.torch.dtensor import is_dtensor, local_chunk

WORKER = Path(__file__).resolve().parents[1] / "support" / "fsdp_worker.py"


@pytest.fixture(scope="module")
def mesh():
    """A one-rank CPU device mesh (gloo over an in-process store), torn down after the module."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def test_local_chunk_is_a_view_of_the_local_tensor_and_its_box(mesh):
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = torch.arange(12.0).reshape(3, 4)
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    assert is_dtensor(sharded) and not is_dtensor(local) and not is_dtensor(local.numpy())
    chunk = local_chunk(sharded, "state: w")
    assert chunk.tensor.data_ptr() == local.data_ptr()
    assert (chunk.global_shape, chunk.offsets, chunk.replicated) == ((3, 4), (0, 0), False)
    assert local_chunk(DTensor.from_local(local, mesh, [Replicate()], run_check=False), "w").replicated


def test_a_dtensor_that_is_not_one_box_is_refused_naming_its_path(mesh):
    import torch
    from torch.distributed.tensor import DTensor, Partial, Shard

    local = torch.arange(12.0).reshape(3, 4)
    pending = DTensor.from_local(local, mesh, [Partial()], run_check=False)
    with pytest.raises(InvalidStateError, match="^state: w is a DTensor with a Partial placement"):
        local_chunk(pending, "state: w")
    with pytest.raises(InvalidStateError, match=r'^rank 0: state\["m"\]\[0\] is a DTensor with a Partial'):
        flatten({"m": [pending]}, "rank 0")
    strided = DTensor.from_local(local.t(), mesh, [Shard(0)], run_check=False)
    with pytest.raises(InvalidStateError, match="^w is a DTensor whose local tensor is not contiguous"):
        local_chunk(strided, "w")


def test_a_replicated_dtensor_is_replicated_and_a_sharded_one_is_not(mesh):
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = torch.ones(2, 2, dtype=torch.complex64)
    state = {
        "r": DTensor.from_local(local, mesh, [Replicate()], run_check=False),
        "s": DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False),
    }
    flat = flatten(state)
    assert flat.replicated == frozenset({"r"})
    assert flat.structure.chunks["s"].global_shape == (2, 2, 2)  # complex: its float pairs


def run_job(root: Path, world_size: int, do: str, remote=None, **config) -> dict[int, dict]:
    """Run ``world_size`` FSDP2 rank processes over ``root/nodes``; return each rank's result."""
    return launch_ranks(WORKER, root, world_size, {"do": do, **config}, remote=remote)


@pytest.mark.slow
@pytest.mark.parametrize("old, news", [(2, (4, 3)), (4, (2,)), (3, (3,))])
def test_an_fsdp2_state_restores_byte_equal_on_another_world_size(tmp_path, s3_url, old, news):
    saved = run_job(tmp_path, old, "save", remote=s3_url)
    assert all("error" not in result for result in saved.values()), saved
    expected = saved[0]["digests"]
    assert all(result["digests"] == expected for result in saved.values())  # the full state, seen from any rank
    for new in news:  # 2->4, 2->3, 4->2, 3->3
        restored = run_job(tmp_path, new, "restore", remote=s3_url)
        for rank, result in restored.items():
            assert "error" not in result, result
            assert result["digests"] == expected  # model and AdamW state, every byte, and the scalars
            assert result["seed"] == (rank if new == old else 0)  # a rank's own array: rank 0's when resharded
            if rank >= old and new == max(news):  # a rank that never existed: an empty disk, all from the bucket
                assert set(result["sources"].values()) == {"remote"}, result


@pytest.mark.slow
def test_replicated_arrays_are_written_once_and_each_rank_keeps_its_own(tmp_path):
    saved = run_job(tmp_path, 3, "save")  # no bucket: a same-size restore needs none
    manifest = json.loads((tmp_path / "nodes" / "rank-0" / step_dir_name(3) / "manifest.json").read_text())
    held = {shard["rank"]: {chunk["name"] for chunk in shard["chunks"]} for shard in manifest["shards"]}
    left = {shard["rank"]: dict(shard.get("replicas", [])) for shard in manifest["shards"]}
    for name in ("extras/table", "optim/state/0.weight/step"):  # the same on every rank
        holders = [rank for rank, names in held.items() if name in names]
        assert len(holders) == 1, (name, holders)
        assert all(left[rank] == {**left[rank], name: holders[0]} for rank in range(3) if rank != holders[0])
    assert all("extras/seed" in names for names in held.values())  # each rank's own value stays in its shard
    assert all("model/0.weight" in names for names in held.values())  # FSDP2 chunks: every rank its own
    assert sum(len(names) for names in left.values()) == 2 * 6 + 2  # 6 AdamW steps and the table, 2 ranks each

    for do in ("restore", "restore_plain"):  # into a fresh FSDP2 state, and as saved; from the other ranks
        restored = run_job(tmp_path, 3, do)
        for rank, result in restored.items():
            assert "error" not in result, result
            assert set(result["sources"]) == {str(rank)} and result["sources"][str(rank)] == "local"
            if do == "restore":
                assert result["digests"] == saved[rank]["digests"] and result["seed"] == rank
            else:
                assert result["local"] == saved[rank]["local"]


@pytest.mark.slow
def test_a_part_of_the_state_restores_with_the_replicated_arrays_under_it_and_no_others(tmp_path):
    saved = run_job(tmp_path, 3, "save")  # extras/table is written once, by one rank, for all three
    for part in ("extras", "model"):  # its replica received from its holder; none exchanged at all
        restored = run_job(tmp_path, 3, f"restore_{part}")
        for rank, result in restored.items():
            assert "error" not in result, result
            expected = {key: digest for key, digest in saved[rank]["local"].items() if key.startswith(f"/{part}/")}
            assert result["local"] == expected and expected


@pytest.mark.slow
def test_a_flipped_byte_in_a_needed_shard_is_caught_and_read_from_the_bucket(tmp_path, s3_url):
    saved = run_job(tmp_path, 2, "save", remote=s3_url)
    step_dir = tmp_path / "nodes" / "rank-0" / step_dir_name(3)
    shard = step_dir / shard_name(0, 2)
    flip_byte(shard, shard.stat().st_size - 8)  # inside the last chunk's bytes
    restored = run_job(tmp_path, 3, "restore", remote=s3_url)
    assert restored[0]["sources"]["0"] == "remote"  # the damaged local copy was refused
    assert all(result["digests"] == saved[0]["digests"] for result in restored.values())


@pytest.mark.slow
def test_without_a_bucket_a_flipped_byte_fails_the_restore_on_every_rank(tmp_path):
    run_job(tmp_path, 2, "save")
    shard = tmp_path / "nodes" / "rank-1" / step_dir_name(3) / shard_name(1, 2)
    flip_byte(shard, shard.stat().st_size - 8)
    restored = run_job(tmp_path, 2, "restore")
    for result in restored.values():
        assert result["error"][0] == "ChecksumMismatchError", result


@pytest.mark.slow
@pytest.mark.parametrize("save, old, new", [("dcp_save", 2, 3), ("dcp_async_save", 3, 2)])
def test_the_dcp_backend_round_trips_an_fsdp2_state_across_world_sizes(tmp_path, s3_url, save, old, new):
    saved = run_job(tmp_path, old, save, remote=s3_url)
    assert all("error" not in result for result in saved.values()), saved
    loaded = run_job(tmp_path, new, "dcp_load", remote=s3_url)
    for result in loaded.values():
        assert "error" not in result, result
        assert result["digests"] == saved[0]["digests"]
    manifest = json.loads((tmp_path / "nodes" / "rank-0" / step_dir_name(3) / "manifest.json").read_text())
    assert manifest["world_size"] == old and all(shard["chunks"] for shard in manifest["shards"])


def lose_rank(root: Path, rank: int) -> None:
    """Rank ``rank``'s node is replaced: its directory (and its node's memory, if any) is gone."""
    shutil.rmtree(root / "nodes" / f"rank-{rank}")
    shutil.rmtree(root / f"memory-{'ab'[rank]}", ignore_errors=True)


def assert_refilled(root: Path, rank: int, step: int = 3) -> None:
    disk = LocalTier(root / "nodes" / f"rank-{rank}")
    assert disk.steps() == [step]
    assert disk.held_ranks(step, disk.manifest(step)) == [rank]
    assert disk.check_shard(step, disk.manifest(step).shard(rank)) is None  # its bytes match the manifest


@pytest.mark.slow
def test_a_restore_into_dtensors_refills_a_replaced_disk_from_the_bucket(tmp_path, s3_url):
    saved = run_job(tmp_path, 2, "save", remote=s3_url)
    lose_rank(tmp_path, 1)
    restored = run_job(tmp_path, 2, "restore", remote=s3_url)
    for rank, result in restored.items():
        assert "error" not in result, result
        assert result["digests"] == saved[rank]["digests"] and result["seed"] == rank
    assert restored[1]["sources"] == {"1": "remote"}
    assert_refilled(tmp_path, 1)


@pytest.mark.slow
def test_a_restore_into_dtensors_refills_a_replaced_disk_from_the_partners_memory(tmp_path):
    nodes = {"nodes": ["a", "b"], "root": str(tmp_path)}
    saved = launch_ranks(WORKER, tmp_path, 2, {"do": "save", **nodes})
    lose_rank(tmp_path, 1)
    restored = launch_ranks(WORKER, tmp_path, 2, {"do": "restore", **nodes})
    for rank, result in restored.items():
        assert "error" not in result, result
        assert result["digests"] == saved[rank]["digests"] and result["seed"] == rank
    assert restored[1]["sources"] == {"1": "peer"}
    assert_refilled(tmp_path, 1)


@pytest.mark.slow
def test_an_fsdp2_step_with_a_frozen_layer_references_its_chunks_and_restores_on_any_world_size(tmp_path, s3_url):
    saved = run_job(tmp_path, 2, "save", s3_url, wide=True, frozen=True)
    assert all("error" not in result for result in saved.values()), saved
    expected = saved[0]["digests"]
    manifest = LocalTier(tmp_path / "nodes" / "rank-0").manifest(4)
    referenced = {shard.rank: {n for ref in shard.references for n in ref.names} for shard in manifest.shards}
    for rank, names in referenced.items():
        # the frozen layer's chunks and their AdamW moments: in step 3's files, not written again
        frozen = {"model/0.weight", "optim/state/0.weight/exp_avg", "optim/state/0.weight/exp_avg_sq"}
        assert frozen <= names, (rank, names)
        assert not names & {"model/2.weight", "optim/state/2.weight/exp_avg"}  # trained: written
        assert {ref.step for ref in manifest.shard(rank).references} == {3}
    table_writer = [rank for rank, names in referenced.items() if "extras/table" in names]
    assert len(table_writer) == 1  # a replicated array: referenced by the rank that stores it
    for new in (2, 3):  # into fresh FSDP2 states: the same world size, and resharded (rank 2 from the bucket)
        restored = run_job(tmp_path, new, "restore", s3_url, wide=True, frozen=True)
        for result in restored.values():
            assert "error" not in result, result
            assert result["digests"] == expected  # model and AdamW state of step 4, every byte
    plain = run_job(tmp_path, 2, "restore_plain", s3_url, wide=True, frozen=True)  # as saved, each rank's chunks
    for rank, result in plain.items():
        assert "error" not in result, result
        assert result["local"] == saved[rank]["local"]
