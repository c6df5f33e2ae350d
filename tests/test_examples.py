import subprocess
import sys
from pathlib import Path

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
