"""What a DCP save stores in each shard: its sections, chunk names, values stored without
pickle, and the reader's checks of a shard that is not what the writer writes."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tiered_ckpt.errors import ShardFormatError
from tiered_ckpt.format.state import ChunkOf, flatten

torch = pytest.importorskip("torch")
from tiered_ckpt.torch.dcp_document import (  # noqa: E402
    ROOT,
    blob_of,
    blob_value,
    chunk_key,
    complex_dtypes_of,
    document,
    fqn_of,
    is_value_chunk,
    keys_at,
    planner_data_of,
    planner_paths,
    torch_dtype,
    value_path,
)


def structure_of(dcp_section: dict):
    return flatten({ROOT: dcp_section}).structure


def test_the_document_holds_its_sections_in_the_order_the_shard_is_written():
    sections = document({"w": {}}, {"b": {}}, {"o": 1}, {"c": "complex64"}, {"w": ["w"]})
    assert list(sections) == [ROOT]
    assert list(sections[ROOT]) == ["tensors", "blobs", "objects", "complex", "planner_data"]


@pytest.mark.parametrize(
    "value, kind",
    [(b"\x00\xff", "bytes"), (b"", "bytes"), (io.BytesIO(b"titan"), "bytesio"),
     (np.arange(6.0).reshape(2, 3), "ndarray"), (np.int16(-3), "npscalar"), (np.complex64(1j), "npscalar")],
)  # fmt: skip
def test_a_value_stored_as_one_array_comes_back_as_the_same_type_and_bytes(value, kind):
    stored = blob_of(value)
    assert stored is not None and list(stored) == [kind]
    chunk = stored[kind]
    assert isinstance(chunk, ChunkOf) and chunk.offsets == (0,) * np.ndim(chunk.data)
    back = blob_value({kind: np.asarray(chunk.data)}, "w")
    assert type(back) is type(value)
    if isinstance(value, io.BytesIO):
        assert back.getvalue() == value.getvalue()
    else:
        assert np.array_equal(np.asarray(back), np.asarray(value)) and np.asarray(back).dtype == np.asarray(value).dtype


@pytest.mark.parametrize("value", [1, "text", None, [1, 2], {"a": 1}, np.ma.masked_array([1, 2]), bytearray(b"x")])
def test_any_other_value_is_left_to_the_json_document(value):
    assert blob_of(value) is None


@pytest.mark.parametrize(
    "built, problem",
    [({"bytes": np.zeros(1), "ndarray": np.zeros(1)}, "is not a stored value"), ([1], "is not a stored value"),
     ({"pickle": np.zeros(1)}, "has unknown kind 'pickle'")],
)  # fmt: skip
def test_a_stored_value_of_another_shape_or_kind_is_a_shard_format_error_naming_it(built, problem):
    with pytest.raises(ShardFormatError, match=f"rank 1 of step 5: 'opt.x' {problem}"):
        blob_value(built, "rank 1 of step 5: 'opt.x'")


def test_a_chunk_name_gives_back_its_fqn_and_other_names_are_refused_naming_the_shard():
    assert chunk_key((0, 4, 2)) == "0,4,2" and chunk_key(()) == ""
    assert fqn_of("dcp/tensors/model.w/0,4", "rank 0 of step 1") == "model.w"
    assert fqn_of("dcp/tensors/a%2Fb/0", "rank 0 of step 1") == "a/b"  # a "/" in a key is escaped
    for name in ("dcp/tensors/w", "dcp/tensors/a/b/0", "other/tensors/w/0", "w"):
        with pytest.raises(ShardFormatError, match=f"rank 2 of step 7: {name!r} is not a chunk written by"):
            fqn_of(name, "rank 2 of step 7")
    assert is_value_chunk("dcp/blobs/x/bytes") and is_value_chunk("dcp/objects/x/0")
    assert not is_value_chunk("dcp/tensors/x/0")
    assert value_path("objects", "a.b") == (ROOT, "objects", "a.b")


def test_planner_paths_keep_only_the_key_paths_dcp_can_give_back():
    recorded = {"a.b": ("a", "b"), "l.0": ["l", 0], "bad": ("a", 1.5), 3: ("x",), "odd": "a.b"}
    assert planner_paths(recorded) == {"a.b": ["a", "b"], "l.0": ["l", 0]}
    assert planner_paths(None) == {} and planner_paths([("a", "b")]) == {}


def test_the_complex_and_planner_data_sections_are_read_back_checked():
    structure = structure_of({"complex": {"rope": "complex128"}, "planner_data": {"a.b": ["a", "b"], "l.0": ["l", 0]}})
    assert complex_dtypes_of(structure, "rank 0 of step 1") == {"rope": "complex128"}
    assert planner_data_of(structure, "rank 0 of step 1") == {"a.b": ("a", "b"), "l.0": ("l", 0)}
    assert keys_at(structure, (ROOT,)) == ["complex", "planner_data"]
    assert keys_at(structure, (ROOT, "blobs")) == []


def test_an_older_writers_shard_without_the_sections_reads_as_empty():
    structure = structure_of({"tensors": {}})
    assert complex_dtypes_of(structure, "w") == {} and planner_data_of(structure, "w") == {}


@pytest.mark.parametrize(
    "read, section, problem",
    [(complex_dtypes_of, {"complex": {"rope": "complex32"}}, "dcp/complex names a dtype other than"),
     (complex_dtypes_of, {"complex": ["complex64"]}, "dcp/complex is not a dict"),
     (planner_data_of, {"planner_data": {"a.b": "a.b"}}, "dcp/planner_data must map each key to a list"),
     (planner_data_of, {"planner_data": {"a.b": ["a", 1.5]}}, "dcp/planner_data must map each key to a list"),
     (planner_data_of, {"planner_data": 7}, "dcp/planner_data is not a dict")],
)  # fmt: skip
def test_a_section_that_is_not_what_the_writer_writes_is_a_shard_format_error_naming_the_shard(read, section, problem):
    with pytest.raises(ShardFormatError, match=f"rank 3 of step 9: {problem}"):
        read(structure_of(section), "rank 3 of step 9")


def test_a_manifest_dtype_code_names_its_torch_dtype():
    assert torch_dtype("F32") == torch.float32 and torch_dtype("BF16") == torch.bfloat16
