"""A compressed object's entry (tiered_ckpt/format/compressed.py): read strictly, and refused unless
it fits its shard, so that no read of it fetches or allocates more than the shard's bytes."""

import dataclasses
import io
import json

import pytest

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.compressed import MAX_FRAME_BYTES, CompressedObject
from tiered_ckpt.io.zstd_frames import compress_frames, frame_lengths, raw_frame_bytes

SOURCE = "s3://b/run/step-000000000001/manifest.json"
SHARD_BYTES = 10_000_000


def entry(**changes) -> CompressedObject:
    frames = (120, 3_000_000, 3_100_000, 1_600_000)  # a 200-byte head, then 4 MiB frames
    made = CompressedObject("zstd", sum(frames), "b" * 16, 200, 4 << 20, frames)
    return dataclasses.replace(made, **changes)


def test_an_entry_round_trips_through_its_json_and_the_manifests_dict():
    made = entry()
    assert made.problem(SHARD_BYTES) is None
    assert CompressedObject.from_dict(made.to_dict(), source=SOURCE) == made
    assert CompressedObject.from_json(made.to_json(), source=SOURCE) == made
    assert " " not in made.to_json()  # compact: it travels between the processes of a job


def test_the_index_places_each_frame_in_both_streams():
    index = entry().index(SHARD_BYTES)
    assert index.lengths == (200, 4 << 20, 4 << 20, SHARD_BYTES - 200 - (8 << 20))
    assert index.starts[1] == 200 and index.offsets[1] == 120 and index.offsets[-1] == entry().size_bytes


def test_the_object_record_is_of_the_compressed_bytes_and_keeps_the_shards_name_rank_and_sha256():
    from tiered_ckpt.format.manifest import ShardRecord

    record = ShardRecord(3, "rank-00003-of-00004.safetensors", "c" * 64, "d" * 16, SHARD_BYTES, 0, 0)
    record = dataclasses.replace(record, header_bytes=200, header_sha256="e" * 64, array_xxh3_64="f" * 16)
    own = entry().object_record(record)
    assert (own.rank, own.path) == (3, record.path)
    assert (own.size_bytes, own.sha256, own.xxh3_64) == (entry().size_bytes, "c" * 64, "b" * 16)
    assert own.header_bytes == 0 and own.array_xxh3_64 == ""


def test_an_entry_of_what_compress_frames_wrote_fits_its_shard():
    data = bytes(range(256)) * 1000
    out = io.BytesIO()
    done = compress_frames(io.BytesIO(data), out, frame_lengths(len(data), 100, 64 << 10))
    made = CompressedObject.made(done, 100, 64 << 10)
    assert made.problem(len(data)) is None and made.size_bytes == len(out.getvalue())


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"codec": "lz4"}, "unknown codec"),
        ({"xxh3_64": "B" * 16}, "hex digits"),
        ({"xxh3_64": "b" * 15}, "hex digits"),
        ({"frame_bytes": 100}, "frame_bytes 100 is outside"),
        ({"frame_bytes": MAX_FRAME_BYTES + 1}, "is outside"),
        ({"head_bytes": 0}, "head_bytes 0"),
        ({"head_bytes": 200_000_000}, "head_bytes 200000000"),
        ({"frames": (120, 3_000_000, 3_100_000)}, "3 frames, a shard of 10000000 bytes has 4"),
        ({"frames": (120, 3_000_000, 3_100_000, 1_600_000, 5)}, "5 frames"),
        ({"frames": (raw_frame_bytes(200) + 1, 3_000_000, 3_100_000, 1_600_000)}, "frame 0 takes"),
        ({"size_bytes": 1}, "size_bytes is 1"),
    ],
)
def test_an_entry_that_does_not_fit_its_shard_says_why(change, problem):
    assert problem in entry(**change).problem(SHARD_BYTES)


def test_an_empty_shard_has_no_frames():
    assert entry(frames=(), size_bytes=0, head_bytes=0).problem(0) is None
    assert "1 frames" in entry(frames=(9,), size_bytes=9).problem(0)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"extra": 1}, "compression.rank.extra"),
        ({"codec": 7}, "compression.rank.codec"),
        ({"codec": "brotli"}, "compression.rank.codec"),
        ({"size_bytes": -1}, "compression.rank.size_bytes"),
        ({"size_bytes": True}, "compression.rank.size_bytes"),
        ({"head_bytes": 1.5}, "compression.rank.head_bytes"),
        ({"frames": "120,3"}, "compression.rank.frames"),
        ({"frames": [120, True]}, "compression.rank.frames[1]"),
        ({"frames": [120, 0]}, "compression.rank.frames[1]"),
        ({"frames": [120, "3"]}, "compression.rank.frames[1]"),
    ],
)
def test_a_field_this_library_would_not_write_is_refused_naming_it(change, field):
    document = {**entry().to_dict(), **change}
    with pytest.raises(ManifestError, match=f"{SOURCE}: field '{field.replace('[', '.').replace(']', '.')}"):
        CompressedObject.from_dict(document, source=SOURCE, prefix="compression.rank.")


def test_a_missing_field_or_a_non_object_is_refused():
    document = entry().to_dict()
    del document["frames"]
    with pytest.raises(ManifestError, match="field 'frames': missing"):
        CompressedObject.from_dict(document, source=SOURCE)
    with pytest.raises(ManifestError, match="expected an object"):
        CompressedObject.from_dict([1, 2], source=SOURCE, prefix="compression.rank.")
    with pytest.raises(ManifestError, match="not a compressed object's entry"):
        CompressedObject.from_json("{", source=SOURCE)
    assert json.loads(entry().to_json())["frames"] == list(entry().frames)
