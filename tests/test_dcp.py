"""The torch.distributed.checkpoint backend: steps named by checkpoint_id, template-free loads,
values that need no pickle, and loads by real rank processes with a disk each."""

from __future__ import annotations

import inspect
import io
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dcp_worker import digests, template, train_state

from conftest import FaultInjectingProxy, launch_ranks, s3_storage_options
from tiered_ckpt import CheckpointManager, InvalidStateError, ShardFormatError, UsageError
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.format.state import ChunkOf

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint import format_utils  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys  # noqa: E402

from tiered_ckpt.torch import TieredReader, TieredWriter  # noqa: E402

WORKER = Path(__file__).resolve().parent / "dcp_worker.py"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")


def failure(caught: pytest.ExceptionInfo) -> BaseException:
    """The error a rank raised inside DCP (DCP wraps it in a CheckpointException)."""
    error = caught.value
    if isinstance(error, CheckpointException):
        ((error, _trace),) = error.failures.values()
    return error


@pytest.fixture
def manager(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", world_size=1) as manager:
        yield manager


def loaded(manager: CheckpointManager, checkpoint_id=None, reader_step=None) -> dict:
    state = template()
    dcp.load(state, storage_reader=TieredReader(manager, reader_step), checkpoint_id=checkpoint_id)
    return digests(state)


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


def test_a_writer_with_no_step_refuses_the_save(manager):
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(2)}, storage_writer=TieredWriter(manager))
    assert isinstance(failure(caught), UsageError) and "no step" in str(failure(caught))
    assert manager.steps() == []


def test_a_loaded_step_that_is_not_committed_names_the_committed_ones(manager):
    dcp.save({"w": torch.ones(2)}, storage_writer=TieredWriter(manager, 10))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(2)}, storage_reader=TieredReader(manager), checkpoint_id=11)
    assert "step 11 is not committed; committed steps: [10]" in str(failure(caught))  # DCP restates it


def test_template_free_loads_give_the_nested_state(manager, tmp_path, monkeypatch):
    state = train_state(10, 0)
    dcp.save(state, storage_writer=TieredWriter(manager, 10))
    expected = digests(state)

    whole = _load_state_dict_from_keys(storage_reader=TieredReader(manager, 10))
    assert sorted(whole) == ["extra", "model", "optim"] and digests(whole) == expected
    assert sorted(whole["optim"]["state"]) == ["0", "1", "2", "3"]  # as DCP's flattening records them
    assert isinstance(whole["optim"]["param_groups"], list)  # a list stays a list (its indices are ints)
    part = _load_state_dict_from_keys({"model", "extra.step"}, storage_reader=TieredReader(manager, 10))
    assert list(part) == ["model", "extra"] and part["extra"] == {"step": 10}
    assert digests(part["model"]) == digests(state["model"])

    # dcp_to_torch_save reads through the reader it is handed (DCP's own names a directory)
    monkeypatch.setattr(format_utils, "FileSystemReader", lambda _directory: TieredReader(manager, 10))
    format_utils.dcp_to_torch_save("step 10", tmp_path / "step10.pt")
    assert digests(torch.load(tmp_path / "step10.pt", weights_only=False)) == expected  # our own file


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


@pytest.mark.parametrize(
    "value, path, problem",
    [
        ({1, 2}, 'state["train"]["odd"]', "builtins.set"),
        (np.array([object()], dtype=object), 'state["train"]["odd"]', "dtype object"),
        ([1, {"x": frozenset()}], 'state["train"]["odd"][1]["x"]', "frozenset"),
    ],
)
def test_a_value_the_reader_could_not_give_back_is_refused_before_anything_is_written(manager, value, path, problem):
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(2), "train": {"odd": value}}, storage_writer=TieredWriter(manager, 1))
    error = failure(caught)
    assert isinstance(error, InvalidStateError) and path in str(error) and problem in str(error), error
    assert manager.steps() == [] and not list(manager.root.glob("step-*"))


def test_read_metadata_takes_no_rank_argument_so_dcp_never_retries_it_on_one_rank_alone():
    # DCP calls read_metadata(rank=...) on a rank whose read_metadata() failed, if it accepts
    # keyword arguments, and then skips the collectives the other ranks run.
    assert list(inspect.signature(TieredReader.read_metadata).parameters) == ["self"]


def test_async_save_in_a_process_is_refused_saying_why(tmp_path):
    result = launch_ranks(WORKER, tmp_path, 1, {"actions": [{"do": "async_save_process", "step": 10}]})[0]
    assert result["error"][0] == "UsageError", result
    assert "AsyncCheckpointerType.PROCESS" in result["error"][1]  # what was refused
    assert "AsyncCheckpointerType.THREAD" in result["error"][1]  # and what works
    assert not list((tmp_path / "nodes" / "rank-0").glob("step-*"))


def run_job(root: Path, actions: list, remote=None) -> dict[int, dict]:
    return launch_ranks(WORKER, root, 2, {"actions": actions}, remote=remote)


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


def test_a_load_right_after_a_save_reads_nothing_another_rank_has_not_uploaded(tmp_path, moto_endpoint, s3_url):
    # no shard upload lands (what else the manager writes to the bucket goes through)
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=0.0, stall=("PUT", "POST"), stall_paths=(".safetensors",))
    try:
        remote = (s3_url[0], s3_storage_options(proxy.endpoint))
        actions = [
            {"do": "save", "step": 10},
            {"do": "load", "id": None, "as": "newest"},
            {"do": "load", "id": 10, "as": "10"},
        ]
        results = run_job(tmp_path, actions, remote=remote)
    finally:
        proxy.close()
    for result in results.values():
        assert "error" not in result, result
        assert result["loaded"]["newest"] == result["saved"]["10"] == result["loaded"]["10"]
        assert result["remote_steps"] == []  # the loads ran with no shard in the bucket


def test_ranks_that_find_different_newest_steps_refuse_the_load_on_every_rank(tmp_path):
    run_job(tmp_path, [{"do": "save", "step": 10}, {"do": "save", "step": 20}])
    shutil.rmtree(tmp_path / "nodes" / "rank-1" / step_dir_name(20))  # rank 1's disk lost step 20
    results = run_job(tmp_path, [{"do": "load", "id": None, "as": "newest"}])
    for result in results.values():
        assert "different steps" in result["error"][1] and "checkpoint_id" in result["error"][1], result
    results = run_job(tmp_path, [{"do": "load", "id": 10, "as": "10"}])
    assert all("error" not in result for result in results.values()), results


def test_a_step_the_writer_of_0_2_saved_loads_its_values_from_rank_0s_shard(tmp_path, file_url):
    actions = [{"do": "save_as_0_2", "step": 5}, {"do": "load_0_2", "id": 5, "as": "5"}]
    for result in run_job(tmp_path, actions, remote=file_url).values():
        assert "error" not in result, result
        assert result["loaded"]["5"] == {"w": [float(i) for i in range(8)], "epoch": 5}


def test_a_chunk_another_writer_saved_is_refused_by_the_reader_naming_it(manager):
    manager.save(1, {"other": ChunkOf(np.ones(2), (4,), (0,))})
    with pytest.raises(ShardFormatError, match="rank 0 of step 1: 'other' is not a chunk written by TieredWriter"):
        TieredReader(manager, 1).read_metadata()


@pytest.mark.parametrize(
    "section, problem",
    [({"tensors": {"w": {"0": ChunkOf(np.ones(3, np.float32), (3,), (0,))}}, "complex": {"w": "complex64"}},
      "'dcp/tensors/w/0' is not the float pairs of a complex tensor"),
     ({"tensors": {}, "complex": {"w": "complex256"}}, "dcp/complex names a dtype other than"),
     ({"tensors": {}, "planner_data": {"w": "w"}}, "dcp/planner_data must map each key to a list")],
)  # fmt: skip
def test_a_shard_that_is_not_what_the_writer_writes_is_refused_naming_the_rank_and_step(manager, section, problem):
    manager.save(3, {"dcp": section})
    with pytest.raises(ShardFormatError, match=f"rank 0 of step 3: {problem}"):
        TieredReader(manager, 3).read_metadata()


def test_a_stored_value_of_an_unknown_kind_is_refused_naming_it_and_nothing_is_unpickled(manager):
    blob = {"pickle": ChunkOf(np.frombuffer(b"\x80\x04N.", np.uint8), (4,), (0,))}
    manager.save(4, {"dcp": {"tensors": {}, "blobs": {"x": blob}, "planner_data": {}}})
    into = {"x": b""}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(into, storage_reader=TieredReader(manager, 4))
    error = failure(caught)
    assert isinstance(error, ShardFormatError) and "rank 0 of step 4: 'x' has unknown kind 'pickle'" in str(error)
    assert into == {"x": b""}
