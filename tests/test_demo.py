import subprocess
import sys


def test_demo_resumes_after_sigkill_and_a_lost_disk_bit_for_bit(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tiered_ckpt", "demo", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "died with signal 9 (SIGKILL) at step 34" in out
    assert "deleted 2 shard files" in out
    assert "resumed at step 30; shards from: {0: 'local', 1: 'local', 2: 'remote', 3: 'local'}" in out
    assert "loss curves are bit-for-bit identical" in out
