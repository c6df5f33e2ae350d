"""format/structure: the structure document as hostile input, and what a reader sees of it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt import ShardFormatError, save_sharded
from tiered_ckpt.format.shardfile import ShardContents, write_shard
from tiered_ckpt.format.state import FlatState, flatten
from tiered_ckpt.format.structure import MAX_DEPTH, STRUCTURE_KEY, Structure, leaf_name, unescape
from tiered_ckpt.tiers.local import LocalTier


def read_in(directory, record):
    """The state of ``record``'s shard in ``directory``, read by the local tier (as a load reads it)."""
    return LocalTier(directory, single_step=True).read_shard(0, record)


def shard_with_document(tmp_path, document: str | None, arrays=None):
    """A shard whose sha256 matches its bytes, whatever structure document it carries."""
    from tiered_ckpt.format.manifest import ShardRecord

    arrays = {"w": np.arange(4, dtype=np.float32)} if arrays is None else arrays
    path = tmp_path / "rank-00000-of-00001.safetensors"
    with open(path, "wb") as out:
        digest = write_shard(out, arrays, {STRUCTURE_KEY: document} if document is not None else {})
    return ShardRecord(0, path.name, digest.sha256, digest.xxh3_64, digest.size_bytes, 0, 0)


VALID = json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}]]}})
HOSTILE = {
    "not json": '{"version": 1, "root": ',
    "not an object": "[1, 2]",
    "extra field": json.dumps({"version": 1, "root": {"dict": []}, "more": 1}),
    "unknown version": json.dumps({"version": 2, "root": {"dict": [["w", {"array": "w"}]]}}),
    "version as string": json.dumps({"version": "1", "root": {"dict": [["w", {"array": "w"}]]}}),
    "root not a dict": json.dumps({"version": 1, "root": {"list": [{"array": "w"}]}}),
    "array the shard lacks": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "v"}]]}}),
    "array named twice": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], ["v", {"array": "w"}]]}}),
    "array left out": json.dumps({"version": 1, "root": {"dict": []}}),
    "unknown node": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], ["s", {"set": [1]}]]}}),
    "two tags": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w", "list": []}]]}}),
    "float as json number": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], ["f", 1.5]]}}),
    "bad float bits": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], ["f", {"float": "xyz"}]]}}),
    "bad hex int": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], ["i", {"int": "12"}]]}}),
    "int out of range": '{"version": 1, "root": {"dict": [["w", {"array": "w"}], ["i", 99999999999999999999]]}}',
    "int too long to parse": '{"version": 1, "root": {"dict": [["w", {"array": "w"}], ["i", ' + "9" * 5000 + "]]}}",
    "duplicate key": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], ["w", None]]}}),
    "key of wrong type": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], [[1], None]]}}),
    "item not a pair": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], ["x"]]}}),
    "complex wrapping a list": json.dumps(
        {"version": 1, "root": {"dict": [["w", {"complex64": {"list": [{"array": "w"}]}}]]}}
    ),
    "bytes naming no string": json.dumps(
        {"version": 1, "root": {"dict": [["w", {"array": "w"}], ["b", {"bytes": 1}]]}}
    ),
    "list not a list": json.dumps({"version": 1, "root": {"dict": [["w", {"array": "w"}], ["l", {"list": 3}]]}}),
    "huge nesting": '{"version": 1, "root": {"dict": [["w", {"array": "w"}], ["x", '
    + '{"list": [' * 100_000
    + "]}" * 100_000
    + "]]}}",
    "deep but valid json": '{"version": 1, "root": {"dict": [["w", {"array": "w"}], ["x", '
    + '{"list": [' * (MAX_DEPTH + 5)
    + "]}" * (MAX_DEPTH + 5)
    + "]]}}",
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_structure_document_is_a_shard_format_error_naming_the_file(tmp_path, case):
    record = shard_with_document(tmp_path, HOSTILE[case])
    with pytest.raises(ShardFormatError, match="rank-00000-of-00001.safetensors"):
        read_in(tmp_path, record)


def test_a_shard_without_a_document_is_refused_naming_the_file_and_the_key(tmp_path):
    record = shard_with_document(tmp_path, None, {"w": np.arange(3.0), "b": np.zeros(2, np.float16)})
    with pytest.raises(ShardFormatError, match=r"safetensors: the shard has no structure document \(tiered_ckpt"):
        read_in(tmp_path, record)
    assert read_in(tmp_path, shard_with_document(tmp_path, VALID)).unflatten()["w"].tolist() == [0, 1, 2, 3]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_documents_parse_or_raise_shard_format_error(data):
    state = {"w": np.zeros(2), "opt": {0: {"m": np.ones(1)}, "lr": 0.5, "betas": (0.9, 0.99)}, "e": [1, None, "x"]}
    flat = flatten(state)
    text = flat.structure.to_json()
    kind = data.draw(st.sampled_from(["truncate", "replace", "insert"]))
    at = data.draw(st.integers(0, len(text)))
    if kind == "truncate":
        text = text[:at]
    else:
        piece = data.draw(st.sampled_from(['"', "[", "]", "{", "}", ",", "1", "-", "null", '"int"', '"x"', ":", "e9"]))
        text = text[:at] + piece + text[at + (1 if kind == "replace" else 0) :]
    try:
        parsed = Structure.from_json(text, flat.arrays, "mutated")
    except ShardFormatError as error:
        assert "mutated" in str(error)
    else:
        parsed.build(flat.arrays)  # whatever parses, builds


def test_from_shard_reads_the_document_from_the_metadata():
    arrays = {"w": np.zeros(1)}
    flat = FlatState.from_shard(ShardContents(arrays, {STRUCTURE_KEY: VALID}), "x")
    assert flat.structure.kinds == {"w": "array"}


def test_a_nested_state_shard_opens_with_safetensors_under_its_tensor_names(tmp_path):
    from safetensors import safe_open

    state = {"optim": {"state": {0: {"exp_avg": np.ones(3, np.float32)}}, "lr": 0.1}, "a/b": np.zeros(2)}
    save_sharded([state], tmp_path, step=1)
    (path,) = tmp_path.glob("rank-*")
    with safe_open(str(path), "np") as shard:
        assert sorted(shard.keys()) == ["a%2Fb", "optim/state/#0/exp_avg"]
        assert shard.get_tensor("optim/state/#0/exp_avg").tolist() == [1.0, 1.0, 1.0]
        assert json.loads(shard.metadata()[STRUCTURE_KEY])["version"] == 1


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("%#/2F35ab_"), max_size=10).filter(lambda key: key != "__metadata__"))
def test_unescape_gives_back_the_key_a_name_segment_was_made_of(key):
    assert unescape(leaf_name([key])) == key


def test_a_complex_leaf_whose_pairs_are_not_floats_is_a_shard_format_error(tmp_path):
    document = json.dumps({"version": 1, "root": {"dict": [["w", {"complex64": {"array": "w"}}]]}})
    record = shard_with_document(tmp_path, document, {"w": np.arange(4, dtype=np.int32)})
    state = read_in(tmp_path, record)
    with pytest.raises(ShardFormatError, match="complex64"):
        state.unflatten()
