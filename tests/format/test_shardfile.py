import hashlib
import io
import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt import ChecksumMismatchError, InvalidStateError, ShardFormatError
from tiered_ckpt.format import shardfile
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.format.shardfile import (
    DTYPES,
    header_length,
    header_problem,
    json_length_bound,
    read_shard_file,
    write_shard,
)
from tiered_ckpt.io.hashing import ShardDigest


def write_to_bytes(arrays, metadata=None) -> tuple[bytes, ShardDigest]:
    out = io.BytesIO()
    digest = write_shard(out, arrays, metadata)
    return out.getvalue(), digest


@pytest.fixture
def read_from_bytes(tmp_path):
    """Return a function that puts bytes in a file and reads them back as a shard."""

    def read(data: bytes, digest: ShardDigest, verify="full"):
        path = tmp_path / "shard.safetensors"
        path.write_bytes(data)
        record = ShardRecord(0, "shard.safetensors", digest.sha256, digest.xxh3_64, digest.size_bytes, 0, 0)
        with open(path, "rb") as source:
            return read_shard_file(
                source, check=lambda got: record.verify(got, "test shard"), verify=verify, what="test shard"
            ).arrays

    return read


def sample(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    raw = np.random.default_rng(7).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.dtype(bool):
        return (raw % 2).astype(bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("code", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 0, 2), (2, 3, 4)])
def test_every_dtype_and_shape_round_trips_byte_for_byte(code, shape, read_from_bytes):
    array = sample(DTYPES[code], shape)
    data, digest = write_to_bytes({"x": array})
    [(name, got)] = read_from_bytes(data, digest).items()
    assert name == "x" and got.dtype == array.dtype and got.shape == shape
    assert got.tobytes() == array.tobytes()


def test_digest_covers_every_byte_written_and_measures_the_header():
    data, digest = write_to_bytes({"a": np.arange(10.0), "b": np.ones((2, 2), np.float16)})
    (length,) = struct.unpack("<Q", data[:8])
    header = data[: 8 + length]
    assert digest == ShardDigest(
        len(data),
        hashlib.sha256(data).hexdigest(),
        xxhash.xxh3_64(data).hexdigest(),
        header_bytes=len(header),
        header_sha256=hashlib.sha256(header).hexdigest(),
    )


def test_part_digests_hash_each_array_on_its_own():
    arrays = {"a": np.arange(10.0), "b": np.ones((2, 2), np.float16)}
    out = io.BytesIO()
    digest = write_shard(out, arrays, part_digests="both")
    assert {name: (d.size_bytes, d.sha256, d.xxh3_64) for name, d in digest.arrays.items()} == {
        name: (array.nbytes, hashlib.sha256(array.tobytes()).hexdigest(), xxhash.xxh3_64(array.tobytes()).hexdigest())
        for name, array in arrays.items()
    }


def test_non_contiguous_big_endian_and_scalar_inputs_are_saved_as_their_values(read_from_bytes):
    matrix = np.arange(24, dtype=np.int32).reshape(4, 6)
    big_endian = np.arange(5, dtype=">f8")
    arrays = {"transposed": matrix.T, "strided": matrix[:, ::2], "big": big_endian, "scalar": np.float32(2.5)}
    data, digest = write_to_bytes(arrays)
    got = read_from_bytes(data, digest)
    np.testing.assert_array_equal(got["transposed"], matrix.T)
    np.testing.assert_array_equal(got["strided"], matrix[:, ::2])
    assert got["big"].dtype == np.dtype("<f8") and np.array_equal(got["big"], big_endian)
    assert got["scalar"].shape == () and got["scalar"] == np.float32(2.5)


def test_large_non_contiguous_array_is_written_in_bounded_slabs(read_from_bytes):
    matrix = np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(-1, 3)
    column = matrix[:, 1]
    data, digest = write_to_bytes({"column": column})
    np.testing.assert_array_equal(read_from_bytes(data, digest)["column"], column)


def test_every_array_starts_aligned_to_its_item_size():
    arrays = {
        "u8": np.ones(3, np.uint8),
        "f64": np.ones(3),
        "f16": np.ones(3, np.float16),
        "f32": np.ones(1, np.float32),
    }
    data, _ = write_to_bytes(arrays)
    (header_len,) = struct.unpack("<Q", data[:8])
    assert (8 + header_len) % 8 == 0
    header = json.loads(data[8 : 8 + header_len])
    for name, array in arrays.items():
        assert header[name]["data_offsets"][0] % array.dtype.itemsize == 0


def test_shard_opens_with_the_safetensors_package(tmp_path):
    arrays = {
        code: sample(dtype, (3, 4))
        for code, dtype in DTYPES.items()
        if not code.startswith("F8")  # safetensors.numpy has no float8 (torch reads them)
    }
    arrays["scalar"] = np.array(3, dtype=np.int64)
    arrays["empty"] = np.zeros((0, 2), np.float32)
    path = tmp_path / "shard.safetensors"
    with open(path, "wb") as out:
        write_shard(out, arrays, {"tiered_ckpt.rank": "3"})
    loaded = safetensors.numpy.load_file(str(path))
    assert sorted(loaded) == sorted(arrays)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].tobytes() == array.tobytes(), name
    with safetensors.safe_open(str(path), framework="numpy") as opened:
        assert opened.metadata() == {"tiered_ckpt.rank": "3"}


def test_float8_shard_header_is_accepted_by_safetensors(tmp_path):
    arrays = {"e4m3": sample(DTYPES["F8_E4M3"], (4,)), "e5m2": sample(DTYPES["F8_E5M2"], (2, 2)), "x": np.ones(2)}
    path = tmp_path / "fp8.safetensors"
    with open(path, "wb") as out:
        write_shard(out, arrays)
    with safetensors.safe_open(str(path), framework="numpy") as opened:
        assert sorted(opened.keys()) == ["e4m3", "e5m2", "x"]
        np.testing.assert_array_equal(opened.get_tensor("x"), np.ones(2))


@pytest.mark.parametrize(
    "arrays, problem",
    [
        ({"c": np.ones(2, np.complex64)}, "dtype complex64"),
        ({"o": np.array([object()])}, "dtype object"),
        ({"u": np.array(["text"])}, "dtype <U4"),
        ({"l": [1, 2, 3]}, "not a numpy array"),
        ({"": np.ones(1)}, "invalid array name"),
        ({"__metadata__": np.ones(1)}, "invalid array name"),
        ({"nuz": np.ones(2, ml_dtypes.float8_e4m3fnuz)}, "float8_e4m3fnuz"),
    ],
)
def test_unsavable_state_is_refused_before_anything_is_written(arrays, problem):
    out = io.BytesIO()
    with pytest.raises(InvalidStateError, match=problem):
        write_shard(out, arrays)
    assert out.getvalue() == b""


def test_a_header_the_reader_would_refuse_is_refused_before_writing(monkeypatch):
    monkeypatch.setattr(shardfile, "MAX_HEADER_BYTES", 64_000)  # both the reader's and the writer's limit
    fits = {"w": np.ones(1)}, {"note": "x" * 63_000}
    data, digest = write_to_bytes(*fits)
    assert 63_000 < struct.unpack("<Q", data[:8])[0] <= 64_000
    assert header_length(*fits) == struct.unpack("<Q", data[:8])[0]  # what flatten measures is what is written
    out = io.BytesIO()
    with pytest.raises(InvalidStateError, match="over the 64,000"):
        write_shard(out, {"w": np.ones(1)}, {"note": "x" * 64_000})
    assert out.getvalue() == b""
    assert header_problem({"w": np.ones(1)}, {"note": "x" * 64_000}) is not None
    assert header_problem(*fits) is None and header_problem(*fits, reserve=1_000) is not None


@given(st.text())
def test_the_json_length_bound_is_never_below_the_json_length(text):
    assert json_length_bound(text) >= len(json.dumps(text))


@settings(max_examples=50, deadline=None)
@given(
    st.dictionaries(st.text(min_size=1), st.sampled_from([(), (0,), (3, 2), (1,) * 9]), max_size=5),
    st.dictionaries(st.text(), st.text(), max_size=3),
)
def test_a_header_a_reader_would_refuse_is_always_found(shapes, metadata):
    arrays = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    try:
        length = header_length(arrays, metadata)
    except InvalidStateError:  # a name a shard cannot hold at all
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shardfile, "MAX_HEADER_BYTES", length - 1)  # a reader would refuse this header
        assert header_problem(arrays, metadata) is not None
        patch.setattr(shardfile, "MAX_HEADER_BYTES", length)
        assert header_problem(arrays, metadata) is None


@pytest.mark.parametrize("offset", [0, 3, 9, 40, -1])
def test_any_flipped_byte_is_a_checksum_mismatch(offset, read_from_bytes):
    data, digest = write_to_bytes({"a": np.arange(100.0), "b": np.ones(3, np.int8)})
    damaged = bytearray(data)
    damaged[offset] ^= 0x01
    for verify in ("full", "fast"):
        with pytest.raises(ChecksumMismatchError, match="test shard"):
            read_from_bytes(bytes(damaged), digest, verify)


def handmade_shard(header: dict, payload: bytes) -> tuple[bytes, ShardDigest]:
    encoded = json.dumps(header).encode()
    data = struct.pack("<Q", len(encoded)) + encoded + payload
    return data, ShardDigest(len(data), hashlib.sha256(data).hexdigest(), xxhash.xxh3_64(data).hexdigest())


@pytest.mark.parametrize(
    "header, payload",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
        ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
        (
            {
                "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]},
            },
            b"\0" * 3,
        ),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "extra": 1}}, b"\0"),
        ({"__metadata__": {"k": 1}}, b""),
        ([1, 2], b""),
        ({"a": {"dtype": "U8", "shape": [2**63, 0], "data_offsets": [0, 0]}}, b""),  # numpy cannot make it
        ({"a": {"dtype": "U8", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}, b""),
        ({"a": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [0, 1]}}, b"\0"),  # 65 dimensions
    ],
)
def test_verified_but_malformed_shard_is_a_format_error(header, payload, read_from_bytes):
    data, digest = handmade_shard(header, payload)
    with pytest.raises(ShardFormatError, match="test shard"):
        read_from_bytes(data, digest)


def test_header_length_beyond_the_file_is_a_format_error_when_bytes_verify(read_from_bytes):
    data = struct.pack("<Q", 10**12) + b"{}"
    digest = ShardDigest(len(data), hashlib.sha256(data).hexdigest(), xxhash.xxh3_64(data).hexdigest())
    with pytest.raises(ShardFormatError, match="header length"):
        read_from_bytes(data, digest)


def test_unknown_verify_modes_are_refused_rather_than_skipping_the_sha256(read_from_bytes):
    from tiered_ckpt import ConfigError

    data, digest = write_to_bytes({"a": np.arange(10.0)})
    for mode in ("Full", "none", "", None):
        with pytest.raises(ConfigError, match="verify must be 'full'"):
            read_from_bytes(data, digest, mode)


def test_arrays_a_shard_cannot_hold_faithfully_are_refused_before_writing():
    out = io.BytesIO()
    with pytest.raises(InvalidStateError, match="'m' is a masked array"):
        write_shard(out, {"m": np.ma.masked_array([1.0, 2.0], mask=[False, True])})
    with pytest.raises(InvalidStateError, match="invalid array name"):
        write_shard(out, {"bad\udcff": np.zeros(1)})  # a lone surrogate: no UTF-8 form
    assert out.getvalue() == b""


@given(data=st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_any_bytes_that_verify_load_or_fail_with_a_typed_error_naming_the_file(data, tmp_path_factory):
    """Fuzz of the header parser: bytes whose checksum matches the record either are a shard
    or raise ShardFormatError naming the file; never another exception or a hang."""
    path = tmp_path_factory.mktemp("fuzz") / "shard.safetensors"
    path.write_bytes(data)
    record = ShardRecord(
        0, path.name, hashlib.sha256(data).hexdigest(), xxhash.xxh3_64(data).hexdigest(), len(data), 0, 0
    )
    with open(path, "rb") as source:
        try:
            arrays = read_shard_file(source, check=lambda got: record.verify(got, str(path)), what=str(path)).arrays
        except ShardFormatError as error:
            assert str(path) in str(error)
            return
    out = io.BytesIO()  # what loaded is exactly what the header described: it writes back to a valid shard
    write_shard(out, arrays)


@given(
    arrays=st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: k != "__metadata__"),
        st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
        max_size=4,
    ),
    flip=st.integers(min_value=0),
)
@settings(max_examples=200, deadline=None)
def test_a_shard_with_any_flipped_byte_fails_or_loads_exactly_what_was_saved(arrays, flip, tmp_path_factory):
    saved = {key: np.array(values, dtype=np.int32) for key, values in arrays.items()}
    data, digest = write_to_bytes(saved)
    damaged = bytearray(data)
    damaged[flip % len(damaged)] ^= 0x10
    path = tmp_path_factory.mktemp("fuzz") / "shard.safetensors"
    path.write_bytes(bytes(damaged))
    record = ShardRecord(0, path.name, digest.sha256, digest.xxh3_64, digest.size_bytes, 0, 0)
    with open(path, "rb") as source, pytest.raises(ChecksumMismatchError, match=str(path)):
        read_shard_file(source, check=lambda got: record.verify(got, str(path)), what=str(path))


@given(st.dictionaries(st.text(alphabet="ab", min_size=1, max_size=3), st.sampled_from(["f8", "f4", "u1", "i2"])))
def test_write_order_is_by_item_size_then_name(dtypes):
    arrays = {name: np.zeros(1, dtype) for name, dtype in dtypes.items()}
    assert shardfile.write_order(arrays) == sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
