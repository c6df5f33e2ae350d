"""The host memory a save holds for staging (tiered_ckpt.engine.memory_budget, engine.staging):
measured in fresh processes (the benchmark's ``benchmarks.memory``), a state of 2, 5 and 20
times the budget saved and restored."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.host_device import on_device
from tiered_ckpt import CheckpointManager, ConfigError, RuntimeOptions
from tiered_ckpt.engine.memory_budget import (
    MIN_DEFAULT_BYTES,
    NODE_SHARE,
    cgroup_limit,
    default_host_memory_bytes,
    local_processes,
    node_memory_bytes,
)
from tiered_ckpt.engine.staging import PIECE_BYTES
from tiered_ckpt.io import off_host

REPOSITORY = Path(__file__).resolve().parents[2]
MIB = 1 << 20
SLOT = PIECE_BYTES  # the allowance past the budget: the write path's own buffers and the allocator's slack


def run_child(directory: Path, state_bytes: int, budget: int | None, arrays: int, *extra: str, env=None):
    """``benchmarks.memory``'s measure in a fresh process: what a save and a restore added to its peak RSS."""
    command = [sys.executable, "-m", "benchmarks.memory", str(directory), str(state_bytes), str(budget or "default")]
    environ = {**os.environ, **(env or {})}
    done = subprocess.run(
        [*command, str(arrays), *extra], capture_output=True, text=True, env=environ, cwd=REPOSITORY, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("times", [2, 5, 20])
def test_a_state_larger_than_the_budget_is_saved_and_restored_within_it(tmp_path, times):
    budget = 16 * MIB
    got = run_child(tmp_path, times * budget, budget, 8)
    assert got["exact"]  # bit for bit, into the caller's arrays
    assert got["save_peak"] <= budget + SLOT, got
    assert got["restore_peak"] <= budget + SLOT, got
    assert got["staged_bytes"] == budget and got["throttled_bytes"] == (times - 1) * budget  # a slice of one array
    assert abs(got["blocked_seconds"] - got["around"]) <= 0.1 * got["around"]
    assert 0 < got["throttled_seconds"] <= got["blocked_seconds"]


@pytest.mark.slow
def test_a_restore_from_the_bucket_into_given_arrays_holds_no_copy_of_the_state(tmp_path):
    budget = 16 * MIB
    got = run_child(tmp_path, 10 * budget, budget, 8, "bucket")
    assert got["exact"] and got["save_peak"] <= budget + SLOT and got["restore_peak"] <= budget + SLOT, got


@pytest.mark.slow
@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_a_restore_into_arrays_over_an_unnamed_file_holds_a_piece_of_them(tmp_path, where):
    # What a restore into CUDA tensors past the budget reads into: pages the read touches count
    # in the process unless it lets them go (without: the state's size, 320 MiB here; letting go
    # of each piece's range only, 85 MiB: faults of large folios mapped pages let go before).
    budget = 16 * MIB
    got = run_child(tmp_path, 20 * budget, budget, 8, "paged", *(["bucket"] if where == "bucket" else []))
    assert got["exact"] and got["restore_peak"] <= budget + SLOT, got


@pytest.mark.slow
def test_the_default_budget_holds_on_a_state_larger_than_it(tmp_path):
    # As many processes on the node as make a quarter of its memory, shared, fall below the floor.
    processes = str(max(1, default_host_memory_bytes({}) // MIN_DEFAULT_BYTES + 1))
    assert default_host_memory_bytes({"LOCAL_WORLD_SIZE": processes}) == MIN_DEFAULT_BYTES
    state = MIN_DEFAULT_BYTES + 64 * MIB
    got = run_child(tmp_path, state, None, 5, env={"LOCAL_WORLD_SIZE": processes})
    assert got["exact"] and got["save_peak"] <= MIN_DEFAULT_BYTES + SLOT, got
    assert got["staged_bytes"] == MIN_DEFAULT_BYTES and got["throttled_bytes"] > 0


def test_the_default_is_a_share_of_the_nodes_memory_per_process_with_a_floor():
    node = node_memory_bytes()
    assert 0 < node <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_host_memory_bytes({}) == max(MIN_DEFAULT_BYTES, node // NODE_SHARE)
    assert default_host_memory_bytes({"LOCAL_WORLD_SIZE": "4"}) == max(MIN_DEFAULT_BYTES, node // NODE_SHARE // 4)
    assert default_host_memory_bytes({"LOCAL_WORLD_SIZE": "junk"}) == default_host_memory_bytes({})


def test_a_throttled_save_is_bit_exact_says_what_it_cost_and_warns_once(tmp_path, caplog):
    states = [{"w": np.arange(300_000, dtype=np.float64) + rank, "b": np.ones((2, 5), np.int32)} for rank in range(2)]
    runtime = RuntimeOptions(host_memory_bytes=1 << 20)  # the state is 4.8 MB
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        with CheckpointManager(tmp_path, world_size=2, runtime=runtime) as manager:
            first = manager.save(1, states, blocking=True)
            second = manager.save(2, states, blocking=True)
            restored = manager.restore()
    for handle in (first, second):
        assert handle.throttled_bytes > 0 and 0 < handle.staged_bytes <= 1 << 20
        assert handle.staged_bytes + handle.throttled_bytes == 2 * (300_000 * 8 + 40)
    for rank in range(2):
        np.testing.assert_array_equal(restored.states[rank]["w"], states[rank]["w"])
    warnings = [r.getMessage() for r in caplog.records if "throttled by runtime.host_memory_bytes" in r.getMessage()]
    assert len(warnings) == 1 and "step 1" in warnings[0]


def test_a_budget_that_is_not_a_positive_integer_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match="host_memory_bytes"):
        RuntimeOptions(host_memory_bytes=0)
    with pytest.raises(ConfigError, match="host_memory_bytes"):
        RuntimeOptions(host_memory_bytes=1.5)


def test_the_tightest_limit_of_the_processs_cgroup_and_its_ancestors_is_the_nodes_memory(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "job" / "memory.max").write_text("1073741824\n")
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    cgroups = tmp_path / "cgroup-v2"
    cgroups.write_text("0::/job/step\n")
    assert cgroup_limit(str(cgroups), str(v2)) == 1 << 30  # the job's, above the step's cgroup
    v1 = tmp_path / "v1"
    (v1 / "memory" / "slurm" / "uid_0").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "slurm" / "uid_0" / "memory.limit_in_bytes").write_text("2147483648\n")
    cgroups.write_text("12:cpu,cpuacct:/slurm\n5:memory:/slurm/uid_0\n")
    assert cgroup_limit(str(cgroups), str(v1)) == 2 << 30
    (v1 / "memory" / "slurm" / "uid_0" / "memory.limit_in_bytes").unlink()
    assert cgroup_limit(str(cgroups), str(v1)) == 9223372036854771712  # no limit: the RAM caps it
    assert cgroup_limit(str(tmp_path / "none"), str(tmp_path / "nothing")) is None


def test_the_processes_on_a_node_are_counted_from_any_launchers_variable():
    assert local_processes({}) == 1
    assert local_processes({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert local_processes({"SLURM_NTASKS_PER_NODE": "4(x2)"}) == 4
    assert local_processes({"OMPI_COMM_WORLD_LOCAL_SIZE": "6", "LOCAL_WORLD_SIZE": "junk"}) == 6
    assert local_processes({"MPI_LOCALNRANKS": "0"}) == 1


@pytest.mark.parametrize("budget", [1 << 20, 3_000_000], ids=["whole-arrays-lent", "a-tail-staged"])
def test_arrays_changed_once_a_throttled_save_returns_are_saved_as_they_were(tmp_path, budget):
    """What ``save`` returns after is what is saved: the caller overwrites its arrays at once."""
    states = [{f"w{i}": np.full(200_000, rank * 10 + i, np.float64) for i in range(4)} for rank in range(3)]
    expected = [{name: array.copy() for name, array in state.items()} for state in states]
    runtime = RuntimeOptions(host_memory_bytes=budget, max_workers=1)  # shards one at a time: the longest wait
    with CheckpointManager(tmp_path, world_size=3, runtime=runtime) as manager:
        handle = manager.save(1, states)  # not blocking
        assert handle.throttled_bytes > 0
        for state in states:
            for array in state.values():
                array.fill(-1.0)
        manager.wait()
        restored = manager.restore()
    for rank in range(3):
        for name, array in expected[rank].items():
            np.testing.assert_array_equal(restored.states[rank][name], array)


@pytest.mark.parametrize("budget", [None, 1 << 20], ids=["staged-from-the-device", "written-from-the-device"])
def test_arrays_on_a_device_are_copied_once_within_the_budget_and_saved_bit_exact(tmp_path, budget, monkeypatch):
    """A device array (here a stand-in whose "device" is host memory, copied call for call as
    CUDA's is) is copied whole into a buffer of its source's within the budget; past it, the
    writer copies it a piece at a time while the save call waits, and nothing else reads it."""
    monkeypatch.setattr(off_host, "PIECE_BYTES", 64 << 10)  # "w" is then many pieces
    rng = np.random.default_rng(7)
    arrays = {"w": rng.standard_normal(300_000).astype(np.float32), "m": rng.integers(0, 9, (64, 33), np.int64)}
    stand_ins = {name: on_device(array) for name, array in arrays.items()}
    state = {"model": {name: stand_in for name, (stand_in, _source) in stand_ins.items()}, "step": 3}
    runtime = RuntimeOptions(host_memory_bytes=budget or (64 << 20))
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:
        first = manager.save(1, state, blocking=True)
        second = manager.save(2, state, blocking=True)
        restored = manager.restore()
    for name, array in arrays.items():
        np.testing.assert_array_equal(restored.state["model"][name], array)
    assert restored.state["step"] == 3
    source = stand_ins["w"][1]
    if budget is None:  # staged whole, once per save, into one buffer allocated once
        assert source.copies == [(0, arrays["w"].nbytes)] * 2 and source.buffers == [arrays["w"].nbytes]
        assert first.throttled_bytes == second.throttled_bytes == 0
    else:  # past the budget: in pieces, as the writer writes, each save through two small buffers
        pieces = -(-arrays["w"].nbytes // (64 << 10))
        assert (
            len(source.copies) == 2 * pieces and sum(size for _start, size in source.copies) == 2 * arrays["w"].nbytes
        )
        assert max(source.buffers) == 64 << 10 and second.throttled_bytes >= arrays["w"].nbytes
