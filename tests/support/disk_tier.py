"""A second disk of this node as a later tier, for tests: the local tier's own code under
another root and another name.

A later tier lands and commits steps the replicator hands it, so it needs its directory's
lock as the first tier does; this one takes it when made and holds it for its process's life
(a killed process's lock goes with it). Durable, not shared: each node holds its own part.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

from tiered_ckpt.tiers.local import LocalTier


class DiskTier(LocalTier):
    """A :class:`LocalTier` at ``root`` called ``name``, locked from the start."""

    def __init__(self, root: str | os.PathLike[str], name: str = "disk2") -> None:
        super().__init__(root)
        self.name = name
        self._held = ExitStack()
        self._held.enter_context(self.lock())

    def __repr__(self) -> str:
        return f"DiskTier({str(self.root)!r}, {self.name!r})"

    def release(self) -> None:
        """Give the directory's lock back."""
        self._held.close()
