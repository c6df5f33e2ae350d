"""io/hashing: every function's checksums are those of hashlib, xxhash and crc32c over the same bytes."""

import base64
import hashlib
import io
import os

import crc32c
import numpy as np
import pytest
import xxhash

from tiered_ckpt.errors import ConfigError
from tiered_ckpt.io import hashing
from tiered_ckpt.io.durable import atomic_write
from tiered_ckpt.io.hashing import (
    CHUNK_BYTES,
    HashedStream,
    Hasher,
    check_verify,
    composite_crc32c,
    copy_and_hash,
    copy_hashing,
    hash_stream,
    hashing_writer,
    part_crc32c,
    read_hashing,
)

# Sizes around the chunk size, so that the last piece is empty, short and whole.
SIZES = [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, 2 * CHUNK_BYTES + 7]


def payload(size: int) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


def sums(data: bytes) -> tuple[int, str, str]:
    return len(data), hashlib.sha256(data).hexdigest(), xxhash.xxh3_64(data).hexdigest()


def test_check_verify_refuses_a_typo():
    check_verify("full")
    check_verify("fast")
    with pytest.raises(ConfigError, match="'ful'"):
        check_verify("ful")


@pytest.mark.parametrize("verify", [None, "full", "fast"])
def test_hasher_computes_only_what_verify_asks(verify):
    data = payload(1000)
    hasher = Hasher(verify)
    hasher.update(data[:10])
    hasher.update(memoryview(data)[10:])
    digest = hasher.digest()
    size, sha, xxh = sums(data)
    assert digest.size_bytes == size
    assert digest.sha256 == ("" if verify == "fast" else sha)
    assert digest.xxh3_64 == ("" if verify == "full" else xxh)


@pytest.mark.parametrize("size", SIZES)
def test_hash_stream_and_copy_and_hash_match_hashlib(size):
    data = payload(size)
    digest = hash_stream(io.BytesIO(data))
    assert (digest.size_bytes, digest.sha256, digest.xxh3_64) == sums(data)
    out = io.BytesIO()
    copied = copy_and_hash(io.BytesIO(data), out, chunk_bytes=CHUNK_BYTES // 3)
    assert out.getvalue() == data and copied == digest


def test_hashing_writer_hashes_what_an_atomic_write_stages(tmp_path):
    data = payload(3 * CHUNK_BYTES + 5)
    hasher = Hasher()

    def write_pieces(out):
        write = hashing_writer(out, hasher)
        for start in range(0, len(data), 100_000):
            write(memoryview(data)[start : start + 100_000])

    atomic_write(tmp_path / "f", write_pieces)
    assert (tmp_path / "f").read_bytes() == data
    digest = hasher.digest()
    assert (digest.size_bytes, digest.sha256, digest.xxh3_64) == sums(data)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("verify", ["full", "fast"])
def test_copy_hashing_and_read_hashing_return_the_asked_checksum(tmp_path, size, verify):
    data = payload(size)
    expected = sums(data)[1 if verify == "full" else 2]
    target = np.zeros(size, np.uint8)
    assert copy_hashing(np.frombuffer(data, np.uint8), target, verify) == expected
    assert target.tobytes() == data
    path = tmp_path / "f"
    path.write_bytes(b"xyz" + data)
    target = np.zeros(size, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_hashing(fd, 3, target, verify) == expected
        assert target.tobytes() == data
        with pytest.raises(OSError, match="file ended at byte"):
            read_hashing(fd, 4, np.zeros(size + 1, np.uint8), verify)
    finally:
        os.close(fd)


def test_hashed_stream_hashes_every_byte_once_in_order():
    data = payload(10_000)
    blocks = iter(memoryview(data)[start : start + 999] for start in range(0, len(data), 999))
    hasher = Hasher()
    stream = HashedStream(blocks, hasher)
    assert stream.take(8) == data[:8]
    target = np.zeros(5000, np.uint8)
    stream.copy_into(target)
    assert target.tobytes() == data[8:5008]
    stream.hash_rest()
    assert stream.take(1) == b""
    assert hasher.digest() == hashing.ShardDigest(*sums(data))
    with pytest.raises(OSError, match="short"):
        HashedStream(iter([memoryview(b"ab")]), Hasher()).copy_into(np.zeros(3, np.uint8))


@pytest.mark.parametrize("rest", ["copied", "hashed"])
def test_hashing_behind_on_a_thread_hashes_every_byte_once_in_order(rest):
    # Pieces small and large, more than a batch of them: the thread starts, batches go over in order.
    data = payload(3 * hashing.CHUNK_BYTES + 12_345)
    blocks = iter(memoryview(data)[start : start + 300_000] for start in range(0, len(data), 300_000))
    stream = HashedStream(blocks, Hasher(), behind=True)
    assert stream.take(8) == data[:8]
    position, targets = 8, []
    for size in [100] * 500 + [2_000_000, 7]:
        target = np.zeros(size, np.uint8)
        stream.copy_into(target)
        targets.append(target)
        position += size
    if rest == "copied":
        stream.copy_into(last := np.zeros(len(data) - position, np.uint8))
        targets.append(last)
    else:
        stream.hash_rest()
    digest = stream.digest()
    stream.close()
    assert digest == hashing.ShardDigest(*sums(data))
    copied = b"".join(target.tobytes() for target in targets)
    assert copied == data[8 : 8 + len(copied)]


def test_crc32c_as_s3_carries_and_composes_it():
    data = payload(3000)
    assert part_crc32c(data) == base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()
    parts = [part_crc32c(data[i : i + 1000]) for i in range(0, 3000, 1000)]
    assert composite_crc32c(parts[:1]) == parts[0]
    joined = b"".join(base64.b64decode(part) for part in parts)
    assert composite_crc32c(parts) == f"{part_crc32c(joined)}-3"


def test_a_ranged_fill_reads_in_pieces_and_hashes_what_it_copied():
    import hashlib

    import numpy as np

    from tiered_ckpt.io.hashing import fill_hashing

    data = bytes(range(256)) * 1000
    asked = []

    def read(start, stop):
        asked.append((start, stop))
        return data[start:stop]

    target = np.empty(len(data) - 100, np.uint8)
    assert fill_hashing(read, 100, target, piece_bytes=60_000) == hashlib.sha256(data[100:]).hexdigest()
    assert target.tobytes() == data[100:] and asked[:2] == [(100, 60_100), (60_100, 120_100)] and len(asked) == 5
    from tiered_ckpt.errors import IncompleteCheckpointError

    with pytest.raises(IncompleteCheckpointError, match="a ranged read: got 60000 of bytes 0-70000"):
        fill_hashing(lambda start, stop: data[start:stop][:60_000] if start else data[:60_000], 0,
                     np.empty(70_000, np.uint8), piece_bytes=70_000)  # fmt: skip
