"""The metrics each tier's steps recorded, read once per step for keep-best retention.

A committed step's manifest does not change, so its metrics are read from the tier once
and kept (per tier: the bucket's copy of a step may come from another branch of the run
than the disk's); a step retention deletes is forgotten. A step whose manifest cannot be
read now (a bucket's blip) is *unknown*, and retention keeps it this pass: a step that may
be among the best is never deleted for want of its value. A manifest that can never be read
(damaged, or of a later release: :class:`ManifestError`) records no value the policy can
rank, and its step is weighed as one without metrics (by ``keep_last``), with a WARNING.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from tiered_ckpt.errors import CheckpointError, ManifestError
from tiered_ckpt.format.metrics import Metrics
from tiered_ckpt.tiers.base import Tier

__all__ = ["StepMetrics"]

logger = logging.getLogger("tiered_ckpt")


class StepMetrics:
    """Every tier's steps' metrics, as their manifests recorded them (see the module doc)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], Metrics] = {}
        self._lock = threading.Lock()  # the local tier's and each later tier's passes run on threads of their own

    def scores(self, tier: Tier, steps: Iterable[int], metric: str) -> tuple[dict[int, float | None], set[int]]:
        """``metric``'s value for each of ``steps`` of ``tier`` (None: the save recorded none),
        and the steps whose manifest could not be read now (logged at WARNING)."""
        values: dict[int, float | None] = {}
        unknown: set[int] = set()
        for step in steps:
            with self._lock:
                recorded = self._known.get((tier.name, step))
            if recorded is None:
                try:
                    recorded = tier.manifest(step).metrics
                except ManifestError as exc:  # damaged, or of a later release: it records no value this can read
                    logger.warning("retention of %s ranks step %d without metrics: %s", tier.url, step, exc)
                    values[step] = None
                    continue
                except CheckpointError as exc:
                    logger.warning(
                        "retention of %s keeps step %d: its metrics could not be read (%s)", tier.url, step, exc
                    )
                    unknown.add(step)
                    continue
                with self._lock:
                    self._known[(tier.name, step)] = recorded
            values[step] = dict(recorded).get(metric)
        return values, unknown

    def forget(self, tier: Tier, step: int) -> None:
        """``step`` left ``tier``: a later step of that number is another save."""
        with self._lock:
            self._known.pop((tier.name, step), None)
