"""What a restore gives back (tiered_ckpt.engine.restore_result): the result and how its ranks and tiers read."""

from dataclasses import replace

import numpy as np
import pytest

from tiered_ckpt import CheckpointManager, UsageError
from tiered_ckpt.engine.restore_result import by_tier, on_devices, rank_ranges


def test_rank_ranges_are_short_runs():
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert rank_ranges(range(1024)) == "0-1023"
    assert rank_ranges([]) == "-"


def test_by_tier_lists_each_tier_once_with_its_ranks_as_runs():
    assert by_tier({0: "local", 1: "local", 2: "local", 3: "remote", 5: "local"}) == "{local: 0-2,5, remote: 3}"
    assert by_tier({}) == "{}"


def test_state_is_the_one_rank_and_a_result_of_many_ranks_says_to_use_states(tmp_path):
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(4, [{"w": np.arange(3, dtype=np.float32) + rank} for rank in range(2)], blocking=True)
        both = manager.restore()
    with pytest.raises(UsageError, match=r"^this result holds 2 ranks; use \.states$"):
        _ = both.state
    # the result one process of a job of one process per rank gets: its rank only
    one = replace(both, states=both.states[1:], sources={1: "remote"}, ranks=(1,), flat=both.flat[1:], bytes_read=0)
    assert one.state["w"].tolist() == [1.0, 2.0, 3.0]
    assert one.torch_state()["w"].tolist() == [1.0, 2.0, 3.0]
    assert repr(one) == "RestoreResult(step=4, ranks=1, sources={remote: 1}, arrays=1, nbytes=12, bytes_read=0)"


def test_the_host_arrays_that_stood_in_for_device_tensors_are_replaced_by_them(tmp_path):
    state = {"w": np.arange(4, dtype=np.float32), "nested": [{"b": np.ones(2, np.float32)}, (np.zeros(1),)], "n": 3}
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, state, blocking=True)
        result = manager.restore()
    tensors = {"w": object(), "b": object()}  # what a restore into CUDA tensors copied them to
    placed = {id(result.state["w"]): tensors["w"], id(result.state["nested"][0]["b"]): tensors["b"]}
    swapped = on_devices(result, lambda value: placed.get(id(value)))
    assert swapped.state["w"] is tensors["w"] and swapped.state["nested"][0]["b"] is tensors["b"]
    assert swapped.flat[0].arrays["w"] is tensors["w"] and swapped.state["n"] == 3
    assert type(swapped.state["nested"][1]) is tuple and swapped.state["nested"][1][0] is result.state["nested"][1][0]
    assert on_devices(result, lambda value: None).states == result.states
