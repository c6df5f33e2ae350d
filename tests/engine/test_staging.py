"""The staging buffers a save copies into (tiered_ckpt.engine.staging)."""

import numpy as np
import pytest

from tiered_ckpt.engine.staging import PARALLEL_BYTES, PIECE_BYTES, StagingBuffers, _pieces


def test_staging_buffers_are_reused_and_reallocated_only_when_shapes_change():
    staging = StagingBuffers()
    first = staging.stage([{"a": np.ones(4), "b": np.zeros(2, np.int8)}])
    second = staging.stage([{"a": np.full(4, 2.0), "b": np.ones(2, np.int8)}])
    assert second[0]["a"] is first[0]["a"] and second[0]["b"] is first[0]["b"]
    np.testing.assert_array_equal(second[0]["a"], np.full(4, 2.0))
    third = staging.stage([{"a": np.ones(5)}])
    assert third[0]["a"] is not first[0]["a"] and "b" not in third[0]
    assert staging.nbytes == 40


@pytest.mark.slow
def test_a_large_state_is_copied_exactly_in_pieces_by_several_threads():
    rng = np.random.default_rng(0)
    big = rng.integers(0, 2**31, PARALLEL_BYTES // 4 + 12_345, dtype=np.int32)  # not a whole number of pieces
    strided = rng.standard_normal((300, 400))[:, ::2]  # not contiguous: copied whole
    scalar = np.array(7, dtype=np.int64)
    staged = StagingBuffers().stage([{"big": big, "strided": strided, "scalar": scalar}, {"other": big[::-1]}])
    np.testing.assert_array_equal(staged[0]["big"], big)
    np.testing.assert_array_equal(staged[0]["strided"], strided)
    assert staged[0]["strided"].flags.c_contiguous and staged[0]["scalar"] == 7
    np.testing.assert_array_equal(staged[1]["other"], big[::-1])
    assert not np.shares_memory(staged[0]["big"], big)


def test_the_pieces_of_an_array_cover_it_once():
    array = np.arange(3 * PIECE_BYTES // 8 + 5, dtype=np.float64)
    buffer = np.empty_like(array)
    pieces = _pieces(buffer, array)
    assert len(pieces) == 4 and sum(target.size for target, _ in pieces) == array.size
    for target, source in pieces:
        np.copyto(target, source)
    np.testing.assert_array_equal(buffer, array)
