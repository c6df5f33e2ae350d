import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import s3_credentials_env, write_s3_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_saves_reloads_and_shows_the_three_failure_modes(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "every array byte-for-byte equal" in result.stdout
    for error in ("WorldSizeMismatchError", "ShardCountMismatchError", "IncompleteCheckpointError"):
        assert error in result.stdout
    step_dir = tmp_path / "step-000000001234"
    assert sorted(p.name for p in step_dir.iterdir()) == ["manifest.json"] + [
        f"rank-{r:05d}-of-00004.safetensors" for r in range(4)
    ]


def test_training_example_resumes_and_a_fresh_node_restores_from_the_bucket(tmp_path, s3_url, moto_endpoint):
    url, _options = s3_url
    config = write_s3_config(tmp_path / "job.toml", tmp_path / "node-a", url, moto_endpoint)
    env = s3_credentials_env()

    def run(script, *args):
        result = subprocess.run(
            [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    first = run("train_numpy_zero1.py", "--config", str(config), "--steps", "20")
    assert "step 20: loss" in first and "resumed" not in first
    second = run("train_numpy_zero1.py", "--config", str(config), "--steps", "30")
    assert "resumed from step 20; shards from {0: 'local', 1: 'local', 2: 'local', 3: 'local'}" in second
    fresh = run("resume_from_bucket.py", "--config", str(config), "--local-dir", str(tmp_path / "node-b"))
    assert "restored step 30 of 4 ranks" in fresh
    assert "{0: 'remote', 1: 'remote', 2: 'remote', 3: 'remote'}" in fresh
    assert sorted(p.name for p in (tmp_path / "node-b").iterdir()) == ["step-000000000030"]


def test_ddp_example_resumes_after_a_sigkill_to_the_same_parameters_as_an_uninterrupted_run(tmp_path):
    def torchrun(local_dir, *args):
        env = {**os.environ, "TIERED_CKPT_LOCAL_DIR": str(local_dir)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
        script = [str(EXAMPLES / "torch_ddp_train.py"), "--steps", "30", *args]
        return subprocess.run([*command, *script], capture_output=True, text=True, env=env, timeout=300)

    def final_digest(run):
        assert run.returncode == 0, run.stderr
        return re.search(r"final parameters sha256 ([0-9a-f]{64})", run.stdout).group(1)

    uninterrupted = final_digest(torchrun(tmp_path / "a"))
    killed = torchrun(tmp_path / "b", "--kill-at-step", "25")
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    resumed = torchrun(tmp_path / "b")
    for rank in range(4):
        assert f"rank {rank}: resumed from step 20; shards from {{{rank}: 'local'}}" in resumed.stdout
    assert final_digest(resumed) == uninterrupted


def test_ddp_example_resumes_with_fewer_ranks_through_the_bucket(tmp_path, s3_url, moto_endpoint):
    url, _options = s3_url
    config = write_s3_config(tmp_path / "job.toml", tmp_path / "nodes", url, moto_endpoint)

    def torchrun(processes, *args):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
        script = [str(EXAMPLES / "torch_ddp_train.py"), "--config", str(config), *args]
        run = subprocess.run([*command, *script], capture_output=True, text=True, env=s3_credentials_env(), timeout=300)
        assert run.returncode == 0, run.stderr
        return run.stdout

    torchrun(4, "--steps", "20")
    resumed = torchrun(2, "--steps", "30", "--reshard")
    # new rank 0 holds old ranks 0-1: old rank 0's shard is on its disk (rank-0), old rank 1's in the bucket
    assert "rank 0: resumed from step 20; shards from {0: 'local', 1: 'remote'}" in resumed
    assert "rank 1: resumed from step 20; shards from {2: 'remote', 3: 'remote'}" in resumed
    assert "step 30: loss" in resumed
