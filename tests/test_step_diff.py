"""What a step holds and how two steps differ (tiered_ckpt.step_diff, ``tiered-ckpt diff``): from
manifests and shard headers only, on the local disk and from a moto bucket."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from support.stores import s3_credentials_env, write_s3_config
from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions
from tiered_ckpt.format import manifest as manifest_module
from tiered_ckpt.format.state import ChunkOf
from tiered_ckpt.step_diff import diff_steps
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.store import TieredStore


def run(env, *args):
    """The real entry point; (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "tiered_ckpt", *args], capture_output=True, text=True, env=env)
    return done.returncode, done.stdout, done.stderr


def two_steps() -> tuple[dict, dict]:
    first = {
        "model": {"w": np.ones((64, 64), np.float32), "b": np.zeros(64, np.float32), "frozen": np.arange(10.0)},
        "optim": {"m": np.zeros(64)},
        "step": 1,
    }
    second = {
        "model": {
            "w": np.ones((64, 64), np.float32),
            "b": np.zeros(64, np.float64),  # another dtype
            "frozen": np.arange(10.0),  # the same bytes
        },
        "optim": {"m": np.zeros(65), "v": np.ones(3)},  # another shape; one more array
        "step": 2,
    }
    second["model"]["w"][7, 7] = 0.5  # one value changed
    first["optim"]["gone"] = np.ones(2)
    return first, second


def test_every_kind_of_difference_is_listed_and_the_same_arrays_counted(tmp_path):
    first, second = two_steps()
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, first, blocking=True)
        manager.save(2, second, blocking=True)
    code, out, err = run(None, "diff", "1", "2", "--local-dir", str(tmp_path), "--json")
    assert code == 0, err
    got = json.loads(out)
    changes = {change["name"]: change["change"] for change in got["changes"]}
    assert changes == {
        "model/b": "dtype",
        "model/w": "bytes",
        "optim/m": "shape",
        "optim/v": "added",
        "optim/gone": "removed",
    }
    assert got["same"] == 1 and got["identical"] is False  # model/frozen
    assert got["first"]["bytes"] > 0 and got["second"]["world_size"] == 1
    code, out, _ = run(None, "diff", "2", "2", "--local-dir", str(tmp_path))
    assert code == 0 and "0 arrays changed, 0 added, 0 removed, 5 the same" in out and "step 2: 1 rank," in out
    code, out, _ = run(None, "diff", "1", "2", "--local-dir", str(tmp_path))
    assert "step 1 -> step 2: 3 arrays changed, 1 added, 1 removed, 1 the same" in out
    assert [line.split()[1] for line in out.splitlines()[1:6]] == ["dtype", "bytes", "removed", "shape", "added"]


def test_arrays_of_dtensor_chunks_are_compared_by_their_sha256(tmp_path):
    chunk = {"w": ChunkOf(np.ones((4, 3), np.float32), (4, 3), (0, 0)), "v": ChunkOf(np.zeros(2), (2,), (0,))}
    changed = {"w": ChunkOf(np.full((4, 3), 2, np.float32), (4, 3), (0, 0)), "v": ChunkOf(np.zeros(2), (2,), (0,))}
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, chunk, blocking=True)
        manager.save(2, changed, blocking=True)
    diff = diff_steps(TieredStore([LocalTier(tmp_path)]), 1, 2)
    assert [(c.name, c.change) for c in diff.changes] == [("w", "bytes")] and diff.same == 1
    assert diff.changes[0].before.digest.startswith("sha256:")


def test_arrays_whose_manifest_records_no_digest_are_said_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_module, "_ARRAY_DIGESTS_BYTES", 0)  # as a shard of very many arrays
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, {"w": np.ones(8)}, blocking=True)
        manager.save(2, {"w": np.ones(8)}, blocking=True)
    diff = diff_steps(TieredStore([LocalTier(tmp_path)]), 1, 2)
    assert [(c.name, c.change) for c in diff.changes] == [("w", "unknown")] and not diff.identical


@pytest.mark.slow
def test_a_diff_reads_the_bucket_alone_when_the_disk_lost_the_steps(tmp_path, s3_url, moto_endpoint):
    url, options = s3_url
    local = tmp_path / "local"
    first, second = two_steps()
    with CheckpointManager(LocalOptions(local), world_size=1, remote=RemoteOptions(url, storage_options=options)) as m:
        m.save(1, first)
        m.save(2, second)
        m.wait(uploaded=True)
    shutil.rmtree(local)
    config = write_s3_config(tmp_path / "ckpt.toml", local, url, moto_endpoint)
    code, out, err = run(s3_credentials_env(), "--config", str(config), "diff", "1", "2", "--json")
    assert code == 0, err
    kinds = {change["change"] for change in json.loads(out)["changes"]}
    assert kinds == {"dtype", "bytes", "shape", "added", "removed"}
    assert "reading the bucket alone" in err
    code, _, err = run(s3_credentials_env(), "--config", str(config), "diff", "1", "3")
    assert code == 1 and "step 3" in err


def test_the_bytes_a_step_owns_are_told_from_those_it_references(tmp_path):
    base = {f"layer{i}": np.full((32, 64), i, np.float32) for i in range(3)}  # 8 KiB each
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, {"base": base, "adapter": np.zeros((32, 64), np.float32)}, blocking=True)
        manager.save(2, {"base": base, "adapter": np.ones((32, 64), np.float32)}, blocking=True)
    code, out, err = run(None, "diff", "1", "2", "--local-dir", str(tmp_path), "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["first"]["referenced_bytes"] == 0 and got["second"]["referenced_bytes"] == 3 * 8192
    assert [change["name"] for change in got["changes"]] == ["adapter"] and got["same"] == 3
    assert got["second"]["bytes"] < got["first"]["bytes"] - 3 * 8192 + 4096
    code, out, _ = run(None, "show", "2", "--local-dir", str(tmp_path))
    assert "24.0K referenced in earlier steps" in out and out.count("(in step 1)") == 3
    code, out, _ = run(None, "ls", "--local-dir", str(tmp_path), "--json")
    assert [row["referenced_bytes"] for row in json.loads(out)] == [0, 3 * 8192]
    code, out, _ = run(None, "verify", "--local-dir", str(tmp_path))
    assert code == 0, out
    shard = tmp_path / "step-000000000001" / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the last array of step 1's file: a base layer step 2 references
    shard.write_bytes(bytes(data))
    code, out, err = run(None, "verify", "2", "--local-dir", str(tmp_path))
    assert code == 1 and "referenced by this shard" in out + err
