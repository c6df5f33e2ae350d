"""CUDA tensors saved and restored through pinned host buffers (tiered_ckpt.torch.device_copies).

The CUDA tests run where a CUDA device is present and skip with their reason elsewhere; the
CPU tests show that a process without CUDA never calls a CUDA API.
"""

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_ckpt import (
    CheckpointError,
    CheckpointManager,
    InvalidStateError,
    LocalOptions,
    RuntimeOptions,
    TorchDistributedCoordinator,
)
from tiered_ckpt.engine.staging import PIECE_BYTES as SLOT
from tiered_ckpt.torch.device_copies import pinned_bytes

REPOSITORY = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")


def _bits(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, whatever its dtype (bf16 and fp8 through an integer view)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _cuda_state(seed: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(1 << 16, 3, device="cuda", generator=generator)
    return {
        "fp32": base.clone(),
        "bf16": base.to(torch.bfloat16),
        "fp8": {"e4m3": base.to(torch.float8_e4m3fn), "e5m2": base.to(torch.float8_e5m2)},
        "transposed": base.t(),  # not contiguous: saved as its values, in C order
        "scalar": torch.tensor(3.5 + seed, device="cuda"),
        "empty": torch.empty(0, 4, device="cuda"),
        "steps": 7,
    }


def _all_bits(state) -> dict[str, bytes]:
    """The bytes of every tensor of a nested state, by path (DTensors gathered whole)."""
    from torch.distributed.tensor import DTensor

    found = {}

    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}")
        elif isinstance(value, torch.Tensor):
            found[path] = _bits(value.full_tensor() if isinstance(value, DTensor) else value)

    walk(state, "")
    return found


def test_cpu_tensors_are_saved_and_restored_without_a_cuda_call(tmp_path, monkeypatch):
    def refused(*_args, **_kwargs):
        raise AssertionError("a CUDA API was called for CPU tensors")

    for name in ("Stream", "Event", "current_stream", "stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, refused)
    state = {"w": torch.arange(1000, dtype=torch.bfloat16), "b": torch.ones(3), "step": 1}
    into = {"w": torch.zeros(1000, dtype=torch.bfloat16), "b": torch.zeros(3), "step": 0}
    with CheckpointManager(tmp_path, world_size=1, runtime=RuntimeOptions(host_memory_bytes=1 << 10)) as manager:
        manager.save(1, state, blocking=True)
        manager.restore(into=into)
    assert torch.equal(into["w"], state["w"]) and torch.equal(into["b"], state["b"])


def test_into_a_tensor_on_a_device_without_a_copy_path_is_refused_naming_it(tmp_path):
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, {"w": torch.ones(2), "step": 1}, blocking=True)
        with pytest.raises(InvalidStateError, match=r'into\[0\]: state\["w"\] is on meta'):
            manager.restore(into={"w": torch.empty(2, device="meta"), "step": 0})


@needs_cuda
@pytest.mark.parametrize("budget", [64 << 20, 1 << 20], ids=["staged", "past-the-budget"])
def test_cuda_tensors_round_trip_bit_for_bit_into_cuda_tensors(tmp_path, budget):
    state = _cuda_state(0)
    expected = _all_bits(state)
    runtime = RuntimeOptions(host_memory_bytes=budget)
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:
        handle = manager.save(1, state)  # returns once the copies are done: the tensors may change
        for value in (state["fp32"], state["bf16"], *state["fp8"].values(), state["scalar"]):
            value.zero_()
        handle.committed.result()
        into = _cuda_state(1)
        restored = manager.restore(into=into)
        plain = manager.restore()
    assert (handle.throttled_bytes > 0) == (budget == 1 << 20)
    assert _all_bits(into) == expected and set(expected) >= {"/fp8/e4m3", "/fp8/e5m2", "/empty", "/scalar"}
    assert into["fp8"]["e5m2"].device.type == "cuda" and into["transposed"].stride() == (1, 3)
    assert restored.step == plain.step == 1 and plain.state["steps"] == 7
    assert restored.state["fp32"] is into["fp32"] and restored.state["transposed"] is into["transposed"]  # no host copy
    np.testing.assert_array_equal(plain.state["fp32"], _cuda_state(0)["fp32"].cpu().numpy())


@needs_cuda
def test_a_save_copies_what_the_callers_stream_computes_even_while_it_is_busy(tmp_path):
    base = torch.randn(1 << 20, device="cuda")
    expected_doubled = _bits(base * 2)
    expected_tripled_t = _bits((base.reshape(1024, 1024) * 3).t())
    with CheckpointManager(tmp_path, world_size=1) as manager:
        torch.cuda._sleep(1 << 30)  # the caller's stream is busy for a while: what follows is queued
        state = {"first": base * 2, "second": (base.reshape(1024, 1024) * 3).t(), "step": 1}
        manager.save(1, state, blocking=True)
        restored = manager.restore()
    assert restored.state["first"].tobytes() == expected_doubled
    assert np.ascontiguousarray(restored.state["second"]).tobytes() == expected_tripled_t


@needs_cuda
@pytest.mark.parametrize("budget", [None, 1 << 10], ids=["pinned", "past-the-budget"])
def test_a_failed_restore_leaves_the_cuda_tensors_as_they_were(tmp_path, budget):
    runtime = RuntimeOptions(host_memory_bytes=budget)
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager:
        manager.save(1, {"w": torch.ones(1 << 16, device="cuda")}, blocking=True)
    shard = next(Path(tmp_path).rglob("*.shard"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    into = {"w": torch.full((1 << 16,), 2.0, device="cuda")}
    with CheckpointManager(tmp_path, world_size=1, runtime=runtime) as manager, pytest.raises(CheckpointError):
        manager.restore(into=into)
    assert bool((into["w"] == 2.0).all())


@needs_cuda
def test_a_restore_into_cuda_tensors_past_the_budget_holds_no_host_copy_of_them(tmp_path):
    budget = 16 << 20
    command = [sys.executable, "-m", "tests.support.cuda_restore_peak", str(tmp_path), str(5 * budget), str(budget)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPOSITORY, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["exact"] and got["restore_peak"] <= budget + SLOT, got  # was the state's size, 80 MiB


@needs_cuda
def test_the_pinned_buffers_are_reused_over_100_saves(tmp_path):
    state = _cuda_state(0)
    runtime = RuntimeOptions(host_memory_bytes=64 << 20)
    with CheckpointManager(LocalOptions(tmp_path, keep_last=1), world_size=1, runtime=runtime) as manager:
        for step in range(1, 11):  # warm: every buffer allocated
            manager.save(step, state, blocking=True)
        pinned, resident = pinned_bytes(), _resident_bytes()
        assert 0 < pinned <= 64 << 20
        for step in range(11, 111):
            state["fp32"].add_(1.0)
            manager.save(step, state)
        manager.wait()
        restored = manager.restore()
        assert pinned_bytes() == pinned, "pinned memory grew over 100 saves"
    assert _resident_bytes() - resident < 64 << 20, "resident memory grew over 100 saves"
    np.testing.assert_array_equal(restored.state["fp32"], state["fp32"].cpu().numpy())


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@needs_cuda
def test_an_fsdp2_model_on_one_gpu_round_trips_bit_for_bit(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:

        def build(seed: int):
            torch.manual_seed(seed)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
            mesh = init_device_mesh("cuda", (1,))
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=0.01)

        model, optimizer = build(0)
        model(torch.randn(4, 64, device="cuda")).sum().backward()
        optimizer.step()
        saved = get_state_dict(model, optimizer)
        expected = _all_bits(saved)
        root = tmp_path / "ckpt"
        with CheckpointManager(root, coordinator=TorchDistributedCoordinator()) as manager:
            manager.save(1, {"model": saved[0], "optim": saved[1]}, blocking=True)
        fresh, fresh_optimizer = build(1)
        into_model, into_optim = get_state_dict(fresh, fresh_optimizer)
        with CheckpointManager(root, coordinator=TorchDistributedCoordinator()) as manager:
            manager.restore(into={"model": into_model, "optim": into_optim})
        set_state_dict(fresh, fresh_optimizer, model_state_dict=into_model, optim_state_dict=into_optim)
        assert _all_bits(get_state_dict(fresh, fresh_optimizer)) == expected
    finally:
        dist.destroy_process_group()


if os.environ.get("TIERED_CKPT_REQUIRE_CUDA") and not CUDA:  # a GPU run that lost its device fails, not skips
    raise RuntimeError("TIERED_CKPT_REQUIRE_CUDA is set but torch sees no CUDA device")


class _Stream:  # CUDA's ordering calls, for host memory: every copy is done when issued
    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class _Event:
    def __init__(self, blocking=False):
        self.waited = 0

    def record(self, stream=None):
        pass

    def synchronize(self):
        self.waited += 1


class _Cudart:
    @staticmethod
    def cudaHostRegister(address, nbytes, flags):
        return 1  # refused: the buffers stay pageable, nothing to unregister later


@pytest.fixture
def host_cuda(monkeypatch):
    """CUDA's calls stood in for on the CPU: what runs where no device is, is the host side of it."""
    import contextlib

    from tiered_ckpt.torch import device_copies

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart)
    monkeypatch.setattr(device_copies, "_streams", {})
    monkeypatch.setattr(device_copies, "PIECE_BYTES", 4096)  # many pieces, through both buffers
    return device_copies


def test_a_restore_past_the_budget_fills_the_tensors_a_piece_at_a_time_from_an_unnamed_file(tmp_path, host_cuda):
    from tiered_ckpt.io.scratch import pages_of
    from tiered_ckpt.torch.tensors import float_pairs

    device_copies = host_cuda
    source = torch.randn(3000, 7)
    expected = {
        "first": source[:10].clone(),  # within the budget
        "bf16": source.to(torch.bfloat16),
        "transposed": source.t().contiguous(),
        "complex": torch.complex(source[:, 0], source[:, 1]),
        "empty": torch.empty(0, 3),
    }
    tensors = {
        "first": torch.zeros(10, 7),
        "bf16": torch.zeros(3000, 7, dtype=torch.bfloat16),
        "transposed": torch.zeros(3000, 7).t(),  # not contiguous: filled through a contiguous copy
        "complex": torch.zeros(3000, dtype=torch.complex64),
        "empty": torch.zeros(0, 3),
    }
    targets = device_copies.DeviceTargets(lambda release: 1024, tmp_path)
    hosts = {name: targets.host_for(tensor) for name, tensor in tensors.items()}
    assert pages_of(hosts["first"]) is None and pages_of(hosts["bf16"]) is not None
    for name, host in hosts.items():
        host.reshape(-1).view(np.uint8)[:] = expected[name].contiguous().reshape(-1).view(torch.uint8).numpy()
    placed = targets.copy_back()
    assert {placed.tensor_for(host) is tensors[name] for name, host in hosts.items()} == {True}
    # A complex tensor's host array is saved as its float pairs: those stand for the tensor's pairs.
    pairs = placed.tensor_for(float_pairs(hosts["complex"]))
    assert pairs.dtype == torch.float32 and pairs.data_ptr() == tensors["complex"].data_ptr()
    assert placed.tensor_for(np.zeros(3)) is None and placed.tensor_for(hosts["first"].copy()) is None
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), name
    assert tensors["transposed"].stride() == (1, 7)
    assert targets.copy_back().tensor_for(hosts["bf16"]) is None  # each buffer let go once


def test_a_restore_lets_the_saves_staging_go_only_when_its_tensors_do_not_fit_beside_it(tmp_path, host_cuda):
    asked = []

    def room(release):
        asked.append(release)
        return 4096 if release else 1024  # the staging buffers hold 3 KiB of a 4 KiB budget

    targets = host_cuda.DeviceTargets(room, tmp_path)
    targets.host_for(torch.zeros(256))  # 1 KiB: fits beside the staging
    assert asked == [False]
    for _ in range(3):
        targets.host_for(torch.zeros(256))  # the staging is let go, once: 4 KiB in all
    assert asked == [False, True]
    from tiered_ckpt.io.scratch import pages_of

    assert pages_of(targets.host_for(torch.zeros(256))) is not None  # past the whole budget: on the disk
    targets.copy_back()


def test_a_disk_without_room_for_the_tensors_past_the_budget_is_said_once(tmp_path, host_cuda, caplog):
    targets = host_cuda.DeviceTargets(lambda release: 0, tmp_path / "gone")
    tensors = [torch.full((100,), float(i)) for i in range(5)]
    hosts = [targets.host_for(torch.zeros(100)) for _ in tensors]
    for host, tensor in zip(hosts, tensors, strict=True):
        host[:] = tensor.numpy()
    targets.copy_back()
    said = [r.getMessage() for r in caplog.records if "cannot hold" in r.getMessage()]
    assert len(said) == 1 and "gone" in said[0] and "No such file" in said[0] and "pageable memory" in said[0]
    assert not any("read through unnamed files" in r.getMessage() for r in caplog.records)


def test_bytes_that_changed_on_the_disk_after_their_read_never_reach_the_tensor(tmp_path, host_cuda):
    from tiered_ckpt import StorageError
    from tiered_ckpt.io.scratch import pages_of

    targets = host_cuda.DeviceTargets(lambda release: 0, tmp_path)
    tensor = torch.zeros(4096)
    host = targets.host_for(tensor)
    raw = host.reshape(-1).view(np.uint8)
    raw[:] = np.arange(raw.size, dtype=np.uint32).astype(np.uint8)
    pages = pages_of(raw)
    for start in range(0, raw.size, 4096):  # as a verified read hands it over
        pages.filled(start, raw[start : start + 4096].data)
    os.pwrite(pages.backing.file.fileno(), b"\xff" * 8, 3 * 4096 + 5)  # in the page cache, or from the disk
    with pytest.raises(StorageError, match="differ from those verified"):
        targets.copy_back()
    assert not bool(tensor[3 * 1024 :].any())  # from the changed piece on, nothing was copied


def test_tensors_past_the_budget_share_a_few_unnamed_files(tmp_path, host_cuda, monkeypatch):
    from tiered_ckpt.io.scratch import pages_of

    monkeypatch.setattr(host_cuda, "_FIRST_ARENA", 1 << 20)  # files of 1, 2, 4, 4 MiB: the rule, on little disk
    monkeypatch.setattr(host_cuda, "_LARGEST_ARENA", 4 << 20)
    targets = host_cuda.DeviceTargets(lambda release: 0, tmp_path)
    tensors = [torch.full((1 << 14,), float(i)) for i in range(160)]  # 64 KiB each, 10 MiB
    hosts = [targets.host_for(torch.zeros(1 << 14)) for _ in tensors]
    backings = {id(pages_of(host).backing) for host in hosts}
    assert len(backings) == 4  # not 160 files (maps, descriptors)
    for host, tensor in zip(hosts, tensors, strict=True):
        host[:] = tensor.numpy()
    outs = [torch.zeros(1 << 14) for _ in tensors]
    targets._pairs = [(host, out) for host, out in zip(hosts, outs, strict=True)]
    targets.copy_back()
    assert all(torch.equal(out, tensor) for out, tensor in zip(outs, tensors, strict=True))


def test_a_disk_without_room_for_a_whole_file_of_tensors_still_takes_each_tensor(tmp_path, host_cuda, monkeypatch):
    import errno

    from tiered_ckpt.io.scratch import pages_of

    real = host_cuda.paged_array

    def small_disk(directory, nbytes):
        if nbytes > 8 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(directory, nbytes)

    monkeypatch.setattr(host_cuda, "paged_array", small_disk)
    targets = host_cuda.DeviceTargets(lambda release: 0, tmp_path)
    hosts = [targets.host_for(torch.zeros(1 << 20)) for _ in range(4)]  # 4 MiB each
    assert all(pages_of(host) is not None for host in hosts)
    assert len({id(pages_of(host).backing) for host in hosts}) == 2  # files of 8 MiB: the most the disk takes
    targets.copy_back()
