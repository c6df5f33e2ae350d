"""The step a DCP checkpoint_id names: a step, its digits, or its directory under the
manager's local_dir or remote_url; anything else is refused naming both places."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_ckpt import CheckpointManager, RemoteOptions, UsageError
from tiered_ckpt.format.layout import step_dir_name

pytest.importorskip("torch")
from tiered_ckpt.torch.dcp_steps import step_of  # noqa: E402


@pytest.fixture
def manager(tmp_path, file_url):
    url, options = file_url
    with CheckpointManager(
        tmp_path / "ckpt", world_size=1, remote=RemoteOptions(url, storage_options=options)
    ) as manager:
        yield manager


def test_a_step_its_digits_or_its_directory_under_either_tier_name_the_step(manager, file_url):
    url = file_url[0]
    assert step_of(0, manager) == 0 and step_of(10, manager) == 10
    assert step_of("10", manager) == 10 and step_of("0010", manager) == 10
    assert step_of(manager.root / step_dir_name(10), manager) == 10
    assert step_of(f"{manager.root}/{step_dir_name(12)}/", manager) == 12
    assert step_of(f"{url}/{step_dir_name(14)}", manager) == 14
    assert step_of(f"{url}/{step_dir_name(14)}/", manager) == 14
    relative = Path("..") / manager.root.parent.name / manager.root.name / step_dir_name(16)
    assert step_of(manager.root.parent / relative, manager) == 16  # resolved before it is compared


@pytest.mark.parametrize(
    "checkpoint_id",
    ["latest", "step-10", "", " 10", "١٠", -1, True, 1.5, None, b"10", "/elsewhere/step-000000000010",
     "s3://other/run/step-000000000010", step_dir_name(10)],
)  # fmt: skip
def test_anything_else_is_refused_naming_the_places_a_step_could_be(manager, file_url, checkpoint_id):
    with pytest.raises(UsageError, match="names no step of") as caught:
        step_of(checkpoint_id, manager)
    assert str(manager.root) in str(caught.value) and file_url[0] in str(caught.value)
    assert step_dir_name(10) in str(caught.value)  # what a step's directory looks like
