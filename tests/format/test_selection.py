"""What a partial restore selects: the structure cut to the paths asked for, and refusals naming the path."""

import numpy as np
import pytest

from tiered_ckpt.errors import UsageError
from tiered_ckpt.format.selection import check_paths, prefixes, select, selects
from tiered_ckpt.format.state import flatten

STATE = {
    "model": {"w": np.ones(3), "b": np.zeros(2), "version": 3},
    "optim": {"state": {0: {"m": np.ones(3)}, 1: {"m": np.ones(2)}}, "param_groups": [{"lr": 0.1}]},
    "step": 7,
    "a/b": np.ones(1),
}


def cut(*paths):
    flat = flatten(STATE)
    structure = select(flat.structure, check_paths(list(paths)), "shard")
    return structure.build({name: flat.arrays[name] for name in structure.kinds}), set(structure.kinds)


def test_a_top_level_key_keeps_its_whole_subtree_scalars_included():
    state, names = cut("model")
    assert set(state) == {"model"} and state["model"]["version"] == 3
    assert names == {"model/w", "model/b"}


def test_a_path_of_keys_cuts_each_level_and_int_keys_stay_ints():
    state, names = cut(("optim", "state", 1))
    assert state == {"optim": {"state": {1: {"m": state["optim"]["state"][1]["m"]}}}}
    assert names == {"optim/state/#1/m"}


def test_tensor_names_and_keys_that_look_like_names_each_select_what_they_name():
    state, names = cut("model/w", "a/b", "step")
    assert names == {"model/w", "a%2Fb"} and state["step"] == 7 and set(state["model"]) == {"w"}


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        (["nope"], r"'nope' is neither a top-level key \(a/b, model, optim, step\) nor an array"),
        ([("optim", "state", 2)], r'state\["optim"\]\["state"\]\[2\] is not in the saved state'),
        ([("optim", "state", "0")], r'state\["optim"\]\["state"\]\["0"\] is not in the saved state'),
        ([("optim", "param_groups", 0)], r'state\["optim"\]\["param_groups"\]\[0\] goes into a list, not a dict'),
    ],
)
def test_a_path_not_in_the_state_or_into_a_list_is_refused_naming_it(paths, message):
    with pytest.raises(UsageError, match=message):
        cut(*paths)


@pytest.mark.parametrize("bad", ["model", [], [3], [()], [("a", 1.5)], None])
def test_paths_that_are_not_a_list_of_keys_names_or_tuples_are_refused(bad):
    with pytest.raises(UsageError, match="paths"):
        check_paths(bad)


def test_the_start_of_tensor_names_selects_the_part_they_lie_under_int_keys_included():
    state, names = cut("optim/state/#1")
    assert names == {"optim/state/#1/m"} and set(state["optim"]["state"]) == {1}


def test_a_huge_int_key_beside_the_selection_is_no_obstacle():
    flat = flatten({"model": {"w": np.ones(2)}, 2**70: np.zeros(1)})
    structure = select(flat.structure, check_paths(["model"]), "shard")
    assert set(structure.kinds) == {"model/w"}


def test_the_names_a_selection_starts_decide_alike_from_names_alone():
    flat = flatten(STATE)
    starts = prefixes(flat.structure, check_paths(["model", ("optim", "state", 0)]), "shard")
    assert starts == ("model", "optim/state/#0")
    assert selects(starts, "model/w") and selects(starts, "optim/state/#0/m")
    assert not selects(starts, "optim/state/#1/m") and not selects(starts, "modelx/w")


def test_bytes_are_not_a_path_of_keys():
    with pytest.raises(UsageError, match=r"b'model' is neither a key"):
        check_paths([b"model"])
