"""Independent zstd frames (tiered_ckpt/io/zstd_frames.py): any frame reads alone, any range reads
from the frames covering it, a changed byte never reads as the original, and the stream is zstd's."""

import io
import os

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt.errors import ChecksumMismatchError, IncompleteCheckpointError
from tiered_ckpt.io.hashing import Hasher
from tiered_ckpt.io.zstd_frames import (
    FrameCache,
    FrameIndex,
    FramesReader,
    compress_frames,
    decompress_frame,
    frame_lengths,
    raw_frame,
    raw_frame_bytes,
    read_range_into,
)


def weights(count: int, seed: int = 0) -> bytes:
    """fp32 values like trained weights: small-magnitude normal (their exponent bytes compress)."""
    return (np.random.default_rng(seed).standard_normal(count, dtype=np.float32) * 0.02).tobytes()


def compressed(data: bytes, head: int, frame: int) -> tuple[bytes, FrameIndex]:
    out = io.BytesIO()
    lengths = frame_lengths(len(data), head, frame)
    done = compress_frames(io.BytesIO(data), out, lengths)
    assert done.source.size_bytes == len(data) and done.source.xxh3_64 == xxhash.xxh3_64_hexdigest(data)
    assert done.output.size_bytes == len(out.getvalue()) == sum(done.frames)
    return out.getvalue(), FrameIndex(tuple(lengths), done.frames)


def test_frame_lengths_put_the_head_alone_then_equal_frames_then_the_rest():
    assert frame_lengths(0, 10, 100) == []
    assert frame_lengths(50, 10, 100) == [10, 40]
    assert frame_lengths(250, 10, 100) == [10, 100, 100, 40]
    assert frame_lengths(5, 10, 100) == [5]
    assert frame_lengths(210, 10, 100) == [10, 100, 100]


def test_the_stream_is_standard_zstd_and_each_frame_decompresses_alone():
    data = weights(100_000) + os.urandom(70_000) + bytes(60_000)
    stream, index = compressed(data, 1000, 65536)
    whole = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stream), read_across_frames=True).read()
    assert whole == data  # what `zstd -d` gives back
    for number in range(len(index.sizes)):
        frame = stream[index.offsets[number] : index.offsets[number + 1]]
        expected = data[index.starts[number] : index.starts[number + 1]]
        assert decompress_frame(frame, index.lengths[number], "test") == expected
    assert len(stream) < len(data)


def test_incompressible_frames_are_stored_raw_and_compressible_ones_shrink():
    noise, zeros = os.urandom(300_000), bytes(300_000)
    stream, index = compressed(noise + zeros, 300_000, 300_000)
    assert index.sizes[0] == raw_frame_bytes(300_000) == len(raw_frame(noise))  # never larger than raw
    assert index.sizes[1] < 1000
    assert stream[: index.sizes[0]] == raw_frame(noise)


def test_weights_shrink_and_a_frame_of_one_byte_is_raw():
    data = weights(500_000)
    stream, _index = compressed(data, 1, 1 << 20)
    assert len(stream) < 0.95 * len(data)
    assert stream[:14] == raw_frame(data[:1])[:14]


@pytest.mark.parametrize("kind", ["compressed", "raw"])
def test_a_changed_bit_anywhere_in_a_frame_never_decompresses_to_other_bytes(kind):
    data = weights(512) if kind == "compressed" else os.urandom(2048)
    stream, index = compressed(data, len(data), 1 << 20)
    assert (index.sizes[0] < len(data)) == (kind == "compressed")
    refused = 0
    for at in range(len(stream)):
        for flip in (0x01, 0x80):
            changed = bytearray(stream)
            changed[at] ^= flip
            try:
                same = decompress_frame(bytes(changed), len(data), "frame 0") == data
            except ChecksumMismatchError as exc:
                assert "frame 0" in str(exc)
                refused += 1
            else:
                assert same  # a bit zstd's decoder ignores (a table's padding): the bytes are the frame's
    assert refused >= 2 * len(stream) - 4


def test_a_frame_claiming_more_bytes_than_its_index_is_refused_before_decompressing():
    big = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 20))
    with pytest.raises(ChecksumMismatchError, match="declares 1048576 bytes, the index records 10"):
        decompress_frame(big, 10, "test")
    with pytest.raises(ChecksumMismatchError, match="does not decompress"):
        decompress_frame(big + big, 1 << 20, "test")  # two frames where one is recorded


class Fetches:
    """The compressed stream, served by ranged reads that it counts."""

    def __init__(self, stream: bytes) -> None:
        self.stream, self.ranges = stream, []

    def __call__(self, start: int, end: int) -> bytes:
        self.ranges.append((start, end))
        return self.stream[start:end]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_range_reads_exactly_from_the_frames_covering_it(data):
    payload = weights(40_000, seed=1)[:150_001]
    head = data.draw(st.integers(1, 20_000))
    stream, index = compressed(payload, head, 16_384)
    start = data.draw(st.integers(0, len(payload)))
    end = data.draw(st.integers(start, len(payload)))
    verify = data.draw(st.sampled_from(["full", "fast"]))
    fetch = Fetches(stream)
    buffer = bytearray(end - start)
    digest = read_range_into(fetch, index, start, memoryview(buffer), verify, "test")
    assert bytes(buffer) == payload[start:end]
    hasher = Hasher(verify)
    hasher.update(payload[start:end])
    assert digest == (hasher.digest().sha256 if verify == "full" else hasher.digest().xxh3_64)
    covering = index.covering(start, end)
    fetched = sum(stop - begin for begin, stop in fetch.ranges)
    assert fetched == (index.offsets[covering.stop] - index.offsets[covering.start] if covering else 0)
    assert len(fetch.ranges) <= 1  # consecutive frames in one request


def test_a_range_past_the_end_or_a_short_fetch_is_incomplete():
    payload = weights(10_000)
    stream, index = compressed(payload, 100, 16_384)
    with pytest.raises(IncompleteCheckpointError, match="past the end"):
        read_range_into(Fetches(stream), index, len(payload) - 5, memoryview(bytearray(10)), "full", "test")
    with pytest.raises(IncompleteCheckpointError, match="shorter"):
        read_range_into(Fetches(stream[:-3]), index, 0, memoryview(bytearray(len(payload))), "full", "test")


def test_frames_read_once_stay_cached_for_the_next_small_range():
    payload = weights(100_000)
    stream, index = compressed(payload, 100, 65_536)
    fetch, cache = Fetches(stream), (FrameCache(), "stream-1")
    for start in range(100, 65_636, 4096):  # many small arrays in one frame
        buffer = bytearray(100)
        read_range_into(fetch, index, start, memoryview(buffer), "fast", "test", cache)
        assert bytes(buffer) == payload[start : start + 100]
    assert fetch.ranges == [(index.offsets[1], index.offsets[2])]
    other = Fetches(stream)
    read_range_into(other, index, 100, memoryview(bytearray(10)), "fast", "test", (cache[0], "stream-2"))
    assert len(other.ranges) == 1  # another stream's frames are its own


def test_the_cache_holds_at_most_its_bytes():
    cache = FrameCache(max_bytes=1000)
    for number in range(10):
        cache.put(("s", number), bytes(200))
    assert cache.get(("s", 9)) is not None and cache.get(("s", 0)) is None
    cache.put(("s", 99), bytes(600))  # over a quarter of it: not kept
    assert cache.get(("s", 99)) is None


class Reads(io.BytesIO):
    """A source recording the size of each read asked of it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.asked: list[int] = []

    def readinto(self, buffer) -> int:
        self.asked.append(len(buffer))
        return super().readinto(buffer)

    def read(self, size=-1) -> bytes:
        self.asked.append(size)
        return super().read(size)


def test_the_reader_streams_every_frame_in_order_and_refuses_a_short_or_long_stream():
    payload = weights(60_000) + os.urandom(30_000)
    stream, index = compressed(payload, 777, 65_536)
    reader = FramesReader(io.BytesIO(stream), index, "object")
    pieces = []
    while chunk := reader.read(10_000):
        pieces.append(chunk)
    assert b"".join(pieces) == payload
    buffer = bytearray(len(payload) + 10)
    view, got = memoryview(buffer), 0
    reader = FramesReader(io.BytesIO(stream), index, "object")
    while count := reader.readinto(view[got:]):
        got += count
    assert bytes(buffer[:got]) == payload
    source = Reads(stream)
    assert FramesReader(source, index, "object").read() == payload
    assert min(source.asked[:-1]) >= 16 << 20 and source.asked[-1] == 1  # a few large reads, then the end
    with pytest.raises(IncompleteCheckpointError, match="object ends in frame"):
        FramesReader(io.BytesIO(stream[:-1]), index, "object").read()
    with pytest.raises(ChecksumMismatchError, match="longer than its frames"):
        FramesReader(io.BytesIO(stream + b"x"), index, "object").read()


def test_compressing_reads_a_frame_at_a_time_and_hashes_a_longer_source_whole():
    payload = weights(100_000)
    source = Reads(payload)
    done = compress_frames(source, io.BytesIO(), frame_lengths(len(payload) - 10, 1000, 65_536))
    assert max(source.asked) == 65_536  # one frame's buffer, never the whole source
    assert done.source.size_bytes == len(payload) and len(done.frames) == len(
        frame_lengths(len(payload) - 10, 1000, 65_536)
    )
    short = compress_frames(io.BytesIO(payload[:500]), io.BytesIO(), [1000, 1000])
    assert short.source.size_bytes == 500 and short.frames == ()


def test_a_range_read_into_an_unnamed_file_hands_each_frame_over(tmp_path):
    # What a restore into CUDA tensors past the budget reads a compressed object into.
    from tiered_ckpt.io.scratch import paged_array, pages_of

    payload = weights(300_000, seed=2)
    target = paged_array(tmp_path, len(payload) - 100)
    # A first copy (other bytes, other frames), then the next tier's: the first one's pieces are forgotten.
    for data, frame in ((weights(300_000, seed=3), 40_000), (payload, 65_536)):
        stream, index = compressed(data, 1000, frame)
        read_range_into(Fetches(stream), index, 100, memoryview(target.data), "full", "test")
    pages = pages_of(target)
    assert sum(size for size, _digest in pages.backing.filled.values()) == target.size
    out = np.empty(target.size, np.uint8)
    pages.reader().read_into(0, out)
    assert out.tobytes() == payload[100:]
