"""How the processes of a job agree: which ranks a process holds, who commits, barriers.

A :class:`Coordinator` is what :class:`~tiered_ckpt.CheckpointManager` asks whenever
more than one process could be involved. Payloads are small JSON-like objects (shard
records, step numbers), never arrays.

:class:`SingleProcessCoordinator` is the case of the original lesson: one process holds
every rank's state, so it is the leader, gathers from itself and needs no barrier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["Coordinator", "SingleProcessCoordinator"]


@runtime_checkable
class Coordinator(Protocol):
    """The collective operations a checkpoint needs across the processes of a job."""

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        ...

    @property
    def local_ranks(self) -> Sequence[int]:
        """The ranks whose state this process saves and restores."""
        ...

    @property
    def is_leader(self) -> bool:
        """True on the one process that commits manifests and decides which step to restore."""
        ...

    def barrier(self) -> None:
        """Return once every process has called it."""
        ...

    def all_gather(self, payload: Any) -> list[Any]:
        """Return every process's payload, in process order, on every process."""
        ...

    def broadcast(self, payload: Any) -> Any:
        """Return the leader's payload on every process."""
        ...


class SingleProcessCoordinator:
    """One process that holds all ``world_size`` ranks (simulated ranks)."""

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self._world_size = world_size

    def __repr__(self) -> str:
        return f"SingleProcessCoordinator(world_size={self._world_size})"

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_ranks(self) -> Sequence[int]:
        return range(self._world_size)

    @property
    def is_leader(self) -> bool:
        return True

    def barrier(self) -> None:
        return None

    def all_gather(self, payload: Any) -> list[Any]:
        return [payload]

    def broadcast(self, payload: Any) -> Any:
        return payload
