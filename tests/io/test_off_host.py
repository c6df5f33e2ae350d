"""Stand-ins for arrays on a device (tiered_ckpt.io.off_host), with a device whose memory is host memory."""

import numpy as np
import pytest

from tests.support.host_device import on_device
from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.shardfile import check_arrays


def test_a_stand_in_has_the_dtype_shape_and_size_but_no_bytes_of_its_own():
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    stand_in, _source = on_device(array)
    assert stand_in.dtype == array.dtype and stand_in.shape == array.shape and stand_in.nbytes == array.nbytes
    assert stand_in.strides == (0, 0, 0) and not stand_in.flags.writeable
    assert check_arrays({"a": stand_in})["a"] is stand_in  # the checks before a write read its dtype and shape


@pytest.mark.parametrize("size", [0, 1, 1000, 4096, 4097, 3 * 4096 + 5])
def test_its_pieces_are_its_bytes_in_order_each_copied_while_the_last_is_used(size):
    array = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    stand_in, source = on_device(array)
    seen = b"".join(bytes(piece) for piece in stand_in.chunks(piece_bytes=4096))
    assert seen == array.tobytes()
    assert source.copies == [(start, min(4096, size - start)) for start in range(0, size, 4096)]
    assert len(source.buffers) == (0 if size == 0 else 2)  # the source's two piece buffers, used in turn


def test_the_next_piece_is_copied_before_the_one_before_is_given():
    stand_in, source = on_device(np.arange(10_000, dtype=np.uint8))
    pieces = stand_in.chunks(piece_bytes=4096)
    next(pieces)
    assert [start for start, _size in source.copies] == [0, 4096]  # the second lands while the first is written


def test_a_view_of_a_stand_in_has_no_bytes_to_copy():
    stand_in, _source = on_device(np.zeros((4, 4), np.float64))
    with pytest.raises(InvalidStateError, match="view of an array on a device"):
        next(stand_in.reshape(-1).chunks())
