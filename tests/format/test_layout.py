import pytest

from tiered_ckpt import UsageError
from tiered_ckpt.format import layout
from tiered_ckpt.io import durable


def test_step_dir_names_sort_as_numbers_and_parse_back():
    steps = [0, 9, 10, 1200, 999_999_999_999]
    names = [layout.step_dir_name(step) for step in steps]
    assert sorted(names) == names
    assert [layout.parse_step_dir_name(name) for name in names] == steps
    assert layout.step_dir_name(1200) == "step-000000001200"


@pytest.mark.parametrize("name", ["step-12", "step-00000000001x", "steps-000000000001", "step-000000000001.tmp", ""])
def test_other_names_are_not_step_dirs(name):
    assert layout.parse_step_dir_name(name) is None


def test_shard_name_is_plain_and_rejects_bad_rank():
    assert layout.shard_name(3, 4) == "rank-00003-of-00004.safetensors"
    assert layout.is_plain_name(layout.shard_name(3, 4))
    with pytest.raises(UsageError):  # a ValueError too
        layout.shard_name(4, 4)


def test_temp_names_are_unique_never_plain_and_trace_back_to_their_target():
    first, second = durable.temp_name("manifest.json"), durable.temp_name("manifest.json")
    assert first != second
    for name in (first, second):
        assert durable.is_temp_name(name)
        assert not layout.is_plain_name(name)
        assert durable.temp_target(name) == "manifest.json"
    assert not durable.is_temp_name("manifest.json")
    assert durable.temp_target("rank-00000-of-00001.safetensors") is None
