import subprocess
import sys


def test_benchmark_runs_every_section_and_prints_its_ratios(tmp_path):
    (tmp_path / "scratch").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tiered_ckpt.bench", "--size-gib", "0.02", "--remote-size-gib", "0.02"]
        + ["--repeat", "1", "--train-steps", "20", "--params", "200", "--dir", str(tmp_path / "scratch")]
        + ["--plot", str(tmp_path / "peers.png")],
        capture_output=True,
        text=True,
        timeout=600,
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
        "upload / boto3 upload_file",
        "save / min(raw, sha256), 1 process",
        "save / min(raw, sha256), 4 processes",
        "slowdown",
        "structure / save_sharded",
        "structure / load_sharded",
        "save / dcp.save (throughput)",
        "load+verify / dcp.load (throughput)",
        "stall: save(blocking=False) / dcp.async_save",
    ):
        assert line in result.stdout
    rows = [line.split()[0] for line in result.stdout.split("peers:")[1].splitlines()[3:7]]
    assert rows == ["tiered_ckpt", "safetensors", "torch.save", "dcp"]  # this library's row first
    assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "scratch").iterdir()) == []  # the benchmark's files are removed


def test_plotting_without_a_directory_to_write_to_fails_before_measuring(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tiered_ckpt.bench", "--only", "sync", "--plot", str(tmp_path / "no" / "such.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "no directory" in result.stderr
    assert "save_sharded" not in result.stdout
