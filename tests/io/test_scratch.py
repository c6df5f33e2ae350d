"""A file with no name for bytes a process must not hold (tiered_ckpt.io.scratch), and reading a map
of one a block at a time with its pages let go (tiered_ckpt.io.pages.blocks_of)."""

import sys

import numpy as np
import pytest

from tests.support.smaps import mapping_field
from tiered_ckpt.io.pages import blocks_of, let_go, whole_map
from tiered_ckpt.io.scratch import unnamed_map

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
MIB = 1 << 20


def resident_bytes(array: np.ndarray) -> int:
    """The resident bytes of the mapping that holds ``array``'s first byte."""
    return int(mapping_field(array.__array_interface__["data"][0], "Rss:")[0]) * 1024


def test_a_map_of_a_file_with_no_name_keeps_what_is_written_and_leaves_no_file(tmp_path):
    mapped = unnamed_map(tmp_path, 3 * MIB + 5)
    data = np.frombuffer(mapped, np.uint8)
    expected = np.random.default_rng(1).integers(0, 256, data.size, dtype=np.uint8)
    data[:] = expected
    assert list(tmp_path.iterdir()) == []  # no name, from the start: nothing a crash could leave
    assert let_go(mapped, 0, len(mapped))
    assert np.array_equal(data, expected)  # the file kept the bytes whose pages were let go
    assert whole_map(memoryview(mapped)) is mapped and whole_map(memoryview(mapped)[1:]) is None


def test_a_directory_that_cannot_hold_it_raises_os_error(tmp_path):
    with pytest.raises(OSError):
        unnamed_map(tmp_path / "gone", MIB)


@linux
def test_reading_a_whole_map_a_block_at_a_time_holds_one_block_of_it(tmp_path):
    mapped = unnamed_map(tmp_path, 32 * MIB)
    data = np.frombuffer(mapped, np.uint8)
    data[:] = 7
    let_go(mapped, 0, len(mapped))
    total, most = 0, 0
    for block in blocks_of(memoryview(mapped), MIB, whole_map(memoryview(mapped))):
        total += int(np.frombuffer(block, np.uint8).sum(dtype=np.int64))
        most = max(most, resident_bytes(data))
    assert total == 7 * 32 * MIB
    assert most <= 2 * MIB and resident_bytes(data) == 0  # without letting go: all 32 MiB by the end
