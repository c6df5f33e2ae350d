"""CUDA tensors to and from host memory: pinned buffers, a side stream, copies that do not block.

A save stands a CUDA tensor in for an :class:`~tiered_ckpt.io.off_host.OffHost` array
(:func:`stand_in`) while it is checked; its bytes are copied later, once, straight from the
device into a host buffer (:class:`TensorSource`). The copies run on a stream of their own
(one per device), after the work the caller's stream had queued when the save began
(an event recorded then), with ``non_blocking=True`` into pinned memory: a page-locked
buffer is what lets the copy run at the link's speed rather than through a pageable bounce.
Pinned buffers come from torch's caching host allocator, which keeps a freed block for the
next request of its size: a buffer reused from save to save is pinned once.

A restore into CUDA tensors fills pinned host buffers (:class:`DeviceTargets`), verified as
any restore's arrays, and copies them to the tensors only once the whole restore succeeded.

torch is imported only when called; a process without CUDA never calls a CUDA API here: a
CPU tensor never reaches this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from tiered_ckpt.io.off_host import OffHost, off_host
from tiered_ckpt.torch.tensors import numpy_dtype

__all__ = ["DeviceTargets", "TensorSource", "is_cuda", "stand_in"]

logger = logging.getLogger("tiered_ckpt")

_streams: dict[Any, Any] = {}  # the copy stream of each device, made on first use


def is_cuda(tensor: Any) -> bool:
    """True for a tensor on a CUDA device."""
    return bool(tensor.device.type == "cuda")


def _stream(device: Any) -> Any:
    import torch

    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device=device)
    return stream


def pinned(nbytes: int) -> np.ndarray:
    """A uint8 host buffer of ``nbytes`` in pinned memory (from torch's caching host allocator)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


class TensorSource:
    """The bytes of one CUDA tensor (C-contiguous), copied on its device's copy stream once
    the caller's stream reached ``ready`` (an event recorded when the save began)."""

    def __init__(self, tensor: Any, ready: Any) -> None:
        import torch

        self._tensor = tensor
        self._flat = tensor.reshape(-1).view(torch.uint8)
        self._ready = ready
        self.device = str(tensor.device)

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return pinned(nbytes)

    def start_copy(self, out: np.ndarray, start: int = 0) -> Callable[[], None]:
        import torch

        stream = _stream(self._tensor.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self._ready)
            torch.from_numpy(out).copy_(self._flat[start : start + out.size], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(stream)
        return landed.synchronize


def stand_in(tensor: Any, ready: dict[Any, Any]) -> OffHost:
    """The :class:`OffHost` stand-in of CUDA ``tensor`` (detached; made contiguous on its
    device if it is not); ``ready`` holds, by device, the event that marks the caller's
    queued work, recorded on the first tensor of each device."""
    import torch

    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    device = tensor.device
    if device not in ready:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        ready[device] = event
    return off_host(numpy_dtype(tensor.dtype), tuple(tensor.shape), TensorSource(tensor, ready[device]))


class DeviceTargets:
    """Host buffers standing in for the CUDA tensors a restore fills (``into=``), within
    ``budget`` bytes of pinned memory (past it, pageable: logged once, WARNING), copied to
    the tensors by :meth:`copy_back` once the restore succeeded (every array of ``into`` is
    filled: a restore of some paths takes ``into`` of those paths only)."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self._pairs: list[tuple[np.ndarray, Any]] = []
        self._pinned = 0
        self._told = False

    def host_for(self, tensor: Any) -> np.ndarray:
        """A host array of ``tensor``'s dtype and shape, filled in its place; :meth:`copy_back` moves it over."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.budget is None or self._pinned + nbytes <= self.budget:
            self._pinned += nbytes
            raw = pinned(nbytes)
        else:
            if not self._told:
                self._told = True
                logger.warning(
                    "restore into CUDA tensors: %d bytes of them do not fit runtime.host_memory_bytes=%d of pinned "
                    "buffers and go through pageable memory (slower, and past the budget)",
                    nbytes,
                    self.budget,
                )
            raw = np.empty(nbytes, np.uint8)
        self._pairs.append((raw, tensor))
        return raw.view(numpy_dtype(tensor.dtype)).reshape(tuple(tensor.shape))

    def copy_back(self) -> None:
        """Copy every host buffer to its tensor (on each device's copy stream, then wait for them)."""
        if not self._pairs:
            return
        import torch

        callers = {tensor.device: torch.cuda.current_stream(tensor.device) for _raw, tensor in self._pairs}
        for device, caller in callers.items():
            _stream(device).wait_stream(caller)  # after the work queued on the tensors
        for raw, tensor in self._pairs:
            with torch.cuda.stream(_stream(tensor.device)):
                host = torch.from_numpy(raw).view(tensor.dtype).reshape(tensor.shape)
                tensor.detach().copy_(host, non_blocking=True)  # any strides: torch lays the values out
        for device, caller in callers.items():
            caller.wait_stream(_stream(device))  # the caller's next work sees the new values
            _stream(device).synchronize()  # and the host buffers may go
        self._pairs.clear()
        self._pinned = 0
