import numpy as np
import pytest

from conftest import ZERO1_SHARDED_KEYS, assert_states_equal, split_sizes, zero1_states
from tiered_ckpt import CheckpointManager, ReshardError, partition_sizes, save_sharded
from tiered_ckpt.reshard import reshard
from tiered_ckpt.sharded import load_sharded


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
    with CheckpointManager(tmp_path, world_size=4, sharded_keys=ZERO1_SHARDED_KEYS) as manager:
        manager.save(1, zero1_states(world_size=4), blocking=True)
    with CheckpointManager(tmp_path, world_size=8) as manager:
        result = manager.restore(reshard=True)
    assert_states_equal(zero1_states(world_size=8), result.states)


def test_replicated_arrays_must_agree_on_every_rank(tmp_path):
    states = zero1_states(world_size=4)
    states[2]["step"] = np.array(1235, dtype=np.int64)
    manifest = save_sharded(states, tmp_path, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    with pytest.raises(ReshardError, match="replicated key 'step' differs between rank 0 and rank 2"):
        reshard(load_sharded(tmp_path, 4), manifest, 2)


def test_ranks_must_hold_the_same_keys(tmp_path):
    states = zero1_states(world_size=2)
    del states[1]["loss_scale"]
    manifest = save_sharded(states, tmp_path, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    with pytest.raises(ReshardError, match=r"rank 1 holds different keys than rank 0: \['loss_scale'\]"):
        reshard(load_sharded(tmp_path, 2), manifest, 4)


def test_sharded_dtype_must_agree_on_every_rank(tmp_path):
    states = zero1_states(world_size=2)
    states[1]["exp_avg"] = states[1]["exp_avg"].astype(np.float64)
    manifest = save_sharded(states, tmp_path, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    with pytest.raises(ReshardError, match="sharded key 'exp_avg' on rank 1 is float64"):
        reshard(load_sharded(tmp_path, 2), manifest, 3)
