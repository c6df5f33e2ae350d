"""The host buffers a save's arrays are copied into before the background write, within a budget.

The copy is what ``save(blocking=False)`` makes the training loop wait for (with a state
within the budget, all of it), so it runs on several threads (numpy's copy releases the
GIL): large arrays are cut into pieces, and the pieces are copied in parallel, the training
loop's thread taking part.

The buffers hold at most ``budget`` bytes (``runtime.host_memory_bytes``,
:mod:`~tiered_ckpt.engine.memory_budget`). A state larger than it is staged from the end of
each shard, in the order its file holds the arrays (:func:`~tiered_ckpt.format.shardfile.write_order`),
as far as each shard's share of the budget goes: the arrays before those are written straight
from the caller's memory, first, and the save call waits only until the writer is done with
them (:class:`Staged`), so a larger state makes the call wait longer, never hold more.

An array on a device (an :class:`~tiered_ckpt.io.off_host.OffHost` stand-in for a CUDA
tensor) is staged the same way, in a pinned buffer its source allocates, copied straight
from the device (its copies run while the host arrays are copied, and the stage waits for
them); one past the budget is copied by the writer, a piece at a time, as it writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.shardfile import check_arrays, write_order
from tiered_ckpt.io.off_host import DeviceSource, OffHost

__all__ = ["Staged", "StagingBuffers"]

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


@dataclass(frozen=True)
class Staged:
    """A save's arrays after staging, by rank: the arrays to write (``states``: a staging
    buffer holding a copy, or the caller's own array where the budget did not reach), the
    names of those whose bytes are read from the caller's memory (``direct``, all of them or,
    for an array in ``tails``, all but its last bytes, which the tail buffer holds), and the
    bytes of each kind."""

    states: list[dict[str, np.ndarray]]
    direct: list[frozenset[str]]
    staged_bytes: int
    direct_bytes: int
    tails: list[dict[str, np.ndarray]] = field(default_factory=list)


def _splittable(array: np.ndarray) -> bool:
    """True if the last bytes of ``array`` are the end of what its shard stores of it, as they are in memory."""
    in_memory = array.flags.c_contiguous and not isinstance(array, OffHost)
    return array.ndim > 0 and in_memory and array.dtype.byteorder != ">"


def _plan(arrays: Mapping[str, np.ndarray], share: int) -> tuple[set[str], tuple[str, int] | None]:
    """What of one rank's arrays is staged within ``share`` bytes: the longest run of whole
    arrays that ends its shard's file and fits, and the last bytes of the array before them
    (its name and how many, whole items) where those fit and its memory allows."""
    chosen: set[str] = set()
    used = 0
    for name in reversed(write_order(arrays)):
        array = arrays[name]
        if used + array.nbytes <= share:
            chosen.add(name)
            used += array.nbytes
            continue
        tail = (share - used) // array.itemsize * array.itemsize
        return chosen, (name, tail) if tail and _splittable(array) else None
    return chosen, None


class StagingBuffers:
    """Host buffers that hold a copy of every rank's arrays between a save call and its write,
    at most ``budget`` bytes of them (None: no bound).

    A buffer is reused from save to save and reallocated only when its array's dtype or
    shape changes; buffers no longer wanted are released before any new one is allocated,
    so the buffers never hold more than the budget.
    """

    def __init__(self, budget: int | None = None) -> None:
        self._buffers: list[dict[str, np.ndarray]] = []
        self._tails: list[dict[str, np.ndarray]] = []
        self.budget = budget

    def stage(self, states: Sequence[Mapping[str, np.ndarray]]) -> Staged:
        """Copy ``states`` (arrays by name), or as much of them as the budget holds (see the
        module doc), into the buffers (C-contiguous copies)."""
        checked = [check_arrays(state, f"rank {rank}") for rank, state in enumerate(states)]
        total = sum(array.nbytes for arrays in checked for array in arrays.values())
        if self.budget is None or total <= self.budget:
            plans: list[tuple[set[str], tuple[str, int] | None]] = [(set(arrays), None) for arrays in checked]
        else:  # each shard's share of the budget in proportion to its size: they are written side by side
            budget = self.budget
            sizes = [sum(array.nbytes for array in arrays.values()) for arrays in checked]
            plans = [_plan(arrays, budget * size // total) for arrays, size in zip(checked, sizes, strict=True)]
        chosen = zip(checked, plans, strict=True)
        wholes = [{name: _wanted(arrays[name]) for name in names} for arrays, (names, _split) in chosen]
        tails = [{split[0]: (np.dtype(np.uint8), (split[1],), None)} if split else {} for _names, split in plans]
        old_buffers, old_tails = _kept(self._buffers, wholes), _kept(self._tails, tails)
        self._buffers, self._tails = [], []  # what is not reused is freed before anything new is allocated
        pieces: list[tuple[np.ndarray, np.ndarray]] = []
        landed: list[Callable[[], None]] = []
        buffers = [_allocated(wanted, old) for wanted, old in zip(wholes, old_buffers, strict=True)]
        tail_buffers = [_allocated(wanted, old) for wanted, old in zip(tails, old_tails, strict=True)]
        try:
            for arrays, mine, ends in zip(checked, buffers, tail_buffers, strict=True):
                for name, buffer in mine.items():
                    array = arrays[name]
                    if not isinstance(array, OffHost):
                        pieces += _pieces(buffer, array)
                    elif array.source is None:  # its memory is no array's bytes
                        raise InvalidStateError(f"{name!r} stands for an array on a device but has no source")
                    else:  # from the device, once
                        landed.append(array.source.start_copy(buffer.reshape(-1).view(np.uint8)))
                for name, buffer in ends.items():  # the last bytes of the array, as its shard stores them
                    whole = arrays[name].reshape(-1).view(np.uint8)
                    pieces += _pieces(buffer, whole[whole.size - buffer.size :])
            _copy(pieces)  # the device copies run meanwhile
        finally:  # a device copy still running lands before its buffer may go
            for wait in landed:
                wait()
        self._buffers, self._tails = buffers, tail_buffers
        direct = [frozenset(arrays).difference(names) for arrays, (names, _split) in zip(checked, plans, strict=True)]
        states_out = [{**arrays, **mine} for arrays, mine in zip(checked, buffers, strict=True)]
        return Staged(states_out, direct, self.nbytes, total - self.nbytes, tail_buffers)

    def release(self) -> None:
        """Let go of the buffers (the next save allocates them again); only while no save's
        write still reads them."""
        self._buffers, self._tails = [], []

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(buffer.nbytes for group in (*self._buffers, *self._tails) for buffer in group.values())


Wanted = Mapping[str, tuple[np.dtype, tuple[int, ...], DeviceSource | None]]


def _wanted(array: np.ndarray) -> tuple[np.dtype, tuple[int, ...], DeviceSource | None]:
    """The buffer ``array`` is staged in: its dtype and shape, and the device source of an
    :class:`OffHost` array (whose buffer is pinned host memory of that device's)."""
    source = array.source if isinstance(array, OffHost) else None
    return array.dtype, array.shape, source


def _kept(previous: Sequence[dict[str, np.ndarray]], wanted: Sequence[Wanted]) -> list[dict[str, np.ndarray]]:
    """By rank, the buffers of ``previous`` that ``wanted`` reuses: of the same dtype and shape,
    pinned where a device array is wanted."""
    kept = []
    for rank, each in enumerate(wanted):
        old = previous[rank] if rank < len(previous) else {}
        kept.append(
            {
                name: buffer
                for name, buffer in old.items()
                if name in each
                and each[name][:2] == (buffer.dtype, buffer.shape)
                and (each[name][2] is None or _pinned(buffer))
            }
        )
    return kept


def _pinned(buffer: np.ndarray) -> bool:
    """True for a buffer a device source allocated (its memory is not numpy's own)."""
    return buffer.base is not None


def _allocated(wanted: Wanted, old: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A buffer for each name of ``wanted``: ``old``'s, else a new one (pinned, for a device array)."""
    return {name: old[name] if name in old else _new(*each) for name, each in wanted.items()}


def _new(dtype: np.dtype, shape: tuple[int, ...], source: DeviceSource | None) -> np.ndarray:
    if source is None:
        return np.empty(shape, dtype)
    return source.host_buffer(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize).view(dtype).reshape(shape)
