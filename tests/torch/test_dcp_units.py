"""Pieces of the DCP storage backend (tiered_ckpt.torch.dcp) that tests/torch/test_dcp.py does not reach:
a writer on a manager holding several ranks, a checkpoint_id naming a step under the bucket's URL,
a step not written by TieredWriter, the metadata of a save, and paths DCP must never pick it for."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tiered_ckpt import CheckpointManager, RemoteOptions, UsageError
from tiered_ckpt.format.layout import step_dir_name

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from tiered_ckpt.torch import TieredReader, TieredWriter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")


def failure(caught: pytest.ExceptionInfo) -> BaseException:
    """The error a rank raised inside DCP (DCP wraps it in a CheckpointException)."""
    error = caught.value
    if isinstance(error, CheckpointException):
        ((error, _trace),) = error.failures.values()
    return error


def test_a_writer_on_a_manager_holding_several_ranks_is_refused_naming_them(tmp_path):
    # DCP saves one rank per process (a reader may consolidate every rank in one process)
    with CheckpointManager(tmp_path / "ckpt", world_size=2) as manager:
        with pytest.raises(UsageError, match=r"one rank per process.*holds ranks \[0, 1\]"):
            TieredWriter(manager, 1)


def test_a_checkpoint_id_may_name_the_steps_directory_under_the_bucket(tmp_path, memory_url):
    url, options = memory_url
    with CheckpointManager(
        tmp_path / "ckpt", world_size=1, remote=RemoteOptions(url, storage_options=options)
    ) as manager:
        state = {"w": torch.arange(6.0)}
        dcp.save(state, storage_writer=TieredWriter(manager), checkpoint_id=f"{url}/{step_dir_name(7)}")
        assert manager.steps() == [7]
        into = {"w": torch.zeros(6)}
        dcp.load(into, storage_reader=TieredReader(manager), checkpoint_id=f"{url}/{step_dir_name(7)}/")
        assert torch.equal(into["w"], state["w"])
        other = f"memory://another-bucket/run/{step_dir_name(7)}"
        with pytest.raises(UsageError, match=f"names no step of {tmp_path / 'ckpt'} or {url}"):
            TieredReader(manager, other)


def test_a_step_saved_by_manager_save_offers_dcp_no_tensor_and_loads_nothing(manager):
    manager.save(3, {"w": np.arange(4.0)}, blocking=True)
    into = {"w": torch.zeros(4)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(into, storage_reader=TieredReader(manager, 3))
    assert "Missing key in checkpoint state_dict: w" in str(failure(caught))
    assert torch.equal(into["w"], torch.zeros(4))  # nothing of the step was taken for a DCP chunk


def test_read_metadata_rebuilds_each_tensors_dtype_shape_and_chunks_and_each_value_from_the_manifest(manager):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    state = {"a": torch.ones(3, 5, dtype=torch.float16), "b": torch.zeros(7, dtype=torch.int64), "n": 3}
    dcp.save(state, storage_writer=TieredWriter(manager, 2))
    metadata = TieredReader(manager, 2).read_metadata()  # no collective: a call on its own
    a, b, n = (metadata.state_dict_metadata[key] for key in ("a", "b", "n"))
    assert isinstance(a, TensorStorageMetadata) and a.properties.dtype == torch.float16 and a.size == (3, 5)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in a.chunks] == [((0, 0), (3, 5))]
    assert isinstance(b, TensorStorageMetadata) and b.properties.dtype == torch.int64 and b.size == (7,)
    assert isinstance(n, BytesStorageMetadata)
    assert set(metadata.state_dict_metadata) == {"a", "b", "n"}


def test_one_writer_saves_each_step_it_is_reset_to(manager):
    writer = TieredWriter(manager)
    for step in (1, 2):
        dcp.save({"w": torch.full((2,), float(step))}, storage_writer=writer, checkpoint_id=step)
    assert manager.steps() == [1, 2]
    into = {"w": torch.zeros(2)}
    dcp.load(into, storage_reader=TieredReader(manager, 1))
    assert torch.equal(into["w"], torch.ones(2))


@pytest.mark.parametrize("kind", [TieredWriter, TieredReader])
def test_dcp_never_picks_this_backend_for_a_path_on_its_own(kind, tmp_path):
    assert kind.validate_checkpoint_id(str(tmp_path)) is False
    assert kind.validate_checkpoint_id(tmp_path / step_dir_name(1)) is False


def test_a_writer_cannot_be_pickled_and_says_why(manager):
    with pytest.raises(UsageError, match="cannot be sent to another process"):
        pickle.dumps(TieredWriter(manager, 1))
