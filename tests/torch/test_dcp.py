"""The torch.distributed.checkpoint backend end to end: steps named by checkpoint_id on both
sides, values that need no pickle saved and loaded, and real rank processes with a disk each."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys

import numpy as np
import pytest

from support.dcp_support import failure, run_job
from support.dcp_worker import digests, template, train_state
from tiered_ckpt import CheckpointManager, UsageError
from tiered_ckpt.format.layout import step_dir_name

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys  # noqa: E402

from tiered_ckpt.torch import TieredReader, TieredWriter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")


def loaded(manager: CheckpointManager, checkpoint_id=None, reader_step=None) -> dict:
    state = template()
    dcp.load(state, storage_reader=TieredReader(manager, reader_step), checkpoint_id=checkpoint_id)
    return digests(state)


@pytest.mark.slow
def test_the_torch_package_imports_the_backend_on_first_use_only():
    code = (
        "import sys; import tiered_ckpt.torch as glue; assert 'torch' not in sys.modules, 'eager'; "
        "from tiered_ckpt.torch.dcp_writer import TieredWriter; from tiered_ckpt.torch.dcp_reader import TieredReader; "
        "assert glue.TieredWriter is TieredWriter and glue.TieredReader is TieredReader; "
        "assert sorted(glue.__all__) == ['TieredReader', 'TieredWriter']; "
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    with pytest.raises(AttributeError, match="has no attribute 'Tiered'"):
        import tiered_ckpt.torch as glue

        glue.Tiered  # noqa: B018


@pytest.mark.slow
def test_checkpoint_id_names_the_step_saved_and_the_step_loaded(manager):
    writer = TieredWriter(manager)  # one writer for every step, as with a FileSystemWriter per directory
    saved = {}
    for step, checkpoint_id in ((10, 10), (20, "20")):
        state = train_state(step, 0)
        saved[step] = digests(state)
        dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
    assert manager.steps() == [10, 20] and saved[10] != saved[20]
    assert loaded(manager, 10) == saved[10]  # not the newest: the step named
    assert loaded(manager, "10") == saved[10]
    assert loaded(manager, manager.root / step_dir_name(10)) == saved[10]
    assert loaded(manager, str(manager.root / step_dir_name(20)) + "/") == saved[20]
    assert loaded(manager, reader_step=10) == saved[10]
    assert loaded(manager) == saved[20]  # no step named: the newest
    with pytest.raises(CheckpointException) as caught:
        dcp.save(train_state(20, 0), storage_writer=writer, checkpoint_id=20)  # a step already saved
    assert type(failure(caught)).__name__ == "CheckpointExistsError"


@pytest.mark.parametrize("checkpoint_id", ["latest", "step-10", -1, True, 1.5, " 10", "/elsewhere/step-000000000010"])
def test_a_checkpoint_id_that_names_no_step_is_refused_before_anything_is_read_or_written(manager, checkpoint_id):
    dcp.save({"w": torch.ones(2)}, storage_writer=TieredWriter(manager, 10))
    with pytest.raises(UsageError, match="names no step"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=TieredReader(manager), checkpoint_id=checkpoint_id)
    with pytest.raises(UsageError, match="names no step"):
        dcp.save({"w": torch.ones(2)}, storage_writer=TieredWriter(manager), checkpoint_id=checkpoint_id)
    with pytest.raises(UsageError, match="names no step"):
        TieredReader(manager, checkpoint_id)
    assert manager.steps() == [10]


def test_bytes_bytesio_numpy_and_complex_values_come_back_as_they_were_saved(manager):
    state = {
        "model": {"rope": torch.polar(torch.ones(4, 2), torch.arange(8.0).reshape(4, 2)).to(torch.complex128)},
        "train": {"blob": b"\x00\xff", "io": io.BytesIO(b"titan"), "np": np.arange(6.0).reshape(2, 3),
                  "scalar": np.int16(-3), "complex_np": np.ones(2, np.complex64) * 1j, "list": [1, (2.5, None)]},
    }  # fmt: skip
    dcp.save(state, storage_writer=TieredWriter(manager, 1))
    into = {
        "model": {"rope": torch.zeros(4, 2, dtype=torch.complex128)},
        "train": {"blob": b"", "io": io.BytesIO(), "np": None, "scalar": None, "complex_np": None, "list": None},
    }
    dcp.load(into, storage_reader=TieredReader(manager, 1))
    rope = into["model"]["rope"]
    assert rope.dtype == torch.complex128 and torch.equal(rope, state["model"]["rope"])
    train = into["train"]
    assert type(train["blob"]) is bytes and train["blob"] == b"\x00\xff"
    assert type(train["io"]) is io.BytesIO and train["io"].getvalue() == b"titan"
    assert type(train["np"]) is np.ndarray and np.array_equal(train["np"], state["train"]["np"])
    assert type(train["scalar"]) is np.int16 and train["scalar"] == -3
    assert train["complex_np"].dtype == np.complex64
    assert np.array_equal(train["complex_np"], state["train"]["complex_np"])
    assert train["list"] == [1, (2.5, None)]
    shard = next((manager.root / step_dir_name(1)).glob("*.safetensors"))
    assert b"torch" not in shard.read_bytes()[:64] and b"\x80\x02" not in shard.read_bytes()  # no pickle


@pytest.mark.slow
def test_two_ranks_with_a_disk_each_and_no_bucket_save_and_load_each_step_by_id(tmp_path):
    results = run_job(
        tmp_path,
        [
            {"do": "save", "step": 10},
            {"do": "save", "step": 20},
            {"do": "load", "id": 10, "as": "10"},
            {"do": "load", "id": None, "as": "newest"},
            {"do": "load", "id": "20", "as": "20"},
        ],
    )
    for rank, result in results.items():
        assert "error" not in result, result
        saved = result["saved"]
        other = results[1 - rank]["saved"]["10"]
        assert saved["10"] != saved["20"] and saved["10"]["/extra/rank_note"] != other["/extra/rank_note"]
        assert result["loaded"]["10"] == saved["10"]  # every tensor, value and the rank's own bytes of step 10
        assert result["loaded"]["newest"] == saved["20"] and result["loaded"]["20"] == saved["20"]

    # one process holding both ranks, their shards gathered in one directory, consolidates the step
    step_dir = tmp_path / "nodes" / "rank-0" / step_dir_name(10)
    shutil.copy(next((tmp_path / "nodes" / "rank-1" / step_dir_name(10)).glob("rank-00001-*")), step_dir)
    with CheckpointManager(tmp_path / "nodes" / "rank-0", world_size=2) as manager:
        whole = _load_state_dict_from_keys(storage_reader=TieredReader(manager, 10))
    assert digests(whole) == results[0]["saved"]["10"]  # rank 0's values
