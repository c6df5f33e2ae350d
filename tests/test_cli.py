import json
import os
import subprocess
import sys

import pytest

from conftest import ZERO1_SHARDED_KEYS, flip_byte, s3_credentials_env, write_s3_config, zero1_states
from tiered_ckpt import CheckpointManager
from tiered_ckpt.checksums import part_crc32c
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.remote import RemoteTier


@pytest.fixture
def setup(tmp_path, s3_url, moto_endpoint):
    """A config file for a local directory and a moto bucket; credentials in the environment."""
    url, options = s3_url
    local = tmp_path / "local"
    config = write_s3_config(
        tmp_path / "ckpt.toml", local, url, moto_endpoint, local_keep="keep_last = 1", remote_keep="keep_last = 2"
    )
    return config, local, url, options, s3_credentials_env()


def run(env, *args):
    """Run the real entry point; return (exit code, stdout, stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "tiered_ckpt", *args], capture_output=True, text=True, env=env, timeout=300
    )
    return result.returncode, result.stdout, result.stderr


def save_steps(local, url, options, steps, *, upload=True):
    manager = CheckpointManager(
        local,
        world_size=4,
        keep_last=None,
        sharded_keys=ZERO1_SHARDED_KEYS,
        **({"remote_url": url, "storage_options": options} if upload else {}),
    )
    for step in steps:
        manager.save(step, zero1_states(seed=step))
    manager.wait(uploaded=True)
    manager.close()


def test_ls_shows_each_step_in_each_tier(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2])
    save_steps(local, url, options, [3], upload=False)
    (local / step_dir_name(4)).mkdir()  # a step being written: no manifest yet
    code, out, err = run(env, "--config", str(config), "--json", "ls")
    assert code == 0, err
    rows = {row["step"]: row for row in json.loads(out)}
    assert [rows[s]["local"] for s in (1, 2, 3, 4)] == ["committed", "committed", "committed", "staged"]
    assert [rows[s]["remote"] for s in (1, 2, 3, 4)] == ["committed", "committed", "uploading", "-"]
    assert rows[2]["world_size"] == 4 and rows[2]["bytes"] > 0 and rows[2]["age_seconds"] >= 0
    code, out, _ = run(env, "--config", str(config), "ls")
    assert code == 0 and "STEP" in out.splitlines()[0] and "uploading" in out


def test_status_says_how_far_the_bucket_is_behind(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2])
    save_steps(local, url, options, [3, 4], upload=False)  # the bucket is two steps behind
    code, out, err = run(env, "--config", str(config), "--json", "status")
    assert code == 0, err
    lag = json.loads(out)
    assert (lag["newest_local"], lag["newest_remote"], lag["steps_behind"]) == (4, 2, 2)
    assert [w["step"] for w in lag["waiting"]] == [3, 4] and all(w["bytes"] > 0 for w in lag["waiting"])
    assert lag["waiting_seconds"] >= 0 and lag["last_error"] is None
    code, out, _ = run(env, "--config", str(config), "status")
    assert code == 0 and "2 steps waiting for upload: 3 (" in out


def test_verify_passes_then_fails_on_a_flipped_byte_in_either_tier(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [5])
    code, out, err = run(env, "--config", str(config), "verify")
    assert code == 0, err
    assert "8 shards verified, 0 failed" in out
    flip_byte(local / step_dir_name(5) / "rank-00002-of-00004.safetensors", 99)
    code, out, _ = run(env, "--config", str(config), "--json", "verify", "5")
    failed = [(r["tier"], r["rank"]) for r in json.loads(out) if r["status"] == "failed"]
    assert code == 1 and failed == [("local", 2)]
    tier = RemoteTier(url, options)
    tier._fs.pipe_file(f"{tier._root}/{step_dir_name(5)}/rank-00000-of-00004.safetensors", b"garbage")
    code, out, _ = run(env, "--config", str(config), "--json", "verify")
    failed = sorted((r["tier"], r["rank"]) for r in json.loads(out) if r["status"] == "failed")
    assert code == 1 and failed == [("local", 2), ("remote", 0)]


def test_verify_remote_checks_the_stores_own_checksums_without_downloading(setup, monkeypatch):
    config, local, url, options, env = setup
    save_steps(local, url, options, [5])
    tier = RemoteTier(url, options)
    remote = tier.read_manifest(5)
    assert set(remote.store_checksums) == {record.path for record in remote.manifest.shards}
    assert all(value.startswith("crc32c:") for value in remote.store_checksums.values())
    code, out, err = run(env, "--config", str(config), "--json", "verify", "--remote")
    assert code == 0, err
    assert [(r["tier"], r["status"]) for r in json.loads(out)] == [("remote", "ok")] * 4  # the bucket only
    # An object replaced behind the library's back (same size, other bytes and checksum) is caught by a HEAD.
    record = remote.manifest.shard(1)
    key = f"{tier._root}/{step_dir_name(5)}/{record.path}"
    bucket, name, _version = tier._fs.split_path(key)
    zeros = b"\0" * record.size_bytes
    tier._fs.call_s3("put_object", Bucket=bucket, Key=name, Body=zeros, ChecksumCRC32C=part_crc32c(zeros))
    code, out, _ = run(env, "--config", str(config), "--json", "verify", "--remote")
    failed = [(r["rank"], r["problem"]) for r in json.loads(out) if r["status"] == "failed"]
    assert code == 1 and failed[0][0] == 1 and "the store keeps checksum" in failed[0][1]
    # No download: with reads made impossible, the check of the stores' checksums still runs.
    monkeypatch.setattr(RemoteTier, "read_shard", lambda *args: pytest.fail("downloaded"))
    from tiered_ckpt import TieredStore
    from tiered_ckpt.local import LocalTier

    checks = TieredStore(LocalTier(local), tier).verify(5, remote_only=True)
    assert [check.status for check in checks] == ["ok", "failed", "ok", "ok"]


def test_pull_refills_a_lost_local_directory(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [7])
    import shutil

    shutil.rmtree(local)
    code, out, err = run(env, "--config", str(config), "--json", "pull")
    assert code == 0, err
    assert json.loads(out) == {"step": 7, "downloaded_ranks": [0, 1, 2, 3]}
    code, out, _ = run(env, "--config", str(config), "verify", "7")
    assert code == 0 and "8 shards verified, 0 failed" in out


def test_push_uploads_what_only_the_local_tier_holds(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2], upload=False)
    code, out, err = run(env, "--config", str(config), "--json", "push")
    assert code == 0, err
    assert json.loads(out) == {"uploaded_steps": [1, 2]}
    assert RemoteTier(url, options).committed_steps() == [1, 2]
    code, out, _ = run(env, "--config", str(config), "--json", "push")
    assert json.loads(out) == {"uploaded_steps": []}


def test_prune_dry_run_then_prune(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2, 3])
    code, out, err = run(env, "--config", str(config), "--json", "prune", "--dry-run")
    assert code == 0, err
    assert json.loads(out) == {"dry_run": True, "local": [1, 2], "remote": [1], "aborted": []}
    assert sorted(p.name for p in local.iterdir()) == [step_dir_name(s) for s in (1, 2, 3)]
    code, out, _ = run(env, "--config", str(config), "--json", "prune")
    assert code == 0 and json.loads(out) == {"dry_run": False, "local": [1, 2], "remote": [1], "aborted": []}
    assert sorted(p.name for p in local.iterdir()) == [step_dir_name(3)]
    assert RemoteTier(url, options).committed_steps() == [2, 3]


def test_bad_config_exits_2_naming_the_key(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[local]\ndir = 5\n")
    code, _, err = run(os.environ, "--config", str(config), "ls")
    assert code == 2 and "local.dir" in err and str(config) in err


def test_environment_alone_configures_the_local_tier(tmp_path):
    env = {**os.environ, "TIERED_CKPT_LOCAL_DIR": str(tmp_path)}
    code, out, err = run(env, "--json", "ls")
    assert code == 0, err
    assert json.loads(out) == []


def test_failure_to_reach_a_step_exits_1(tmp_path):
    env = {**os.environ, "TIERED_CKPT_LOCAL_DIR": str(tmp_path)}
    code, _, err = run(env, "verify", "9")
    assert code == 1 and "step 9 is committed in no tier" in err


def test_global_options_work_after_the_command_and_sizes_fit_their_unit(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1])
    code, out, err = run(env, "ls", "--config", str(config))  # as in git: options after the verb
    assert code == 0, err
    size = out.splitlines()[1].split()[4]
    assert size.endswith("K") and float(size[:-1]) > 1  # a ~50 KB step, not "0.0M"
    code, out, err = run(env, "verify", "1", "--json", "--config", str(config))
    assert code == 0 and all(row["status"] == "ok" for row in json.loads(out)), err


@pytest.mark.parametrize("size, shown", [(0, "0B"), (812, "812B"), (33 * 1024, "33.0K"), (3 << 29, "1.5G")])
def test_human_size(size, shown):
    from tiered_ckpt.cli import human_size

    assert human_size(size) == shown


@pytest.mark.parametrize("command", [["ls"], ["status"], ["verify", "--remote"], ["--json", "ls"]])
def test_a_missing_bucket_is_named_and_fails_the_command(tmp_path, moto_endpoint, command):
    local = tmp_path / "local"
    local.mkdir()
    config = write_s3_config(tmp_path / "ckpt.toml", local, "s3://tiered-no-such-bucket/run", moto_endpoint)
    code, out, err = run(s3_credentials_env(), "--config", str(config), *command)
    assert code == 1 and out == ""
    assert "the bucket 'tiered-no-such-bucket' does not exist" in err
