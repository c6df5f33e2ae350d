"""Retention as data: which steps of a tier to delete, and which must be kept whatever the policy says.

Pure functions of step numbers: no I/O, no clock. Every tier uses the same policy class;
what differs is what each protects (a tier keeps the steps a tier it feeds has not
committed yet, and the first tier weighs only the steps no newer than one complete on
every rank); :mod:`~tiered_ckpt.tiers.pruning` applies them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from tiered_ckpt.errors import invalid_option
from tiered_ckpt.format.bounds import MAX_COUNT, check_number

__all__ = ["RetentionPolicy", "BestMode", "awaiting", "best", "protected", "retainable"]

BestMode = Literal["min", "max"]


def _check_keep(name: str, value: object) -> None:
    if value is not None:
        check_number(name, value, 1, MAX_COUNT, hint=" (or None: keep all)")


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` steps (None: all), every step divisible by ``keep_every``,
    and the ``keep_best`` steps with the lowest (``best_mode="min"``) or highest (``"max"``)
    value of the metric ``best_metric`` their saves recorded (see :func:`best`).

    The newest step is always kept, and so is every step the caller protects.
    ``max_awaiting_upload`` (local tier) bounds how many steps still waiting for their
    upload are protected beyond that (the newest ones; None: all of them); only the steps
    divisible by ``upload_every`` (the bucket's cadence) and a preemption's stop step ever
    wait for an upload.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    max_awaiting_upload: int | None = None
    upload_every: int = 1
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: BestMode = "min"

    def __post_init__(self) -> None:
        _check_keep("keep_last", self.keep_last)
        _check_keep("keep_every", self.keep_every)
        _check_keep("max_awaiting_upload", self.max_awaiting_upload)
        if isinstance(self.upload_every, bool) or not isinstance(self.upload_every, int) or self.upload_every < 1:
            raise invalid_option("upload_every", f"must be an integer >= 1, got {self.upload_every!r:.60}")
        _check_best(self.keep_best, self.best_metric, self.best_mode, self.keep_last)

    @property
    def keeps_everything(self) -> bool:
        return self.keep_last is None

    def to_delete(
        self, steps: Iterable[int], protected: Collection[int] = (), scores: Mapping[int, float | None] | None = None
    ) -> list[int]:
        """The steps of ``steps`` this policy deletes, oldest first; never the newest, never ``protected``.
        ``scores`` are the steps' values of ``best_metric`` (a step it lacks, or with None, has none)."""
        ordered = sorted(set(steps))
        keep = set(ordered[-self.keep_last :]) if self.keep_last is not None else set(ordered)
        if self.keep_every is not None:
            keep |= {step for step in ordered if step % self.keep_every == 0}
        if self.keep_best is not None:
            keep |= best({step: (scores or {}).get(step) for step in ordered}, self.keep_best, self.best_mode)
        keep |= set(ordered[-1:]) | set(protected)
        return [step for step in ordered if step not in keep]


def _check_best(keep_best: object, metric: object, mode: object, keep_last: int | None) -> None:
    _check_keep("keep_best", keep_best)
    if metric is not None and (not isinstance(metric, str) or not metric):
        raise invalid_option("best_metric", f"must be a metric's name, got {metric!r:.60}")
    if mode not in ("min", "max"):
        raise invalid_option("best_mode", f"must be 'min' or 'max', got {mode!r:.60}")
    if (keep_best is None) != (metric is None):
        given, missing = ("keep_best", "best_metric") if metric is None else ("best_metric", "keep_best")
        raise invalid_option(missing, f"must be given with {given} (how many steps to keep, by which metric)")
    if keep_best is not None and keep_last is None:
        raise invalid_option(
            "keep_best", "needs keep_last (the newest steps kept beside the best): with None every step is kept"
        )


def best(scores: Mapping[int, float | None], count: int, mode: BestMode) -> set[int]:
    """The ``count`` steps of ``scores`` with the lowest (``"min"``) or highest (``"max"``) value;
    a step without one (None) is never among them, and of equal values the newer step wins."""
    scored = [(value, step) for step, value in scores.items() if value is not None]
    ranked = sorted(scored, key=lambda pair: (pair[0] if mode == "min" else -pair[0], -pair[1]))
    return {step for _value, step in ranked[:count]}


def awaiting(steps: Iterable[int], receipted: Collection[int], pending: Collection[int]) -> set[int]:
    """Steps a later tier waits for: not receipted (committed there), and either still queued
    for it or newer than the newest receipted step (not superseded there)."""
    newest_receipted = max(receipted, default=-1)
    return {step for step in steps if step not in receipted and (step in pending or step > newest_receipted)}


def protected(
    steps: Iterable[int], receipted: Collection[int], pending: Collection[int], limit: int | None
) -> set[int]:
    """The steps retention must keep for a later tier's sake: the steps queued for it and the
    newest ``limit`` of the steps it is :func:`awaiting` (all with None). Older waiting steps
    are left to the policy (the newest step it always keeps; a step already committed there,
    its newest commit included, is never a waiting step)."""
    waiting = sorted(awaiting(steps, receipted, pending))
    kept = set(waiting if limit is None else waiting[len(waiting) - limit :])
    return kept | set(pending).intersection(waiting)


def retainable(steps: Iterable[int], newest_complete: int | None) -> list[int]:
    """The local steps a policy may weigh, oldest first: those no newer than ``newest_complete``,
    the newest step known to be complete on every rank (None: none is, and nothing may go).

    A step newer than it is kept whatever the policy says, and it does not count towards
    ``keep_last``: with one process per rank, a step one rank committed may be missing on
    another (killed before its commit), and deleting older steps for it could leave no step
    every rank can restore.
    """
    if newest_complete is None:
        return []
    return sorted(step for step in set(steps) if step <= newest_complete)
