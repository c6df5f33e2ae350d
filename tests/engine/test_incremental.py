"""Incremental saves (tiered_ckpt.engine.incremental): an array unchanged since the step before is
referenced in the earlier file holding its bytes, every step still restores bit for bit, and
retention keeps what a retained step references (real files, real managers)."""

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from support.processes import kill_when_told
from support.states import incremental_state, referenced_files_exist, same_state
from tiered_ckpt import (
    CheckpointManager,
    ChecksumMismatchError,
    LocalOptions,
    RemoteOptions,
    RuntimeOptions,
)
from tiered_ckpt.format.layout import KEPT_NAME, MANIFEST_NAME, step_dir_name
from tiered_ckpt.format.manifest import REFERENCES_SCHEMA_VERSION, SCHEMA_VERSION

RNG = np.random.default_rng(7)
BASE = {f"layer{i}": RNG.standard_normal((64, 64)).astype(np.float32) for i in range(6)}  # 16 KiB each


def lora_state(step: int, base: dict | None = None) -> dict:
    """A LoRA run's state at ``step``: a frozen base, an adapter and its moments that change every step."""
    rng = np.random.default_rng(step)
    adapter = {
        "a": rng.standard_normal((64, 8)).astype(np.float32),
        "b": rng.standard_normal((8, 64)).astype(np.float32),
    }
    moments = {name: rng.random((64, 8)).astype(np.float32) for name in ("m", "v")}
    return {"model": {"base": dict(base or BASE), "adapter": adapter}, "optim": moments, "step": step}


def manifest_of(root, step: int) -> dict:
    return json.loads((root / step_dir_name(step) / MANIFEST_NAME).read_text())


def shard_bytes(root, step: int) -> int:
    directory = root / step_dir_name(step)
    return sum(entry.stat().st_size for entry in directory.iterdir() if entry.name.startswith("rank-"))


def test_only_the_arrays_that_changed_are_written_and_every_step_restores_bit_for_bit(tmp_path):
    saved = {step: lora_state(step) for step in (1, 2, 3)}
    with CheckpointManager(tmp_path, world_size=1) as manager:
        for step, state in saved.items():
            manager.save(step, state, blocking=True)
    first, later = shard_bytes(tmp_path, 1), shard_bytes(tmp_path, 3)
    base_bytes = sum(array.nbytes for array in BASE.values())
    assert first > base_bytes and later < first - base_bytes + 4096  # the base is not written again
    document = manifest_of(tmp_path, 3)
    assert document["schema_version"] == REFERENCES_SCHEMA_VERSION
    (ref,) = document["shards"][0]["references"]
    assert ref["step"] == 1 and ref["names"] == sorted(ref["names"]) and len(ref["names"]) == len(BASE)
    assert ref["bytes"] == base_bytes and manifest_of(tmp_path, 1)["schema_version"] == SCHEMA_VERSION
    with CheckpointManager(tmp_path, world_size=1) as manager:
        for step, state in saved.items():
            assert same_state(manager.restore(step=step).states[0], state)
            part = manager.restore(step=step, paths=[("model", "base")]).states[0]
            assert same_state(part["model"]["base"], BASE)
            into = {key: value for key, value in lora_state(0, {k: np.zeros_like(v) for k, v in BASE.items()}).items()}
            result = manager.restore(step=step, into=into)
            assert same_state(into["model"], state["model"]) and same_state(into["optim"], state["optim"])
            assert result.bytes_read >= base_bytes  # the referenced bytes are read, and counted


def test_a_restarted_job_references_the_step_on_its_disk_and_never_a_chain(tmp_path):
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, lora_state(1), blocking=True)
    changed = {**BASE, "layer0": BASE["layer0"] + 1}
    with CheckpointManager(tmp_path, world_size=1) as manager:  # the baseline read from step 1's header
        manager.save(2, lora_state(2, changed), blocking=True)
        manager.save(3, lora_state(3, changed), blocking=True)
    refs = {ref["step"]: ref["names"] for ref in manifest_of(tmp_path, 3)["shards"][0]["references"]}
    assert refs == {1: [f"model/base/layer{i}" for i in range(1, 6)], 2: ["model/base/layer0"]}  # where the bytes are
    with CheckpointManager(tmp_path, world_size=1) as manager:
        assert same_state(manager.restore(step=3).states[0], lora_state(3, changed))


def test_retention_keeps_what_a_retained_step_references_and_removes_the_rest(tmp_path, caplog):
    caplog.set_level(logging.INFO, "tiered_ckpt")
    local = LocalOptions(tmp_path, keep_last=2)
    with CheckpointManager(local, world_size=1) as manager:
        for step in range(1, 5):
            manager.save(step, lora_state(step), blocking=True)
        manager.wait()
        assert manager.steps() == [3, 4]
        kept = tmp_path / f"kept-{step_dir_name(1)}"  # which no clean-up of crashed saves touches
        assert (kept / KEPT_NAME).is_file() and not (tmp_path / step_dir_name(1)).exists()
        assert not (tmp_path / step_dir_name(2)).exists()  # nothing of it referenced
        changed = {name: array + 1 for name, array in BASE.items()}
        for step in (5, 6, 7):  # the base changes: step 1's file is referenced by no retained step
            manager.save(step, lora_state(step, changed), blocking=True)
        manager.wait()
        assert manager.steps() == [6, 7] and not kept.exists()
        assert (tmp_path / f"kept-{step_dir_name(5)}" / KEPT_NAME).is_file()
        assert same_state(manager.restore(step=7).states[0], lora_state(7, changed))
    assert any("no retained step references" in r.getMessage() for r in caplog.records)


def test_a_crash_leaves_the_kept_files_and_the_next_start_removes_only_what_nothing_references(tmp_path):
    with CheckpointManager(LocalOptions(tmp_path, keep_last=1), world_size=1) as manager:
        for step in (1, 2):
            manager.save(step, lora_state(step), blocking=True)
    kept = tmp_path / f"kept-{step_dir_name(1)}"
    stray = kept / "rank-00001-of-00002.safetensors"  # as a deletion cut short by a crash leaves it
    stray.write_bytes(b"x" * 10)
    (tmp_path / step_dir_name(9)).mkdir()  # an uncommitted save
    (tmp_path / step_dir_name(9) / "rank-00000-of-00001.safetensors").write_bytes(b"partial")
    with CheckpointManager(LocalOptions(tmp_path, keep_last=1), world_size=1) as manager:
        assert not stray.exists() and (kept / "rank-00000-of-00001.safetensors").is_file()
        assert not (tmp_path / step_dir_name(9)).exists()
        assert same_state(manager.restore().states[0], lora_state(2))


def test_a_damaged_referenced_file_fails_the_restore_naming_it(tmp_path):
    with CheckpointManager(tmp_path, world_size=1) as manager:
        for step in (1, 2):
            manager.save(step, lora_state(step), blocking=True)
    path = tmp_path / step_dir_name(1) / "rank-00000-of-00001.safetensors"  # a retained step's own file
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    begin, _end = json.loads(data[8 : 8 + length])["model/base/layer3"]["data_offsets"]
    data[8 + length + begin] ^= 0xFF  # a byte of a base layer, which step 2 references
    path.write_bytes(bytes(data))
    with CheckpointManager(tmp_path, world_size=1) as manager:
        with pytest.raises(ChecksumMismatchError, match=r"step-000000000001.*referenced by step 2"):
            manager.restore(step=2)
        with pytest.raises(ChecksumMismatchError, match="referenced by step 2"):
            manager.restore(step=2, paths=[("model", "base")])


def test_the_option_off_writes_every_array(tmp_path):
    runtime = RuntimeOptions(incremental=False)
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:
        for step in (1, 2):
            manager.save(step, lora_state(step), blocking=True)
    assert "references" not in manifest_of(tmp_path, 2)["shards"][0]
    assert shard_bytes(tmp_path, 2) == shard_bytes(tmp_path, 1)


def test_a_bucket_gets_only_what_changed_and_restores_every_step_alone(tmp_path):
    bucket = tmp_path / "bucket"
    saved = {step: lora_state(step) for step in (1, 2, 3)}
    remote = RemoteOptions(f"file://{bucket}")
    with CheckpointManager(LocalOptions(tmp_path / "local"), remote=remote, world_size=1) as manager:
        for step, state in saved.items():
            manager.save(step, state, blocking=True)
        manager.wait(uploaded=True)
    assert "references" in manifest_of(tmp_path / "local", 3)["shards"][0]
    uploaded = {step: shard_bytes(bucket, step) for step in saved}
    assert uploaded[2] == shard_bytes(tmp_path / "local", 2) < uploaded[1] // 4  # only the changed arrays
    shutil.rmtree(tmp_path / "local")
    with CheckpointManager(LocalOptions(tmp_path / "local"), remote=remote, world_size=1) as manager:
        for step, state in saved.items():
            assert same_state(manager.restore(step=step).states[0], state)
    assert "references" in manifest_of(tmp_path / "local", 3)["shards"][0]  # refilled, as it was saved
    assert referenced_files_exist(tmp_path / "local") == []  # with the files it references


def test_a_state_with_nothing_large_enough_writes_everything(tmp_path):
    small = {"w": np.arange(8.0).reshape(2, 4), "b": np.zeros((3, 1), np.float32)}
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, small, blocking=True)
        manager.save(2, small, blocking=True)
    assert manifest_of(tmp_path, 2)["schema_version"] == SCHEMA_VERSION
    assert os.path.getsize(tmp_path / step_dir_name(2) / "rank-00000-of-00001.safetensors") > 0


def test_a_referencing_step_exports_and_reshards_bit_for_bit(tmp_path):
    from safetensors.numpy import load_file

    from tiered_ckpt.export import export_step
    from tiered_ckpt.tiers.local import LocalTier
    from tiered_ckpt.tiers.store import TieredStore

    frozen = np.full((32, 64), 5, np.float32)

    def ranks(step: int) -> list[dict]:  # two ranks: a replicated frozen table, and flat slices of 3 + 3 values
        return [{"frozen": frozen, "param": np.arange(3.0) + 3 * rank + step} for rank in (0, 1)]

    with CheckpointManager(tmp_path / "ckpt", world_size=2) as manager:
        manager.save(1, ranks(1), blocking=True)
        manager.save(2, ranks(2), blocking=True)
    assert all("references" in shard for shard in manifest_of(tmp_path / "ckpt", 2)["shards"])
    with CheckpointManager(tmp_path / "ckpt", world_size=3) as manager:
        states = manager.restore(step=2, reshard=True).states
    assert np.array_equal(np.concatenate([state["param"] for state in states]), np.arange(6.0) + 2)
    assert all(np.array_equal(state["frozen"], frozen) for state in states)
    store = TieredStore([LocalTier(tmp_path / "ckpt")])
    export_step(store, 2, tmp_path / "hf", only="frozen")
    exported = {
        name: array for path in (tmp_path / "hf").glob("*.safetensors") for name, array in load_file(path).items()
    }
    assert exported and all(np.array_equal(array, frozen) for array in exported.values())


CHILD = Path(__file__).resolve().parent.parent / "support" / "incremental_child.py"


def _kill_child_at(directory: Path, point: str, count: int) -> None:
    """Run the child's schedule of saves into ``directory``; SIGKILL it the ``count``-th time it reaches ``point``."""
    kill_when_told([sys.executable, str(CHILD), str(directory), point, str(count)], point)


def _unreferenced_kept_files(root: Path) -> list[str]:
    referenced = {
        (ref["step"], ref["file"]["path"])
        for manifest in root.glob("step-*/manifest.json")
        for shard in json.loads(manifest.read_text())["shards"]
        for ref in shard.get("references", ())
    }
    return [
        str(path)
        for path in root.glob("*step-*/rank-*")
        if not (path.parent / MANIFEST_NAME).exists()
        and (int(path.parent.name.rpartition("-")[2]), path.name) not in referenced
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "point, count",
    [("before-commit", 9), ("kept-marked", 3), ("kept-marked", 6), ("removing", 4), ("removing", 7),
     ("removing-dir", 2), ("removing-dir", 5)],
)  # fmt: skip
def test_a_sigkill_at_any_point_leaves_no_step_whose_references_dangle(tmp_path, point, count):
    _kill_child_at(tmp_path, point, count)
    assert referenced_files_exist(tmp_path) == []
    with CheckpointManager(LocalOptions(tmp_path, keep_last=2), world_size=1) as manager:
        steps = manager.steps()
        assert steps and _unreferenced_kept_files(tmp_path) == []  # the start removed what nothing references
        for step in steps:
            assert same_state(manager.restore(step=step).states[0], incremental_state(step))
        following = steps[-1] + 1
        manager.save(following, incremental_state(following), blocking=True)
        manager.wait()
        assert same_state(manager.restore(step=following).states[0], incremental_state(following))
    assert referenced_files_exist(tmp_path) == [] and _unreferenced_kept_files(tmp_path) == []


def test_a_big_endian_array_is_never_taken_for_the_little_endian_one_of_the_same_bytes(tmp_path):
    big = np.arange(4096, dtype=">f4")
    same_bytes = big.view("<f4").copy()  # other values, the same raw bytes
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, {"w": big}, blocking=True)
        manager.save(2, {"w": same_bytes}, blocking=True)
        assert np.array_equal(manager.restore(step=2).states[0]["w"], same_bytes)
        assert np.array_equal(manager.restore(step=1).states[0]["w"], big)


def test_a_referencing_step_is_never_sent_to_a_tier_that_keeps_no_referenced_files(tmp_path, caplog):
    from support.memory_tier import MemoryTier
    from tiered_ckpt.engine.background import ErrorBox
    from tiered_ckpt.engine.replication import Replicator
    from tiered_ckpt.tiers.local import LocalTier
    from tiered_ckpt.tiers.store import TieredStore

    caplog.set_level(logging.WARNING, "tiered_ckpt")
    with CheckpointManager(LocalOptions(tmp_path / "local"), world_size=1) as manager:
        for step in (1, 2):
            manager.save(step, lora_state(step), blocking=True)
    peer = MemoryTier("peer")  # a later tier that keeps no referenced files
    store = TieredStore([LocalTier(tmp_path / "local"), peer])
    assert not store.keeps_references and not store.sendable(2, peer) and store.sendable(1, peer)
    with store.local.lock():
        replicator = Replicator(store, peer, errors=ErrorBox())
        try:
            assert replicator.resume() == [1]  # the newest step it may hold
            replicator.wait()
            replicator.errors.raise_first()
        finally:
            replicator.close()
    assert peer.steps() == [1]
    assert any("step 2 is not sent to" in r.getMessage() for r in caplog.records)


def test_load_sharded_of_a_referencing_step_says_to_restore_it_with_the_manager(tmp_path):
    from tiered_ckpt import UsageError, load_sharded

    with CheckpointManager(tmp_path, world_size=1) as manager:
        for step in (1, 2):
            manager.save(step, lora_state(step), blocking=True)
    assert same_state(load_sharded(tmp_path / step_dir_name(1), 1)[0], lora_state(1))
    with pytest.raises(UsageError, match=r"step 2 references arrays .*\(restore\(step=2\)\)"):
        load_sharded(tmp_path / step_dir_name(2), 1)


def test_a_manifest_placing_an_own_array_elsewhere_or_a_step_outside_is_refused(tmp_path):
    from tiered_ckpt import IncompleteCheckpointError, ManifestError

    with CheckpointManager(tmp_path, world_size=1) as manager:
        for step in (1, 2):
            manager.save(step, lora_state(step), blocking=True)
    path = tmp_path / step_dir_name(2) / MANIFEST_NAME
    document = json.loads(path.read_text())
    ref = document["shards"][0]["references"][0]
    hostile = {**ref, "names": sorted([*ref["names"], "optim/m"]), "xxh3_64": ref["xxh3_64"] + "0" * 16}
    path.write_text(json.dumps({**document, "shards": [{**document["shards"][0], "references": [hostile]}]}))
    with CheckpointManager(tmp_path, world_size=1) as manager:
        with pytest.raises(ManifestError, match="holds 'optim/m', which its manifest record references elsewhere"):
            manager.restore(step=2)
    path.write_text(json.dumps(document))
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    (tmp_path / step_dir_name(1)).rename(elsewhere)
    (tmp_path / step_dir_name(1)).symlink_to(elsewhere)
    with CheckpointManager(tmp_path, world_size=1) as manager:
        with pytest.raises(IncompleteCheckpointError, match="symbolic link"):
            manager.restore(step=2)


def test_the_files_a_step_keeps_take_at_most_twice_its_state(tmp_path):
    rng = np.random.default_rng(3)
    frozen = {f"f{i}": rng.random(1024).astype(np.float32) for i in range(20)}  # 4 KiB each

    def state(step: int) -> dict:  # buffer i stops changing at step i; a 64 KiB array changes every step
        buffers = {name: array + min(step, i) for i, (name, array) in enumerate(frozen.items())}
        return {"buffers": buffers, "moving": np.full(16384, step, np.float32)}

    size = sum(array.nbytes for array in state(1)["buffers"].values()) + 16384 * 4
    with CheckpointManager(LocalOptions(tmp_path, keep_last=2), world_size=1) as manager:
        for step in range(1, 25):
            manager.save(step, state(step), blocking=True)
            manager.wait()
        for step in manager.steps():
            assert same_state(manager.restore(step=step).states[0], state(step))
    kept = sum(path.stat().st_size for path in tmp_path.glob("kept-step-*/rank-*"))
    assert kept <= 2 * 2 * size  # two retained steps, each keeping at most twice its state


def test_a_two_rank_lora_job_resumes_from_the_bucket_after_its_disks_are_lost_bit_for_bit(tmp_path, s3_url):
    """Two real rank processes, each its own disk, save a LoRA run to a moto bucket; both disks
    are deleted; a new job restores from the bucket alone, bit for bit, and its next save writes
    only what changed again."""
    from support import rank_worker
    from support.processes import launch_ranks
    from tiered_ckpt.tiers.remote.tier import RemoteTier

    worker = Path(rank_worker.__file__)
    actions = [{"do": "save", "step": step} for step in (1, 2, 3)] + [{"do": "wait"}]
    launch_ranks(worker, tmp_path, 2, {"actions": actions, "state": "lora", "timeout_seconds": 60}, remote=s3_url)
    bucket = RemoteTier(*s3_url)
    assert bucket.steps() == [1, 2, 3]
    for record in bucket.manifest(3).shards:  # each rank's base is in its step-1 file
        assert {ref.step for ref in record.references} == {1}
        assert record.size_bytes < bucket.manifest(1).shard(record.rank).size_bytes // 3
    shutil.rmtree(tmp_path / "nodes")
    actions = [{"do": "restore"}, {"do": "save", "step": 4}, {"do": "wait"}]
    results = launch_ranks(worker, tmp_path, 2, {"actions": actions, "state": "lora", "timeout_seconds": 60}, s3_url)
    for rank in (0, 1):
        restored = results[rank]["restored"]
        assert "error" not in results[rank], results[rank]
        assert restored["step"] == 3 and restored["sources"] == {str(rank): "remote"}
        assert restored["digests"] == rank_worker.digests(rank_worker.lora_state(3, 2, rank))
    for record in bucket.manifest(4).shards:  # compared with the restored step: only the adapter again
        assert {ref.step for ref in record.references} == {1}


def test_a_damaged_kept_file_is_read_from_the_bucket_and_repaired_where_it_lies(tmp_path):
    from support.states import flip_byte
    from tiered_ckpt.tiers.local import LocalTier

    saved = {step: lora_state(step) for step in (1, 2, 3)}
    remote = RemoteOptions(f"file://{tmp_path / 'bucket'}")
    options = LocalOptions(tmp_path / "local", keep_last=1)
    with CheckpointManager(options, remote=remote, world_size=1) as manager:
        for step, state in saved.items():
            manager.save(step, state, blocking=True)
            manager.wait(uploaded=True)
        manager.save(4, lora_state(4), blocking=True)  # a pass after step 3's upload: step 1's file is kept
        manager.wait(uploaded=True)
    local = LocalTier(tmp_path / "local")
    ref = local.manifest(4).shard(0).references[0]
    kept = local.shard_path(ref.step, ref.file)
    assert kept.parent.name.startswith("kept-")
    flip_byte(kept, kept.stat().st_size - 100)  # in the last array
    shutil.rmtree(tmp_path / "local" / step_dir_name(4))  # the step's own file lost: a whole refill
    with CheckpointManager(options, remote=remote, world_size=1) as manager:
        assert same_state(manager.restore(step=4).states[0], lora_state(4))
    assert local.check_shard(ref.step, ref.file) is None and local.shard_path(ref.step, ref.file) == kept
