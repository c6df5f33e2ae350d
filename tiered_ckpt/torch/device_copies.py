"""CUDA tensors to and from host memory: pinned buffers, a side stream, copies that do not block.

A save stands a CUDA tensor in for an :class:`~tiered_ckpt.io.off_host.OffHost` array
(:func:`stand_in`) while it is checked; its bytes are copied later, once, straight from the
device into a host buffer (:class:`TensorSource`). The copies run on a stream of their own
(one per device), after the work the caller's stream had queued when the save began
(an event recorded then), with ``non_blocking=True`` into pinned memory: a page-locked
buffer is what lets the copy run at the link's speed rather than through a pageable bounce.
A pinned buffer is host memory of the exact size asked, registered with CUDA
(``cudaHostRegister``) when allocated and unregistered when freed: torch's caching host
allocator would round each buffer up to a power of two and keep freed ones, which a budget
cannot count. The staging reuses its buffers from save to save, so each is pinned once.
Only the caller's current stream is waited for: work queued on other streams must be
synchronized by the caller before ``save``.

A restore into CUDA tensors fills host buffers (:class:`DeviceTargets`), verified as any
restore's arrays, and copies them to the tensors only once the whole restore succeeded:
pinned buffers within the budget; past it, arrays over an unnamed file on the local disk
(:func:`~tiered_ckpt.io.scratch.paged_array`), whose pages the reads let go as they fill
them and which reach the device a piece at a time through two pinned piece buffers.

torch is imported only when called; a process without CUDA never calls a CUDA API here: a
CPU tensor never reaches this module.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiered_ckpt.io.off_host import PIECE_BYTES, OffHost, off_host
from tiered_ckpt.io.scratch import paged_array, pages_of
from tiered_ckpt.torch.tensors import numpy_dtype

__all__ = ["DeviceTargets", "Placed", "TensorSource", "is_cuda", "pinned", "pinned_bytes", "stand_in"]

logger = logging.getLogger("tiered_ckpt")

_streams: dict[Any, Any] = {}  # the copy stream of each device, made on first use
_pieces = threading.local()  # each writer thread's two pinned piece buffers, reused from save to save


def is_cuda(tensor: Any) -> bool:
    """True for a tensor on a CUDA device."""
    return bool(tensor.device.type == "cuda")


def _stream(device: Any) -> Any:
    import torch

    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device=device)
    return stream


_registered = [0]  # the bytes of pinned buffers alive in this process
_FIRST_ARENA, _LARGEST_ARENA = 64 << 20, 1 << 30


def pinned_bytes() -> int:
    """The bytes of this module's pinned buffers alive in this process."""
    return _registered[0]


def pinned(nbytes: int) -> np.ndarray:
    """A uint8 host buffer of exactly ``nbytes``, pinned (registered with CUDA) until it is freed;
    pageable if CUDA refuses to register it (logged, WARNING)."""
    import torch

    buffer = np.empty(nbytes, np.uint8)
    if not nbytes:
        return buffer
    address = buffer.ctypes.data
    status = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(status) != 0:
        logger.warning(
            "could not pin %d bytes of host memory (CUDA error %s): copies go through pageable memory", nbytes, status
        )
        return buffer
    _registered[0] += nbytes
    weakref.finalize(buffer, _unregister, address, nbytes)
    return buffer


def _piece_buffers(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two pinned piece buffers of at least ``nbytes``, kept from call to call."""
    held: tuple[np.ndarray, np.ndarray] | None = getattr(_pieces, "buffers", None)
    if held is None or held[0].size < nbytes:
        _pieces.buffers = None  # the smaller pair goes before a larger one is pinned
        size = max(nbytes, PIECE_BYTES)
        held = _pieces.buffers = (pinned(size), pinned(size))
    return held


def _unregister(address: int, nbytes: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)
    _registered[0] -= nbytes


class TensorSource:
    """The bytes of one CUDA tensor (C-contiguous), copied on its device's copy stream once
    the caller's stream reached ``ready`` (an event recorded when the save began)."""

    def __init__(self, tensor: Any, ready: Any) -> None:
        import torch

        self._tensor = tensor
        self._flat: Any = tensor.reshape(-1).view(torch.uint8)
        self._ready = ready
        self.device = str(tensor.device)

    def release(self) -> None:
        """Let go of the tensor (its last copy has landed): the caller may free its memory."""
        self._tensor = self._flat = None

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return pinned(nbytes)

    def piece_buffers(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        return _piece_buffers(nbytes)

    def start_copy(self, out: np.ndarray, start: int = 0) -> Callable[[], None]:
        import torch

        stream = _stream(self._tensor.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self._ready)
            torch.from_numpy(out).copy_(self._flat[start : start + out.size], non_blocking=True)
            landed = torch.cuda.Event(blocking=True)  # its wait sleeps rather than spins a core
            landed.record(stream)
        return landed.synchronize


def stand_in(tensor: Any, ready: dict[Any, Any]) -> OffHost:
    """The :class:`OffHost` stand-in of CUDA ``tensor`` (detached; made contiguous on its
    device if it is not); ``ready`` holds, by device, the event that marks the caller's
    queued work, recorded on the first tensor of each device."""
    import torch

    tensor = tensor.detach()
    dtype = numpy_dtype(tensor.dtype)
    device = tensor.device
    event = ready.get(device)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
        event = None  # queued after the event: the copy waits for this tensor's own
    if event is None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        ready.setdefault(device, event)
    return off_host(dtype, tuple(tensor.shape), TensorSource(tensor, event))


class DeviceTargets:
    """Host buffers standing in for the CUDA tensors a restore fills (``into=``), copied to
    the tensors by :meth:`copy_back` once the restore succeeded (every array of ``into`` is
    filled: a restore of some paths takes ``into`` of those paths only). Pinned within
    ``room(False)``, the host memory the budget leaves beside the saves' buffers (None: no
    bound), asked when the first tensor comes, and ``room(True)``, what it leaves once they
    are let go, asked when a tensor does not fit the first; past that, arrays over an unnamed
    file in ``scratch`` (the local disk) that the reads fill a piece at a time, letting each
    piece's pages go (WARNING, once); a disk without room for them gives pageable memory
    instead (WARNING, once)."""

    def __init__(self, room: Callable[[bool], int | None], scratch: Path | None = None) -> None:
        self._room = room
        self.scratch = scratch
        self._pairs: list[tuple[np.ndarray, Any]] = []
        self._pinned = 0
        self._budget: int | None = None
        self._asked = self._released = self._told = False
        self._arena: np.ndarray | None = None  # the unnamed file tensors past the budget are placed in
        self._used = 0
        self._next_arena = _FIRST_ARENA

    def host_for(self, tensor: Any) -> np.ndarray:
        """A host array of ``tensor``'s dtype and shape, filled in its place; :meth:`copy_back` moves it over."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._fits(nbytes):
            self._pinned += nbytes
            raw = pinned(nbytes)
        else:
            raw = self._past_budget(nbytes)
        host = raw.view(numpy_dtype(tensor.dtype)).reshape(tuple(tensor.shape))
        self._pairs.append((host, tensor))
        return host

    def _fits(self, nbytes: int) -> bool:
        if not self._asked:
            self._asked, self._budget = True, self._room(False)
        if self._budget is not None and self._pinned + nbytes > self._budget and not self._released:
            self._released, self._budget = True, self._room(True)
        return self._budget is None or self._pinned + nbytes <= self._budget

    def _past_budget(self, nbytes: int) -> np.ndarray:
        if nbytes and self.scratch is not None:
            try:
                array = self._paged(nbytes)
            except OSError as exc:
                logger.warning(
                    "restore into CUDA tensors: %s cannot hold a tensor of %d bytes in an unnamed file (%s): "
                    "it and those after it go through pageable memory, past the %d bytes of pinned memory "
                    "runtime.host_memory_bytes leaves this restore",
                    self.scratch,
                    nbytes,
                    exc.strerror or exc,
                    self._budget,
                )
                self.scratch = None  # asked once: the next tensors would fail alike
            else:
                if not self._told:
                    self._told = True
                    logger.warning(
                        "restore into CUDA tensors: the tensors past the %d bytes of pinned memory "
                        "runtime.host_memory_bytes leaves this restore are read through unnamed files in %s "
                        "and copied to the device a piece at a time (slower)",
                        self._budget,
                        self.scratch,
                    )
                return array
        return np.empty(nbytes, np.uint8)

    def _paged(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of an unnamed file, at a page boundary of one shared by the tensors before
        (files of 64 MiB, then twice as large each up to 1 GiB, or the tensor's size; half as
        large, down to the tensor's, where the disk cannot hold one): a model's thousands of
        tensors take a few files, maps and descriptors, not one each."""
        aligned = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        if self._arena is None or self._used + aligned > self._arena.size:
            assert self.scratch is not None  # _past_budget asks only then
            size = max(aligned, self._next_arena)
            while True:
                try:
                    arena = paged_array(self.scratch, size)
                    break
                except OSError:
                    if size == aligned:
                        raise
                    size = max(aligned, size // 2)  # the disk may still hold a smaller file
                    self._next_arena = size  # and no larger one, for now
            self._arena, self._used = arena, 0
            self._next_arena = min(2 * self._next_arena, _LARGEST_ARENA)
        view = self._arena[self._used : self._used + nbytes]
        self._used += aligned
        return view

    def copy_back(self) -> Placed:
        """Copy every host buffer to its tensor (on each device's copy stream, then wait for
        them) and let go of the buffers; returns which tensor each host array given out stood
        in for (what the restore's result holds in its place)."""
        placed = Placed(self._pairs)
        if not self._pairs:
            return placed
        import torch

        callers = {tensor.device: torch.cuda.current_stream(tensor.device) for _host, tensor in self._pairs}
        for device, caller in callers.items():
            _stream(device).wait_stream(caller)  # after the work queued on the tensors
        pieces: tuple[np.ndarray, np.ndarray] | None = None  # pinned for this restore only: restores are rare
        try:
            for host, tensor in self._pairs:
                if not host.size:
                    continue
                stream = _stream(tensor.device)
                if pages_of(host) is not None:
                    pieces = pieces or (pinned(PIECE_BYTES), pinned(PIECE_BYTES))
                    _in_pieces(host, tensor.detach(), stream, pieces)
                    continue
                with torch.cuda.stream(stream):
                    source = torch.from_numpy(host.reshape(-1).view(np.uint8)).view(tensor.dtype).reshape(tensor.shape)
                    tensor.detach().copy_(source, non_blocking=True)  # any strides: torch lays the values out
        finally:
            for device, caller in callers.items():
                caller.wait_stream(_stream(device))  # the caller's next work sees the new values
                _stream(device).synchronize()  # and the host buffers may go
            self._pairs.clear()
            self._pinned, self._arena = 0, None
        return placed


class Placed:
    """The CUDA tensors a restore filled, found by the host arrays that stood in for them."""

    def __init__(self, pairs: list[tuple[np.ndarray, Any]]) -> None:
        self._tensors = {_where(host): tensor for host, tensor in pairs}

    def tensor_for(self, value: Any) -> Any | None:
        """The tensor that ``value`` stood in for: a host array given out by
        :meth:`DeviceTargets.host_for`, or a view of all of its bytes (a complex tensor's
        float pairs, whose tensor is then the pairs' view of it); None for anything else."""
        if not isinstance(value, np.ndarray):
            return None
        tensor = self._tensors.get(_where(value))
        if tensor is None or not tensor.is_complex() or value.dtype.kind == "c":
            return tensor
        import torch

        return torch.view_as_real(tensor.detach())


def _where(array: np.ndarray) -> tuple[int, int]:
    """An array's memory: where it starts and its size (an empty array's own identity instead),
    the same for every view of all of it."""
    return (array.ctypes.data, array.nbytes) if array.nbytes else (id(array), 0)


def _in_pieces(host: np.ndarray, tensor: Any, stream: Any, buffers: tuple[np.ndarray, np.ndarray]) -> None:
    """Copy ``host`` (over an unnamed file) to ``tensor`` a piece at a time through two
    pinned ``buffers`` of :data:`PIECE_BYTES`, each piece read back from the file and checked
    against what the restore verified (:meth:`~tiered_ckpt.io.scratch.Pages.reader`), the
    next piece read while the last one's copy runs; a non-contiguous tensor is filled
    through a contiguous one on its device."""
    import torch

    whole = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    flat = whole.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    out = flat.view(torch.uint8)
    source = host.reshape(-1).view(np.uint8)
    paged = pages_of(source)
    assert paged is not None  # copy_back sends only those
    reader = paged.reader()
    landed: list[Any] = [None, None]
    for index, start in enumerate(range(0, source.size, PIECE_BYTES)):
        slot = index % 2
        if landed[slot] is not None:
            landed[slot].synchronize()  # its last copy has left the buffer
        buffer = buffers[slot][: min(PIECE_BYTES, source.size - start)]
        reader.read_into(start, buffer)
        with torch.cuda.stream(stream):
            out[start : start + buffer.size].copy_(torch.from_numpy(buffer), non_blocking=True)
            landed[slot] = torch.cuda.Event(blocking=True)
            landed[slot].record(stream)
    if whole is not tensor:
        with torch.cuda.stream(stream):
            tensor.copy_(whole, non_blocking=True)
        stream.synchronize()  # before ``whole`` goes back to the allocator
    for event in landed:
        if event is not None:
            event.synchronize()
