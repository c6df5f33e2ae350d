"""A file with no name for bytes a process must not hold (tiered_ckpt.io.scratch), reading a map
of one a block at a time with its pages let go (tiered_ckpt.io.pages.blocks_of), and arrays over
one that the hashing reads fill a piece at a time (tiered_ckpt.io.hashing)."""

import hashlib
import os
import sys

import numpy as np
import pytest

from tests.support.smaps import mapping_field
from tiered_ckpt.errors import StorageError
from tiered_ckpt.io.hashing import HashedStream, Hasher, fill_hashing, read_hashing
from tiered_ckpt.io.pages import blocks_of, let_go, whole_map
from tiered_ckpt.io.scratch import Pages, paged_array, pages_of, unnamed_map

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


def test_a_paged_array_and_its_views_name_their_map_and_where_they_start_in_it(tmp_path):
    array = paged_array(tmp_path, 4 * MIB)
    pages = pages_of(array)
    assert len(pages.backing.mapped) == 4 * MIB and pages.offset == 0
    floats = array.view(np.float32).reshape(1024, 1024)
    assert pages_of(floats[512:]) == Pages(pages.backing, 2 * MIB, 2 * MIB)
    given = np.frombuffer(floats[1:].reshape(-1).view(np.uint8).data, np.uint8)
    assert pages_of(given) == Pages(pages.backing, 4096, 4 * MIB - 4096)
    # Arrays that merely inherit the class, or hold other memory, are refused: their pages are not the file's.
    assert pages_of(floats + 1) is None and pages_of(np.zeros(8)) is None
    assert list(tmp_path.iterdir()) == []


@linux
@pytest.mark.parametrize("fill", ["stream", "read", "ranged"])
def test_filling_a_paged_array_hashes_every_byte_and_holds_a_piece_of_it(tmp_path, fill):
    data = np.random.default_rng(2).integers(0, 256, 24 * MIB + 5, dtype=np.uint8)
    path = tmp_path / "source"
    path.write_bytes(data.tobytes())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    target = paged_array(scratch, data.size - 5)
    if fill == "stream":  # after an array of the caller's, hashed behind on a thread
        blocks = iter(memoryview(data)[start : start + MIB] for start in range(0, data.size, MIB))
        stream = HashedStream(blocks, Hasher(), behind=True)
        stream.copy_into(head := np.zeros(5, np.uint8))
        stream.copy_into(target)
        digest, expected = stream.digest().sha256, hashlib.sha256(data.tobytes()).hexdigest()
        stream.close()
        assert np.array_equal(head, data[:5])
    else:  # ranged reads take their target as np.frombuffer of its bytes
        given = np.frombuffer(target.data, np.uint8)
        if fill == "read":
            with open(path, "rb") as source:
                digest = read_hashing(source.fileno(), 5, given)
        else:
            raw = data.tobytes()
            digest = fill_hashing(lambda start, stop: raw[start:stop], 5, given, piece_bytes=4 * MIB)
        expected = hashlib.sha256(data[5:].tobytes()).hexdigest()
    assert resident_bytes(target) <= 4 * MIB + 4096  # without letting go: all 24 MiB
    assert digest == expected and np.array_equal(target, data[5:])


@pytest.mark.parametrize("damage", [None, "changed", "short"])
def test_the_bytes_read_back_are_those_handed_over_or_an_error_names_the_directory(tmp_path, damage):
    data = np.random.default_rng(3).integers(0, 256, 5 * MIB + 11, dtype=np.uint8)
    target = paged_array(tmp_path, data.size)
    pages = pages_of(target)
    for start in range(0, data.size, 3 * MIB // 2):  # handed over in pieces of one size ...
        piece = target[start : start + 3 * MIB // 2]
        piece[:] = data[start : start + piece.size]
        pages.filled(start, piece.data)
    fd = pages.backing.file.fileno()
    if damage == "changed":  # what the disk gives back is not what was verified
        os.pwrite(fd, b"\xff\x00", 4 * MIB)
    elif damage == "short":
        os.ftruncate(fd, 4 * MIB)
    reader, out = pages.reader(), np.empty(data.size, np.uint8)
    starts = range(0, data.size, MIB)  # ... read back in pieces of another
    if damage is None:
        for start in starts:
            reader.read_into(start, out[start : start + MIB])
        assert np.array_equal(out, data)
        return
    with pytest.raises(StorageError, match=f"an unnamed file in {tmp_path}") as raised:
        for start in starts:
            reader.read_into(start, out[start : start + MIB])
    assert ("differ from those verified" if damage == "changed" else "could not be read back") in str(raised.value)


def test_arrays_sharing_an_unnamed_file_read_back_their_own_pieces_only(tmp_path):
    shared = paged_array(tmp_path, 3 * MIB)
    first, second = shared[: MIB + 5], shared[2 * MIB :]
    for array, value in ((first, 1), (second, 2)):
        array[:] = value
        pages_of(array).filled(0, array.data)
    out = np.empty(MIB, np.uint8)
    pages_of(second).reader().read_into(0, out)
    assert (out == 2).all()


def test_an_array_filled_again_reads_back_what_the_second_fill_verified(tmp_path):
    # A copy that failed to verify, then the next tier's, cut in pieces elsewhere.
    target = paged_array(tmp_path, 3 * MIB + 7)
    bad = np.zeros(target.size, np.uint8)
    good = np.random.default_rng(4).integers(0, 256, target.size, dtype=np.uint8)
    for data, block in ((bad, MIB), (good, 700_000)):
        blocks = iter(memoryview(data)[start : start + block] for start in range(0, data.size, block))
        HashedStream(blocks, Hasher()).copy_into(target)
    out = np.empty(target.size, np.uint8)
    pages_of(target).reader().read_into(0, out)
    assert np.array_equal(out, good)
