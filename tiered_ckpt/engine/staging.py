"""The host buffers a save's arrays are copied into before the background write.

The copy is all that ``save(blocking=False)`` makes the training loop wait for, so it runs
on several threads (numpy's copy releases the GIL): large arrays are cut into pieces, and
the pieces are copied in parallel, the training loop's thread taking part.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tiered_ckpt.format.shardfile import check_arrays

__all__ = ["StagingBuffers"]

PIECE_BYTES = 32 << 20  # large enough that a piece's copy dwarfs handing it to a thread
PARALLEL_BYTES = 64 << 20  # below this, one thread copies: starting others costs more than it saves
MAX_COPY_THREADS = 4  # memory bandwidth, not cores, bounds a copy past a few threads


def _pieces(buffer: np.ndarray, array: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(target, source) pairs that together copy ``array`` into ``buffer``: slices of
    ``PIECE_BYTES`` of both when ``array`` is C-contiguous, else the whole of each."""
    if not array.flags.c_contiguous or array.nbytes <= PIECE_BYTES or array.ndim == 0:
        return [(buffer, array)]
    target, source = buffer.reshape(-1), array.reshape(-1)
    step = max(1, PIECE_BYTES // array.itemsize)
    return [(target[start : start + step], source[start : start + step]) for start in range(0, len(source), step)]


def _copy(pieces: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    threads = min(MAX_COPY_THREADS, os.cpu_count() or 1, len(pieces))
    if threads < 2 or sum(target.nbytes for target, _ in pieces) < PARALLEL_BYTES:
        for target, source in pieces:
            np.copyto(target, source, casting="no")
        return
    with ThreadPoolExecutor(threads - 1, thread_name_prefix="tiered-ckpt-stage") as pool:
        others = [
            pool.submit(np.copyto, target, source, casting="no")
            for index, (target, source) in enumerate(pieces)
            if index % threads
        ]
        for target, source in pieces[::threads]:  # the calling thread's share: it would otherwise only wait
            np.copyto(target, source, casting="no")
        for future in others:
            future.result()


class StagingBuffers:
    """Host buffers that hold a copy of every rank's arrays between a save call and its write.

    A buffer is reused from save to save and reallocated only when its array's dtype or
    shape changes; arrays that are no longer saved are released.
    """

    def __init__(self) -> None:
        self._buffers: list[dict[str, np.ndarray]] = []

    def stage(self, states: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Copy ``states`` (arrays by name) into the buffers and return the buffers (C-contiguous copies)."""
        staged, pieces = [], []
        for rank, state in enumerate(states):
            previous = self._buffers[rank] if rank < len(self._buffers) else {}
            buffers = {}
            for key, array in check_arrays(state, f"rank {rank}").items():
                buffer = previous.get(key)
                if buffer is None or buffer.dtype != array.dtype or buffer.shape != array.shape:
                    buffer = np.empty(array.shape, dtype=array.dtype)
                pieces += _pieces(buffer, array)
                buffers[key] = buffer
            staged.append(buffers)
        _copy(pieces)
        self._buffers = staged
        return staged

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(buffer.nbytes for buffers in self._buffers for buffer in buffers.values())
