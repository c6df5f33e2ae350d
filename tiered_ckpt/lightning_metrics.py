"""The metrics the Lightning plugin records with a step: what a tier's ``keep_best`` ranks steps by.

A ``ModelCheckpoint`` with a ``monitor`` gives the saves it ranks their score
(:func:`monitored`); :class:`RecordMetrics` gives every save the logged values it names.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from tiered_ckpt.errors import UsageError

__all__ = ["METRICS_KEY", "RecordMetrics", "monitored"]


METRICS_KEY = "tiered_ckpt_metrics"
"""The key :class:`RecordMetrics` adds to each checkpoint, which the plugin records as the step's
metrics (``save(..., metrics=)``) and does not store with the checkpoint."""


class RecordMetrics(Callback):
    """Record the logged metrics ``names`` (``trainer.callback_metrics``) with every checkpoint the
    plugin saves, as the step's metrics: what a tier's ``keep_best`` ranks its steps by.

    ``ModelCheckpoint`` gives a score only to the saves it ranks into its top k; a save it does
    not rank (``last.ckpt``, a step outside its top k) has none, and keep-best can then rank
    only the callback's successive bests. With this callback, every save carries the values
    the loop logged last (a metric not logged yet is left out)."""

    def __init__(self, *names: str) -> None:
        if not names or not all(isinstance(name, str) and name for name in names):
            raise UsageError(f"RecordMetrics takes the names of logged metrics, got {names!r:.80}")
        self.names = names

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        logged = trainer.callback_metrics
        checkpoint[METRICS_KEY] = {name: float(logged[name]) for name in self.names if name in logged}


def monitored(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """The values ``ModelCheckpoint`` callbacks gave the checkpoint they save at ``path``, by the
    metric each monitors: its score in the callback's ``best_k_models``, which the callback
    records before it saves. A save it did not rank (``last.ckpt``, a save without a monitor)
    has none; its ``current_score`` is not used, as it may be an earlier step's."""
    monitored: dict[str, Any] = {}
    states = checkpoint.get("callbacks")
    for state in states.values() if isinstance(states, dict) else ():
        if not isinstance(state, dict) or not isinstance(state.get("best_k_models"), dict):
            continue
        monitor, score = state.get("monitor"), state["best_k_models"].get(os.fspath(path))
        if isinstance(monitor, str) and score is not None:
            monitored[monitor] = score
    return monitored
