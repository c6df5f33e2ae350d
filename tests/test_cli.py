import json
import os
import re
import select
import subprocess
import sys

import numpy as np
import pytest

from support.states import ZERO1_SHARDED_KEYS, flip_byte, zero1_states
from support.stores import free_port, s3_credentials_env, write_s3_config
from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions, RuntimeOptions, save_sharded
from tiered_ckpt.format.layout import MANIFEST_NAME, shard_name, step_dir_name
from tiered_ckpt.io.hashing import part_crc32c
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier


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


def save_steps(local, url, options, steps, *, upload=True, metrics=None):
    manager = CheckpointManager(
        LocalOptions(local, keep_last=None),
        remote=RemoteOptions(url, storage_options=options) if upload else None,
        runtime=RuntimeOptions(sharded_keys=ZERO1_SHARDED_KEYS),
        world_size=4,
    )
    for step in steps:
        manager.save(step, zero1_states(seed=step), metrics=(metrics or {}).get(step))
    manager.wait(uploaded=True)
    manager.close()


@pytest.mark.slow
def test_ls_shows_each_step_in_each_tier(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2], metrics={2: {"val_loss": 0.125, "acc": float("nan")}})
    save_steps(local, url, options, [3], upload=False)
    (local / step_dir_name(4)).mkdir()  # a step being written: a shard, no manifest yet
    (local / step_dir_name(4) / shard_name(0, 4)).write_bytes(b"the start of a shard")
    (local / step_dir_name(5)).mkdir()  # an empty directory holds nothing of a step
    code, out, err = run(env, "--config", str(config), "--json", "ls")
    assert code == 0, err
    rows = {row["step"]: row for row in json.loads(out)}
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[s]["local"] for s in (1, 2, 3, 4)] == ["committed", "committed", "committed", "staged"]
    assert [rows[s]["remote"] for s in (1, 2, 3, 4)] == ["committed", "committed", "uploading", None]  # JSON null
    assert rows[2]["world_size"] == 4 and rows[2]["bytes"] > 0 and rows[2]["age_seconds"] >= 0
    assert rows[2]["metrics"] == {"acc": None, "val_loss": 0.125} and rows[1]["metrics"] == {}
    assert rows[4]["metrics"] is None  # no manifest yet
    code, out, _ = run(env, "--config", str(config), "ls")
    assert code == 0 and "STEP" in out.splitlines()[0] and "uploading" in out
    assert [line for line in out.splitlines() if line.endswith("  acc=-  val_loss=0.125")] != []
    code, out, _ = run(env, "--config", str(config), "show", "2")
    assert code == 0 and out.splitlines()[-1].endswith("; metrics acc=-, val_loss=0.125")


@pytest.mark.slow
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


@pytest.mark.slow
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
    tier.backend.fs.pipe_file(f"{tier.backend.root}/{step_dir_name(5)}/rank-00000-of-00004.safetensors", b"garbage")
    code, out, _ = run(env, "--config", str(config), "--json", "verify")
    failed = sorted((r["tier"], r["rank"]) for r in json.loads(out) if r["status"] == "failed")
    assert code == 1 and failed == [("local", 2), ("remote", 0)]


@pytest.mark.slow
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
    key = f"{tier.backend.root}/{step_dir_name(5)}/{record.path}"
    bucket, name, _version = tier.backend.fs.split_path(key)
    zeros = b"\0" * record.size_bytes
    tier.backend.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=zeros, ChecksumCRC32C=part_crc32c(zeros))
    code, out, _ = run(env, "--config", str(config), "--json", "verify", "--remote")
    failed = [(r["rank"], r["problem"]) for r in json.loads(out) if r["status"] == "failed"]
    assert code == 1 and failed[0][0] == 1 and "the store keeps checksum" in failed[0][1]
    # No download: with reads made impossible, the check of the stores' checksums still runs.
    monkeypatch.setattr(RemoteTier, "open_shard", lambda *args: pytest.fail("downloaded"))
    from tiered_ckpt import TieredStore
    from tiered_ckpt.tiers import survey

    result = survey.verify(TieredStore([LocalTier(local), tier]), 5, later_only=True)
    assert [check.status for check in result.checks] == ["ok", "failed", "ok", "ok"]
    assert not result.ok and [check.rank for check in result.failed] == [1]


@pytest.mark.slow
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


@pytest.mark.slow
def test_push_uploads_what_only_the_local_tier_holds(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2], upload=False)
    code, out, err = run(env, "--config", str(config), "--json", "push")
    assert code == 0, err
    assert json.loads(out) == {"uploaded_steps": [1, 2]}
    assert RemoteTier(url, options).steps() == [1, 2]
    code, out, _ = run(env, "--config", str(config), "--json", "push")
    assert json.loads(out) == {"uploaded_steps": []}


@pytest.mark.slow
def test_push_uploads_every_other_step_when_one_fails_and_reports_them(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2, 3], upload=False)
    flip_byte(local / step_dir_name(2) / "rank-00001-of-00004.safetensors", 99)
    code, out, err = run(env, "--config", str(config), "--json", "push")
    assert code == 1 and json.loads(out) == {"uploaded_steps": [1, 3], "failed_steps": [2]}, err
    assert "UploadError" in err and "step 2" in err
    assert RemoteTier(url, options).steps() == [1, 3]


@pytest.mark.slow
def test_prune_dry_run_then_prune(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2, 3])
    code, out, err = run(env, "--config", str(config), "--json", "prune", "--dry-run")
    assert code == 0, err
    assert json.loads(out) == {
        "dry_run": True,
        "local": [1, 2],
        "remote": [1],
        "aborted": [],
        "local_kept_unproven": [],
    }
    assert sorted(p.name for p in local.iterdir()) == [step_dir_name(s) for s in (1, 2, 3)]
    code, out, _ = run(env, "--config", str(config), "--json", "prune")
    assert code == 0 and json.loads(out) == {
        "dry_run": False,
        "local": [1, 2],
        "remote": [1],
        "aborted": [],
        "local_kept_unproven": [],
    }
    assert sorted(p.name for p in local.iterdir()) == [step_dir_name(3)]
    assert RemoteTier(url, options).steps() == [2, 3]


@pytest.mark.slow
def test_prune_of_one_ranks_directory_says_which_steps_it_keeps_and_why(tmp_path):
    """A rank's directory of a 2-rank job: one rank's commit of step 3 proves nothing of the other's."""
    root = tmp_path / "rank-0"
    for step in (1, 2, 3):
        states = [{"w": np.arange(64, dtype=np.float32) + step}, {"w": np.zeros(64, dtype=np.float32)}]
        directory = root / step_dir_name(step)
        manifest = save_sharded(states, directory, step)
        (directory / shard_name(1, 2)).unlink()  # rank 1's shard is on its node
        tier = LocalTier(root)
        with tier.lock():
            tier.record_held(step, manifest, [0])
    config = tmp_path / "rank.toml"
    config.write_text(f"[local]\ndir = '{root}'\nkeep_last = 1\n")
    for dry_run in (["--dry-run"], []):
        code, out, err = run(os.environ, "--config", str(config), "prune", *dry_run)
        assert code == 0, err
        assert out.splitlines()[0].endswith("local none, remote none")
        assert (
            "kept local steps [1, 2]: no newer step is known to be complete on every rank (in "
            f"{root}, the directory of one rank of a multi-process job"
        ) in out, out
        assert "the job's own retention deletes them" in out and "--remote-url" in out
    code, out, _ = run(os.environ, "--config", str(config), "--json", "prune")
    assert json.loads(out)["local_kept_unproven"] == [1, 2]
    assert sorted(path.name for path in root.iterdir()) == [step_dir_name(step) for step in (1, 2, 3)]


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


@pytest.mark.slow
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


# --- a directory that is not the checkpoints' root ----------------------------------------


@pytest.mark.parametrize("command", [["ls"], ["status"], ["verify"], ["prune"], ["prune", "--dry-run"], ["push"]])
def test_a_missing_local_dir_is_named_and_never_created(tmp_path, command):
    missing = tmp_path / "no-such-dir"
    code, out, err = run(os.environ, *command, "--local-dir", str(missing))
    assert code == 2 and out == "", err
    assert f"{missing} (local.dir, from --local-dir): no such directory" in err
    assert not missing.exists()
    env = {**os.environ, "TIERED_CKPT_LOCAL_DIR": str(missing)}
    code, _, err = run(env, *command)
    assert code == 2 and "from environment (TIERED_CKPT_LOCAL_DIR)): no such directory" in err
    assert not missing.exists()


@pytest.mark.slow
def test_verify_remote_reads_only_the_bucket_and_needs_one(setup, tmp_path):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1])
    missing = tmp_path / "fresh-node"
    code, out, err = run(env, "--config", str(config), "verify", "--remote", "--local-dir", str(missing))
    assert code == 0 and "4 shards verified, 0 failed" in out, err
    assert not missing.exists()
    code, _, err = run(os.environ, "verify", "--remote", "--local-dir", str(local))
    assert code == 2 and "verify --remote needs a remote tier" in err


@pytest.mark.slow
def test_a_step_directory_given_as_the_root_is_named_with_its_parent(tmp_path):
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(3, [{"w": np.arange(4.0)}, {"w": np.arange(4.0)}], blocking=True)
    step_dir = tmp_path / step_dir_name(3)
    for command in (["ls"], ["verify"], ["prune"], ["pull"]):
        code, out, err = run(os.environ, *command, "--local-dir", str(step_dir))
        assert code == 2 and out == "", err
        assert f"this looks like a step directory; give its parent, {tmp_path}" in err
    code, out, err = run(os.environ, "--json", "ls", "--local-dir", str(tmp_path))
    assert code == 0 and [row["step"] for row in json.loads(out)] == [3], err


def test_a_relative_local_dir_in_a_config_is_read_from_the_config_files_folder(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", world_size=1) as manager:
        manager.save(5, [{"w": np.arange(4.0)}], blocking=True)
    config = tmp_path / "job.toml"
    config.write_text("[local]\ndir = 'ckpt'\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tiered_ckpt", "--json", "ls", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert [row["step"] for row in json.loads(result.stdout)] == [5]


# --- naming an S3 endpoint -----------------------------------------------------------------


@pytest.mark.slow
def test_endpoint_url_option_and_environment_variables_reach_the_store(tmp_path, s3_url, moto_endpoint):
    url, options = s3_url
    save_steps(tmp_path / "job", url, options, [1, 2])
    empty = tmp_path / "fresh-node"
    empty.mkdir()
    env = s3_credentials_env()
    common = ("--json", "ls", "--local-dir", str(empty), "--remote-url", url)

    def remote_steps(env, *extra):
        code, out, err = run(env, *common, *extra)
        assert code == 0, err
        return [(row["step"], row["local"], row["remote"]) for row in json.loads(out)]

    expected = [(1, None, "committed"), (2, None, "committed")]
    assert remote_steps(env, "--endpoint-url", moto_endpoint) == expected
    assert remote_steps({**env, "TIERED_CKPT_REMOTE_ENDPOINT_URL": moto_endpoint}) == expected
    assert remote_steps({**env, "AWS_ENDPOINT_URL": moto_endpoint}) == expected  # botocore's own, as --help says
    assert remote_steps({**env, "AWS_ENDPOINT_URL_S3": moto_endpoint}) == expected
    # the option wins over the variable
    wrong = {**env, "TIERED_CKPT_REMOTE_ENDPOINT_URL": "http://127.0.0.1:9"}
    assert remote_steps(wrong, "--endpoint-url", moto_endpoint) == expected


@pytest.mark.slow
def test_a_bad_endpoint_url_is_refused_naming_where_it_came_from(tmp_path):
    code, _, err = run(
        os.environ, "ls", "--local-dir", str(tmp_path), "--remote-url", "s3://b/run", "--endpoint-url", "minio:9000"
    )
    assert code == 2 and "tiered-ckpt: --endpoint-url: key 'remote.endpoint_url' must be an http" in err
    assert "minio" not in err and "remote_endpoint_url" not in err
    code, _, err = run(os.environ, "ls", "--local-dir", str(tmp_path), "--endpoint-url", "http://127.0.0.1:9000")
    assert code == 2 and "tiered-ckpt: --endpoint-url: key 'remote.url' is required" in err
    env = {**os.environ, "TIERED_CKPT_REMOTE_ENDPOINT_URL": "http://127.0.0.1:9000"}
    code, _, err = run(env, "ls", "--local-dir", str(tmp_path))
    assert code == 2 and "TIERED_CKPT_REMOTE_ENDPOINT_URL): key 'remote.url' is required" in err
    code, _, err = run(env, "ls", "--local-dir", str(tmp_path), "--remote-url", f"file://{tmp_path}/bucket")
    assert code == 2 and "applies to s3://, gs:// and az:// URLs only" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    "endpoint",
    ["admin:hunter2@minio:9000", "http://admin:hunter2@minio:9000", "s3://admin:hunter2@m", "http://a:b/hunter2@m"],
)
def test_an_endpoint_url_with_a_password_is_refused_without_showing_it(tmp_path, endpoint):
    toml = tmp_path / "ckpt.toml"
    toml.write_text(f"[local]\ndir = '{tmp_path}'\n[remote]\nurl = 's3://b/run'\nendpoint_url = '{endpoint}'\n")
    ways = {
        "--endpoint-url": (os.environ, "--remote-url", "s3://b/run", "--endpoint-url", endpoint),
        "the config file": (os.environ, "--config", str(toml)),
        "the variable": (
            {**os.environ, "TIERED_CKPT_REMOTE_ENDPOINT_URL": endpoint, "TIERED_CKPT_REMOTE_URL": "s3://b/run"},
        ),
    }
    for way, (env, *options) in ways.items():
        code, out, err = run(env, "ls", "--local-dir", str(tmp_path), *options)
        assert code == 2 and "key 'remote.endpoint_url' must not hold credentials" in err, (way, err)
        assert "hunter2" not in err + out and "admin" not in err + out, way


# --- version, help, JSON, progress ---------------------------------------------------------


def test_version_is_the_one_pyproject_declares():
    import tomllib
    from pathlib import Path

    declared = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    code, out, _ = run(os.environ, "--version")
    assert code == 0 and out.strip() == f"tiered-ckpt {declared['project']['version']}"


def test_bench_is_not_a_command_the_benchmark_lives_outside_the_package():
    code, out, err = run(os.environ, "bench")
    assert code == 2 and "invalid choice: 'bench'" in err and out == ""
    code, out, _ = run(os.environ, "--help")
    assert code == 0 and "bench" not in out


@pytest.mark.parametrize("command", [[], ["ls"], ["verify"], ["pull"]])
def test_help_is_plain_text_and_lists_the_environment_variables_and_exit_codes(command):
    code, out, _ = run(os.environ, *command, "--help")
    assert code == 0
    for markup in ("``", ":class:", ":func:", ":meth:", ":mod:", "~tiered_ckpt"):
        assert markup not in out
    variables = (
        "TIERED_CKPT_LOCAL_DIR",
        "TIERED_CKPT_REMOTE_URL",
        "TIERED_CKPT_REMOTE_ENDPOINT_URL",
        "AWS_ENDPOINT_URL",
    )
    assert all(name in out for name in variables)
    assert "exit codes:" in out and "--endpoint-url" in out
    assert re.search(r"^\s+0\s+success", out, re.M) and re.search(r"^\s+2\s+bad usage", out, re.M)


def run_on_a_terminal(env, *args):
    """Run the CLI with stderr on a pseudo-terminal; return (exit code, stdout, what the terminal showed)."""
    import fcntl
    import pty
    import struct
    import termios

    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    process = subprocess.Popen(
        [sys.executable, "-m", "tiered_ckpt", *args], stdout=subprocess.PIPE, stderr=terminal, text=True, env=env
    )
    os.close(terminal)
    shown = b""
    while True:
        # a guard, not a timing: a child that hangs fails the test instead of hanging the run
        ready, _, _ = select.select([controller], [], [], 300)
        if not ready:
            process.kill()
            process.wait()
            os.close(controller)
            pytest.fail(f"tiered-ckpt {' '.join(args)} showed nothing for 300 s: {shown.decode(errors='replace')}")
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    out = process.stdout.read()
    code = process.wait(timeout=300)
    os.close(controller)
    return code, out, shown.decode(errors="replace")


@pytest.mark.slow
def test_pull_and_push_show_progress_on_a_terminal_only(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2], upload=False)
    code, out, shown = run_on_a_terminal(env, "--config", str(config), "push")
    assert code == 0 and "uploaded steps: [1, 2]" in out, shown
    assert re.search(r"push: +0%.*\| 0/2 ", shown), shown  # the bar, before the first step is done
    import shutil

    shutil.rmtree(local)
    code, out, shown = run_on_a_terminal(env, "--config", str(config), "pull")
    assert code == 0 and "4 shards downloaded" in out, shown
    assert re.search(r"pull: .*B ", shown), shown  # bytes downloaded so far
    shutil.rmtree(local)
    code, out, err = run(env, "--config", str(config), "pull")  # stderr is a pipe: no bar
    assert code == 0 and err == "", err


# --- a damaged manifest among good ones ----------------------------------------------------


@pytest.mark.slow
def test_ls_lists_every_step_and_marks_a_damaged_remote_manifest_and_verify_fails_it(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2, 3])
    import shutil

    shutil.rmtree(local / step_dir_name(1))  # an old step only the bucket holds
    tier = RemoteTier(url, options)
    tier.backend.fs.pipe_file(f"{tier.backend.root}/{step_dir_name(1)}/{MANIFEST_NAME}", b'{"not": "a manifest"')
    code, out, err = run(env, "--config", str(config), "--json", "ls")
    assert code == 0, err  # the listing itself succeeded; verify is the check that fails
    rows = {row["step"]: row for row in json.loads(out)}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["remote"] == "committed" and rows[1]["world_size"] is None and "manifest" in rows[1]["problem"]
    assert rows[2]["problem"] is None and rows[3]["world_size"] == 4
    assert "step 1 is damaged" in err and "tiered-ckpt verify 1" in err
    code, out, err = run(env, "--config", str(config), "ls")
    assert code == 0 and re.search(r"^\s+1\s+-\s+committed .*DAMAGED$", out, re.M), out
    code, out, _ = run(env, "--config", str(config), "--json", "verify")
    results = json.loads(out)
    failed = [(r["step"], r["tier"], r["rank"]) for r in results if r["status"] == "failed"]
    assert code == 1 and failed == [(1, "remote", None)]
    assert {(r["step"], r["tier"]) for r in results if r["status"] == "ok"} == {
        (step, tier) for step in (2, 3) for tier in ("local", "remote")
    }
    code, out, _ = run(env, "--config", str(config), "verify", "2")
    assert code == 0 and "8 shards verified, 0 failed" in out
    code, out, _ = run(env, "--config", str(config), "verify", "1")
    assert code == 1 and "step 1 remote manifest: FAILED" in out


@pytest.mark.parametrize("command", [["ls"], ["status"], ["verify", "--remote"], ["--json", "ls"]])
def test_a_missing_bucket_is_named_and_fails_the_command(tmp_path, moto_endpoint, command):
    local = tmp_path / "local"
    local.mkdir()
    config = write_s3_config(tmp_path / "ckpt.toml", local, "s3://tiered-no-such-bucket/run", moto_endpoint)
    code, out, err = run(s3_credentials_env(), "--config", str(config), *command)
    assert code == 1 and out == ""
    assert "the bucket 'tiered-no-such-bucket' does not exist" in err


@pytest.mark.slow
def test_show_lists_each_ranks_arrays_from_their_headers_alone(setup, tmp_path):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1])
    code, out, err = run(env, "--config", str(config), "--json", "show", "1")
    assert code == 0, err
    rows = json.loads(out)
    states = zero1_states(seed=1)
    assert {(row["rank"], row["name"]) for row in rows} == {(r, name) for r in range(4) for name in states[r]}
    for row in rows:
        array = states[row["rank"]][row["name"]]
        assert (row["shape"], row["bytes"], row["tier"]) == (list(array.shape), array.nbytes, "local")
    # a laptop with no local copy: each header is a ranged GET from the bucket, nothing is written
    fresh = tmp_path / "laptop"
    code, out, err = run(env, "--config", str(config), "show", "1", "--local-dir", str(fresh))
    assert code == 0 and not fresh.exists(), err
    assert f"step 1: {len(rows)} arrays in 4 shards" in out and " F32 " in out
    code, _, err = run(env, "--config", str(config), "show", "7")
    assert code == 1 and "step 7 is committed in no tier" in err


def test_show_of_a_shard_whose_header_does_not_verify_fails_naming_it(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1], upload=False)
    flip_byte(local / step_dir_name(1) / shard_name(2, 4), 20)  # inside rank 2's header
    code, _, err = run(env, "--config", str(config), "show", "1")
    assert code == 1 and "rank 2" in err and "header's sha256" in err, err


# --- a bucket alone, a bucket out of reach, one rank's directory, a reader gone ------------


@pytest.mark.slow
def test_ls_and_status_read_the_bucket_alone_without_a_local_directory(setup, tmp_path):
    config, local, url, options, env = setup
    save_steps(local, url, options, [1, 2])
    fresh = tmp_path / "laptop"
    code, out, err = run(env, "--config", str(config), "--json", "ls", "--local-dir", str(fresh))
    assert code == 0, err
    assert [(row["step"], row["local"], row["remote"]) for row in json.loads(out)] == [
        (1, None, "committed"),
        (2, None, "committed"),
    ]
    assert f"{fresh} (local.dir, from --local-dir) does not exist; reading the bucket alone" in err  # a typo shows
    code, out, err = run(env, "--config", str(config), "--json", "status", "--local-dir", str(fresh))
    assert code == 0, err
    lag = json.loads(out)
    assert (lag["newest_local"], lag["newest_remote"], lag["steps_behind"]) == (None, 2, 0)
    code, out, err = run(env, "--config", str(config), "status", "--local-dir", str(fresh))
    assert code == 0 and "newest local step None, newest remote step 2" in out, err
    assert not fresh.exists()  # a read creates nothing


@pytest.mark.slow
def test_ls_with_an_unreachable_bucket_lists_the_local_steps_and_says_the_bucket_was_not_reached(tmp_path):
    local = tmp_path / "local"
    save_steps(local, None, None, [1, 2], upload=False)
    nothing_listens = f"http://127.0.0.1:{free_port()}"  # bound, then closed: connections are refused
    config = write_s3_config(tmp_path / "ckpt.toml", local, "s3://tiered-unreachable/run", nothing_listens)
    env = {**s3_credentials_env(), "TIERED_CKPT_UPLOAD_MAX_TRIES": "1"}
    code, out, err = run(env, "--config", str(config), "--json", "ls")
    assert code == 1, err
    rows = json.loads(out)
    assert [(row["step"], row["local"], row["remote"]) for row in rows] == [
        (1, "committed", "unreachable"),
        (2, "committed", "unreachable"),
    ]
    assert rows[1]["world_size"] == 4 and rows[1]["bytes"] > 0
    assert "tiered-ckpt: the bucket could not be reached; only the local steps are listed" in err
    assert "s3://tiered-unreachable" in err
    code, out, err = run(env, "--config", str(config), "ls")
    assert code == 1 and re.search(r"^\s+2\s+committed\s+unreachable\s", out, re.M), out + err


@pytest.mark.slow
def test_show_on_one_ranks_directory_lists_that_ranks_arrays_and_names_the_others(tmp_path):
    root = tmp_path / "rank-1"  # the directory of rank 1 of a 2-rank job, as under torchrun
    states = [{"w": np.arange(64, dtype=np.float32)}, {"w": np.zeros(64, dtype=np.float32), "b": np.ones(3)}]
    manifest = save_sharded(states, root / step_dir_name(4), 4)
    (root / step_dir_name(4) / shard_name(0, 2)).unlink()  # rank 0's shard is on its node
    tier = LocalTier(root)
    with tier.lock():
        tier.record_held(4, manifest, [1])
    code, out, err = run(os.environ, "--json", "show", "4", "--local-dir", str(root))
    assert code == 0, err
    assert sorted((row["rank"], row["name"], row["shape"]) for row in json.loads(out)) == [
        (1, "b", [3]),
        (1, "w", [64]),
    ]
    assert f"{root} holds the shards of rank 1 of 2" in err and "those of rank 0 are on other nodes' disks" in err
    code, out, err = run(os.environ, "show", "4", "--local-dir", str(root))
    assert code == 0 and out.splitlines()[-1].startswith("step 4: 2 arrays in 1 of 2 shards"), out + err


@pytest.mark.slow
def test_a_failed_pull_leaves_no_step_directory_behind(setup):
    config, local, url, options, env = setup
    save_steps(local, url, options, [7])
    import shutil

    shutil.rmtree(local)  # a fresh node
    tier = RemoteTier(url, options)
    key = f"{tier.backend.root}/{step_dir_name(7)}/{shard_name(2, 4)}"
    damaged = bytearray(tier.backend.fs.cat_file(key))
    damaged[99] ^= 0xFF
    tier.backend.fs.pipe_file(key, bytes(damaged))
    code, out, err = run(env, "--config", str(config), "pull")
    assert code == 1 and out == "" and "ChecksumMismatchError" in err, err
    assert not local.exists()  # neither the step's directory nor the root it made
    local.mkdir()
    code, out, err = run(env, "--config", str(config), "pull")
    assert code == 1 and os.listdir(local) == [], err  # a directory that was there stays, empty


def _with_its_output_closed(env, *args):
    """Run the CLI writing to a pipe whose reading end is closed before it starts (a reader that
    went away, as ``head`` does once it has read enough); return (exit code, stderr)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tiered_ckpt", *args],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=300,
        )
    finally:
        os.close(writer)
    return result.returncode, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, buffered",
    [
        (["--json", "ls"], True),
        (["--json", "ls"], False),
        (["status"], True),
        (["verify"], True),
        (["show", "3"], True),
        (["--version"], True),
    ],  # unbuffered, argparse ignores a failed write of --version
    ids=["ls-json", "ls-json-unbuffered", "status", "verify", "show", "version"],
)
def test_a_reader_that_closes_the_output_early_ends_the_command_quietly(tmp_path, command, buffered):
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(3, [{"w": np.arange(4.0)}, {"w": np.arange(4.0)}], blocking=True)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    if not buffered:  # each print is written at once: the write itself fails, not the flush at exit
        env["PYTHONUNBUFFERED"] = "1"
    code, err = _with_its_output_closed(env, *command, "--local-dir", str(tmp_path))
    assert (code, err) == (141, "")  # as a Unix tool that SIGPIPE ended: no traceback, no "Exception ignored"


def test_ls_says_which_deleted_steps_are_kept_for_later_ones_and_their_size(tmp_path):
    base = {f"layer{i}": np.full((32, 64), i, np.float32) for i in range(3)}  # 8 KiB each
    remote = RemoteOptions(f"file://{tmp_path / 'bucket'}", keep_last=1)
    with CheckpointManager(LocalOptions(tmp_path / "local", keep_last=2), remote=remote, world_size=1) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"base": base, "adapter": np.full((32, 64), step, np.float32)}, blocking=True)
            manager.wait(uploaded=True)
    args = ("--local-dir", str(tmp_path / "local"), "--remote-url", f"file://{tmp_path / 'bucket'}")
    code, out, err = run(None, "ls", "--json", *args)
    assert code == 0, err
    rows = {row["step"]: row for row in json.loads(out)}
    assert (rows[1]["local"], rows[1]["remote"], rows[1]["world_size"]) == ("kept", "kept", None)
    assert rows[1]["bytes"] > 3 * 8192  # the base, kept on the disk for steps 2 and 3
    assert (rows[2]["local"], rows[2]["remote"]) == ("committed", None)  # step 3 uses nothing of its own file
    assert rows[3]["referenced_bytes"] == 3 * 8192
    code, out, _ = run(None, "ls", *args)
    assert re.search(r"^\s+1  kept\s+kept\s+-\s+\d", out, re.MULTILINE), out


def test_pull_of_an_incremental_step_brings_the_files_it_references(tmp_path):
    import shutil

    base = {f"layer{i}": np.full((32, 64), i, np.float32) for i in range(3)}  # 8 KiB each
    with CheckpointManager(LocalOptions(tmp_path / "local", keep_last=2), world_size=1) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"base": base, "adapter": np.full((32, 64), step, np.float32)}, blocking=True)
    args = ("--local-dir", str(tmp_path / "local"), "--remote-url", f"file://{tmp_path / 'bucket'}")
    code, out, err = run(None, "push", *args)
    assert code == 0 and "[2, 3]" in out, err
    shutil.rmtree(tmp_path / "local")
    code, _, err = run(None, "pull", *args)
    assert code == 0, err
    assert (tmp_path / "local" / f"kept-{step_dir_name(1)}").is_dir()
    code, out, err = run(None, "verify", *args)
    assert code == 0 and "3 shards verified, 0 failed" in out, out + err
