"""Lightning's DDP strategy, saving each checkpoint on every rank: a step of every rank's manager.

Lightning's strategies hand a checkpoint to the ``CheckpointIO`` on rank 0 only (and load it
on every rank), as each writes one file. A :class:`~tiered_ckpt.lightning.TieredCheckpointIO`
of several processes saves a step on every rank together (one collective save, each array
written once), so it needs every rank's call: :class:`TieredDDPStrategy` is ``DDPStrategy``
with that one change. Removals stay on rank 0 (the plugin's other ranks hold the steps rank
0's pointers name). Needs the ``lightning`` package, as :mod:`tiered_ckpt.lightning` does.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy

from tiered_ckpt.errors import UsageError

__all__ = ["TieredDDPStrategy"]


class TieredDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose checkpoints are saved through a ``TieredCheckpointIO`` on every rank.

    ``Trainer(strategy=TieredDDPStrategy(), plugins=[TieredCheckpointIO(make_manager)])``, where
    ``make_manager`` makes this rank's :class:`~tiered_ckpt.CheckpointManager` (its own
    ``local.dir``, a ``TorchDistributedCoordinator``). Takes ``DDPStrategy``'s arguments. A save
    raises :class:`UsageError` on every rank if the strategy's ``CheckpointIO`` (or the one
    Lightning's ``AsyncCheckpointIO`` wraps) is another plugin: each rank would write the same
    file.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Hand ``checkpoint`` to the ``CheckpointIO`` on every rank (Lightning's default: rank 0 only)."""
        plugin = self.checkpoint_io
        inner = getattr(plugin, "checkpoint_io", plugin)  # AsyncCheckpointIO wraps the plugin
        if not hasattr(inner, "saves_on_every_rank"):
            raise UsageError(
                f"{type(self).__name__} saves through a tiered_ckpt.lightning.TieredCheckpointIO on every rank, and "
                f"the Trainer's CheckpointIO is a {type(inner).__name__}, with which each rank would write one file: "
                "pass plugins=[TieredCheckpointIO(...)], or use Lightning's DDPStrategy"
            )
        inner.saves_on_every_rank = True
        plugin.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
