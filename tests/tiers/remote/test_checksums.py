"""The checksums a store computes of an uploaded shard, computed locally (tiered_ckpt.tiers.remote.checksums),
checked against independent computations with hashlib and crc32c: S3's ETag and composite CRC32C
per part size, GCS's whole-object CRC32C and MD5, Azure's whole-blob MD5."""

import base64
import hashlib
import os

import crc32c
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt.errors import ChecksumMismatchError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.tiers.remote.backends import open_backend
from tiered_ckpt.tiers.remote.checksums import StoreSums, check_source, hash_for_store
from tiered_ckpt.tiers.remote.retry import RetryPolicy

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # as conftest: no gRPC probe

PART = 1000  # small parts keep the files small; the backends cut them as the upload does


def crc(data: bytes) -> str:
    """CRC32C as S3's ChecksumCRC32C and GCS's crc32c carry it: base64 of the 4 big-endian bytes."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def s3_composite(parts: list[bytes]) -> str:
    """S3's ChecksumCRC32C of a multipart object: the CRC32C of the parts' raw digests, then -N."""
    digests = b"".join(crc32c.crc32c(part).to_bytes(4, "big") for part in parts)
    return f"{crc(digests)}-{len(parts)}"


def cut(data: bytes, part: int) -> list[bytes]:
    return [data[start : start + part] for start in range(0, len(data), part)] or [b""]


def shard_file(tmp_path, size, name="rank-00000-of-00001.safetensors", seed=0):
    """A file of ``size`` random bytes and its record (the record's xxh3 is what the checks compare)."""
    data = bytes((seed * 131 + index * 7 + index // 251) % 256 for index in range(size))
    path = tmp_path / name
    path.write_bytes(data)
    record = ShardRecord(
        rank=0, path=name, sha256=hashlib.sha256(data).hexdigest(), xxh3_64=xxhash.xxh3_64(data).hexdigest(),
        size_bytes=size, param_shard_offset=0, param_shard_numel=0,
    )  # fmt: skip
    return path, record, data


def backend(scheme):
    # Opening a client makes no request: the endpoint is never contacted by these tests.
    options = {
        "s3": {"anon": True},
        "gs": {"token": "anon", "project": "test"},
        "az": {"account_name": "devstoreaccount1", "anon": True},
    }[scheme]
    return open_backend(
        f"{scheme}://bucket/run", {**options, "endpoint_url": "http://127.0.0.1:9"},
        retry=RetryPolicy(), part_bytes=PART, part_concurrency=1,
    )  # fmt: skip


# -- hash_for_store ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, PART - 1, PART, PART + 1, 2 * PART, 2 * PART + 1, 5 * PART + 7])
def test_split_gives_the_crc32c_of_each_part_cut_every_chunk(tmp_path, size):
    path, record, data = shard_file(tmp_path, size)
    hashes = hash_for_store(path, record, chunk_bytes=PART, md5=False, split=True)
    assert hashes.crc32c == tuple(crc(part) for part in cut(data, PART))
    assert len(hashes.crc32c) == -(-size // PART) and hashes.md5 is None


@pytest.mark.parametrize("size", [0, 1, PART, 3 * PART + 5])
def test_whole_gives_one_crc32c_and_the_md5_of_every_byte_whatever_the_chunk(tmp_path, size):
    path, record, data = shard_file(tmp_path, size)
    hashes = hash_for_store(path, record, chunk_bytes=PART, md5=True, split=False)
    assert hashes.crc32c == (crc(data),)  # chained over the chunks, not the last chunk's
    assert hashes.md5 == hashlib.md5(data).digest()


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 6000), chunk=st.integers(1, 2500), split=st.booleans(), seed=st.integers(0, 255))
def test_hash_for_store_matches_hashlib_and_crc32c_for_any_size_and_chunk(tmp_path_factory, size, chunk, split, seed):
    path, record, data = shard_file(tmp_path_factory.mktemp("f"), size, seed=seed)
    hashes = hash_for_store(path, record, chunk_bytes=chunk, md5=True, split=split)
    assert hashes.md5 == hashlib.md5(data).digest()
    assert hashes.crc32c == (tuple(crc(part) for part in cut(data, chunk)) if split else (crc(data),))


@pytest.mark.parametrize("split", [False, True])
def test_a_file_that_is_not_its_record_is_refused_before_any_checksum_is_returned(tmp_path, split):
    path, record, data = shard_file(tmp_path, 3 * PART)
    damaged = bytearray(data)
    damaged[PART + 17] ^= 0x01  # one flipped bit, the size unchanged
    path.write_bytes(bytes(damaged))
    with pytest.raises(ChecksumMismatchError, match=rf"{path.name} \(before its upload\): .*xxh3_64"):
        hash_for_store(path, record, chunk_bytes=PART, md5=True, split=split)
    path.write_bytes(data + b"x")
    with pytest.raises(ChecksumMismatchError, match=str(path)):
        hash_for_store(path, record, chunk_bytes=PART, md5=True, split=split)


def test_check_source_passes_the_recorded_bytes_and_refuses_any_other(tmp_path):
    path, record, data = shard_file(tmp_path, 2 * PART + 3)
    check_source(path, record)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0x80]))
    with pytest.raises(ChecksumMismatchError, match=r"before its upload"):
        check_source(path, record)
    path.write_bytes(data[:-1])
    with pytest.raises(ChecksumMismatchError, match="2002 bytes, the manifest records 2003"):
        check_source(path, record)


# -- StoreSums.kept ------------------------------------------------------------------------


def test_kept_is_the_s3_composite_of_the_parts_with_their_count():
    parts = [b"a" * PART, b"b" * PART, b"c" * 10]
    sums = StoreSums(None, tuple(crc(part) for part in parts))
    assert sums.kept == "crc32c:" + s3_composite(parts)
    assert sums.kept.endswith("-3")


def test_kept_of_one_part_is_that_parts_crc32c_without_a_count():
    assert StoreSums('"etag"', (crc(b"whole"),)).kept == "crc32c:" + crc(b"whole")


def test_kept_is_the_gcs_crc32c_or_nothing():
    assert StoreSums("md5", crc32c=crc(b"object")).kept == "crc32c:" + crc(b"object")
    assert StoreSums("md5").kept is None


def test_kept_is_the_azure_md5_where_no_crc32c_is_kept():
    md5 = base64.b64encode(hashlib.md5(b"blob").digest()).decode()
    assert StoreSums(None, md5=md5).kept == "md5:" + md5
    assert StoreSums(None, crc32c=crc(b"blob"), md5=md5).kept == "crc32c:" + crc(b"blob")


# -- the backends' sums ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, PART, 2 * PART - 1])
def test_s3_below_two_parts_is_one_put_the_etag_its_quoted_md5_and_the_whole_crc32c(tmp_path, size):
    path, record, data = shard_file(tmp_path, size)
    sums = backend("s3").sums(path, record)
    assert sums.etag == f'"{hashlib.md5(data).hexdigest()}"'
    assert sums.parts == (crc(data),) and sums.kept == "crc32c:" + crc(data)


@pytest.mark.parametrize("size", [2 * PART, 2 * PART + 1, 7 * PART + 999])
def test_s3_from_two_parts_is_multipart_the_composite_crc32c_per_part_and_no_etag(tmp_path, size):
    path, record, data = shard_file(tmp_path, size)
    sums = backend("s3").sums(path, record)
    parts = cut(data, PART)
    assert sums.etag is None  # a multipart ETag is not an MD5 of the body: not compared
    assert sums.parts == tuple(crc(part) for part in parts)
    assert sums.kept == "crc32c:" + s3_composite(parts) and sums.kept.endswith(f"-{len(parts)}")


@pytest.mark.parametrize("size", [1, 2 * PART, 7 * PART + 999])
def test_gcs_keeps_the_whole_objects_crc32c_and_base64_md5_whatever_its_size(tmp_path, size):
    path, record, data = shard_file(tmp_path, size)
    sums = backend("gs").sums(path, record)
    assert sums.etag == base64.b64encode(hashlib.md5(data).digest()).decode()  # GCS's md5Hash
    assert sums.crc32c == crc(data) and sums.parts == ()
    assert sums.kept == "crc32c:" + crc(data)


@pytest.mark.parametrize("size", [0, 1, 2 * PART, 7 * PART + 999])
def test_azure_keeps_the_whole_blobs_base64_md5_whatever_its_size(tmp_path, size):
    path, record, data = shard_file(tmp_path, size)
    sums = backend("az").sums(path, record)
    assert sums.md5 == base64.b64encode(hashlib.md5(data).digest()).decode()  # the blob's Content-MD5
    assert sums.etag is None and sums.crc32c is None and sums.parts == ()
    assert sums.kept == "md5:" + sums.md5


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_a_backend_never_computes_sums_of_a_damaged_source(tmp_path, scheme):
    path, record, data = shard_file(tmp_path, 3 * PART)
    path.write_bytes(bytes(reversed(data)))
    with pytest.raises(ChecksumMismatchError):
        backend(scheme).sums(path, record)
