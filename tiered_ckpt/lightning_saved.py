"""What a step saved through the Lightning plugin holds, to compare a second save of the same step with.

Lightning saves one step under several names (the top-k file and ``last.ckpt``), and again
after the step's training (at the epoch's end): the plugin saves a step once and points its
other names at it, so it compares what each later save holds with what the step holds, and
refuses a change to the weights or the optimizers (:class:`SavedStep`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiered_ckpt.errors import CheckpointExistsError
from tiered_ckpt.format.shardfile import dtype_code
from tiered_ckpt.format.state import flatten

__all__ = ["SavedStep"]

logger = logging.getLogger("tiered_ckpt")


@dataclass(frozen=True)
class SavedStep:
    """A step saved or loaded here: its number, and the fingerprint of each top-level key's value
    (the xxh3-128 of its structure document and of every array's name, dtype, shape and bytes; a
    chance collision is 2**-64 even over 2**32 checkpoints)."""

    step: int
    digests: Mapping[str, str]

    @classmethod
    def of(cls, step: int, checkpoint: dict[str, Any], owner: str) -> SavedStep:
        """``checkpoint`` of ``step``; :class:`InvalidStateError` naming ``owner`` and the path of a
        value that cannot be stored."""
        digests = {}
        for key, value in _compared(checkpoint).items():
            flat = flatten({key: value}, owner)
            hasher = xxhash.xxh3_128()
            hasher.update(flat.structure.to_json().encode())
            for name in sorted(flat.arrays):
                array = flat.arrays[name]
                hasher.update(json.dumps([name, dtype_code(array), list(array.shape)]).encode())
                hasher.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
            digests[str(key)] = hasher.hexdigest()
        return cls(step, digests)

    def refuse_other(self, other: SavedStep, target: Path) -> None:
        """Raise :class:`CheckpointExistsError` naming ``target`` unless ``other`` holds what this step
        holds, but for Lightning's progress bookkeeping (:data:`_PROGRESS`), which may have moved on
        since (a WARNING naming it: the step keeps this save's)."""
        if other.digests.keys() != self.digests.keys():
            raise CheckpointExistsError(
                f"{target}: step {self.step} is saved already with the top-level keys {sorted(self.digests)}, "
                f"not {sorted(other.digests)} (a weights-only and a full checkpoint of one step?); a step is saved "
                "once, and its other names point at it"
            )
        differ = sorted(key for key in self.digests if self.digests[key] != other.digests[key])
        changed = [key for key in differ if key not in _PROGRESS]
        if changed:
            why = (
                "a scheduler that changed the learning rate at the epoch's end?"
                if changed == ["optimizer_states"] and "lr_schedulers" in differ
                else "weights changed without an optimizer step: merged, averaged or quantized?"
            )
            raise CheckpointExistsError(
                f"{target}: step {self.step} is saved already with other contents in {', '.join(changed)} ({why}); "
                "a step is saved once, and its other names point at the same bytes: save the changed state as a new "
                "step, or elsewhere (a manager of another local.dir and remote.url, or Lightning's TorchCheckpointIO)"
            )
        if differ:
            logger.warning(
                "%s names step %d as first saved, without this save's %s (Lightning's bookkeeping moved on after "
                "the step's training: the end of its epoch); a step is saved once, and resuming from it resumes "
                "as from that save, running the epoch's end again",
                *(target, self.step, ", ".join(differ)),
            )


_PROGRESS = frozenset({"epoch", "loops", "callbacks", "lr_schedulers"})
"""The keys of a Trainer's checkpoint that move on after a step's training without an optimizer step:
the loops' counters and the epoch, the callbacks' states (which files hold which step, early
stopping), the schedulers stepped at an epoch's end."""


_FILE_BOOKKEEPING = frozenset({"dirpath", "best_model_path", "best_k_models", "last_model_path"})


def _compared(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` without the states of its ``ModelCheckpoint`` callbacks (of any subclass):
    which files hold which step, which change between the names of one step as each is
    written (the top-k file and ``last.ckpt``), and are no news to warn of."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return checkpoint
    kept = {
        key: state
        for key, state in callbacks.items()
        if not (isinstance(state, dict) and _FILE_BOOKKEEPING <= state.keys())
    }
    return {**checkpoint, "callbacks": kept}
