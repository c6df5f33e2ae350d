import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.stores import s3_credentials_env, write_s3_config
from tiered_ckpt import CheckpointManager, RemoteOptions
from tiered_ckpt.tiers.remote.tier import RemoteTier

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_resume_from_bucket_takes_the_world_size_from_the_manifest(tmp_path, s3_url, moto_endpoint):
    url, options = s3_url
    with CheckpointManager(
        tmp_path / "job", world_size=3, remote=RemoteOptions(url, storage_options=options)
    ) as manager:
        manager.save(7, [{"w": np.full(5, rank, dtype=np.float32)} for rank in range(3)])
        manager.wait(uploaded=True)
    config = write_s3_config(tmp_path / "job.toml", tmp_path / "job", url, moto_endpoint)
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "resume_from_bucket.py"), "--config", str(config),
         "--local-dir", str(tmp_path / "fresh")],
        capture_output=True, text=True, env=s3_credentials_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "restored step 7 of 3 ranks" in result.stdout
    assert "{0: 'remote', 1: 'remote', 2: 'remote'}" in result.stdout


@pytest.mark.slow
def test_ddp_example_resumes_after_a_sigkill_to_the_same_parameters_as_an_uninterrupted_run(tmp_path):
    def torchrun(local_dir, *args):
        env = {**os.environ, "TIERED_CKPT_LOCAL_DIR": str(local_dir)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
        script = [str(EXAMPLES / "torch_ddp_train.py"), "--steps", "30", *args]
        return subprocess.run([*command, *script], capture_output=True, text=True, env=env, timeout=300)

    def final_digest(run):
        assert run.returncode == 0, run.stderr
        return re.search(r"final parameters sha256 ([0-9a-f]{64})", run.stdout).group(1)

    uninterrupted = final_digest(torchrun(tmp_path / "a"))
    killed = torchrun(tmp_path / "b", "--kill-at-step", "25")
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    resumed = torchrun(tmp_path / "b")
    for rank in range(3):  # three ranks: a ring all-reduce whose sums' order follows DDP's buckets
        assert f"rank {rank}: resumed from step 20; shards from {{{rank}: 'local'}}" in resumed.stdout
    assert final_digest(resumed) == uninterrupted


@pytest.mark.slow
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


def preempted_ddp_run(tmp_path, config, processes, signalled_rank, after_step, env):
    """Run the DDP example, send SIGTERM to one rank once rank 0 reports ``after_step``; return its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    script = [str(EXAMPLES / "torch_ddp_train.py"), "--config", str(config), "--steps", "60", "--log-every", "1"]
    job = subprocess.Popen([*command, *script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines, pids = [], {}
    try:
        for line in job.stdout:
            lines.append(line)
            if match := re.match(r"rank (\d+): pid (\d+)", line):
                pids[int(match.group(1))] = int(match.group(2))
            if line.startswith(f"step {after_step}:"):
                os.kill(pids[signalled_rank], signal.SIGTERM)  # a preemption notice, to one rank only
                break
        rest, errors = job.communicate(timeout=120)  # the grace period
    finally:
        job.kill()
    assert job.returncode == 0, errors
    return "".join(lines) + rest


@pytest.mark.slow
@pytest.mark.parametrize("processes, signalled_rank", [(1, 0), (2, 1)])
def test_ddp_example_preempted_by_sigterm_commits_that_step_and_a_fresh_node_resumes_bit_for_bit(
    tmp_path, s3_url, moto_endpoint, processes, signalled_rank
):
    url, _options = s3_url
    env = s3_credentials_env()
    config = write_s3_config(tmp_path / "job.toml", tmp_path / "node-a", url, moto_endpoint)
    after_step = random.choice([s for s in range(12, 40) if s % 10 not in (0, 9)])
    preempted = preempted_ddp_run(tmp_path, config, processes, signalled_rank, after_step, env)
    stops = {int(m.group(2)) for m in re.finditer(r"rank (\d+): preempted at step (\d+)", preempted)}
    assert len(stops) == 1 and len(re.findall(r"preempted at step", preempted)) == processes  # one step, every rank
    stop = stops.pop()
    assert stop >= after_step and "final parameters" not in preempted
    remote = RemoteTier(url, _options)
    assert remote.steps()[-1] == stop  # that very step is in the bucket

    def torchrun(config_path, local_dir):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
        script = [str(EXAMPLES / "torch_ddp_train.py"), "--config", str(config_path), "--steps", "60"]
        run_env = {**env, "TIERED_CKPT_LOCAL_DIR": str(local_dir)}
        run = subprocess.run([*command, *script], capture_output=True, text=True, env=run_env, timeout=300)
        assert run.returncode == 0, run.stderr
        return run.stdout

    fresh = torchrun(config, tmp_path / "node-b")  # an empty disk: every shard from the bucket
    expected = {rank: "remote" for rank in range(processes)}
    for rank in range(processes):
        assert f"rank {rank}: resumed from step {stop}; shards from {{{rank}: '{expected[rank]}'}}" in fresh
    other = write_s3_config(tmp_path / "other.toml", tmp_path / "node-c", url + "-uninterrupted", moto_endpoint)
    uninterrupted = torchrun(other, tmp_path / "node-c")
    digest = re.compile(r"final parameters sha256 ([0-9a-f]{64})")
    assert digest.search(fresh).group(1) == digest.search(uninterrupted).group(1)


@pytest.mark.slow
def test_fsdp2_example_resumes_bit_for_bit_and_on_another_world_size_through_the_bucket(
    tmp_path, s3_url, moto_endpoint
):
    url, _options = s3_url
    env = s3_credentials_env()

    def torchrun(processes, config, *args, ok=True):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
        script = [str(EXAMPLES / "torch_fsdp2_train.py"), "--config", str(config), "--steps", "24", *args]
        run = subprocess.run([*command, *script], capture_output=True, text=True, env=env, timeout=300)
        if ok:
            assert run.returncode == 0, run.stderr
        return run

    def final_digest(run):
        return re.search(r"final parameters sha256 ([0-9a-f]{64})", run.stdout).group(1)

    uninterrupted = torchrun(2, write_s3_config(tmp_path / "a.toml", tmp_path / "a", url + "-a", moto_endpoint))
    pids = dict(re.findall(r"rank (\d+): pid (\d+)", uninterrupted.stdout))
    assert sorted(pids) == ["0", "1"] and len(set(pids.values())) == 2  # one process per rank, each named
    # a save returns once staged; the commit comes later, and is only claimed once it happened
    assert "step 5: loss" in uninterrupted.stdout and "checkpoint saved" not in uninterrupted.stdout
    line = r"^step (\d+): loss [0-9.]+, checkpoint staged; newest committed on disk: (.*)$"
    staged = re.findall(line, uninterrupted.stdout, re.M)
    assert [int(step) for step, _ in staged] == [5, 10, 15, 20]
    assert all(newest in ("none yet", *(f"step {s}" for s in range(5, int(step) + 1, 5))) for step, newest in staged)
    assert "every checkpoint committed on disk and in the bucket; newest step 20" in uninterrupted.stdout
    config = write_s3_config(tmp_path / "b.toml", tmp_path / "b", url, moto_endpoint)
    killed = torchrun(2, config, "--kill-at-step", "17", "--compare-dcp", str(tmp_path / "dcp"), ok=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    resumed = torchrun(2, config, "--compare-dcp", str(tmp_path / "dcp"))
    for rank in range(2):
        assert f"rank {rank}: resumed from step 15; shards from {{{rank}: 'local'}}" in resumed.stdout
    assert final_digest(resumed) == final_digest(uninterrupted)
    wider = torchrun(3, config, "--steps", "30", "--reshard", "--compare-dcp", str(tmp_path / "dcp"))
    assert "rank 2: resumed from step 20; shards from {0: 'remote', 1: 'remote'}" in wider.stdout
    for rank in range(3):  # the same state as DCP's own resharding load of the same step
        assert f"rank {rank}: restored state equals DCP's own load of step 20: True" in wider.stdout
    assert "step 30: loss" in wider.stdout
