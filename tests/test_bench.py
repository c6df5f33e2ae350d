"""Tests of the benchmark in benchmarks/ (outside the package): run as a user runs it,
``python -m benchmarks`` from the repository root, and its import graph read from its source."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
BENCHMARKS = REPOSITORY / "benchmarks"


def bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=REPOSITORY, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 220 s on a loaded 2-core machine, and bench()'s own guard is 600 s
def test_benchmark_runs_every_section_and_prints_its_ratios(tmp_path):
    (tmp_path / "scratch").mkdir()
    result = bench(
        *["--size-gib", "0.02", "--remote-size-gib", "0.02", "--repeat", "1", "--train-steps", "20"],
        *["--params", "200", "--dir", str(tmp_path / "scratch"), "--plot", str(tmp_path / "peers.png")],
        *["--small-arrays", "2000", "--small-arrays-mib", "4"],
        *[
            "--dist-processes",
            "1",
            "4",
            "--fsdp-processes",
            "2",
            "--scale-processes",
            "3",
            "--requests-ranks",
            "4",
            "8",
        ],  # the fewest that say it all
    )
    assert result.returncode == 0, result.stderr
    for line in (
        "save / min(disk limit, sha256 all cores)",
        "load_sharded warm / sha256 all cores",
        "manager restore cold / raw cold read",
        "manager restore / load_sharded, warm",
        "into arrays, cold / raw cold read",
        "save(blocking=False) / np.copyto",
        "extra peak RSS / state size",
        "keep_last=1 / no retention (throughput)",
        "upload / boto3 upload_file, moto",
        "upload / boto3 upload_file, model",
        "download+verify / boto3 download_file, model",
        "requests the model answered 503 SlowDown",
        "upload with SlowDown / without, flat keys",
        "upload with SlowDown / without, hashed keys",
        "bf16 model + fp32 AdamW: bucket bytes, zstd / none",
        "fp32 model + AdamW: upload time, zstd / none",
        "random fp32 bits: compress CPU s per GiB",
        "fp32 model + AdamW: decompress CPU s per GiB",
        "save / min(raw, sha256), 1 process",
        "save / min(raw, sha256), 4 processes",
        "slowdown",
        "structure / save_sharded",
        "structure / load_sharded",
        "many small / few large arrays: save",
        "many small / few large arrays: load, cold",
        "many small / few large arrays: load, warm",
        "many small / few large arrays: into, cold",
        "many small / few large arrays: into, warm",
        "save / dcp.save (throughput)",
        "load+verify / dcp.load (throughput)",
        "stall: save(blocking=False) / dcp.async_save",
        "lost node: partner / bucket (restore speed-up), moto",
        "lost node: partner / bucket (restore speed-up), model",
        "lost node: partner / own disk, model",
        "partner copy stall / disk save stall",
        "partner copy / disk save (until committed)",
        "partner copy every 10 steps: slowdown",
        "floor of its CPU share, no core free",
        "restore(model) / full restore: bytes read",
        "export peak RSS growth / largest tensor",
        "gloo operations per save; save / dcp.save",
        "growth time(4096) / time(1024)",
        "the leader of     8 ranks, one save",
        "save    HeadObject               growth 4 -> 8 ranks",
        "save peak / (budget + slot), 20x",
        "restore peak / (budget + slot), 5x",
    ):
        assert line in result.stdout
    assert "2 processes" not in result.stdout and "4 rank processes" not in result.stdout  # as told
    summary = result.stdout.split("issue 45, every target measured in this run")[1]
    rows = [TARGET_LINE.fullmatch(line.strip()) for line in summary.splitlines() if TARGET_LINE.match(line.strip())]
    assert all(rows) and {row["item"] for row in rows if row} == {"2", "3", "4", "7"}
    for label in (
        "item 2: lost node: partner / bucket restore speed-up, model",
        "item 2: upload with SlowDown / without, hashed keys",
        "item 3: restore requests, growth 4 -> 8 ranks",
        "item 4: 2,000 small / 4 large arrays: into, warm",
        "item 7: per-save overhead / dcp.save's, 3 processes",
    ):
        assert label in summary
    assert "item 5: not measured in this run (section fresh)" in summary
    rows = [line.split()[0] for line in result.stdout.split("peers:")[1].splitlines()[3:7]]
    assert rows == ["tiered_ckpt", "safetensors", "torch.save", "dcp"]  # this library's row first
    assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "scratch").iterdir()) == []  # the benchmark's files are removed


TARGET_LINE = re.compile(r"item (?P<item>\d): (?P<label>.+?) +(?P<value>\d+\.\d+) +(>=|>|<=) \d\.\d\d +(met|not met)")
FRESH_TARGETS = (
    *(f"item 7: save / {peer} save" for peer in ("safetensors", "torch.save", "dcp")),
    *(
        f'item 5: verify="fast" load {temperature} / {peer} load (new arrays)'
        for temperature in ("warm", "cold")
        for peer in ("safetensors", "torch.save", "dcp")
    ),
    "item 5: into caller's arrays warm / min(sha256 all cores, read warm)",
    "item 5: into caller's arrays cold / min(sha256 all cores, read cold)",
    "item 5: writer CPU-s per GiB / sha256's own",
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 220 s on a loaded 2-core machine, and bench()'s own guard is 600 s
def test_fresh_processes_print_every_target_of_issue_45_with_a_number_and_a_verdict(tmp_path):
    result = bench("--only", "fresh", "--size-gib", "0.004", "--ranks", "2", "--repeat", "1", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    section, summary = result.stdout.split("issue 45, every target measured in this run")
    for text in (section, summary):
        rows = [TARGET_LINE.fullmatch(line.strip()) for line in text.splitlines() if TARGET_LINE.match(line.strip())]
        assert sorted(f"item {row['item']}: {row['label']}" for row in rows if row) == sorted(FRESH_TARGETS)
        assert all(row and float(row["value"]) >= 0 for row in rows)  # each a ratio, a goal and a verdict
    for limit in (
        "write O_DIRECT, 1 stream(s)",
        "write buffered, 2 stream(s)",
        "read cold, 1 reader(s)",
        "sha256",
        "xxh3",
    ):
        assert limit in section
    for item, section_name in ((2, "sections remote, peer"), (3, "section requests"), (4, "section small-arrays")):
        assert f"item {item}: not measured in this run ({section_name})" in summary
    assert list(tmp_path.iterdir()) == []  # every process's files are removed


def test_plotting_without_a_directory_to_write_to_fails_before_measuring(tmp_path):
    result = bench("--only", "sync", "--plot", str(tmp_path / "no" / "such.png"), timeout=60)
    assert result.returncode != 0 and "no directory" in result.stderr
    assert "save_sharded" not in result.stdout


def test_help_names_the_command_and_every_section():
    result = bench("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m benchmarks")
    assert (
        "{sync,async,retention,dist,train,remote,compression,structure,small-arrays,fsdp,peer,parts,scale,requests,memory,incremental,fresh,peers}"
        in result.stdout
    )
    assert "--dist-processes N [N ...]" in result.stdout and "(default 1 2 4)" in result.stdout
    assert "--fsdp-processes N [N ...]" in result.stdout and "(default 2 4)" in result.stdout
    assert "--scale-processes N [N ...]" in result.stdout and "(default 4 8 16)" in result.stdout


def test_a_rank_process_count_below_one_is_refused_before_measuring():
    result = bench("--only", "dist", "--dist-processes", "2", "0", timeout=60)
    assert result.returncode == 2 and "--dist-processes: 0 is not a positive integer" in result.stderr
    assert result.stdout == ""


def imported(path: Path) -> set[str]:
    """The modules ``path`` imports, at its top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names if node.module == "benchmarks"}
    return names


def test_the_benchmark_is_a_dag_of_a_harness_and_sections_and_the_library_never_imports_it():
    modules = {path.stem: imported(path) for path in BENCHMARKS.glob("*.py")}
    own = {stem: {name for name in names if name.split(".")[0] == "benchmarks"} for stem, names in modules.items()}
    sections = set(modules) - {"__init__", "__main__", "harness"}
    expected = {
        "sync",
        "async_save",
        "retention",
        "dist",
        "train",
        "remote",
        "compression",
        "structure",
        "fsdp",
        "peer",
        "parts",
        "fresh",
        "fresh_worker",
        "scale",
        "peers",
        "memory",
        "requests",
        "bucket_model",
    }
    assert expected <= sections
    assert own["harness"] == set() and own["__init__"] == set()  # the harness imports no section
    for section in sections:
        assert own[section] <= {"benchmarks.harness"}, section  # never another section
    assert {f"benchmarks.{section}" for section in sections} <= own["__main__"]  # the main module picks them
    for path in (REPOSITORY / "tiered_ckpt").rglob("*.py"):
        assert not any(name.split(".")[0] == "benchmarks" for name in imported(path)), path


def test_the_chunk_study_counts_the_bytes_of_changed_arrays_in_chunks_left_as_they_were():
    from benchmarks.incremental import unchanged_share

    before = {"a": np.zeros(4096, np.uint8), "same": np.ones(10, np.uint8)}
    after = {"a": before["a"].copy(), "same": before["same"].copy()}
    after["a"][1500] = 1  # the second of four 1,024-byte chunks changed
    assert unchanged_share(before, after, 1024) == 0.75  # an unchanged array counts for nothing
    after["a"][4095] = 1  # and a byte of the last one
    assert unchanged_share(before, after, 1024) == 0.5 and unchanged_share(before, after, 3000) == 0.0
    assert unchanged_share(before, before, 1024) == 0.0  # nothing changed: nothing to share


class _Clock:
    """A clock that moves only when slept on (or told), for the bucket model's pacing and rates."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_bucket_model_paces_a_connection_and_limits_each_prefixs_requests_by_its_clock():
    from benchmarks.bucket_model import S3, BucketModel, Pacer, PrefixLimiter, prefix_of

    clock = _Clock()
    pacer = Pacer(1000.0, clock, clock.sleep)  # 1,000 bytes a second
    for _ in range(4):
        pacer.passed(500)
    assert clock.now == pytest.approx(102.0) and len(clock.slept) == 4  # 2,000 bytes took 2 s
    clock.now += 10  # an idle connection earns nothing: the pace counts from its start
    pacer.passed(500)
    assert len(clock.slept) == 4

    limiter = PrefixLimiter(BucketModel(1.0, 0.0, writes=2.0, reads=None), clock)
    step = "/bucket/run/step-000000000001"
    admitted = [limiter.admit("PUT", f"{step}/rank-{rank}") for rank in range(3)]
    assert admitted == [True, True, False] and limiter.refused == 1  # a second's worth, then SlowDown
    assert limiter.admit("PUT", "/bucket/run/step-000000000002/rank-0")  # another prefix has its own
    assert all(limiter.admit("GET", f"{step}/rank-0") for _ in range(50))  # reads unlimited here
    clock.now += 0.5  # half a second refills one write
    assert [limiter.admit("DELETE", f"{step}/rank-0") for _ in range(2)] == [True, False]
    assert prefix_of("/bucket/run/step-1/rank-0?partNumber=2&uploadId=x") == "/bucket/run/step-1"
    slow = PrefixLimiter(BucketModel(1.0, 0.0, writes=0.25, reads=None), clock)  # below one a second
    assert [slow.admit("PUT", "/b/k") for _ in range(2)] == [True, False]  # a burst of one, not of none
    clock.now += 4
    assert slow.admit("PUT", "/b/k")
    assert prefix_of("/bucket?list-type=2&prefix=run/") == "/bucket"

    slowed = S3.scaled(10)
    assert (slowed.bandwidth, slowed.latency, slowed.writes, slowed.reads) == (8.5e6, pytest.approx(0.3), 350, 550)
    assert slowed.without_rate_limit().writes is None and slowed.without_rate_limit().reads is None


def test_the_bucket_model_forwards_to_moto_and_answers_slow_down_past_its_rate(moto_endpoint):
    import threading

    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    from benchmarks.bucket_model import BucketModel, serve
    from support.stores import S3_TEST_KEY, S3_TEST_SECRET

    no_writes = BucketModel(bandwidth=1e9, latency=0.0, writes=1e-9, reads=None)  # one write, then none for years
    server = serve(moto_endpoint, no_writes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        keys = {"aws_access_key_id": S3_TEST_KEY, "aws_secret_access_key": S3_TEST_SECRET, "region_name": "us-east-1"}
        direct = boto3.client("s3", endpoint_url=moto_endpoint, **keys)
        proxied = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
            config=Config(retries={"total_max_attempts": 1, "mode": "standard"}),
            **keys,
        )
        direct.create_bucket(Bucket="bucket-model-test")
        direct.put_object(Bucket="bucket-model-test", Key="run/a", Body=b"x" * 70_000)
        assert proxied.get_object(Bucket="bucket-model-test", Key="run/a")["Body"].read() == b"x" * 70_000
        assert proxied.head_object(Bucket="bucket-model-test", Key="run/a")["ContentLength"] == 70_000
        proxied.put_object(Bucket="bucket-model-test", Key="run/b", Body=b"y" * 70_000)  # the one
        with pytest.raises(ClientError, match="SlowDown"):
            proxied.put_object(Bucket="bucket-model-test", Key="run/c", Body=b"y" * 70_000)
        assert server.limiter.refused == 1 and "Contents" not in direct.list_objects_v2(
            Bucket="bucket-model-test", Prefix="run/c"
        )
    finally:
        server.shutdown()
        server.server_close()
