"""The staging buffers a save copies into (tiered_ckpt.engine.staging)."""

import numpy as np
import pytest

from tests.support.host_device import on_device
from tiered_ckpt.engine.staging import PARALLEL_BYTES, PIECE_BYTES, StagingBuffers, _pieces
from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.shardfile import write_order


def test_staging_buffers_are_reused_and_reallocated_only_when_shapes_change():
    staging = StagingBuffers()
    first = staging.stage([{"a": np.ones(4), "b": np.zeros(2, np.int8)}])
    second = staging.stage([{"a": np.full(4, 2.0), "b": np.ones(2, np.int8)}])
    assert second.states[0]["a"] is first.states[0]["a"] and second.states[0]["b"] is first.states[0]["b"]
    np.testing.assert_array_equal(second.states[0]["a"], np.full(4, 2.0))
    third = staging.stage([{"a": np.ones(5)}])
    assert third.states[0]["a"] is not first.states[0]["a"] and "b" not in third.states[0]
    assert staging.nbytes == 40


@pytest.mark.slow
def test_a_large_state_is_copied_exactly_in_pieces_by_several_threads():
    rng = np.random.default_rng(0)
    big = rng.integers(0, 2**31, PARALLEL_BYTES // 4 + 12_345, dtype=np.int32)  # not a whole number of pieces
    strided = rng.standard_normal((300, 400))[:, ::2]  # not contiguous: copied whole
    scalar = np.array(7, dtype=np.int64)
    staged = StagingBuffers().stage([{"big": big, "strided": strided, "scalar": scalar}, {"other": big[::-1]}])
    np.testing.assert_array_equal(staged.states[0]["big"], big)
    np.testing.assert_array_equal(staged.states[0]["strided"], strided)
    assert staged.states[0]["strided"].flags.c_contiguous and staged.states[0]["scalar"] == 7
    np.testing.assert_array_equal(staged.states[1]["other"], big[::-1])
    assert not np.shares_memory(staged.states[0]["big"], big)


def test_the_pieces_of_an_array_cover_it_once():
    array = np.arange(3 * PIECE_BYTES // 8 + 5, dtype=np.float64)
    buffer = np.empty_like(array)
    pieces = _pieces(buffer, array)
    assert len(pieces) == 4 and sum(target.size for target, _ in pieces) == array.size
    for target, source in pieces:
        np.copyto(target, source)
    np.testing.assert_array_equal(buffer, array)


def test_staging_within_a_budget_copies_the_end_of_each_shard_and_lends_the_rest():
    arrays = {f"a{i}": np.full(1000, i, np.float32) for i in range(6)}  # 4000 bytes each
    buffers = StagingBuffers(budget=9002)
    staged = buffers.stage([arrays])
    order = write_order(arrays)
    assert staged.direct == [frozenset(order[:4])]  # the last two in the file's order fit, and a slice of one more
    assert set(staged.tails[0]) == {order[3]}  # its last 1000 bytes (whole float32s: 250 of them)
    np.testing.assert_array_equal(staged.tails[0][order[3]], arrays[order[3]][-250:].view(np.uint8))
    assert staged.staged_bytes == 9000 and staged.direct_bytes == 15000 and buffers.nbytes == 9000
    for name in order[4:]:
        assert staged.states[0][name] is not arrays[name]
        np.testing.assert_array_equal(staged.states[0][name], arrays[name])
    for name in order[:4]:
        assert staged.states[0][name] is arrays[name]
    everything = StagingBuffers(budget=None).stage([arrays])
    assert everything.direct == [frozenset()] and everything.staged_bytes == 24000


def test_an_array_on_a_device_is_copied_from_its_source_and_a_view_of_one_is_refused():
    array = np.arange(1000, dtype=np.float32)
    stand_in, source = on_device(array)
    staged = StagingBuffers(1 << 20).stage([{"a": stand_in}])
    np.testing.assert_array_equal(staged.states[0]["a"], array)
    assert source.copies == [(0, array.nbytes)] and source.waited == 1
    with pytest.raises(InvalidStateError, match="'a' stands for an array on a device but has no source"):
        StagingBuffers(1 << 20).stage([{"a": stand_in.reshape(10, 100)}])  # a view: its memory is no bytes
