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
  in place, resharded on another number of ranks;
- :class:`TieredFSDPStrategy` is ``FSDPStrategy`` (FSDP1) doing the same with its sharded
  state, which FSDP gives as DTensors once it holds a device mesh (the strategy makes one).

Removals stay on rank 0 (the plugin's other ranks hold the steps rank 0's pointers name).
Needs the ``lightning`` package, as :mod:`tiered_ckpt.lightning` does.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from tiered_ckpt.errors import UsageError

__all__ = ["TieredDDPStrategy", "TieredFSDPStrategy", "TieredModelParallelStrategy"]


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


class _ShardedThroughPlugin:
    """What the strategies of sharded states (DTensors) add before Lightning's own, in their
    method order: saves through the plugin on every rank, loads in place, and the plugin's
    tear-down, which Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` skip."""

    checkpoint_io: Any

    def teardown(self) -> None:
        """Lightning's tear-down, then the ``CheckpointIO``'s: under ``AsyncCheckpointIO``, its queued
        saves finish (and a failed one raises) before ``fit`` returns."""
        super().teardown()  # type: ignore[misc]
        self.checkpoint_io.teardown()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Hand ``checkpoint`` (its states of DTensors) to the ``CheckpointIO`` on every rank."""
        _saved_on_every_rank(self, checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``checkpoint_path`` names, its model and optimizer states loaded into the
        model and the optimizers (``load_model_state_dict`` and ``load_optimizer_state_dict`` then
        do nothing, as in Lightning's strategy)."""
        return _loaded_in_place(self, checkpoint_path)


class TieredModelParallelStrategy(_ShardedThroughPlugin, ModelParallelStrategy):
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


class TieredFSDPStrategy(_ShardedThroughPlugin, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1) whose sharded checkpoints are steps of each rank's manager.

    ``Trainer(strategy=TieredFSDPStrategy(...), plugins=[TieredCheckpointIO(make_manager)])``.
    Takes ``FSDPStrategy``'s arguments, by keyword; ``state_dict_type`` is ``"sharded"`` (each
    rank saves its shards; ``"full"``, a state gathered on rank 0, is refused). Without a
    ``device_mesh``, the strategy gives FSDP a one-dimensional mesh of every rank, as FSDP's
    sharded state is a state of DTensors only on a mesh; for hybrid sharding give
    ``device_mesh`` (replicas, shards per replica). Saves and loads then go as in
    :class:`TieredModelParallelStrategy`: each rank writes its own chunks, and a load fills the
    model's and the optimizers' states in place, on another number of ranks too.
    """

    def __init__(self, *, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        if state_dict_type != "sharded":
            raise UsageError(
                f"TieredFSDPStrategy saves each rank's shards (state_dict_type='sharded'), not {state_dict_type!r}: "
                "a full state gathered on rank 0 is Lightning's own FSDPStrategy's"
            )
        if "process_group" in kwargs:
            raise UsageError(
                "TieredFSDPStrategy shards over a device mesh, not a process_group: FSDP's sharded state is a state "
                "of DTensors only on a mesh; give device_mesh=(replicas, shards per replica) instead"
            )
        hybrid = "HYBRID" in str(kwargs.get("sharding_strategy", "")).upper()
        if hybrid and kwargs.get("device_mesh") is None:
            raise UsageError(
                f"TieredFSDPStrategy with sharding_strategy={kwargs['sharding_strategy']!r} needs "
                "device_mesh=(replicas, shards per replica): hybrid sharding is a two-dimensional mesh"
            )
        super().__init__(state_dict_type="sharded", **kwargs)

    def setup_environment(self) -> None:
        """Lightning's set-up, a device mesh of every rank if none was given, then the plugin's
        manager made on every rank (:meth:`TieredCheckpointIO.open`)."""
        super().setup_environment()
        if self.kwargs.get("device_mesh") is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, (self.world_size,))
        _tiered(self).open()


def _loaded_in_place(strategy: Any, checkpoint_path: _PATH) -> dict[str, Any]:
    """The checkpoint ``checkpoint_path`` names, read into the model's and the optimizers' states
    of DTensors (``restore(into=...)``: resharded on another number of ranks) and set into them
    with ``torch.distributed.checkpoint.state_dict``, which knows FSDP1, FSDP2 and tensor
    parallel alike. Without optimizers (``validate``, ``test``), the model only."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    plugin = _tiered(strategy)
    model, optimizers = strategy.model, strategy.optimizers
    assert model is not None and strategy.lightning_module is not None
    into = {
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers],
    }
    checkpoint: dict[str, Any] = plugin.load_checkpoint(checkpoint_path, into=into)
    strict = StateDictOptions(strict=strategy.lightning_module.strict_loading)
    set_model_state_dict(model, checkpoint["state_dict"], options=strict)
    for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states") or [], strict=False):
        set_optimizer_state_dict(model, optimizer, state)
    return checkpoint
