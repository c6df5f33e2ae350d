"""An array whose bytes are not in host memory (a tensor on a GPU), standing in for it until copied.

A save flattens a device tensor to an :class:`OffHost` array: its dtype and shape, with no
bytes of its own, and the :class:`DeviceSource` that copies its bytes to host memory. The
save's staging copies it whole, straight from the device, into a host buffer the source
allocates (pinned, so the copy runs at the link's speed and off the caller's thread); past
the host memory budget, the writer copies it a piece at a time through a small buffer while
it writes (:meth:`OffHost.chunks`), and the save call waits for that as it does for any
array written from the caller's memory. The checks before a write (names, dtypes, shapes,
sizes) read only its dtype and shape.

Its own memory is one item repeated (zero strides), read-only: nothing may read it as the
array's bytes. A view of it (a reshape, a slice) has no source, and :meth:`OffHost.chunks`
refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from tiered_ckpt.errors import InvalidStateError

__all__ = ["DeviceSource", "OffHost", "PIECE_BYTES", "off_host"]

# A piece of a device array copied while the writer writes the one before: large enough that a
# copy's fixed cost (a launch and a synchronization) is small against moving its bytes.
PIECE_BYTES = 16 << 20


class DeviceSource(Protocol):
    """Where an :class:`OffHost` array's bytes are, and how they come to host memory."""

    @property
    def device(self) -> str:
        """The device the bytes are on, as torch names it (``"cuda:0"``)."""
        ...

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A new uint8 host buffer of ``nbytes`` that a copy lands in fast (pinned memory)."""
        ...

    def piece_buffers(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """Two uint8 host buffers of at least ``nbytes`` (<= :data:`PIECE_BYTES`) each, as
        :meth:`host_buffer`'s, for pieces copied by the calling thread: the same two at each
        call from that thread, so that they are pinned once."""
        ...

    def start_copy(self, out: np.ndarray, start: int = 0) -> Callable[[], None]:
        """Begin copying the bytes ``[start, start + out.size)`` of the array (C order) into
        ``out`` (a C-contiguous uint8 view of a :meth:`host_buffer`); return a call that
        blocks until they have landed."""
        ...

    def release(self) -> None:
        """The array's last copy has landed: let go of its memory on the device."""
        ...


class OffHost(np.ndarray):
    """A stand-in for an array on a device (see the module doc); ``source`` copies its bytes."""

    source: DeviceSource | None

    def __array_finalize__(self, obj: Any) -> None:
        self.source = None  # a view is not the array its source copies

    def chunks(self, piece_bytes: int | None = None) -> Iterator[memoryview]:
        """The array's bytes in C order, a piece at a time: each piece is copied from the
        device while the one before is used, into one of two buffers of ``piece_bytes``
        (default :data:`PIECE_BYTES`), the source's :meth:`~DeviceSource.piece_buffers`; a
        piece is valid until the next is asked for. Once the last is given, the source lets
        go of the device's memory (a save flattens its tensors anew)."""
        source = self.source
        if source is None:
            raise InvalidStateError("a view of an array on a device has no bytes to copy; save the tensor itself")
        size = self.nbytes
        if not size:
            return
        step = min(piece_bytes or PIECE_BYTES, size)
        buffers = source.piece_buffers(step)
        running: list[Callable[[], None]] = [source.start_copy(buffers[0][:step], 0)]
        try:
            for index, start in enumerate(range(0, size, step)):
                end = min(start + step, size)
                running.pop()()
                if end < size:  # the next piece comes while this one is written
                    running.append(source.start_copy(buffers[(index + 1) % 2][: min(step, size - end)], end))
                yield buffers[index % 2][: end - start].data
        finally:  # a copy still running lands before its buffer may go
            for landed in running:
                landed()
        source.release()


def off_host(dtype: np.dtype[Any], shape: tuple[int, ...], source: DeviceSource) -> OffHost:
    """The stand-in of an array of ``dtype`` and ``shape`` whose bytes ``source`` copies."""
    one = np.zeros(1, dtype)
    stand_in = np.lib.stride_tricks.as_strided(one, shape, (0,) * len(shape), writeable=False).view(OffHost)
    stand_in.source = source
    return stand_in
