"""Exporting a step as one Hugging Face style checkpoint (tiered_ckpt.export), streamed and verified."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from support.processes import launch_ranks
from support.states import flip_byte
from tiered_ckpt import (
    CheckpointManager,
    ChecksumMismatchError,
    ExportResult,
    RuntimeOptions,
    UsageError,
    export_safetensors,
)
from tiered_ckpt.export import INDEX_NAME
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.tiers.store import TieredStore

HF_WORKER = Path(__file__).resolve().parent / "support" / "hf_worker.py"


@pytest.mark.slow
def test_a_transformers_model_trained_under_fsdp2_exports_and_loads_with_from_pretrained(tmp_path, s3_url):
    import transformers
    from safetensors.torch import load_file

    launch_ranks(HF_WORKER, tmp_path, 2, {}, remote=s3_url)
    results = next(tmp_path.glob("launch-*/results"))
    gathered = load_file(str(results / "gathered.safetensors"))
    shutil.rmtree(tmp_path / "nodes")  # a machine with no local copy: every part from the bucket
    url, options = s3_url
    from tiered_ckpt import RemoteOptions

    remote = RemoteOptions(url, storage_options=options)
    out = results / "hf"  # holds config.json, as model.config.save_pretrained writes it
    result = export_safetensors(tmp_path / "laptop", out, remote=remote, only="model", max_shard_bytes=40_000)
    assert len(result.files) > 2 and result.files[-1].name == INDEX_NAME  # sharded, with its index
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(gathered) == set(result.tensors)
    assert not (tmp_path / "laptop").exists() or not any((tmp_path / "laptop").iterdir())  # nothing written there
    model = transformers.LlamaForCausalLM.from_pretrained(str(out))
    loaded = model.state_dict()
    for name, tensor in gathered.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].equal(tensor), name
    assert result.largest_tensor_bytes == max(t.numel() * t.element_size() for t in gathered.values())


def test_flat_slices_and_replicated_arrays_export_as_full_tensors_named_below_only(tmp_path):
    total = 1003
    flat = np.arange(total, dtype=np.float32)
    cuts = [0, 251, 502, 753, total]
    states = [
        {"model": {"flat_param": flat[cuts[r] : cuts[r + 1]], "embed.weight": np.eye(3), "layers": 2},
         "rng": np.full(2, r)}
        for r in range(4)
    ]  # fmt: skip
    keys = [("model", "flat_param")]
    with CheckpointManager(tmp_path / "ckpt", world_size=4, runtime=RuntimeOptions(sharded_keys=keys)) as manager:
        manager.save(9, states, blocking=True)
    result = export_safetensors(tmp_path / "ckpt", tmp_path / "out", only="model")
    from safetensors.numpy import load_file

    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == {"flat_param", "embed.weight"} and result.skipped == ("model.layers",)
    np.testing.assert_array_equal(exported["flat_param"], flat)
    np.testing.assert_array_equal(exported["embed.weight"], np.eye(3))
    import hashlib

    assert result.files[0].sha256 == hashlib.sha256((tmp_path / "out" / "model.safetensors").read_bytes()).hexdigest()
    assert isinstance(result, ExportResult) and result.step == 9


def test_an_export_verifies_every_part_and_replaces_an_earlier_exports_files(tmp_path):
    states = [{"w": np.arange(5000, dtype=np.float32).reshape(50, 100), "v": np.ones((30, 100), np.float32)}]
    with CheckpointManager(tmp_path / "ckpt", world_size=1) as manager:
        manager.save(2, states, blocking=True)
    export_safetensors(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=10_000)  # two files and the index
    assert (tmp_path / "out" / INDEX_NAME).exists()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    export_safetensors(tmp_path / "ckpt", tmp_path / "out")  # one file now: the old ones would mislead a reader
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "notes.txt"]
    shard = next((tmp_path / "ckpt" / step_dir_name(2)).glob("rank-*.safetensors"))
    flip_byte(shard, shard.stat().st_size - 10)  # inside the last array's bytes
    with pytest.raises(ChecksumMismatchError, match="rank 0"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "again")
    with pytest.raises(UsageError, match="'nope' is neither a top-level key"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "again", only="nope")


def test_an_export_holds_one_tensor_at_a_time(tmp_path):
    import tracemalloc

    states = [{f"layer{i}": np.full((512, 1024), i, np.float32) for i in range(8)}]  # 2 MiB each
    with CheckpointManager(tmp_path / "ckpt", world_size=1) as manager:
        manager.save(1, states, blocking=True)
    del states
    tracemalloc.start()
    try:
        result = export_safetensors(tmp_path / "ckpt", tmp_path / "out")
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.largest_tensor_bytes == 2 << 20 and len(result.tensors) == 8
    assert peak < 1.5 * result.largest_tensor_bytes  # all eight at once would be 8x


@pytest.mark.slow
def test_the_cli_exports_a_step_and_lists_each_files_sha256(tmp_path):
    import hashlib
    import os
    import subprocess
    import sys

    with CheckpointManager(tmp_path / "ckpt", world_size=2) as manager:
        manager.save(4, [{"model": {"w": np.full((40, 50), r, np.float32)}, "opt": np.ones(3)} for r in range(2)])
    command = [sys.executable, "-m", "tiered_ckpt", "--local-dir", str(tmp_path / "ckpt"), "export", "4"]
    done = subprocess.run([*command, str(tmp_path / "out"), "--only", "model", "--max-shard-size", "1KiB"],
                          capture_output=True, text=True, env=os.environ, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    files = sorted((tmp_path / "out").iterdir())
    assert [f.name for f in files] == ["model.safetensors"]  # one tensor: a larger one than the limit, alone
    assert f"{hashlib.sha256(files[0].read_bytes()).hexdigest()}  model.safetensors" in done.stdout
    done = subprocess.run([*command, str(tmp_path / "x"), "--max-shard-size", "big"], capture_output=True, text=True)
    assert done.returncode == 2 and "'big' is not a size" in done.stderr


def chunked_states(columns: int = 8) -> tuple[np.ndarray, list[dict]]:
    """A (4, ``columns``) tensor cut in two by columns (a Shard(1) placement: boxes that are not
    contiguous in the full tensor), one box per rank, and a complex and a scalar beside it."""
    from tiered_ckpt.format.state import ChunkOf

    full = np.arange(4 * columns, dtype=np.float32).reshape(4, columns)
    half = columns // 2
    states = [
        {"model": {"w": ChunkOf(np.ascontiguousarray(full[:, r * half : (r + 1) * half]), (4, columns), (0, r * half)),
                   "freqs": np.ones(2, np.complex64), "layers": 2}}
        for r in range(2)
    ]  # fmt: skip
    return full, states


def test_dtensor_boxes_are_assembled_and_complex_values_left_out_listed(tmp_path):
    from safetensors.numpy import load_file

    full, states = chunked_states()
    with CheckpointManager(tmp_path / "ckpt", world_size=2) as manager:
        manager.save(1, states, blocking=True)
    result = export_safetensors(tmp_path / "ckpt", tmp_path / "out", only="model")
    assert set(result.tensors) == {"w"} and set(result.skipped) == {"model.freqs", "model.layers"}
    np.testing.assert_array_equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], full)


def test_chunk_records_that_do_not_match_their_verified_headers_are_refused(tmp_path):
    from tiered_ckpt import ManifestError
    from tiered_ckpt.format.layout import MANIFEST_NAME

    _full, states = chunked_states()
    with CheckpointManager(tmp_path / "ckpt", world_size=2) as manager:
        manager.save(1, states, blocking=True)
    path = tmp_path / "ckpt" / step_dir_name(1) / MANIFEST_NAME
    document = json.loads(path.read_text())
    chunk = next(c for c in document["shards"][1]["chunks"] if c["name"] == "model/w")
    chunk["offsets"] = [0, 3]  # overlapping rank 0's box, leaving column 7 unread
    path.write_text(json.dumps(document))
    with pytest.raises(ManifestError, match=r"rank 1's record places 'model/w' at \(0, 3\)"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "out")


def test_a_failed_export_leaves_no_earlier_index_or_files_beside_its_own(tmp_path):
    states = [{f"l{i}": np.full((30, 100), i, np.float32) for i in range(3)}]
    with CheckpointManager(tmp_path / "ckpt", world_size=1) as manager:
        manager.save(1, states, blocking=True)
        manager.save(2, [{f"l{i}": np.full((30, 100), 10 + i, np.float32) for i in range(3)}], blocking=True)
    export_safetensors(tmp_path / "ckpt", tmp_path / "out", step=1, max_shard_bytes=12_000)
    assert (tmp_path / "out" / INDEX_NAME).exists() and len(list((tmp_path / "out").iterdir())) == 4
    shard = next((tmp_path / "ckpt" / step_dir_name(2)).glob("rank-*.safetensors"))
    flip_byte(shard, shard.stat().st_size - 10)
    with pytest.raises(ChecksumMismatchError):
        export_safetensors(tmp_path / "ckpt", tmp_path / "out", step=2, max_shard_bytes=12_000)
    from safetensors.numpy import load_file

    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert INDEX_NAME not in left  # no reader takes what is left for a checkpoint
    assert all(load_file(str(tmp_path / "out" / name))["l0" if "00001" in name else "l1"][0, 0] >= 10 for name in left)


@pytest.mark.parametrize(
    ("state", "only", "error"),
    [
        ({"__metadata__": np.ones(2)}, None, "would be named __metadata__"),
        ({"model": {"w": np.ones(2)}}, "nope", "export: paths|neither a top-level key"),
    ],
)
def test_what_cannot_be_exported_is_refused_naming_it(tmp_path, state, only, error):
    with CheckpointManager(tmp_path / "ckpt", world_size=1) as manager:
        manager.save(1, state, blocking=True)
    with pytest.raises(UsageError, match=error):
        export_safetensors(tmp_path / "ckpt", tmp_path / "out", only=only)
    (tmp_path / "afile").write_text("")
    with pytest.raises(UsageError, match="is not a directory"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "afile")


@pytest.mark.slow
def test_pipeline_stages_restore_in_part_and_export_every_stages_layers(tmp_path):
    from safetensors.numpy import load_file

    results = launch_ranks(Path(__file__).resolve().parent / "support" / "pipeline_worker.py", tmp_path, 4, {})
    for rank, result in results.items():
        assert "error" not in result, result
        assert result["part"] == result["whole"] == result["saved"] and result["part_keys"] == ["model"], rank
    assert sum(len(replicas) for replicas in results[0]["replicas"]) == 2  # one plain tensor per stage, left once
    # one directory holding every rank's shards, as a bucket or a shared file system would
    merged = tmp_path / "merged"
    for rank in range(4):
        shutil.copytree(tmp_path / "nodes" / f"rank-{rank}", merged, dirs_exist_ok=True)
    shutil.copy(tmp_path / "nodes" / "rank-0" / step_dir_name(1) / "manifest.json", merged / step_dir_name(1))
    result = export_safetensors(merged, tmp_path / "out", only="model")
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == {"layers.0.w", "layers.0.step", "layers.1.w", "layers.1.step"} == set(result.tensors)
    for stage in range(2):
        expected = np.arange(8, dtype=np.float32).reshape(4, 2) + 10 * stage
        np.testing.assert_array_equal(exported[f"layers.{stage}.w"], expected)
        assert float(exported[f"layers.{stage}.step"]) == 3 + stage


def test_an_export_from_the_bucket_holds_one_tensor_and_one_ranged_read_at_a_time(tmp_path, memory_url):
    import tracemalloc

    from tiered_ckpt import RemoteOptions

    url, options = memory_url
    remote = RemoteOptions(url, storage_options=options)
    with CheckpointManager(tmp_path / "ckpt", world_size=1, remote=remote) as manager:
        manager.save(1, [{f"layer{i}": np.full((4096, 4096), i, np.float32) for i in range(2)}], blocking=True)
        manager.wait(uploaded=True)
    shutil.rmtree(tmp_path / "ckpt")  # every part from the bucket, in ranged reads of 16 MiB
    tracemalloc.start()
    try:
        result = export_safetensors(tmp_path / "ckpt", tmp_path / "out", remote=remote)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.largest_tensor_bytes == 64 << 20
    assert peak < 1.6 * result.largest_tensor_bytes  # a read of the whole tensor at once would be 2x


def test_an_export_of_many_small_tensors_parses_each_shards_structure_once(tmp_path, monkeypatch):
    from tiered_ckpt.format.structure import Structure

    states = [{f"layer{i}": np.full(8, i + 10 * rank, np.float32) for i in range(300)} for rank in range(2)]
    with CheckpointManager(tmp_path / "ckpt", world_size=2, runtime=RuntimeOptions(sharded_keys=[])) as manager:
        manager.save(1, states, blocking=True)
    parsed = []
    from_json = Structure.from_json.__func__

    def counted(cls, text, names, what):
        parsed.append(what)
        return from_json(cls, text, names, what)

    monkeypatch.setattr(Structure, "from_json", classmethod(counted))
    reads = []
    read_parts = TieredStore.read_parts

    def counted_reads(self, step, record, names, **keywords):
        reads.append(record.rank)
        return read_parts(self, step, record, names, **keywords)

    monkeypatch.setattr(TieredStore, "read_parts", counted_reads)
    result = export_safetensors(tmp_path / "ckpt", tmp_path / "out")
    assert len(result.tensors) == 300 and len(parsed) == 2  # once per shard, not once per tensor
    assert reads == [0]  # the 300 tensors (9.6 kB) in one read of the shard holding them
    from safetensors.numpy import load_file

    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(exported[f"layer{i}"].tolist() == [i] * 8 for i in range(300))  # rank 0's copy of each


def test_a_flat_parameter_empty_on_every_rank_exports_as_an_empty_tensor(tmp_path):
    states = [{"model": {"flat": np.zeros(0, np.float16), "bias": np.ones(3, np.float32)}} for _ in range(2)]
    keys = RuntimeOptions(sharded_keys=[("model", "flat")])
    with CheckpointManager(tmp_path / "ckpt", world_size=2, runtime=keys) as manager:
        manager.save(4, states, blocking=True)
    result = export_safetensors(tmp_path / "ckpt", tmp_path / "out", only="model")
    from safetensors.numpy import load_file

    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(result.tensors) == {"flat", "bias"}
    assert exported["flat"].dtype == np.float16 and exported["flat"].shape == (0,)
    np.testing.assert_array_equal(exported["bias"], np.ones(3, np.float32))
