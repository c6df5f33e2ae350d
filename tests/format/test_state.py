"""Nested state: flattening, the structure document, round trips and refusals (hostile documents: test_structure)."""

from __future__ import annotations

import io
import math
import random
import struct
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_structure import read_in, shard_with_document

from tiered_ckpt import CheckpointManager, InvalidStateError, ShardFormatError, load_sharded, save_sharded
from tiered_ckpt.format import shardfile
from tiered_ckpt.format.state import ChunkOf, _Flattener, flatten, sharded_names
from tiered_ckpt.format.structure import MAX_DEPTH, Chunk, Structure, leaf_name

torch = pytest.importorskip("torch")


def bits(value: float) -> bytes:
    return struct.pack(">d", value)


def assert_same(restored, saved, path="state"):
    """Equal values of the same types, containers and key order; arrays byte-equal with their dtype."""
    if isinstance(saved, (np.ndarray, np.generic)) or torch.is_tensor(saved):
        expected = saved.detach().numpy() if torch.is_tensor(saved) else np.asarray(saved)
        actual = restored.detach().numpy() if torch.is_tensor(restored) else restored
        assert isinstance(actual, np.ndarray), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), path
        return
    if isinstance(saved, dict):
        assert type(restored) is dict and list(restored) == list(saved), path
        assert [type(k) for k in restored] == [type(k) for k in saved], path
        for key in saved:
            assert_same(restored[key], saved[key], f"{path}[{key!r}]")
        return
    assert type(restored) is type(saved), path
    if isinstance(saved, (list, tuple)):
        assert len(restored) == len(saved), path
        for index, (mine, theirs) in enumerate(zip(restored, saved, strict=True)):
            assert_same(mine, theirs, f"{path}[{index}]")
    elif isinstance(saved, float):
        assert bits(restored) == bits(saved), path
    else:
        assert restored == saved, path


def training_state(seed: int = 0) -> dict:
    """What a torch job checkpoints: model, AdamW after two steps, scheduler, RNG states, data position."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "sched": scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "data": {"epoch": 3, "position": 12_345, "shuffle_seed": 2**70 + 1},
        "note": "run-7",
        "resumed_from": None,
    }


def test_a_torch_training_state_round_trips_with_its_types(tmp_path):
    state = training_state()
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(10, state, blocking=True)
        restored = manager.restore()
    assert_same(restored.state, state)
    assert isinstance(restored.state["optim"]["state"][0]["exp_avg"], np.ndarray)
    assert restored.state["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert list(restored.state["optim"]["state"]) == [0, 1, 2, 3, 4, 5]  # int keys stay ints
    as_torch = restored.torch_state()
    assert torch.is_tensor(as_torch["model"]["0.weight"]) and torch.is_tensor(as_torch["rng"]["torch"])
    assert isinstance(as_torch["rng"]["numpy"][1], np.ndarray)  # saved as numpy: stays numpy
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    model.load_state_dict(as_torch["model"])
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(as_torch["optim"])
    torch.set_rng_state(as_torch["rng"]["torch"])
    np.random.set_state(as_torch["rng"]["numpy"])
    random.setstate(as_torch["rng"]["python"])
    after_restore = (torch.rand(2).tolist(), np.random.random(), random.random())
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    assert after_restore == (torch.rand(2).tolist(), np.random.random(), random.random())


SCALARS = {
    "zero": 0.0,
    "negative zero": -0.0,
    "inf": math.inf,
    "-inf": -math.inf,
    "nan with payload": struct.unpack(">d", bytes.fromhex("7ff8000000c0ffee"))[0],
    "negative nan": struct.unpack(">d", bytes.fromhex("fff8000000000001"))[0],
    "subnormal": 5e-324,
    "big int": 2**64 + 7,
    "huge negative int": -(2**20000),
    "int64 edge": -(2**63),
    "true": True,
    "false": False,
    "none": None,
    "text": "naïve ☃ / % # \x00",
    "empty": "",
}


def test_scalars_come_back_bit_exact_and_with_their_type(tmp_path):
    state = {"scalars": dict(SCALARS), "keys": {1: "one", "1": "string one", -5: [], 2**80: ()}}
    save_sharded([state], tmp_path, step=1)
    (restored,) = load_sharded(tmp_path, 1)
    assert_same(restored, state)


def test_names_of_distinct_paths_are_distinct_and_readable():
    state = {
        "model": {"layer.0.weight": np.zeros(1)},
        "a/b": np.zeros(1),
        "a": {"b": np.zeros(1), "%2F": np.zeros(1), "#0": np.zeros(1), 0: np.zeros(1), "": np.zeros(1)},
        "list": [np.zeros(1), {"x": np.zeros(1)}],
        "__metadata__": np.zeros(1),
    }
    names = set(flatten(state).arrays)
    assert names == {
        "model/layer.0.weight",
        "a%2Fb",
        "a/b",
        "a/%252F",
        "a/%230",
        "a/#0",
        "a/%",
        "list/0",
        "list/1/x",
        "%5F_metadata__",
    }
    assert flatten({"w": np.zeros(1)}).arrays.keys() == {"w"}  # a flat state keeps its keys as names


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.one_of(st.text(max_size=4), st.integers(-3, 3)), min_size=1, max_size=4), max_size=8))
def test_distinct_paths_never_share_a_name(paths):
    unique = {tuple((type(k), k) for k in path) for path in paths}
    names = {leaf_name([k for _, k in path]) for path in unique}
    prefixes = {p[:i] for p in unique for i in range(1, len(p))}
    if not unique & prefixes:  # a path that is a prefix of another cannot hold an array in one state
        assert len(names) == len(unique)


WhatNot = namedtuple("WhatNot", "a b")


@pytest.mark.parametrize(
    "value, path, problem",
    [
        ({1, 2}, 'state["optim"]["foo"]', "builtins.set"),
        (lambda: 1, 'state["optim"]["foo"]', "function"),
        (object(), 'state["optim"]["foo"]', "builtins.object"),
        ({(1, 2): 3}, 'state["optim"]["foo"]', "key (1, 2) of type tuple"),
        ({True: 3}, 'state["optim"]["foo"]', "key True of type bool"),
        (WhatNot(1, 2), 'state["optim"]["foo"]', "WhatNot"),
        ([1, {"x": np.array(["text"])}], 'state["optim"]["foo"][1]["x"]', "dtype <U4"),
        ("\ud800", 'state["optim"]["foo"]', "lone surrogate"),
        ({"\udc80": 1}, 'state["optim"]["foo"]', "not valid Unicode"),
        (np.ma.masked_array([1.0]), 'state["optim"]["foo"]', "masked array"),
    ],
)
def test_a_value_a_checkpoint_cannot_hold_is_refused_naming_its_path_before_anything_is_written(
    tmp_path, value, path, problem
):
    state = {"model": {"w": np.ones(3)}, "optim": {"foo": value}}
    with CheckpointManager(tmp_path, world_size=1) as manager:
        with pytest.raises(InvalidStateError) as caught:
            manager.save(1, state)
        assert path in str(caught.value) and problem in str(caught.value)
        assert manager.steps() == []
    assert not any(p.name.startswith("step-") for p in tmp_path.iterdir())


def test_a_state_that_contains_itself_or_nests_too_deep_is_refused():
    looped: dict = {"a": []}
    looped["a"].append(looped)
    with pytest.raises(InvalidStateError, match=r'state\["a"\]\[0\] contains itself'):
        flatten(looped)
    deep: dict = {}
    node = deep
    for _ in range(MAX_DEPTH + 1):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(InvalidStateError, match=f"deeper than {MAX_DEPTH}"):
        flatten(deep)


def test_an_ordered_dict_comes_back_as_a_dict_in_its_order():
    state = OrderedDict([("b", 1), ("a", np.arange(3))])
    flat = flatten(state)
    restored = Structure.from_json(flat.structure.to_json(), flat.arrays, "test").build(flat.arrays)
    assert type(restored) is dict and list(restored) == ["b", "a"]


def test_sharded_keys_may_name_paths_tensor_names_or_flat_keys():
    names = ["optim/state/#0/exp_avg", "a%2Fb", "w"]
    keys = [("optim", "state", 0, "exp_avg"), "a/b", "w"]
    assert sharded_names(keys, names) == names
    with pytest.raises(InvalidStateError, match="sharded_keys"):
        sharded_names([3.5], names)


# -- round trips generated by hypothesis ----------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.text(max_size=8),
)
arrays = st.builds(
    lambda dtype, shape, seed: np.random.default_rng(seed).integers(0, 255, size=shape).astype(dtype),
    st.sampled_from([np.float32, np.float16, np.int64, np.uint8, np.bool_]),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 2**32 - 1),
)
keys = st.one_of(st.text(max_size=6), st.integers(-(2**70), 2**70))
nested = st.recursive(
    st.one_of(scalars, arrays),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=20,
)
states = st.dictionaries(keys, nested, max_size=5)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(states)
def test_any_generated_state_survives_flatten_document_and_build(state):
    flat = flatten(state)
    parsed = Structure.from_json(flat.structure.to_json(), flat.arrays, "generated")
    assert_same(parsed.build(flat.arrays), state)
    assert parsed.difference(flat.structure) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(states)
def test_any_generated_state_round_trips_through_a_shard_file(tmp_path_factory, state):
    directory = tmp_path_factory.mktemp("shard")
    save_sharded([state], directory, step=1, sharded_keys=())
    (restored,) = load_sharded(directory, 1)
    assert_same(restored, state)


# -- whatever the reader refuses, the writer refuses first ---------------------------------------


def files_under(root) -> list[tuple[str, int]]:
    """Every file under ``root`` with its size: a save that refuses must leave this unchanged."""
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


def assert_refused_before_anything_is_written(tmp_path, state, *phrases):
    """``save`` (through the manager, and save_sharded) raises InvalidStateError with ``phrases``; no file changes."""
    with CheckpointManager(tmp_path / "run", world_size=1) as manager:
        before = files_under(tmp_path / "run")
        with pytest.raises(InvalidStateError) as caught:
            manager.save(1, state)
        assert files_under(tmp_path / "run") == before and manager.steps() == []
    for phrase in phrases:
        assert phrase in str(caught.value), str(caught.value)[:400]
    with pytest.raises(InvalidStateError):
        save_sharded([state], tmp_path / "sharded", step=1)
    assert not (tmp_path / "sharded").exists()
    return str(caught.value)


def round_trips(tmp_path, state) -> None:
    with CheckpointManager(tmp_path / "fits", world_size=1) as manager:
        manager.save(1, state, blocking=True)
        assert_same(manager.restore().state, state)


@pytest.mark.slow
def test_a_string_whose_shard_header_the_reader_would_refuse_is_refused_naming_its_path(tmp_path):
    # 14.5 M characters of é: 7 bytes each in the header (\\u00e9), over the reader's 100 MB
    state = {"w": np.ones(3, np.float32), "meta": {"note": "é" * 14_500_000}}
    message = assert_refused_before_anything_is_written(
        tmp_path, state, "rank 0: the state's shard header", 'state["meta"]["note"]', "over the 100,000,000"
    )
    assert "é" * 100 not in message  # the value itself is not repeated in the error


@pytest.fixture
def small_header_limit(monkeypatch):
    """The reader's (and so the writer's) header limit made small, so that states at its edge are cheap."""
    limit = 64_000
    monkeypatch.setattr(shardfile, "MAX_HEADER_BYTES", limit)
    return limit


def largest_accepted(make, low: int, high: int) -> int:
    """The largest n in [low, high) for which flatten(make(n)) succeeds (flatten(make(low)) does, make(high) not)."""
    while high - low > 1:
        middle = (low + high) // 2
        try:
            flatten(make(middle))
            low = middle
        except InvalidStateError:
            high = middle
    return low


@pytest.mark.parametrize(
    "what, make, named",
    [
        ("a long string", lambda n: {"w": np.ones(2), "note": "x" * n}, 'state["note"]'),
        ("a long key", lambda n: {"w": np.ones(2), "k" * n: np.zeros(2)}, 'state["kkkkkkkkkk'),
        ("a huge int", lambda n: {"w": np.ones(2), "seed": 2 ** (4 * n)}, 'state["seed"]'),
        pytest.param(
            "many arrays",
            lambda n: {"layers": [np.zeros(1, np.float16) for _ in range(n)]},
            "save fewer, larger",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_state_at_the_header_limit_round_trips_and_one_just_over_it_is_refused(
    tmp_path, small_header_limit, what, make, named
):
    n = largest_accepted(make, 1, small_header_limit)
    round_trips(tmp_path, make(n))  # the reader takes the largest state the writer takes
    shard = next((tmp_path / "fits").rglob("rank-*.safetensors"))
    (header,) = struct.unpack("<Q", shard.read_bytes()[:8])
    assert small_header_limit - 1100 < header <= small_header_limit  # at the edge (the writer keeps 1 KiB spare)
    message = assert_refused_before_anything_is_written(tmp_path, make(n + 1), named, "over the 64,000")
    assert message.startswith("rank 0: ")


def nested(depth: int, leaf) -> dict:
    """A state whose innermost container sits ``depth`` keys below the root (alternating dicts and lists)."""
    node = leaf
    for level in range(depth - 1):
        node = {"d": node} if level % 2 else [node]
    return {"top": node} if depth else node


def test_nesting_at_the_depth_limit_round_trips_and_one_level_more_is_refused(tmp_path):
    state = nested(MAX_DEPTH - 1, {"w": np.arange(3.0), "s": "leaf"})  # its leaves at MAX_DEPTH
    round_trips(tmp_path, state)
    assert_refused_before_anything_is_written(
        tmp_path, nested(MAX_DEPTH, {"w": np.arange(3.0)}), f"nested deeper than {MAX_DEPTH}"
    )
    assert_refused_before_anything_is_written(tmp_path, nested(MAX_DEPTH, {}), f"nested deeper than {MAX_DEPTH}")


def test_the_reader_refuses_a_container_where_the_writer_would_and_no_sooner(tmp_path):
    def document(lists: int) -> str:  # the innermost list `lists` keys below the root
        return (
            '{"version": 1, "root": {"dict": [["w", {"array": "w"}], ["x", ' + '{"list": [' * lists
            + "]}" * lists + "]]}}"
        )  # fmt: skip

    read_in(tmp_path, shard_with_document(tmp_path, document(MAX_DEPTH - 1)))
    with pytest.raises(ShardFormatError, match=f"deeper than {MAX_DEPTH}"):
        read_in(tmp_path, shard_with_document(tmp_path, document(MAX_DEPTH)))
    with pytest.raises(InvalidStateError, match=f"deeper than {MAX_DEPTH}"):
        flatten({"w": np.ones(1), "x": nested(MAX_DEPTH - 1, [])})


def test_a_chunk_placed_by_numpy_or_torch_integers_round_trips(tmp_path):
    whole = np.arange(12.0).reshape(4, 3)
    state = {
        "numpy": ChunkOf(whole[2:], np.array([4, 3]), (np.int64(2), np.int32(0))),
        "torch": ChunkOf(whole[:2], torch.Size([4, 3]), (torch.tensor(0), 0)),
    }
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, state, blocking=True)
        restored = manager.restore()
    np.testing.assert_array_equal(restored.state["numpy"], whole[2:])
    assert restored.flat[0].structure.chunks["numpy"] == Chunk((4, 3), (2, 0))


@pytest.mark.parametrize(
    "global_shape, offsets",
    [((True, 3), (0, 0)), ((4, 3), (0.0, 0)), ((4, 3), (-1, 0)), ((4, 3), ("0", 0)), (4, (0, 0))],
)
def test_a_chunk_placed_by_what_the_reader_refuses_is_refused_naming_its_path(tmp_path, global_shape, offsets):
    state = {"w": ChunkOf(np.ones((2, 3)), global_shape, offsets)}
    assert_refused_before_anything_is_written(tmp_path, state, 'state["w"]')


def chunked_states(arrays_per_rank: int, world_size: int = 2) -> list[dict]:
    """Per rank, ``arrays_per_rank`` DTensor-like chunks (each rank holds one row of each tensor)."""
    return [
        {"layers": [ChunkOf(np.full((1, 3), float(rank)), (world_size, 3), (rank, 0)) for _ in range(arrays_per_rank)]}
        for rank in range(world_size)
    ]


def test_a_step_whose_manifest_the_reader_would_refuse_is_refused_on_every_rank_before_anything_is_written(
    tmp_path, monkeypatch
):
    from tiered_ckpt.format import manifest

    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 200_000)  # the reader's limit, small to stay cheap
    with CheckpointManager(tmp_path / "run", world_size=2) as manager:
        manager.save(1, chunked_states(150), blocking=True)  # fits: the reader reads it back
        assert len(manager.restore().states[1]["layers"]) == 150
        written = (tmp_path / "run" / "step-000000000001" / "manifest.json").stat().st_size
        before = files_under(tmp_path / "run")
        with pytest.raises(InvalidStateError, match=r"step 2: the manifest of its 2 ranks .* over the 200,000"):
            manager.save(2, chunked_states(400))
        assert files_under(tmp_path / "run") == before and manager.steps() == [1]
    assert written < 200_000
    with pytest.raises(InvalidStateError, match="over the 200,000"):
        save_sharded(chunked_states(400), tmp_path / "sharded", step=1)
    assert not (tmp_path / "sharded").exists()


@pytest.mark.slow
def test_a_state_one_rank_could_never_load_fails_the_save_on_every_rank_before_anything_is_written(tmp_path):
    from support.processes import launch_ranks

    worker = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"
    config = {"actions": [{"do": "save", "step": 1, "long_note_on_rank": 1}], "timeout_seconds": 60}
    results = launch_ranks(worker, tmp_path, 2, config)
    for rank, result in results.items():
        assert result["error"][0] == "InvalidStateError", result
        named = "rank 1" if rank == 1 else 'rank 1 (during "save")'  # and the collective, on the other rank
        assert result["error"][1].startswith(f"{named}: the state's shard header"), result
        assert 'state["note"]' in result["error"][1]
        assert not (tmp_path / "nodes" / f"rank-{rank}" / "step-000000000001").exists()


@pytest.mark.parametrize("step", [2**63, 10**300])
def test_a_step_no_directory_name_or_reader_can_hold_is_refused_before_anything_is_written(tmp_path, step):
    with CheckpointManager(tmp_path / "run", world_size=1) as manager:
        manager.save(2**63 - 1, {"w": np.ones(2)}, blocking=True)  # the largest step saves and loads
        assert manager.restore().step == 2**63 - 1
        before = files_under(tmp_path / "run")
        with pytest.raises(InvalidStateError, match=r"step must be an integer from 0 to 2\*\*63 - 1"):
            manager.save(step, {"w": np.ones(2)})
        assert files_under(tmp_path / "run") == before
    with pytest.raises(InvalidStateError, match="step must be"):
        save_sharded([{"w": np.ones(2)}], tmp_path / "sharded", step=step)


def test_bytes_and_bytesio_values_round_trip_as_uint8_arrays_with_their_type(tmp_path):
    state = {
        "train": {"state": io.BytesIO(b"\x00torchtitan\xff"), "rng": b"\x01\x02", "empty": b""},
        "list": [b"a", (io.BytesIO(b""), 3)],
    }
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, state, blocking=True)
        restored = manager.restore()
        shard = next((tmp_path / "step-000000000001").glob("*.safetensors"))
    train = restored.state["train"]
    assert type(train["state"]) is io.BytesIO and train["state"].getvalue() == b"\x00torchtitan\xff"
    assert type(train["rng"]) is bytes and train["rng"] == b"\x01\x02" and train["empty"] == b""
    assert restored.state["list"][0] == b"a" and restored.state["list"][1][0].getvalue() == b""
    assert restored.torch_state()["train"]["rng"] == b"\x01\x02"  # not a tensor: bytes stay bytes
    from safetensors.numpy import load_file  # no pickle: the bytes are a uint8 array any reader opens

    assert load_file(shard)["train/rng"].tolist() == [1, 2]


def test_complex_arrays_and_tensors_round_trip_as_float_pairs_with_their_dtype(tmp_path):
    rope = torch.polar(torch.ones(4, 3), torch.arange(12.0).reshape(4, 3))
    state = {
        "rope": rope,
        "rope128": rope.to(torch.complex128)[:, ::2],  # not contiguous
        "np": (np.arange(5) * (1 + 2j)).astype(np.complex64),
        "scalar": np.complex128(3 - 4j),
    }
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, state, blocking=True)
        restored = manager.restore()
        torch_state = restored.torch_state()
        assert torch_state["rope"].dtype == torch.complex64 and torch.equal(torch_state["rope"], rope)
        assert torch_state["rope128"].dtype == torch.complex128
        assert torch.equal(torch_state["rope128"], state["rope128"])
        assert restored.state["np"].dtype == np.complex64 and np.array_equal(restored.state["np"], state["np"])
        assert restored.state["scalar"].dtype == np.complex128 and restored.state["scalar"] == 3 - 4j
        into = {"rope": torch.zeros(4, 3, dtype=torch.complex64), "rope128": torch.zeros(4, 2, dtype=torch.complex128),
                "np": np.zeros(5, np.complex64), "scalar": np.zeros((), np.complex128)}  # fmt: skip
        manager.restore(into=into)
        assert torch.equal(into["rope"], rope) and np.array_equal(into["np"], state["np"])  # filled in place


class _Subclass(np.ndarray):
    """An ndarray subclass: flattened by the general dispatch, not the plain-array fast path."""


@given(
    st.dictionaries(
        st.one_of(st.text(alphabet=st.sampled_from("%#/ab_é\x01"), max_size=6), st.integers(-3, 3)),
        st.sampled_from(["f4", "i8", "bool", "c8", "u2"]),
        max_size=8,
    ),
    st.booleans(),
)
def test_plain_arrays_flatten_as_the_general_path_does(keys, nested):
    """The fast path for plain arrays under plain keys (any key may need escaping, a complex
    dtype or a renamed ``__metadata__``) names and records each array as the general one."""

    def state(kind):
        arrays = {key: np.zeros(2, dtype).view(kind) for key, dtype in keys.items()}
        return {"outer/": arrays, "__metadata__": np.ones(1).view(kind)} if nested else arrays

    fast, general = flatten(state(np.ndarray)), flatten(state(_Subclass))
    assert fast.structure == general.structure
    assert list(fast.arrays) == list(general.arrays)
    assert all(fast.arrays[name].dtype == array.dtype for name, array in general.arrays.items())


def test_the_fast_path_notes_the_longest_plain_key():
    """The fast path still notes the longest key: what the refusal of a too large header names."""
    long_key = "k" * 2_000
    flattener = _Flattener("rank 0", into=False)
    flattener.node({"a": np.zeros(1), long_key: np.zeros(1), "b": np.zeros(1)}, (), "")
    assert flattener.largest == (2_000, (long_key,))
    for kind in (np.ndarray, _Subclass):  # the first of the longest keys, as the general path names it
        flattener = _Flattener("rank 0", into=False)
        flattener.node({"x" * 1500: np.zeros(1).view(kind), "n": {"y" * 1500: np.zeros(1).view(kind)}}, (), "")
        assert flattener.largest == (1500, ("x" * 1500,))
