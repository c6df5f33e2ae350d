"""Lightning's multi-process strategies, saving each checkpoint on every rank: a step of every rank's manager.

Lightning's strategies hand a checkpoint to the ``CheckpointIO`` on rank 0 only (and load it
on every rank), as each writes one file; ``ModelParallelStrategy`` (FSDP2, tensor parallel)
writes through ``torch.distributed.checkpoint`` instead. A
:class:`~tiered_ckpt.lightning.TieredCheckpointIO` of several processes saves a step on every
rank together (one collective save), so it needs every rank's call:

- :class:`TieredDDPStrategy` is ``DDPStrategy`` saving on every rank: the ranks' states are
  replicas, each array written once over the ranks;
- :class:`TieredModelParallelStrategy` is ``ModelParallelStrategy`` saving its sharded state
  (DTensors) through the plugin on every rank, and loading it into the model and optimizers
  in place, resharded on another number of ranks.

Removals stay on rank 0 (the plugin's other ranks hold the steps rank 0's pointers name).
Needs the ``lightning`` package, as :mod:`tiered_ckpt.lightning` does.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from tiered_ckpt.errors import UsageError

__all__ = ["TieredDDPStrategy", "TieredModelParallelStrategy"]


def _saved_on_every_rank(strategy: Any, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any) -> None:
    """Hand ``checkpoint`` to ``strategy``'s ``CheckpointIO`` on every rank; :class:`UsageError`
    (on every rank alike) if it is not a ``TieredCheckpointIO``, bare or in ``AsyncCheckpointIO``."""
    plugin = strategy.checkpoint_io
    _tiered(strategy).saves_on_every_rank = True
    plugin.save_checkpoint(checkpoint, filepath, storage_options=storage_options)


def _tiered(strategy: Any) -> Any:
    plugin = strategy.checkpoint_io
    inner = getattr(plugin, "checkpoint_io", plugin)  # AsyncCheckpointIO wraps the plugin
    if not hasattr(inner, "saves_on_every_rank"):
        raise UsageError(
            f"{type(strategy).__name__} saves through a tiered_ckpt.lightning.TieredCheckpointIO on every rank, and "
            f"the Trainer's CheckpointIO is a {type(inner).__name__}, with which each rank would write one file: "
            "pass plugins=[TieredCheckpointIO(...)]"
        )
    return inner


class TieredDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose checkpoints are saved through a ``TieredCheckpointIO`` on every rank.

    ``Trainer(strategy=TieredDDPStrategy(), plugins=[TieredCheckpointIO(make_manager)])``, where
    ``make_manager`` makes this rank's :class:`~tiered_ckpt.CheckpointManager` (its own
    ``local.dir``, a ``TorchDistributedCoordinator``). Takes ``DDPStrategy``'s arguments. A save
    raises :class:`UsageError` on every rank if the strategy's ``CheckpointIO`` (or the one
    Lightning's ``AsyncCheckpointIO`` wraps) is another plugin: each rank would write the same
    file.
    """

    def setup_environment(self) -> None:
        """Lightning's set-up, then the plugin's manager made on every rank (:meth:`TieredCheckpointIO.open`)."""
        super().setup_environment()
        _tiered(self).open()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Hand ``checkpoint`` to the ``CheckpointIO`` on every rank (Lightning's default: rank 0 only)."""
        _saved_on_every_rank(self, checkpoint, filepath, storage_options)


class TieredModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2, tensor parallel) whose checkpoints are steps of each rank's manager.

    ``Trainer(strategy=TieredModelParallelStrategy(...), plugins=[TieredCheckpointIO(make_manager)])``.
    Takes ``ModelParallelStrategy``'s arguments; ``save_distributed_checkpoint`` must stay True
    (each rank saves its shards). A save hands the checkpoint, whose model and optimizer states
    are DTensors, to the plugin on every rank: each rank writes its own chunks, and the arrays
    the ranks hold alike once. A load reads the step into the model's and the optimizers'
    DTensors in place, each chunk verified, from the saved chunks that overlap it (on another
    number of ranks too, from the bucket), then sets them as ``ModelParallelStrategy`` does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("save_distributed_checkpoint", True):
            raise UsageError(
                "TieredModelParallelStrategy saves each rank's shards (save_distributed_checkpoint=True): a full "
                "state gathered on rank 0 is Lightning's own ModelParallelStrategy's"
            )
        super().__init__(*args, **kwargs)

    def setup_environment(self) -> None:
        """Lightning's set-up, then the plugin's manager made on every rank (:meth:`TieredCheckpointIO.open`)."""
        super().setup_environment()
        _tiered(self).open()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Hand ``checkpoint`` (its states of DTensors) to the ``CheckpointIO`` on every rank."""
        _saved_on_every_rank(self, checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``checkpoint_path`` names, its model and optimizer states loaded into the
        model and the optimizers (``load_model_state_dict`` and ``load_optimizer_state_dict`` then
        do nothing, as in ``ModelParallelStrategy``)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        plugin = _tiered(self)
        assert self.model is not None and self.lightning_module is not None
        into = {
            "state_dict": get_model_state_dict(self.model),
            "optimizer_states": [get_optimizer_state_dict(self.model, optimizer) for optimizer in self.optimizers],
        }
        checkpoint: dict[str, Any] = plugin.load_checkpoint(checkpoint_path, into=into)
        strict = StateDictOptions(strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint["state_dict"], options=strict)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states") or [], strict=False):
            set_optimizer_state_dict(self.model, optimizer, state)
        return checkpoint
