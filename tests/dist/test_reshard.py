import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.states import ZERO1_SHARDED_KEYS, assert_states_equal, split_sizes, zero1_states
from tiered_ckpt import (
    CheckpointManager,
    InvalidStateError,
    ReshardError,
    RuntimeOptions,
    partition_sizes,
    save_sharded,
)
from tiered_ckpt.dist.reshard import copy_overlap, reshard
from tiered_ckpt.format.state import ChunkOf
from tiered_ckpt.oneshot import load_sharded


@pytest.mark.parametrize("total, world_size", [(10, 4), (1003, 3), (7, 8), (0, 2), (12, 1)])
def test_partition_sizes_tile_the_vector_with_the_remainder_first(total, world_size):
    sizes = partition_sizes(total, world_size)
    assert sum(sizes) == total and len(sizes) == world_size
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("old, new", [(4, 8), (8, 4), (4, 3), (3, 4), (4, 1)])
def test_reshard_equals_a_direct_reslice_byte_for_byte(tmp_path, old, new):
    saved = zero1_states(world_size=old)
    manifest = save_sharded(saved, tmp_path, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    resharded = reshard(load_sharded(tmp_path, old), manifest, new)
    direct = zero1_states(world_size=new)  # the same flat vectors, sliced for `new` ranks
    assert [len(state["master_fp32"]) for state in resharded] == split_sizes(1003, new)
    assert_states_equal(direct, resharded)


def test_manager_reshards_4_to_8_on_request(tmp_path):
    with CheckpointManager(tmp_path, world_size=4, runtime=RuntimeOptions(sharded_keys=ZERO1_SHARDED_KEYS)) as manager:
        manager.save(1, zero1_states(world_size=4), blocking=True)
    with CheckpointManager(tmp_path, world_size=8) as manager:
        result = manager.restore(reshard=True)
    assert_states_equal(zero1_states(world_size=8), result.states)


def test_replicated_arrays_must_agree_on_every_rank(tmp_path):
    states = zero1_states(world_size=4)
    states[2]["step"] = np.array(1235, dtype=np.int64)
    manifest = save_sharded(states, tmp_path, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    with pytest.raises(ReshardError, match=r'replicated state\["step"\] differs between rank 0 and rank 2'):
        reshard(load_sharded(tmp_path, 4), manifest, 2)


def test_ranks_must_hold_the_same_keys(tmp_path):
    states = zero1_states(world_size=2)
    del states[1]["loss_scale"]
    manifest = save_sharded(states, tmp_path, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    with pytest.raises(ReshardError, match=r"rank 1 holds different arrays than rank 0: \['loss_scale'\]"):
        reshard(load_sharded(tmp_path, 2), manifest, 4)


def test_sharded_dtype_must_agree_on_every_rank(tmp_path):
    states = zero1_states(world_size=2)
    manifest = save_sharded(states, tmp_path, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    loaded = load_sharded(tmp_path, 2)
    loaded[1]["exp_avg"] = loaded[1]["exp_avg"].astype(np.float64)  # a save refuses such slices: see test_saving.py
    with pytest.raises(ReshardError, match=r'sharded state\["exp_avg"\] on rank 1 is float64'):
        reshard(loaded, manifest, 3)


def nested_zero1(world_size: int, epoch: int = 3) -> list[dict]:
    """ZeRO-1 slices inside a nested training state, with replicated scalars and arrays beside them."""
    return [
        {
            "model": {"flat": flat["master_fp32"]},
            "optim": {
                "state": {0: {"exp_avg": flat["exp_avg"]}},
                "param_groups": [{"lr": 0.001, "betas": (0.9, 0.95), "params": [0]}],
                "step": flat["step"],
            },
            "data": {"epoch": epoch, "seed": 2**70},
        }
        for flat in zero1_states(world_size=world_size)
    ]


NESTED_SHARDED = [("model", "flat"), ("optim", "state", 0, "exp_avg")]


@pytest.mark.parametrize("old, new", [(4, 3), (3, 5)])
def test_flat_slices_inside_a_nested_state_reshard_by_their_paths(tmp_path, old, new):
    with CheckpointManager(tmp_path, world_size=old, runtime=RuntimeOptions(sharded_keys=NESTED_SHARDED)) as manager:
        manifest = manager.save(1, nested_zero1(old), blocking=True).committed.result()
    assert manifest.sharded_keys == ("model/flat", "optim/state/#0/exp_avg")
    with CheckpointManager(tmp_path, world_size=new) as manager:
        result = manager.restore(reshard=True)
    expected = nested_zero1(new)
    for restored, wanted in zip(result.states, expected, strict=True):
        assert restored["model"]["flat"].tobytes() == wanted["model"]["flat"].tobytes()
        assert restored["optim"]["state"][0]["exp_avg"].tobytes() == wanted["optim"]["state"][0]["exp_avg"].tobytes()
        assert restored["optim"]["param_groups"] == wanted["optim"]["param_groups"]
        assert restored["data"] == {"epoch": 3, "seed": 2**70}


def test_a_scalar_that_differs_between_ranks_refuses_to_reshard_naming_its_path(tmp_path):
    states = nested_zero1(2)
    states[1]["data"]["epoch"] = 4
    manifest = save_sharded(states, tmp_path, step=1, sharded_keys=NESTED_SHARDED)
    with pytest.raises(ReshardError, match=r'state\["data"\]\["epoch"\] differs between rank 0 and rank 1'):
        reshard(load_sharded(tmp_path, 2), manifest, 3)
    assert [s["data"]["epoch"] for s in load_sharded(tmp_path, 2)] == [3, 4]  # without resharding it loads


def boxes(shape: tuple[int, ...], cuts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every box of the grid that ``cuts`` (sorted cut points per dimension) makes of ``shape``."""
    import itertools

    edges = [[0, *sorted(set(c for c in dim_cuts if 0 < c < n)), n] for dim_cuts, n in zip(cuts, shape, strict=True)]
    spans = [list(zip(e[:-1], e[1:], strict=True)) for e in edges]
    return [(tuple(a for a, _ in combo), tuple(b - a for a, b in combo)) for combo in itertools.product(*spans)]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_chunks_of_any_grid_refill_any_other_grid_exactly(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    whole = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    old = boxes(shape, [data.draw(st.lists(st.integers(0, n), max_size=3)) for n in shape])
    new = boxes(shape, [data.draw(st.lists(st.integers(0, n), max_size=3)) for n in shape])
    for offsets, sizes in new:
        target = np.full(sizes, -1, np.float32)
        copied = 0
        for source_offsets, source_sizes in old:
            window = tuple(slice(o, o + s) for o, s in zip(source_offsets, source_sizes, strict=True))
            copied += copy_overlap(target, offsets, whole[window], source_offsets)
        assert copied == target.size
        assert target.tobytes() == whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].tobytes()


def test_a_zero_dimensional_chunk_is_read_in_place_and_copied_in_place():
    from tiered_ckpt.dist.reshard import direct_destination
    from tiered_ckpt.format.manifest import ChunkRecord

    target = np.zeros((), np.float32)
    part = direct_destination(target, (), ChunkRecord("step", "F32", (), (), (), "0" * 64))
    assert part is not None
    part[...] = 7.0
    assert float(target) == 7.0  # a view, not a copy
    assert copy_overlap(target, (), np.array(9.0, np.float32), ()) == 1 and float(target) == 9.0


def test_a_restore_into_the_chunks_of_dtensors_alone_gives_back_the_rest_as_each_rank_holds_it(tmp_path):
    whole = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    rows = [(0, 5), (5, 10), (10, 12)]  # rank 2 holds the fewest bytes: it writes the copies ranks share
    moments = np.arange(12, dtype=np.float32)
    states = [
        {
            "weight": ChunkOf(whole[a:b], whole.shape, (a, 0)),
            "moment": ChunkOf(moments[a:b], moments.shape, (a,)),  # a DTensor outside into (an optimizer's)
            "callbacks": {"score": np.full(3, 2.0 if rank == 1 else 1.0), "seed": np.array([rank])},
            "epoch": 7,
        }
        for rank, (a, b) in enumerate(rows)
    ]
    with CheckpointManager(tmp_path, world_size=3) as manager:
        manager.save(1, states, blocking=True)
        assert ("callbacks/score", 2) in manager.restore().manifest.shard(0).replicas  # rank 0's copy, by rank 2
        into = [{"weight": ChunkOf(np.zeros((b - a, 5), np.float32), whole.shape, (a, 0))} for a, b in rows]
        restored = manager.restore(reshard=True, into=into)
        for rank, (state, (a, b)) in enumerate(zip(restored.states, rows, strict=True)):
            assert np.array_equal(into[rank]["weight"].data, whole[a:b])  # filled in place
            assert state["callbacks"]["score"].tolist() == states[rank]["callbacks"]["score"].tolist()
            assert state["callbacks"]["seed"].tolist() == [rank] and state["epoch"] == 7
            assert np.array_equal(state["moment"], moments[a:b])  # this rank's own chunk, on the saved world size
        assert not np.shares_memory(restored.states[0]["callbacks"]["score"], restored.states[2]["callbacks"]["score"])
