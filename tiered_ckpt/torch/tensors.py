"""torch tensors <-> the numpy arrays a shard holds, without copies on the CPU.

torch is optional: this module imports it only when called, and the rest of the library
never imports it. A CPU tensor becomes a numpy *view* of the same memory (bf16 and fp8
through an integer view reinterpreted with ``ml_dtypes``); a tensor on another device
is copied to host memory first. Every dtype round-trips byte for byte. A complex array
has no dtype in a shard: :func:`float_pairs` views it as its float pairs (the real and
imaginary parts along a trailing dimension of 2, as ``torch.view_as_real``) and
:func:`as_complex` views the pairs as complex again, numpy or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "is_tensor",
    "numpy_dtype",
    "to_numpy",
    "to_torch",
    "float_pairs",
    "as_complex",
    "numpy_state",
    "torch_state",
]

# torch dtypes numpy has no type for, by name (ml_dtypes' and torch's): the same-size integer view
_REINTERPRETED = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def _ml_dtype(name: str) -> np.dtype[Any]:
    import ml_dtypes  # most of a second to import: only for a tensor of bf16 or fp8

    found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
    return found


def is_tensor(value: Any) -> bool:
    """True for a torch.Tensor, without importing torch."""
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """The numpy dtype of the arrays a tensor of torch ``dtype`` becomes (bf16 and fp8 through ``ml_dtypes``)."""
    import torch

    name = str(dtype).removeprefix("torch.")
    if name in _REINTERPRETED:
        return _ml_dtype(name)
    return np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)


def to_numpy(tensor: Any) -> np.ndarray:
    """The tensor's values as a numpy array: a view on the CPU, a host copy from another device."""
    import torch

    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _REINTERPRETED:
        return tensor.view(getattr(torch, _REINTERPRETED[name])).numpy().view(_ml_dtype(name))
    return tensor.numpy()


def to_torch(array: np.ndarray) -> Any:
    """The array as a CPU tensor sharing its memory (bf16 and fp8 included)."""
    import torch

    name = array.dtype.name  # an array of bf16 or fp8 has ml_dtypes' dtype of that name
    if name in _REINTERPRETED and array.dtype == _ml_dtype(name):
        return torch.from_numpy(array.view(_REINTERPRETED[name])).view(getattr(torch, name))
    return torch.from_numpy(array)


_PAIRS: dict[str, np.dtype[Any]] = {"complex64": np.dtype(np.float32), "complex128": np.dtype(np.float64)}


def float_pairs(array: np.ndarray) -> np.ndarray:
    """A complex64/complex128 array as a view of its float32/float64 pairs, shape ``(*shape, 2)``."""
    return array[..., np.newaxis].view(_PAIRS[array.dtype.name])


def as_complex(pairs: Any, dtype: str) -> Any:
    """The complex ``dtype`` ("complex64" or "complex128") view of float ``pairs`` (a numpy array
    or a torch tensor, its last dimension 2); raises ValueError if they are not such pairs."""
    if is_tensor(pairs):
        import torch

        if str(pairs.dtype).removeprefix("torch.") != _PAIRS[dtype].name or pairs.ndim == 0 or pairs.shape[-1] != 2:
            raise ValueError(f"{dtype} needs {_PAIRS[dtype].name} pairs, got {pairs.dtype} {tuple(pairs.shape)}")
        return torch.view_as_complex(pairs if pairs.stride()[-1] == 1 else pairs.contiguous())
    array = np.asarray(pairs)
    if array.dtype != _PAIRS[dtype] or array.ndim == 0 or array.shape[-1] != 2:
        raise ValueError(f"{dtype} needs {_PAIRS[dtype].name} pairs, got {array.dtype} {array.shape}")
    if array.strides[-1] != array.itemsize:
        array = np.ascontiguousarray(array)
    return array.view(np.dtype(dtype))[..., 0]


def numpy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict with every tensor replaced by its numpy view; other values are kept as they are."""
    return {key: to_numpy(value) if is_tensor(value) else value for key, value in state.items()}


def torch_state(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A state dict of numpy arrays as CPU tensors sharing their memory."""
    return {key: to_torch(value) for key, value in state.items()}
