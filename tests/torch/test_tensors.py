import subprocess
import sys

import numpy as np
import pytest
import torch

from tiered_ckpt import CheckpointManager, InvalidStateError, RuntimeOptions, load_sharded, save_sharded
from tiered_ckpt.torch.tensors import as_complex, float_pairs, is_tensor, numpy_state, to_numpy, to_torch, torch_state

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_tensor_becomes_a_numpy_view_and_comes_back_byte_for_byte(dtype):
    tensor = sample(dtype)
    array = to_numpy(tensor)
    assert array.ctypes.data == tensor.data_ptr()  # a view: no copy
    assert array.shape == tuple(tensor.shape) and array.nbytes == tensor.numel() * tensor.element_size()
    back = to_torch(array)
    assert back.dtype == dtype and back.data_ptr() == tensor.data_ptr()
    assert raw_bytes(back) == raw_bytes(tensor)


def test_parameters_that_need_grad_and_zero_dim_tensors():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    step = torch.tensor(7, dtype=torch.int64)
    state = numpy_state({"weight": weight, "step": step, "already": np.ones(2)})
    assert isinstance(state["weight"], np.ndarray) and state["step"].shape == () and int(state["step"]) == 7
    assert np.array_equal(state["already"], np.ones(2))
    assert is_tensor(weight) and not is_tensor(state["weight"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_save_sharded_and_load_of_torch_state_dicts_is_byte_exact(tmp_path, dtype):
    states = [{"w": sample(dtype, (8,)), "m": sample(dtype, (2, 3))} for _ in range(2)]
    save_sharded(states, tmp_path, step=1, sharded_keys=["w"])
    loaded = [torch_state(state) for state in load_sharded(tmp_path, 2)]
    for want, got in zip(states, loaded, strict=True):
        for key in want:
            assert got[key].dtype == want[key].dtype and raw_bytes(got[key]) == raw_bytes(want[key])


def test_manager_saves_a_model_and_optimizer_state_dict_and_hands_tensors_back(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        flat.update({f"optim.{index}.{name}": value for name, value in moments.items()})
    expected = {key: (value.dtype, raw_bytes(value)) for key, value in flat.items()}
    with CheckpointManager(tmp_path, world_size=1, runtime=RuntimeOptions(sharded_keys=[])) as manager:
        manager.save(1, [flat])
        with torch.no_grad():
            for tensor in flat.values():
                tensor.zero_()  # allowed once save returns: the checkpoint holds the values as of the call
        restored = manager.restore().torch_states()[0]
    assert {key: (value.dtype, raw_bytes(value)) for key, value in restored.items()} == expected
    assert restored["model.0.weight"].dtype == torch.bfloat16


def test_the_core_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import tiered_ckpt; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_restore_into_a_nested_torch_state_fills_the_callers_tensors_in_place(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = {"model": model.state_dict(), "optim": optimizer.state_dict(), "epoch": 7}
    expected = {key: value.clone() for key, value in model.state_dict().items()}
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, saved, blocking=True)
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        target = {"model": model.state_dict(), "optim": optimizer.state_dict(), "epoch": 0}
        restored = manager.restore(into=target)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key])  # the model's own tensors hold the checkpoint
    assert restored.state["epoch"] == 7 and restored.state["optim"]["param_groups"][0]["momentum"] == 0.9


def test_restore_into_refuses_a_state_of_another_shape_naming_the_path(tmp_path):
    with CheckpointManager(tmp_path, world_size=1) as manager:
        manager.save(1, {"model": {"w": torch.zeros(3)}}, blocking=True)
        with pytest.raises(InvalidStateError, match=r"'model/w' float32 4 \(the shard: float32 3\)"):
            manager.restore(into={"model": {"w": torch.zeros(4)}})


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_arrays_are_viewed_as_float_pairs_and_back_in_numpy_and_torch(dtype):
    values = (np.arange(12).reshape(3, 4) * (1 - 0.5j)).astype(dtype)[:, ::2]  # a strided view
    pairs = float_pairs(values)
    assert pairs.shape == (3, 2, 2) and pairs.dtype == values.real.dtype and np.shares_memory(pairs, values)
    assert np.array_equal(pairs[..., 0], values.real) and np.array_equal(pairs[..., 1], values.imag)
    assert np.array_equal(as_complex(pairs, np.dtype(dtype).name), values)
    tensor = as_complex(to_torch(np.ascontiguousarray(pairs)), np.dtype(dtype).name)
    assert tensor.dtype == getattr(torch, np.dtype(dtype).name) and np.array_equal(tensor.numpy(), values)


def test_pairs_of_another_dtype_or_shape_are_not_taken_for_complex():
    with pytest.raises(ValueError, match="complex64 needs float32 pairs"):
        as_complex(np.zeros((2, 2), np.float64), "complex64")
    with pytest.raises(ValueError, match="complex128 needs float64 pairs"):
        as_complex(torch.zeros(3, 3, dtype=torch.float64), "complex128")
