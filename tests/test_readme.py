"""Every python sample of README.md, run as printed.

Each sample is taken from the README's text and run in a process of its own (under
``torchrun`` where it needs one process per rank). What a sample takes from its context
(``total_steps``, ``train_one_step``, ``model``, ``manager``, ...) is defined by a
prelude run before it, and the bucket is moto's S3 server on loopback, reached as the
README says credentials and endpoints are found: ``AWS_ENDPOINT_URL`` and the AWS
credential variables. The substitutions: ``/nvme/ckpt`` becomes a temp directory, and
the quickstart's MinIO endpoint the moto server's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import boto3
import pytest

from support.stores import S3_TEST_KEY, S3_TEST_SECRET, StoppableS3
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.tiers.remote.tier import RemoteTier

README = Path(__file__).resolve().parent.parent / "README.md"
BUCKET_URL = "s3://my-bucket/run-42"  # what the samples name
OUTAGE_SECONDS = 30


def python_samples() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.DOTALL | re.MULTILINE)


def sample(marker: str) -> str:
    """The one python sample of the README that contains ``marker``."""
    found = [text for text in python_samples() if marker in text]
    assert len(found) == 1, f"{len(found)} samples contain {marker!r}"
    return found[0]


MARKERS = {
    "use": "def training_state(step):",
    "per_rank": "coordinator=TorchDistributedCoordinator()",
    "outage": "raises only for what a person must fix",
}
QUICKSTART_ENDPOINT = 'endpoint_url="http://127.0.0.1:9000"'  # the quickstart's MinIO, moto here


def test_every_python_sample_of_the_readme_is_run_here():
    claimed = [name for text in python_samples() for name, marker in MARKERS.items() if marker in text]
    assert sorted(claimed) == sorted(MARKERS), "a README sample without a test here (or a marker matching two)"


def test_the_config_sample_loads_with_the_values_it_shows(tmp_path):
    from tiered_ckpt import load_config

    (text,) = re.findall(r"^```toml\n(.*?)^```", README.read_text(), flags=re.DOTALL | re.MULTILINE)
    path = tmp_path / "job.toml"
    path.write_text(text)
    config = load_config(path, environ={})
    assert config.remote is not None and config.remote.url == BUCKET_URL
    assert (config.local.keep_last, config.remote.keep_last, config.upload.when_behind) == (3, 10, "wait")
    assert (config.remote.endpoint_url, config.upload.max_tries, config.restore.verify) == (
        "http://127.0.0.1:9000",
        5,
        "full",
    )


def test_no_sample_takes_a_missing_checkpoint_for_a_fresh_start():
    for text in python_samples():
        assert "except tiered_ckpt.IncompleteCheckpointError" not in text  # restore(missing_ok=True) instead


@pytest.fixture
def bucket():
    """moto on loopback with the samples' bucket; the environment a sample process runs in."""
    server = StoppableS3()
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=S3_TEST_KEY,
        aws_secret_access_key=S3_TEST_SECRET,
        region_name="us-east-1",
    )
    # moto keeps its buckets per process, across servers: an earlier test's "my-bucket" goes first.
    if "my-bucket" in [each["Name"] for each in client.list_buckets()["Buckets"]]:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="my-bucket"):
            for item in page.get("Contents", []):
                client.delete_object(Bucket="my-bucket", Key=item["Key"])
        for upload in client.list_multipart_uploads(Bucket="my-bucket").get("Uploads", []):
            client.abort_multipart_upload(Bucket="my-bucket", Key=upload["Key"], UploadId=upload["UploadId"])
        client.delete_bucket(Bucket="my-bucket")
    client.create_bucket(Bucket="my-bucket")
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": S3_TEST_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_TEST_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "PYTHONUNBUFFERED": "1",
    }
    yield server, env
    server.stop()


def committed(server: StoppableS3) -> list[int]:
    options = {"key": S3_TEST_KEY, "secret": S3_TEST_SECRET, "skip_instance_cache": True}
    options["client_kwargs"] = {"endpoint_url": server.endpoint, "region_name": "us-east-1"}
    return RemoteTier(BUCKET_URL, options).steps()


def script(tmp_path: Path, name: str, prelude: str, text: str, epilogue: str = "") -> Path:
    """``prelude``, the sample as printed (``/nvme/ckpt`` in ``tmp_path``), then ``epilogue``."""
    path = tmp_path / f"{name}.py"
    body = text.replace("/nvme/ckpt", str(tmp_path / "nvme"))
    path.write_text(textwrap.dedent(prelude) + "\n" + body + "\n" + textwrap.dedent(epilogue))
    return path


def run(path: Path, env: dict, cwd: Path, ranks: int | None = None) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if ranks is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)
    ]  # fmt: skip
    return subprocess.run([*launcher, str(path)], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


TRAINING = """
    import sys
    total_steps = 400

    def train_one_step():
        pass
"""


@pytest.mark.slow
def test_the_use_sample_trains_saves_to_the_bucket_and_resumes(tmp_path, bucket):
    server, env = bucket
    text = sample(MARKERS["use"])
    assert QUICKSTART_ENDPOINT in text
    text = text.replace(QUICKSTART_ENDPOINT, f"endpoint_url={server.endpoint!r}")
    path = script(tmp_path, "use", TRAINING, text, 'print("restored", restored and restored.step)')
    first = run(path, env, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "restored None" in first.stdout and committed(server) == [200, 400]
    second = run(path, env, tmp_path)
    assert second.returncode == 0, second.stderr
    assert "restored 400" in second.stdout


@pytest.mark.slow
def test_the_one_process_per_rank_sample_resumes_and_a_damaged_step_is_never_a_fresh_start(tmp_path, bucket):
    server, env = bucket
    prelude = TRAINING + "    import torch\n    model = torch.nn.Linear(8, 8)\n"
    epilogue = 'print(f"rank {rank}: restored {restored and restored.step}")'
    path = script(tmp_path, "per_rank", prelude, sample(MARKERS["per_rank"]), epilogue)
    first = run(path, env, tmp_path, ranks=2)
    assert first.returncode == 0, first.stderr[-5000:]
    assert "rank 1: restored None" in first.stdout and committed(server) == [200, 400]
    second = run(path, env, tmp_path, ranks=2)
    assert second.returncode == 0, second.stderr[-5000:]
    assert "rank 0: restored 400" in second.stdout and "rank 1: restored 400" in second.stdout
    # Rank 1's shard of step 400 lost on its disk and in the bucket: the restore must fail loudly.
    shard = "rank-00001-of-00002.safetensors"
    (tmp_path / "nvme" / "rank-1" / step_dir_name(400) / shard).unlink()
    boto3.client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=S3_TEST_KEY, aws_secret_access_key=S3_TEST_SECRET,
        region_name="us-east-1",
    ).delete_object(Bucket="my-bucket", Key=f"run-42/{step_dir_name(400)}/{shard}")  # fmt: skip
    damaged = run(path, env, tmp_path, ranks=2)
    assert damaged.returncode != 0
    assert "IncompleteCheckpointError" in damaged.stderr and "no copy verifies" in damaged.stderr
    assert "CheckpointExistsError" not in damaged.stderr  # no fresh start over the damaged checkpoint


OUTAGE_PRELUDE = """
    import sys
    import numpy as np
    total_steps = 100

    def train_one_step():
        sys.stdin.readline()  # the test paces the run: one line per step

    def training_state(step):
        return {"weights": np.full(1 << 16, step, np.float32), "data": {"step": step}}
"""


@pytest.mark.slow
def test_the_error_handling_loop_trains_through_a_30_s_bucket_outage_and_every_step_reaches_the_bucket(
    tmp_path, bucket
):
    server, env = bucket
    path = script(tmp_path, "outage", OUTAGE_PRELUDE, sample(MARKERS["outage"]))
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        job = subprocess.Popen(
            [sys.executable, str(path)], stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, env=env, cwd=tmp_path
        )
        try:
            step = 0

            def advance(steps: int) -> None:
                nonlocal step
                for _ in range(steps):
                    job.stdin.write("\n")
                    job.stdin.flush()
                    step += 1

            advance(20)
            give_up = time.monotonic() + 120  # a guard against a hang, not a timing
            while 20 not in committed(server):
                assert time.monotonic() < give_up and job.poll() is None, "step 20 never reached the bucket"
                time.sleep(0.1)
            server.stop()  # the bucket is down: connection refused
            down_since = time.monotonic()
            while time.monotonic() - down_since < OUTAGE_SECONDS and step < 80:
                advance(1)  # training goes on during the outage
                time.sleep(OUTAGE_SECONDS / 60)
            while time.monotonic() - down_since < OUTAGE_SECONDS:
                time.sleep(0.1)
            saved_during = list(range(30, step + 1, 10))
            server.start()  # back, on the same port
            advance(100 - step)
            job.stdin.close()
            assert job.wait(timeout=300) == 0, (tmp_path / "err.txt").read_text()[-3000:]
        finally:
            job.kill()
    output, log = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert len(saved_during) >= 4 and "bucket failing" in output and "on local disk only" not in output
    assert re.search(r"WARNING:tiered_ckpt:upload of step 30 failed \(try 1", log)
    assert set(range(30, 101, 10)) <= set(committed(server))  # every step saved since the outage began
