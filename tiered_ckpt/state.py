"""What a rank hands to ``save``: its arrays, and the host buffers they are staged in.

``save`` copies a rank's arrays (numpy arrays, or torch tensors seen through numpy
views) into :class:`StagingBuffers` and returns; the background writer then streams the
buffers to disk while the training loop overwrites its own arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .shardfile import check_arrays

__all__ = ["StagingBuffers", "State"]

State = Mapping[str, np.ndarray]


class StagingBuffers:
    """Host buffers that hold a copy of every rank's arrays between a save call and its write.

    A buffer is reused from save to save and reallocated only when its array's dtype or
    shape changes; arrays that are no longer saved are released.
    """

    def __init__(self) -> None:
        self._buffers: list[dict[str, np.ndarray]] = []

    def stage(self, states: Sequence[State]) -> list[dict[str, np.ndarray]]:
        """Copy ``states`` into the buffers and return the buffers (C-contiguous copies)."""
        staged = []
        for rank, state in enumerate(states):
            previous = self._buffers[rank] if rank < len(self._buffers) else {}
            buffers = {}
            for key, array in check_arrays(state, f"rank {rank}").items():
                buffer = previous.get(key)
                if buffer is None or buffer.dtype != array.dtype or buffer.shape != array.shape:
                    buffer = np.empty(array.shape, dtype=array.dtype)
                np.copyto(buffer, array, casting="no")
                buffers[key] = buffer
            staged.append(buffers)
        self._buffers = staged
        return staged

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(buffer.nbytes for buffers in self._buffers for buffer in buffers.values())
