"""A large object read in order over several connections (tiered_ckpt/tiers/remote/readahead.py)."""

import hashlib
import threading

import numpy as np
import pytest

from tiered_ckpt import save_sharded
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.remote.backends.fsspec import READ_PART_BYTES
from tiered_ckpt.tiers.remote.readahead import ReadAhead
from tiered_ckpt.tiers.remote.tier import RemoteTier

DATA = np.random.default_rng(7).integers(0, 256, 1000, dtype=np.uint8).tobytes()


class Ranges:
    """``fetch`` over DATA, recording each range asked and the most ranges in flight at once."""

    def __init__(self, fail_at: int | None = None, short_at: int | None = None) -> None:
        self.asked: list[tuple[int, int]] = []
        self.in_flight = self.most = 0
        self.fail_at, self.short_at = fail_at, short_at
        self._lock = threading.Lock()

    def __call__(self, start: int, stop: int) -> bytes:
        with self._lock:
            self.asked.append((start, stop))
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            if start == self.fail_at:
                raise OSError("connection reset (injected)")
            return DATA[start : stop - 10] if start == self.short_at else DATA[start:stop]
        finally:
            with self._lock:
                self.in_flight -= 1


def test_the_reader_gets_the_object_in_order_from_ranges_read_a_window_ahead():
    fetch = Ranges()
    with ReadAhead(fetch, len(DATA), 64, window=4) as stream:
        assert stream.size == len(DATA) and stream.read(1) == DATA[:1]
        assert stream.read(300) == DATA[1:301]  # whole, across ranges, as a buffered file reads
        got = DATA[:301] + stream.read()
    assert got == DATA
    assert sorted(fetch.asked) == [(start, min(start + 64, len(DATA))) for start in range(0, len(DATA), 64)]
    assert 1 <= fetch.most <= 4
    assert stream.closed
    with pytest.raises(ValueError, match="closed"):
        stream.read(1)


def test_a_failed_range_raises_where_the_reader_reaches_it_and_a_short_one_ends_the_stream():
    with ReadAhead(Ranges(fail_at=128), len(DATA), 64, window=3) as stream:
        assert stream.read(128) == DATA[:128]  # the ranges before it arrive whole
        with pytest.raises(OSError, match="injected"):
            stream.read(1)
        with pytest.raises(OSError, match="injected"):
            stream.read(1)  # the stream stays failed: no range is skipped
    with ReadAhead(Ranges(short_at=192), len(DATA), 64, window=3) as stream:
        got = stream.read()
    assert got == DATA[: 192 + 54]  # an object cut under the read: the reader finds it short


@pytest.mark.slow
def test_a_shard_of_several_ranges_downloads_verified_from_s3_and_a_changed_byte_is_caught(tmp_path, s3_url):
    state = {"w": np.random.default_rng(1).standard_normal((5 * READ_PART_BYTES) // 8 + 123)}
    manifest = save_sharded([state], tmp_path / step_dir_name(1), step=1)
    record = manifest.shard(0)
    tier = RemoteTier(*s3_url)
    tier.land_shard(1, record, ShardSource(path=tmp_path / step_dir_name(1) / record.path))
    key = f"{tier.backend.root}/{step_dir_name(1)}/{record.path}"
    with tier.backend.open(key) as stream:
        assert isinstance(stream, ReadAhead) and stream.size == record.size_bytes
    assert tier.check_shard(1, record) is None
    streamed = tier.open_shard(1, record, lambda source: hashlib.sha256(source.read()).hexdigest())
    assert streamed == record.sha256  # read whole in one call, as the reader asked
    data = bytearray(tier.backend.read(key))
    data[3 * READ_PART_BYTES + 5] ^= 0xFF  # a byte in the fourth range
    tier.backend.put_bytes(key, bytes(data))
    assert "sha256" in (tier.check_shard(1, record) or "")


@pytest.mark.slow
def test_an_object_replaced_while_it_is_read_is_read_again_and_found_short(tmp_path, s3_url):
    """Each range asks for the object the read opened (S3: If-Match its ETag), as the stream of
    one connection did: a shard cut under the read fails it, and the read tried again finds it short."""
    from tiered_ckpt import IncompleteCheckpointError

    state = {"w": np.random.default_rng(2).standard_normal((5 * READ_PART_BYTES) // 8)}
    manifest = save_sharded([state], tmp_path / step_dir_name(1), step=1)
    record = manifest.shard(0)
    tier = RemoteTier(*s3_url, part_concurrency=2)
    tier.land_shard(1, record, ShardSource(path=tmp_path / step_dir_name(1) / record.path))
    key = f"{tier.backend.root}/{step_dir_name(1)}/{record.path}"
    whole, tries = tier.backend.read(key), []

    def consume(source):
        tries.append(source.read(1))
        if len(tries) == 1:
            tier.backend.put_bytes(key, whole[: 3 * READ_PART_BYTES])  # cut at a range's boundary
        while source.read(1 << 20):
            pass

    with pytest.raises(IncompleteCheckpointError, match=r"the object has 25165824 bytes, the manifest records"):
        tier.open_shard(1, record, consume)
    assert len(tries) == 1  # the second try refused the object by its size before reading it
