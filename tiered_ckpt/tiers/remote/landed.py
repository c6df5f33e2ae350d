"""What the remote tier keeps of the shards it landed until their step's commit.

Per shard of a step being uploaded: the checksum the store keeps of the bytes that were
sent (none for a shard found already there intact) and, for a shard sent compressed, how
its object is stored (:class:`~tiered_ckpt.format.compressed.CompressedObject`). The
remote manifest records both. With one process per rank, every process lands its own
shards and hands what it kept (:meth:`LandedShards.take`) to the one that commits
(:meth:`LandedShards.add`). Shards of one step land from several threads at once: every
call holds one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from tiered_ckpt.format.compressed import CompressedObject

__all__ = ["Landed", "LandedShards"]


@dataclass(frozen=True)
class Landed:
    """The shards of one step landed: by shard path, the store's ``checksums`` of the bytes sent
    and the ``compressed`` objects' entries."""

    checksums: Mapping[str, str] = field(default_factory=dict)
    compressed: Mapping[str, CompressedObject] = field(default_factory=dict)


class LandedShards:
    """:class:`Landed` of every step being uploaded, by step."""

    def __init__(self) -> None:
        self._checksums: dict[tuple[int, str], str] = {}
        self._compressed: dict[tuple[int, str], CompressedObject] = {}
        self._lock = threading.Lock()

    def keep(self, step: int, path: str, checksum: str | None, compressed: CompressedObject | None) -> None:
        """Keep what landing shard ``path`` of ``step`` gave (each None: nothing of that kind)."""
        with self._lock:
            if checksum is not None:
                self._checksums[(step, path)] = checksum
            if compressed is not None:
                self._compressed[(step, path)] = compressed

    def checksum(self, step: int, path: str) -> str | None:
        """The store's checksum of what was sent of shard ``path`` of ``step``, if kept."""
        with self._lock:
            return self._checksums.get((step, path))

    def compressed(self, step: int, path: str) -> CompressedObject | None:
        """How shard ``path`` of ``step`` was stored, if it was landed compressed."""
        with self._lock:
            return self._compressed.get((step, path))

    def of(self, step: int, paths: Collection[str] | None = None) -> Landed:
        """What is kept of ``step``'s shards (those of ``paths`` only, if given)."""
        with self._lock:
            return self._of(step, paths)

    def take(self, step: int) -> Landed:
        """What is kept of ``step``, handed over once (forgotten here)."""
        with self._lock:
            taken = self._of(step, None)
            self._forget(step)
        return taken

    def add(self, step: int, landed: Landed) -> None:
        """Keep another process's :meth:`take` of ``step`` (its shards), for the commit here."""
        with self._lock:
            self._checksums.update({(step, path): kept for path, kept in landed.checksums.items()})
            self._compressed.update({(step, path): kept for path, kept in landed.compressed.items()})

    def forget(self, step: int) -> None:
        """Drop everything kept of ``step`` (its upload committed or given up)."""
        with self._lock:
            self._forget(step)

    def _of(self, step: int, paths: Collection[str] | None) -> Landed:
        def wanted(key: tuple[int, str]) -> bool:
            return key[0] == step and (paths is None or key[1] in paths)

        return Landed(
            {path: kept for (at, path), kept in self._checksums.items() if wanted((at, path))},
            {path: kept for (at, path), kept in self._compressed.items() if wanted((at, path))},
        )

    def _forget(self, step: int) -> None:
        for kept in (self._checksums, self._compressed):
            for key in [key for key in kept if key[0] == step]:
                del kept[key]
