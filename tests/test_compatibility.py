"""Checkpoints written by version 0.3 (tests/fixtures/v0_3, by its make.py) restore bit for bit.

The fixture is frozen data: the code of the commit that wrote it, never today's, so a change
of any on-disk or in-bucket format (manifests, shard files, receipts, the bucket's layouts and
compression) fails here. Each restore reads a copy, so the fixture itself is never written.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_ckpt import CheckpointManager, RemoteOptions, load_sharded

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "v0_3"
_spec = importlib.util.spec_from_file_location("v0_3_make", FIXTURE / "make.py")
assert _spec is not None and _spec.loader is not None
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)


def assert_same(got, expected, path="state"):
    """``got`` equals ``expected`` bit for bit, with the same types, dtypes and shapes."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), path
        for key in expected:
            assert_same(got[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), path
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape, path
        assert got.view(torch.uint8).numpy().tobytes() == expected.view(torch.uint8).numpy().tobytes(), path
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == expected.dtype and got.shape == expected.shape, path
        assert got.tobytes() == expected.tobytes(), path
    else:
        assert type(got) is type(expected) and got == expected, path


def expected_states(step):
    return [make.state(step, rank) for rank in range(make.WORLD_SIZE)]


@pytest.fixture
def copy(tmp_path):
    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(FIXTURE / name, target)
        return target

    return copy


@pytest.mark.parametrize("step", [None, *make.STEPS])
def test_a_local_directory_written_by_0_3_restores_bit_for_bit(copy, step):
    with CheckpointManager(copy("local"), world_size=make.WORLD_SIZE) as manager:
        restored = manager.restore(step)
        assert restored.step == (step or max(make.STEPS))
        assert set(restored.sources.values()) == {"local"}
        for got, expected in zip(restored.torch_states(), expected_states(restored.step), strict=True):
            assert_same(got, expected)


@pytest.mark.parametrize("bucket", ["bucket-flat", "bucket-hashed-zstd"])
def test_a_bucket_written_by_0_3_restores_bit_for_bit_and_refills_an_empty_disk(copy, tmp_path, bucket):
    remote = RemoteOptions(copy(bucket).as_uri(), layout="hashed" if "hashed" in bucket else "flat")
    with CheckpointManager(tmp_path / "new-disk", world_size=make.WORLD_SIZE, remote=remote) as manager:
        for step in make.STEPS:
            restored = manager.restore(step)
            assert set(restored.sources.values()) == {"remote"}
            for got, expected in zip(restored.torch_states(), expected_states(step), strict=True):
                assert_same(got, expected)
        refilled = manager.restore()
        assert refilled.step == max(make.STEPS) and set(refilled.sources.values()) == {"local"}


def test_a_part_of_a_0_3_step_restores_from_its_bucket(copy, tmp_path):
    remote = RemoteOptions(copy("bucket-hashed-zstd").as_uri(), layout="hashed")
    with CheckpointManager(tmp_path / "new-disk", world_size=make.WORLD_SIZE, remote=remote) as manager:
        restored = manager.restore(paths=["model"])
    for got, expected in zip(restored.torch_states(), expected_states(max(make.STEPS)), strict=True):
        assert_same(got, {"model": expected["model"]})


def test_a_save_sharded_directory_written_by_0_3_loads_bit_for_bit(copy):
    loaded = load_sharded(copy("oneshot"), make.WORLD_SIZE)
    for got, expected in zip(loaded, expected_states(make.STEPS[0]), strict=True):
        tensor = expected["model"].pop("t")  # numpy holds it as ml_dtypes' bfloat16
        array = got["model"].pop("t")
        assert array.dtype.name == "bfloat16" and array.shape == tuple(tensor.shape)
        assert array.tobytes() == tensor.view(torch.uint8).numpy().tobytes()
        assert_same(got, expected)
