"""A step's shards serialized to memory (a step kept in a partner's memory only), byte for byte as on disk."""

import mmap

import numpy as np

from tiered_ckpt.engine.shards import ShardBuffer, serialize_shards, write_shards
from tiered_ckpt.format.shardfile import read_shard_buffer
from tiered_ckpt.format.state import flatten
from tiered_ckpt.tiers.local import LocalTier


def states(step: int, size: int) -> list:
    return [flatten({"w": np.arange(size, dtype=np.float32) * step + rank, "step": step}) for rank in range(2)]


def test_shards_serialized_into_reused_buffers_are_the_bytes_and_records_a_disk_write_makes(tmp_path):
    buffers = {rank: ShardBuffer() for rank in range(2)}
    tier = LocalTier(tmp_path / "disk")
    with tier.lock():
        for step, size in ((1, 50_000), (2, 50_000), (3, 20_000)):  # the same size again, then a smaller one
            serialized = serialize_shards(step, states(step, size), [0, 1], world_size=2, numels=[size, size],
                                          buffers=buffers)  # fmt: skip
            on_disk = write_shards(tier, step, states(step, size), [0, 1], world_size=2, numels=[size, size])
            for (record, data), written in zip(serialized, on_disk, strict=True):
                assert record == written
                assert bytes(data) == tier.shard_path(step, written).read_bytes()
                assert len(data) == record.size_bytes


def test_a_larger_shard_grows_the_buffer_and_reads_back_whole():
    buffers = {0: ShardBuffer(), 1: ShardBuffer()}
    small_record, _small = serialize_shards(
        1, states(1, 1000), [0, 1], world_size=2, numels=[1000] * 2, buffers=buffers
    )[0]
    large_record, large = serialize_shards(2, states(2, 100_000), [0, 1], world_size=2, numels=[100_000] * 2,
                                           buffers=buffers)[0]  # fmt: skip
    contents = read_shard_buffer(large, check=lambda data: large_record.verify(data, "rank 0"), what="rank 0")
    assert np.array_equal(contents.arrays["w"], np.arange(100_000, dtype=np.float32) * 2)
    assert small_record.size_bytes < large_record.size_bytes == len(large)


def test_shards_past_the_room_go_to_unnamed_files_with_the_same_bytes_and_free_their_buffers(tmp_path):
    buffers = {rank: ShardBuffer() for rank in range(2)}
    whole = [(record, bytes(data)) for record, data in serialize_shards(
        1, states(1, 50_000), [0, 1], world_size=2, numels=[50_000] * 2, buffers=buffers)]  # fmt: skip
    assert [buffers[rank].capacity >= len(whole[rank][1]) for rank in range(2)] == [True, True]
    room = len(whole[0][1]) + 1000  # rank 0's shard fits, rank 1's does not
    spills: list[tuple[int, int]] = []
    bounded = serialize_shards(1, states(1, 50_000), [0, 1], world_size=2, numels=[50_000] * 2,
                               buffers=buffers, room=room, spill_dir=tmp_path,
                               on_spill=lambda rank, size: spills.append((rank, size)))  # fmt: skip
    assert spills == [(1, len(whole[1][1]))]  # told, for the writer's WARNING
    for (record, data), (expected, expected_bytes) in zip(bounded, whole, strict=True):
        assert record == expected and bytes(data) == expected_bytes
    assert isinstance(bounded[1][1].obj, mmap.mmap) and not isinstance(bounded[0][1].obj, mmap.mmap)
    assert buffers[1].capacity == 0  # the spilled rank's buffer is freed, the other one kept
    assert buffers[0].capacity >= len(whole[0][1])
    assert list(tmp_path.iterdir()) == []  # the file has no name: a crash leaves nothing behind
    record, data = bounded[1]
    contents = read_shard_buffer(data, check=lambda digest: record.verify(digest, "rank 1"), what="rank 1")
    assert np.array_equal(contents.arrays["w"], np.arange(50_000, dtype=np.float32) + 1)
