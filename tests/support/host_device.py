"""A device whose memory is host memory: an OffHost source that copies with numpy, to test on the CPU
what a CUDA source does (tiered_ckpt.torch.device_copies), call for call."""

from collections.abc import Callable

import numpy as np

from tiered_ckpt.io.off_host import OffHost, off_host


class HostSource:
    """The bytes of ``array``, copied as a device source copies them; counts what it was asked."""

    device = "host:0"

    def __init__(self, array: np.ndarray) -> None:
        self.data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.buffers: list[int] = []  # the size of each host buffer allocated
        self.copies: list[tuple[int, int]] = []  # (start, bytes) of each copy begun
        self.waited = 0
        self.released = False

    def host_buffer(self, nbytes: int) -> np.ndarray:
        self.buffers.append(nbytes)
        return np.empty(nbytes, np.uint8)

    def piece_buffers(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        return self.host_buffer(nbytes), self.host_buffer(nbytes)

    def start_copy(self, out: np.ndarray, start: int = 0) -> Callable[[], None]:
        self.copies.append((start, out.size))
        out[:] = self.data[start : start + out.size]

        def wait() -> None:
            self.waited += 1

        return wait

    def release(self) -> None:
        self.released = True


def on_device(array: np.ndarray) -> tuple[OffHost, HostSource]:
    """``array`` as an OffHost stand-in, and its source."""
    source = HostSource(array)
    return off_host(array.dtype, array.shape, source), source
