import copy
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt import ManifestError, ShardCountMismatchError, ShardManifest
from tiered_ckpt.format import manifest as manifest_module
from tiered_ckpt.format.manifest import (
    MAX_MANIFEST_BYTES,
    ChunkRecord,
    ShardRecord,
    manifest_problem,
    record_bytes_bound,
)
from tiered_ckpt.format.remote_manifest import RemoteManifest

SOURCE = "/ckpt/step-000000000012/manifest.json"


def valid_document(world_size: int = 4) -> dict:
    return {
        "schema_version": 2,
        "world_size": world_size,
        "step": 12,
        "wall_clock_seconds": 1700000000.5,
        "sharded_keys": ["exp_avg", "master_fp32"],
        "shards": [
            {
                "rank": rank,
                "path": f"rank-{rank:05d}-of-{world_size:05d}.safetensors",
                "sha256": f"{rank:064x}",
                "xxh3_64": f"{rank:016x}",
                "size_bytes": 1000 + rank,
                "param_shard_offset": 251 * rank,
                "param_shard_numel": 251,
            }
            for rank in range(world_size)
        ],
    }


def parse(document: dict) -> ShardManifest:
    return ShardManifest.from_json(json.dumps(document), source=SOURCE)


def test_round_trip_is_lossless():
    manifest = parse(valid_document())
    assert ShardManifest.from_json(manifest.to_json(), source=SOURCE) == manifest
    assert manifest.world_size == 4 and manifest.step == 12
    assert manifest.shard(2).param_shard_offset == 502
    assert manifest.total_numel == 1004
    assert manifest.total_bytes == 4006


def test_a_manifest_is_written_a_shard_record_a_line_and_an_indented_one_reads_the_same():
    manifest = parse(valid_document())
    lines = manifest.to_json().splitlines()
    assert [json.loads(line.rstrip(",")) for line in lines[1:5]] == valid_document()["shards"]
    assert len(lines) == 6 and lines[0].startswith('{"schema_version": 2') and lines[5] == "]}"
    indented = json.dumps(manifest.to_dict(), indent=1) + "\n"  # as earlier releases wrote it
    assert ShardManifest.from_json(indented, source=SOURCE) == manifest
    remote = RemoteManifest(manifest, committed_at=1.5)
    assert RemoteManifest.from_json(remote.to_json()) == remote


def test_the_schema_version_is_read_and_written_back_unchanged():
    manifest = parse(valid_document())
    assert manifest.schema_version == 2 and json.loads(manifest.to_json())["schema_version"] == 2


@pytest.mark.parametrize("version", [0, 1, 5])
def test_another_schema_version_is_refused_naming_it(version):
    with pytest.raises(ManifestError, match=f"field 'schema_version': unsupported version {version} "):
        parse({**valid_document(), "schema_version": version})


def test_shards_may_be_listed_in_any_order():
    document = valid_document()
    document["shards"].reverse()
    assert [record.rank for record in parse(document).shards] == [0, 1, 2, 3]


def mutate(path: str, value):
    """Return a function that sets (or, for value=DELETE, deletes) a field of a document."""

    def apply(document: dict) -> dict:
        document = copy.deepcopy(document)
        *parents, last = path.split(".")
        target = document
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        if value is DELETE:
            del target[int(last) if last.isdigit() else last]
        else:
            target[int(last) if last.isdigit() else last] = value
        return document

    return apply


DELETE = object()

VIOLATIONS = {
    "unknown schema version": (mutate("schema_version", 5), "schema_version"),
    "schema version as string": (mutate("schema_version", "1"), "schema_version"),
    "world size as string": (mutate("world_size", "4"), "world_size"),
    "world size zero": (mutate("world_size", 0), "world_size"),
    "step missing": (mutate("step", DELETE), "step"),
    "step negative": (mutate("step", -1), "step"),
    "step as float": (mutate("step", 12.0), "step"),
    "step as bool": (mutate("step", True), "step"),
    "wall clock as string": (mutate("wall_clock_seconds", "now"), "wall_clock_seconds"),
    "wall clock negative": (mutate("wall_clock_seconds", -5), "wall_clock_seconds"),
    "shards not a list": (mutate("shards", {"0": {}}), "shards"),
    "shard not an object": (mutate("shards.1", "rank1.bin"), "shards[1]"),
    "sharded keys not strings": (mutate("sharded_keys", [1]), "sharded_keys[0]"),
    "sharded key twice": (mutate("sharded_keys", ["a", "a"]), "sharded_keys"),
    "unknown top-level field": (mutate("comment", "hi"), "comment"),
    "unknown shard field": (mutate("shards.0.extra", 1), "shards[0].extra"),
    "rank missing": (mutate("shards.0.rank", DELETE), "shards[0].rank"),
    "rank as string": (mutate("shards.0.rank", "0"), "shards[0].rank"),
    "rank duplicated": (mutate("shards.1.rank", 0), "shards[rank 0].rank"),
    "rank out of range": (mutate("shards.3.rank", 4), "shards[rank 4].rank"),
    "rank negative": (mutate("shards.3.rank", -1), "shards[3].rank"),
    "offset negative": (mutate("shards.0.param_shard_offset", -1), "shards[0].param_shard_offset"),
    "numel negative": (mutate("shards.2.param_shard_numel", -251), "shards[2].param_shard_numel"),
    "offset overlapping": (mutate("shards.2.param_shard_offset", 500), "shards[rank 2].param_shard_offset"),
    "offset leaving a gap": (mutate("shards.3.param_shard_offset", 800), "shards[rank 3].param_shard_offset"),
    "first offset not zero": (mutate("shards.0.param_shard_offset", 1), "shards[rank 0].param_shard_offset"),
    "size negative": (mutate("shards.1.size_bytes", -1), "shards[1].size_bytes"),
    "sha256 too short": (mutate("shards.1.sha256", "abc"), "shards[rank 1].sha256"),
    "sha256 upper case": (mutate("shards.1.sha256", "A" * 64), "shards[rank 1].sha256"),
    "sha256 not hex": (mutate("shards.1.sha256", "g" * 64), "shards[rank 1].sha256"),
    "xxh3 not hex": (mutate("shards.1.xxh3_64", "z" * 16), "shards[rank 1].xxh3_64"),
    "path absolute": (mutate("shards.1.path", "/etc/passwd"), "shards[rank 1].path"),
    "path with separator": (mutate("shards.1.path", "sub/rank1.bin"), "shards[rank 1].path"),
    "path with backslash": (mutate("shards.1.path", "..\\rank1.bin"), "shards[rank 1].path"),
    "path dot dot": (mutate("shards.1.path", ".."), "shards[rank 1].path"),
    "path dot": (mutate("shards.1.path", "."), "shards[rank 1].path"),
    "path hidden temp": (mutate("shards.1.path", ".rank1.bin.0123456789abcdef.tmp"), "shards[rank 1].path"),
    "path empty": (mutate("shards.1.path", ""), "shards[rank 1].path"),
    "path is the manifest": (mutate("shards.1.path", "manifest.json"), "shards[rank 1].path"),
    "path used twice": (mutate("shards.1.path", "rank-00000-of-00004.safetensors"), "shards[rank 1].path"),
    "array digests not hex": (mutate("shards.1.array_xxh3_64", "z" * 16), "shards[1].array_xxh3_64"),
    "array digests cut short": (mutate("shards.1.array_xxh3_64", "a" * 15), "shards[1].array_xxh3_64"),
    "array digests not a string": (mutate("shards.1.array_xxh3_64", ["a" * 16]), "shards[1].array_xxh3_64"),
    "array digests without a header": (mutate("shards.1.array_xxh3_64", "a" * 16), "shards[1].array_xxh3_64"),
}


def test_per_array_digests_read_back_and_name_the_arrays_of_the_verified_header():
    document = copy.deepcopy(valid_document())
    document["shards"][1] |= {"header_bytes": 80, "header_sha256": "b" * 64, "array_xxh3_64": "1" * 16 + "2" * 16}
    record = parse(document).shard(1)
    assert ShardManifest.from_json(parse(document).to_json()).shard(1) == record
    assert record.array_digests(["w", "b"]) == {"b": "1" * 16, "w": "2" * 16}  # in the names' sorted order
    with pytest.raises(ManifestError, match="'array_xxh3_64' holds 2 digests for a shard of 3 arrays"):
        record.array_digests(["w", "b", "c"])
    assert parse(valid_document()).shard(1).array_digests(["w"]) == {}


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_violation_raises_manifest_error_naming_file_and_field(name):
    change, field = VIOLATIONS[name]
    with pytest.raises(ManifestError) as caught:
        parse(change(valid_document()))
    assert not isinstance(caught.value, ShardCountMismatchError)
    message = str(caught.value)
    assert SOURCE in message
    assert f"'{field}'" in message


@pytest.mark.parametrize("count", [3, 5])
def test_shard_list_not_matching_world_size_is_shard_count_mismatch(count):
    document = valid_document(world_size=count)
    document["world_size"] = 4
    with pytest.raises(ShardCountMismatchError, match=f"lists {count} shards but world_size is 4") as caught:
        parse(document)
    assert SOURCE in str(caught.value)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[1, 2]",
        '{"world_size": 4, "world_size": 4}',
        json.dumps(valid_document()).replace("1700000000.5", "NaN"),
        json.dumps(valid_document()).replace("1700000000.5", "Infinity"),
        b"\xff\xfe garbage",
    ],
)
def test_malformed_json_raises_manifest_error(text):
    with pytest.raises(ManifestError, match=SOURCE):
        ShardManifest.from_json(text, source=SOURCE)


def test_constructed_manifest_is_validated_too():
    record = ShardRecord(0, "../escape", "0" * 64, "0" * 16, 10, 0, 1)
    with pytest.raises(ManifestError, match="path"):
        ShardManifest(world_size=1, step=0, wall_clock_seconds=0.0, sharded_keys=(), shards=(record,))


def test_manifest_is_frozen():
    manifest = parse(valid_document())
    with pytest.raises(AttributeError):
        manifest.step = 13  # type: ignore[misc]


# --- fuzzing: a typed error naming the file, or exactly the manifest that was written ------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
FIELDS = ["schema_version", "world_size", "step", "wall_clock_seconds", "sharded_keys", "shards"]
SHARD_FIELDS = ["rank", "path", "sha256", "xxh3_64", "size_bytes", "param_shard_offset", "param_shard_numel"]


def _parse_or_typed_error(text) -> ShardManifest | None:
    try:
        manifest = ShardManifest.from_json(text, source=SOURCE)
    except ManifestError as error:
        assert SOURCE in str(error)
        return None
    assert ShardManifest.from_json(manifest.to_json(), source=SOURCE) == manifest  # what parses, round-trips
    return manifest


@given(st.binary(max_size=300) | st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_any_bytes_parse_or_fail_with_a_manifest_error(data):
    _parse_or_typed_error(data)


@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
@settings(max_examples=300, deadline=None)
def test_any_value_in_any_field_parses_or_fails_with_a_manifest_error(field, value):
    document = valid_document()
    document[field] = value
    _parse_or_typed_error(json.dumps(document))


@given(rank=st.integers(0, 3), field=st.sampled_from(SHARD_FIELDS), value=JSON_VALUES)
@settings(max_examples=300, deadline=None)
def test_any_value_in_any_shard_field_parses_or_fails_with_a_manifest_error(rank, field, value):
    document = valid_document()
    document["shards"][rank][field] = value
    manifest = _parse_or_typed_error(json.dumps(document))
    if manifest is not None:
        assert manifest.shard(rank).to_dict()[field] == value  # accepted only as exactly what was given


def chunked_document() -> dict:
    document = valid_document(world_size=2)
    for rank, shard in enumerate(document["shards"]):
        shard["chunks"] = [
            {
                "name": "model/w",
                "dtype": "F32",
                "global_shape": [5, 3],
                "offsets": [3 * rank, 0],
                "sizes": [3 - rank, 3],
                "sha256": f"{rank + 7:064x}",
            }
        ]
        shard["header_bytes"], shard["header_sha256"] = 200, f"{rank + 9:064x}"
    return document


def test_dtensor_chunks_round_trip_in_the_shard_records():
    manifest = parse(chunked_document())
    assert manifest.shard(1).chunks[0].offsets == (3, 0) and manifest.shard(1).chunks[0].sizes == (2, 3)
    assert ShardManifest.from_json(manifest.to_json(), source=SOURCE) == manifest
    assert "chunks" not in json.loads(parse(valid_document()).to_json())["shards"][0]  # absent when there are none


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda c: c.update(dtype="F128"), "chunks[0].dtype"),
        (lambda c: c.update(sizes=[9, 3]), "chunks[0].sizes"),
        (lambda c: c.update(offsets=[0]), "chunks[0]"),
        (lambda c: c.update(offsets=[-1, 0]), "chunks[0].offsets"),
        (lambda c: c.update(offsets=[True, 0]), "chunks[0].offsets"),
        (lambda c: c.update(global_shape=[6, 3]), "chunks"),
        (lambda c: c.update(name=""), "chunks[0].name"),
        (lambda c: c.update(extra=1), "chunks[0].extra"),
        (lambda c: c.pop("sizes"), "chunks[0].sizes"),
        (lambda c: c.update(sha256="ab"), "chunks[0].sha256"),
    ],
)
def test_a_bad_chunk_record_is_a_manifest_error_naming_the_field(change, field):
    document = chunked_document()
    change(document["shards"][1]["chunks"][0])
    with pytest.raises(ManifestError, match=re.escape(field)):
        parse(document)


def test_a_shard_with_chunks_must_record_its_header():
    document = chunked_document()
    document["shards"][0]["header_sha256"] = "nope"
    with pytest.raises(ManifestError, match=re.escape("shards[rank 0].header_sha256")):
        parse(document)


def test_a_header_larger_than_a_reader_accepts_is_refused_before_anything_is_allocated():
    from tiered_ckpt.format.shardfile import MAX_HEADER_BYTES

    document = chunked_document()
    document["shards"][1]["size_bytes"] = 2**62
    document["shards"][1]["header_bytes"] = MAX_HEADER_BYTES + 8
    parse(document)  # the largest header a reader accepts
    document["shards"][1]["header_bytes"] = 2**61  # a hostile manifest asking for 2 EiB of memory
    with pytest.raises(ManifestError, match=re.escape("shards[rank 1].header_bytes")):
        parse(document)


def widest_record(rank: int, world_size: int, chunks, replicas=()) -> ShardRecord:
    """A shard record whose every number has as many digits as a saved one can."""
    from tiered_ckpt.format.shardfile import MAX_HEADER_BYTES

    big = 2**63 - 1
    return ShardRecord(
        rank, f"rank-{rank:05d}-of-{world_size:05d}.safetensors", "a" * 64, "b" * 16, big, big * rank, big,
        chunks, MAX_HEADER_BYTES + 8, "c" * 64, replicas,
    )  # fmt: skip


@pytest.mark.parametrize("ndim", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("name", ["w", "model/layers/#17/attn/wq", 'quote"back\\slash', "naïve ☃ 🚀", "\x01"])
def test_the_record_bound_is_never_below_what_a_manifest_takes(monkeypatch, ndim, name):
    big = 2**63 - 1
    chunks = tuple(
        ChunkRecord(f"{name}{i}", "F8_E4M3", (big,) * ndim, (0,) * ndim, (big,) * ndim, "d" * 64, "e" * 16)
        for i in range(3)
    )
    records = (widest_record(0, 2, chunks), widest_record(1, 2, (), tuple((c.name, 0) for c in chunks)))
    keys = (f"{name}0",) if ndim == 1 else ()
    manifest = ShardManifest(2, big, 1e18, keys, records)
    paths = [record.path for record in records]
    remote = RemoteManifest(
        manifest, 1e18, {path: "crc32c:AAAAAA==-99999" for path in paths}, {path: "3f/" + path for path in paths}
    )
    names = [(c.name, ndim) for c in chunks]
    records_bytes = [record_bytes_bound(names), record_bytes_bound(names)]
    largest = max(len(manifest.to_json()), len(remote.to_json()))
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", largest - 1)  # a reader would refuse either
    assert manifest_problem(records_bytes, keys) is not None  # so the writer refuses first


def test_a_manifest_that_may_be_over_the_limit_is_a_problem():
    assert manifest_problem([MAX_MANIFEST_BYTES // 2] * 2, ()) is not None
    assert manifest_problem([MAX_MANIFEST_BYTES // 4] * 2, ()) is None


@pytest.mark.parametrize(
    "checksum",
    [
        "crc32c:qg7Tjw==",
        "crc32c:qg7Tjw==-3",
        "sha256:" + "A" * 43 + "=",
        "md5:1B2M2Y8AsgTpgAmY7PhCfg==",
        "md5:" + "/" * 21 + "w==",
    ],
)
def test_a_remote_manifest_keeps_each_stores_checksum_form(checksum):
    manifest = ShardManifest.from_dict(valid_document(2), source=SOURCE)
    remote = RemoteManifest(manifest, 1.0, {record.path: checksum for record in manifest.shards})
    assert RemoteManifest.from_json(remote.to_json()).store_checksums == remote.store_checksums


@pytest.mark.parametrize(
    "checksum",
    [
        "md5:1B2M2Y8AsgTpgAmY7PhCfg==-2",  # an MD5 is of the whole blob: no part count
        "md5:1B2M2Y8AsgTpgAmY7PhCfh==",  # not canonical base64 of 16 bytes (bits past the digest)
        "md5:1B2M2Y8AsgTpgAmY7PhCf==",  # 15 bytes
        "md5:1B2M2Y8AsgTpgAmY7PhCfg",  # no padding
        "MD5:1B2M2Y8AsgTpgAmY7PhCfg==",
        "md5:1B2M2Y8AsgTpgAmY7PhCfg==\n",
        "crc32c:1B2M2Y8AsgTpgAmY7PhCfg==",  # an MD5's length under another name
    ],
)
def test_a_store_checksum_of_no_known_form_is_refused_naming_the_field(checksum):
    document = {"kind": "tiered-ckpt remote manifest", "committed_at": 1.0, **valid_document(2)}
    document["store_checksums"] = {document["shards"][0]["path"]: checksum}
    with pytest.raises(ManifestError, match="field 'store_checksums'"):
        RemoteManifest.from_json(json.dumps(document), source=SOURCE)


# -- the remote manifest's compression field ----------------------------------------------------

REMOTE_SOURCE = "s3://b/run/step-000000000012/manifest.json"


def remote_document(**extra) -> dict:
    """A remote manifest of ``valid_document()``'s step as JSON, with ``extra`` fields."""
    return {"kind": "tiered-ckpt remote manifest", "committed_at": 1700000001.0, **valid_document(), **extra}


def compressed_entry(size: int = 1000) -> dict:
    """How a shard of ``size`` bytes is stored compressed: one frame of 900 bytes."""
    return {
        "codec": "zstd",
        "size_bytes": 900,
        "xxh3_64": "f" * 16,
        "head_bytes": size,
        "frame_bytes": 4 << 20,
        "frames": [900],
    }


def parse_remote(document: dict) -> RemoteManifest:
    return RemoteManifest.from_json(json.dumps(document), source=REMOTE_SOURCE)


def test_a_remote_manifest_records_how_each_compressed_object_is_stored_and_reads_it_back():
    path = "rank-00000-of-00004.safetensors"
    remote = parse_remote(remote_document(compression={path: compressed_entry()}))
    assert set(remote.compression) == {path} and remote.compression[path].frames == (900,)
    assert RemoteManifest.from_json(remote.to_json(), source=REMOTE_SOURCE) == remote
    assert json.loads(remote.to_json())["compression"][path] == compressed_entry()


def test_a_remote_manifest_written_before_compression_reads_as_every_object_as_it_is():
    remote = parse_remote(remote_document(store_checksums={}, locations={}))
    assert remote.compression == {} and "compression" not in json.loads(remote.to_json())


@pytest.mark.parametrize(
    "compression, problem",
    [
        ([], "field 'compression': expected an object"),
        ({"rank-00000-of-00004.safetensors": "zstd"}, "field 'compression.rank-00000-of-00004.safetensors': expected"),
        ({"rank-00009-of-00004.safetensors": compressed_entry()}, "names no shard of the step"),
        ({"manifest.json": compressed_entry()}, "names no shard of the step"),
        ({"rank-00000-of-00004.safetensors": compressed_entry(size=999)}, "1 frames, a shard of 1000 bytes has 2"),
        ({"rank-00000-of-00004.safetensors": {**compressed_entry(), "frames": [2000]}}, "frame 0 takes 2000"),
        ({"rank-00000-of-00004.safetensors": {**compressed_entry(), "level": 3}}, ".level': unknown field"),
    ],
)
def test_a_compression_entry_a_writer_could_not_have_made_is_refused_naming_the_field(compression, problem):
    with pytest.raises(ManifestError, match=re.escape(problem)) as caught:
        parse_remote(remote_document(compression=compression))
    assert REMOTE_SOURCE in str(caught.value) and "compression" in str(caught.value)


def referencing_document() -> dict:
    """A version-3 manifest whose rank 1 references two arrays of its file of step 10."""
    document = valid_document()
    document["schema_version"] = 3
    document["shards"][1].update(header_bytes=64, header_sha256="a" * 64, array_xxh3_64="")
    file = {**valid_document()["shards"][1], "header_bytes": 64, "header_sha256": "b" * 64}
    reference = {"step": 10, "file": file, "names": ["w.a", "w.b"], "xxh3_64": "1" * 32, "bytes": 4096}
    document["shards"][1]["references"] = [reference]
    return document


def test_references_round_trip_and_say_where_each_array_is():
    manifest = parse(referencing_document())
    assert ShardManifest.from_json(manifest.to_json(), source=SOURCE) == manifest
    record = manifest.shard(1)
    assert record.elsewhere == {"w.a", "w.b"} and record.referenced["w.b"].step == 10
    assert record.references[0].digests() == {"w.a": "1" * 16, "w.b": "1" * 16}
    assert manifest.referenced_bytes == 4096 and manifest.schema_version == 3


REFERENCE_VIOLATIONS = {
    "references in version 2": (mutate("schema_version", 2), "shards[rank 1].references", "schema_version 3"),
    "a later step": (mutate("shards.1.references.0.step", 12), "references[0].step", "not a step before 12"),
    "another rank's file": (mutate("shards.1.references.0.file.rank", 2), "references[0].file.rank", "is 2"),
    "a path outside": (mutate("shards.1.references.0.file.path", "../x"), "references[0].file.path", "shard"),
    "not a shard": (mutate("shards.1.references.0.file.path", "held-shards.json"), "file.path", "shard file's"),
    "names unsorted": (mutate("shards.1.references.0.names", ["w.b", "w.a"]), "references[0].names", "sorted"),
    "no names": (mutate("shards.1.references.0.names", []), "references[0].names", "at least one"),
    "a digest short": (mutate("shards.1.references.0.xxh3_64", "1" * 16), "references[0].xxh3_64", "16 lowercase"),
    "bytes negative": (mutate("shards.1.references.0.bytes", -1), "references[0].bytes", ">= 0"),
    "no header digest": (mutate("shards.1.references.0.file.header_bytes", DELETE), "references[0].file", "header"),
    "a nested reference": (
        mutate("shards.1.references.0.file.references", []),
        "file.references",
        "references nothing",
    ),
    "an unknown field": (mutate("shards.1.references.0.via", 1), "references[0].via", "unknown"),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_VIOLATIONS))
def test_a_reference_that_is_not_one_we_write_is_refused_naming_its_field(case):
    change, field, problem = REFERENCE_VIOLATIONS[case]
    with pytest.raises(ManifestError) as caught:
        parse(change(referencing_document()))
    assert field in str(caught.value) and problem in str(caught.value) and SOURCE in str(caught.value)


def test_an_array_referenced_twice_is_refused():
    document = referencing_document()
    file = {**document["shards"][1]["references"][0]["file"], "path": "rank-00001-of-00002.safetensors"}
    document["shards"][1]["references"].append(
        {"step": 11, "file": file, "names": ["w.b"], "xxh3_64": "2" * 16, "bytes": 1}
    )
    with pytest.raises(ManifestError, match="'w.b' is empty, reserved or referenced twice"):
        parse(document)


REFERENCED_KEY = "step-000000000010/rank-00001-of-00004.safetensors"  # the file referencing_document names


def test_a_remote_manifest_says_where_each_referenced_file_is_stored_and_reads_it_back():
    entry = {"location": "3f/rank-00001-of-00004.safetensors", "compression": compressed_entry(1001)}
    remote = parse_remote({**remote_document(), **referencing_document(), "referenced": {REFERENCED_KEY: entry}})
    stored = remote.stored(10, "rank-00001-of-00004.safetensors")
    assert stored.location == entry["location"] and stored.compression.frames == (900,)
    assert RemoteManifest.from_json(remote.to_json(), source=REMOTE_SOURCE) == remote
    assert remote.stored(9, "rank-00001-of-00004.safetensors").location == "rank-00001-of-00004.safetensors"


@pytest.mark.parametrize(
    "referenced, problem",
    [
        ({"step-000000000011/rank-00001-of-00004.safetensors": {"location": "x"}}, "names no file the step"),
        ({"steps/rank-00001-of-00004.safetensors": {"location": "x"}}, "names no step's file"),
        ({REFERENCED_KEY: {"location": "3f/rank-00002-of-00004.safetensors"}}, "location"),
        ({REFERENCED_KEY: {"location": "../rank-00001-of-00004.safetensors"}}, "location"),
        ({REFERENCED_KEY: {"location": "rank-00001-of-00004.safetensors", "via": 1}}, ".via': unknown field"),
        ({REFERENCED_KEY: {}}, ".location': missing"),
        ({REFERENCED_KEY: "rank-00001-of-00004.safetensors"}, "expected an object"),
        ({REFERENCED_KEY: {"location": "rank-00001-of-00004.safetensors", "compression": compressed_entry(5)}}, "fr"),
    ],
)
def test_a_referenced_entry_a_writer_could_not_have_made_is_refused_naming_the_field(referenced, problem):
    with pytest.raises(ManifestError, match=re.escape(problem)) as caught:
        parse_remote({**remote_document(), **referencing_document(), "referenced": referenced})
    assert REMOTE_SOURCE in str(caught.value) and "referenced" in str(caught.value)


def chunked_referencing_document(names: list[str]) -> dict:
    """A version-3 manifest of DTensor chunks whose rank 1 references ``names`` in its file of step 10."""
    document = chunked_document()
    document["schema_version"], document["step"] = 3, 11
    file = {**valid_document(world_size=2)["shards"][1], "header_bytes": 64, "header_sha256": "b" * 64}
    digests = "1" * 16 * len(names)
    document["shards"][1]["references"] = [{"step": 10, "file": file, "names": names, "xxh3_64": digests, "bytes": 24}]
    return document


def test_a_shard_of_dtensor_chunks_references_its_chunks_and_says_where_they_are():
    manifest = parse(chunked_referencing_document(["model/w"]))
    record = manifest.shard(1)
    assert record.referenced["model/w"].step == 10 and record.chunks[0].name == "model/w"
    assert ShardManifest.from_json(manifest.to_json(), source=SOURCE) == manifest


def test_a_chunked_shard_referencing_an_array_that_is_not_one_of_its_chunks_or_is_a_replica_is_refused():
    with pytest.raises(ManifestError, match=r"references\[0\].names.*'model/v' is another rank's, or not among"):
        parse(chunked_referencing_document(["model/v"]))
    document = valid_document(world_size=2)  # a plain shard whose array another rank stores
    document["schema_version"] = 3
    document["shards"][1]["replicas"] = [["w.a", 0]]
    document["shards"][0]["chunks"] = [
        {"name": "w.a", "dtype": "F32", "global_shape": [2], "offsets": [0], "sizes": [2], "sha256": "7" * 64}
    ]
    document["shards"][0].update(header_bytes=64, header_sha256="c" * 64)
    file = {**valid_document(world_size=2)["shards"][1], "header_bytes": 64, "header_sha256": "b" * 64}
    document["shards"][1]["references"] = [{"step": 1, "file": file, "names": ["w.a"], "xxh3_64": "1" * 16, "bytes": 8}]
    with pytest.raises(ManifestError, match="'w.a' is another rank's"):
        parse(document)
