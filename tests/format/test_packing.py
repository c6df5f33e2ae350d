"""Shards of many small arrays: gathered writes, per-array digests, and loads into views of shared blocks."""

import hashlib
import io
import json
import os

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import xxhash

from tiered_ckpt import ChecksumMismatchError, StorageError
from tiered_ckpt.format import packing
from tiered_ckpt.format.packing import GATHER_BYTES, SMALL_ARRAY_BYTES, Placed, fill_arrays, write_arrays
from tiered_ckpt.format.shardfile import header_of, read_shard_file, write_shard
from tiered_ckpt.io.hashing import HashedStream, Hasher
from tiered_ckpt.io.pages import blocks_of
from tiered_ckpt.io.scratch import paged_array, pages_of
from tiered_ckpt.oneshot import load_sharded, save_sharded


def mixed_state() -> dict[str, np.ndarray]:
    """Small arrays of every kind the writer treats apart, around large ones, in runs longer than a block."""
    rng = np.random.default_rng(3)
    state: dict[str, np.ndarray] = {
        f"small.{i}": rng.standard_normal(300 + i % 7, dtype=np.float32) for i in range(1900)
    }
    state |= {f"half.{i}": rng.standard_normal(33, dtype=np.float32).astype(ml_dtypes.bfloat16) for i in range(50)}
    state |= {f"flag.{i}": rng.integers(0, 2, size=i % 5).astype(bool) for i in range(50)}  # some empty
    state["scalar"] = np.array(2.5, np.float64)
    state["empty"] = np.zeros((0, 3), np.int64)
    state["big_endian"] = np.arange(10, dtype=">i4")
    state["strided"] = np.arange(40, dtype=np.int16)[::2]
    state["at_the_limit"] = rng.standard_normal(SMALL_ARRAY_BYTES // 4, dtype=np.float32)
    state["large"] = rng.standard_normal(SMALL_ARRAY_BYTES // 4 + 1, dtype=np.float32)
    return state


def test_many_small_arrays_round_trip_byte_for_byte_and_load_with_safetensors(tmp_path):
    state = mixed_state()
    assert sum(a.nbytes for a in state.values() if a.nbytes <= SMALL_ARRAY_BYTES) > 2 * GATHER_BYTES
    save_sharded([state], tmp_path / "ckpt", step=1, sharded_keys=())
    (loaded,) = load_sharded(tmp_path / "ckpt", 1)
    (shard,) = (tmp_path / "ckpt").glob("rank-*")
    theirs = safetensors.numpy.load_file(shard)  # the format is unchanged: any safetensors reader opens it
    assert sorted(loaded) == sorted(state) == sorted(theirs)
    for name, array in state.items():
        assert loaded[name].dtype == array.dtype.newbyteorder("<") and loaded[name].shape == array.shape, name
        assert loaded[name].tobytes() == np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes(), name
        assert theirs[name].tobytes() == loaded[name].tobytes(), name


@pytest.mark.parametrize("cold", [False, True])
def test_loaded_small_arrays_are_writable_aligned_and_share_no_byte(tmp_path, cold):
    state = mixed_state()
    save_sharded([state], tmp_path / "ckpt", step=1, sharded_keys=())
    if cold:  # read past the page cache, by the reader's thread, instead of through a memory map
        (shard,) = (tmp_path / "ckpt").glob("rank-*")
        fd = os.open(shard, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    (loaded,) = load_sharded(tmp_path / "ckpt", 1)
    arrays = list(loaded.values())
    assert any(array.base is not None for array in arrays)  # small ones are views of a shared block
    spans = []
    for array in arrays:
        assert array.flags.writeable and array.flags.aligned and array.flags.c_contiguous
        if array.base is not None:
            assert array.base.nbytes <= GATHER_BYTES  # keeping one alive keeps at most one block
        if array.nbytes:
            start = array.__array_interface__["data"][0]
            spans.append((start, start + array.nbytes))
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))
    before = {name: array.copy() for name, array in loaded.items()}
    loaded["small.5"][:] = 7
    assert all(np.array_equal(loaded[name], before[name]) for name in loaded if name != "small.5")
    assert (loaded["small.5"] == 7).all()


@pytest.mark.parametrize("cold", [False, True])
def test_small_arrays_fill_the_callers_arrays_byte_for_byte(tmp_path, cold):
    """Into given arrays, runs of small ones read as blocks: each filled with its own bytes, in place."""
    state = mixed_state()
    save_sharded([state], tmp_path / "ckpt", step=1, sharded_keys=())
    if cold:
        (shard,) = (tmp_path / "ckpt").glob("rank-*")
        fd = os.open(shard, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    into = {name: np.full(array.shape, 1, array.dtype.newbyteorder("<")) for name, array in state.items()}
    kept = {name: array.__array_interface__["data"][0] for name, array in into.items()}
    (loaded,) = load_sharded(tmp_path / "ckpt", 1, into=[into])
    for name, array in state.items():
        assert loaded[name] is into[name] and into[name].__array_interface__["data"][0] == kept[name], name
        assert into[name].tobytes() == np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes(), name


@pytest.mark.parametrize("nbytes", [4096, 1 << 20])
def test_small_arrays_filled_over_an_unnamed_file_are_checked_when_read_back(tmp_path, nbytes):
    """A target over an unnamed file (a restore into CUDA tensors past the budget) records what
    was verified of each piece, small arrays too: bytes lost there are refused when read back."""
    count = nbytes // 4
    state = {"a": np.arange(count, dtype=np.float32), "b": np.arange(count, dtype=np.float32) * 2}
    save_sharded([state], tmp_path / "ckpt", step=1)
    arena = paged_array(tmp_path, 4 * nbytes)
    into = {"a": arena[:nbytes].view(np.float32), "b": arena[2 * nbytes : 3 * nbytes].view(np.float32)}
    load_sharded(tmp_path / "ckpt", 1, into=[into])
    assert into["b"].tobytes() == state["b"].tobytes()
    os.pwrite(pages_of(into["a"]).backing.file.fileno(), b"\xff", 10)
    with pytest.raises(StorageError, match="differ from those verified"):
        pages_of(into["a"].reshape(-1).view(np.uint8)).reader().read_into(0, np.empty(nbytes, np.uint8))


class _CountingStream(HashedStream):
    """Counts the bytes copied since the hashing thread last caught up: what a fill holds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unhashed = self.most = 0

    def copy_into(self, target):
        super().copy_into(target)
        self.unhashed += target.nbytes
        self.most = max(self.most, self.unhashed)

    def settle(self):
        super().settle()
        self.unhashed = 0


def test_a_fill_of_small_arrays_holds_a_bounded_number_of_blocks_unhashed():
    """The hashing thread keeps each block until it has hashed it: the fill waits for it every few."""
    arrays = [np.full(16 << 10, i % 251, np.uint8) for i in range(40 * GATHER_BYTES // (16 << 10))]  # 40 MiB, small
    entries, offset = [], 0
    for i, array in enumerate(arrays):
        entries.append(Placed(f"w{i}", array.dtype, array.shape, offset, offset + array.nbytes))
        offset += array.nbytes
    data = memoryview(b"".join(array.tobytes() for array in arrays))
    stream = _CountingStream(blocks_of(data, 4 * GATHER_BYTES), Hasher(None), behind=True)
    targets = {entry.name: np.zeros(entry.shape, np.uint8) for entry in entries}
    try:
        fill_arrays(stream, entries, targets)
        digest = stream.digest()
    finally:
        stream.close()
    assert digest.sha256 == hashlib.sha256(data).hexdigest()
    assert all(np.array_equal(targets[f"w{i}"], array) for i, array in enumerate(arrays))
    assert 0 < stream.most <= packing._UNHASHED_BYTES


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("verify", ["full", "fast"])
def test_a_flipped_byte_in_a_small_array_names_the_shard(tmp_path, verify, into):
    state = {f"w.{i}": np.full(100, i, np.float32) for i in range(3000)}
    save_sharded([state], tmp_path / "ckpt", step=1, sharded_keys=())
    (shard,) = (tmp_path / "ckpt").glob("rank-*")
    data = bytearray(shard.read_bytes())
    data[-400 * 1500] ^= 0x01  # inside the bytes of w.1500, well past the header
    shard.write_bytes(bytes(data))
    given = [{name: np.zeros(100, np.float32) for name in state}] if into else None  # filled from blocks, or new
    with pytest.raises(ChecksumMismatchError, match=f"rank 0 shard {shard}"):
        load_sharded(tmp_path / "ckpt", 1, verify=verify, into=given)


@pytest.mark.parametrize("parts", ["xxh3", "both"])
def test_each_arrays_digest_is_that_of_its_own_bytes(parts):
    state = mixed_state()
    names = sorted(state)
    written = bytearray()
    digests = write_arrays(lambda piece: written.extend(piece), [state[n] for n in names], names, parts)
    expected = b"".join(np.ascontiguousarray(state[n], state[n].dtype.newbyteorder("<")).tobytes() for n in names)
    assert bytes(written) == expected
    for name in names:
        raw = np.ascontiguousarray(state[name], state[name].dtype.newbyteorder("<")).tobytes()
        hasher = Hasher(None if parts == "both" else "fast")
        hasher.update(raw)
        assert digests[name].xxh3_64 == xxhash.xxh3_64_hexdigest(raw) == hasher.digest().xxh3_64, name
        assert digests[name].sha256 == (hashlib.sha256(raw).hexdigest() if parts == "both" else ""), name
        assert digests[name].size_bytes == len(raw)


def test_the_manifest_records_each_small_arrays_xxh3(tmp_path):
    state = {f"w.{i}": np.full(50, i, np.int32) for i in range(200)}
    manifest = save_sharded([state], tmp_path / "ckpt", step=1, sharded_keys=())
    recorded = manifest.shard(0).array_digests(state)
    assert recorded == {name: xxhash.xxh3_64_hexdigest(array.tobytes()) for name, array in state.items()}


def test_a_foreign_shard_with_an_unaligned_small_array_loads_it_aligned(tmp_path):
    # Another writer may place a float32 right after 3 bytes: it must not come back as an unaligned view.
    tensors = [("a", "U8", (3,)), ("b", "F32", (2,)), ("c", "U8", (1,))]
    values = np.array([1.5, -2.0], "<f4").tobytes()
    data = header_of(tensors) + b"\x01\x02\x03" + values + b"\x09"
    path = tmp_path / "foreign.safetensors"
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()

    def check(digest):
        assert digest.sha256 == expected

    with open(path, "rb") as source:
        arrays = read_shard_file(source, check=check, what="foreign").arrays
    assert arrays["b"].flags.aligned and arrays["b"].tolist() == [1.5, -2.0]
    assert arrays["a"].tolist() == [1, 2, 3] and arrays["c"].tolist() == [9]


def test_the_header_is_the_json_json_dumps_makes():
    odd = ['q"uote', "back\\slash", "ctrl\x01", "ünï", "emoji\U0001f600", "a/b", "sp ace"]
    arrays = {name: np.zeros(i + 1, np.float32) for i, name in enumerate(odd)}
    out = io.BytesIO()
    metadata = {"k\x02": 'v"\u00e9'}
    digest = write_shard(out, arrays, metadata)
    raw = out.getvalue()[8 : digest.header_bytes].rstrip(b" ")
    document = json.loads(raw)
    assert raw.decode() == json.dumps(document, separators=(",", ":"))
    assert document["__metadata__"] == metadata and set(document) - {"__metadata__"} == set(odd)


@pytest.mark.parametrize("tail_bytes", [4, SMALL_ARRAY_BYTES // 2, 3 * SMALL_ARRAY_BYTES])
def test_an_arrays_tail_written_from_elsewhere_gives_the_same_bytes_and_digests(tail_bytes):
    arrays = [np.arange(SMALL_ARRAY_BYTES, dtype=np.float32), np.arange(10, dtype=np.int16)]
    names = ["big", "small"]
    plain, split = io.BytesIO(), io.BytesIO()
    expected = write_arrays(lambda chunk: plain.write(chunk), arrays, names, "both")
    tail = arrays[0].view(np.uint8)[-tail_bytes:].copy()
    arrays[0].view(np.uint8)[-tail_bytes:] = 0  # what the caller's memory holds now: the tail must come from the copy
    done: list[tuple[str, int]] = []
    digests = write_arrays(
        lambda chunk: split.write(chunk),
        arrays,
        names,
        "both",
        done_with=lambda name: done.append((name, split.tell())),
        tails={"big": tail},
    )
    assert split.getvalue() == plain.getvalue() and digests == expected
    # the caller's array is let go once its bytes before the tail are out, before the tail is written
    assert done[0] == ("big", arrays[0].nbytes - tail_bytes) and [name for name, _ in done] == names
