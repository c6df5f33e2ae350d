import subprocess
import sys


def test_benchmark_runs_every_section_and_prints_its_ratios(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tiered_ckpt.bench", "--size-gib", "0.02", "--remote-size-gib", "0.02"]
        + ["--repeat", "1", "--train-steps", "20", "--params", "200", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    for line in (
        "save / raw write+fsync 2 writers",
        "warm load+verify / sha256 all cores",
        "save(blocking=False) / np.copyto",
        "extra peak RSS / state size",
        "keep_last=1 / no retention (throughput)",
        "upload / boto3 upload_file",
        "save / raw, 1 rank process",
        "save / raw, 4 rank processes",
        "slowdown",
        "structure / save_sharded",
        "structure / load_sharded",
        "save / dcp.save (throughput)",
        "load+verify / dcp.load (throughput)",
        "stall: save(blocking=False) / dcp.async_save",
    ):
        assert line in result.stdout
    assert list(tmp_path.iterdir()) == []  # the benchmark's files are removed
