"""The check of a save call, on the caller's thread, before anything is staged.

:func:`check_save` is one collective, ``save``, in this order:

1. the caller's own checks ran first (a background error not yet raised, the directory
   still locked) and gave this process's newest step; if they failed, every rank raises;
2. each process checks its metrics and flattens its own states (CPU tensors become numpy views, CUDA
   tensors stand-ins whose bytes the staging copies after the collective),
   inside the collective, so bad input raises on every rank rather than stranding the
   others, and reports its :class:`SaveReport`;
3. every process reads the gathered reports the same way: the same call on every rank, a
   step newer than every rank's newest, the sharded keys of the flat-parameter rule (one
   dtype for each flat vector's slices), and
   a manifest that fits what a reader accepts, and whether any rank's state has replicated
   arrays (that other ranks may have identical copies of): if none does, the writer skips the
   exchange that gives each one writer (:func:`~tiered_ckpt.dist.replicas.choose_writers`), a collective less per save.

Around it, :func:`not_saved` says that a background error raised there means this save's
step was not saved.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from tiered_ckpt.dist.coordination import Attempt, Coordinator, gather
from tiered_ckpt.dist.sharding import dtype_summary, resolve_sharded_keys, sharding_summary
from tiered_ckpt.engine.step_choice import same_call
from tiered_ckpt.errors import CheckpointExistsError, SaveError, UploadError, restated
from tiered_ckpt.format.metrics import GivenMetrics, Metrics, metrics_of
from tiered_ckpt.format.state import FlatState, State, flatten
from tiered_ckpt.format.validate import check_manifest_fits, validate_states, validate_step

__all__ = ["SaveReport", "SavePlan", "check_save", "not_saved"]


@contextmanager
def not_saved(step: int) -> Iterator[None]:
    """Around a save's check: a background error it raises says that this save's step was not saved."""
    try:
        yield
    except (SaveError, UploadError) as exc:
        raise restated(exc, f"{exc} (so step {step} was not saved: nothing of it was written)") from exc.__cause__


@dataclass(frozen=True)
class SaveReport:
    """One process's check of a save call: its arguments, its newest step, its arrays' shapes per
    rank, whether each of its ranks' states is a flat dict of arrays, the most bytes each of
    its ranks' records may add to the manifest, whether any of its ranks' states has
    replicated arrays (:attr:`FlatState.replicated`), the
    dtypes of its 1-D arrays per rank (a flat vector's slices have one), and its metrics."""

    arguments: str
    newest: int | None
    shapes: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    flat: bool
    record_bytes: tuple[int, ...]
    replicated: bool = True
    dtypes: tuple[tuple[tuple[str, str], ...], ...] = ()
    metrics: Metrics = ()


@dataclass(frozen=True)
class SavePlan:
    """What a checked save writes: this process's flattened states (one per local rank), the
    sharded keys (sorted), every rank's ``param_shard_numel``, whether any rank's state
    has replicated arrays (then the writer agrees who writes each), and the step's metrics
    (the leader's: rank 0's process gives the values the manifest records)."""

    states: tuple[FlatState, ...]
    sharded_keys: tuple[str, ...]
    numels: tuple[int, ...]
    replicated: bool = True
    metrics: Metrics = ()


def _flatten(step: int, states: Sequence[State] | State, ranks: Sequence[int]) -> tuple[FlatState, ...]:
    validate_step(step)
    given = [states] if isinstance(states, Mapping) else states
    validate_states(given, len(ranks))
    # A CUDA tensor stands in until the staging copies it (engine/staging.py), out of this collective.
    return tuple(flatten(state, f"rank {r}", off_host=True) for r, state in zip(ranks, given, strict=True))


def _report(step: int, local: Sequence[FlatState], newest: int | None, world_size: int) -> SaveReport:
    shapes = tuple(tuple((key, tuple(shape)) for key, shape in sharding_summary(s.arrays).items()) for s in local)
    flat = all(s.structure.flat for s in local)
    sizes = tuple(s.record_bytes(world_size) for s in local)
    dtypes = tuple(tuple(dtype_summary(s.arrays).items()) for s in local)
    replicated = any(s.replicated for s in local)
    return SaveReport(json.dumps({"step": step}), newest, shapes, flat, sizes, replicated, dtypes)


def check_save(
    coordinator: Coordinator,
    step: int,
    states: Sequence[State] | State,
    *,
    checked: Attempt[int | None],
    sharded_keys: Iterable[str | Sequence[str | int]] | None,
    where: str,
    stop_step: int | None = None,
    metrics: GivenMetrics | None = None,
) -> SavePlan:
    """Check a save of ``states`` (this process's ranks) as ``step`` on every rank (see the module doc).

    ``checked`` is the caller's own checks, giving this process's newest committed step.
    Raises on every rank, whichever rank's input or directory is at fault:
    :class:`InvalidStateError` for bad input or arguments that differ between ranks, and
    :class:`CheckpointExistsError` (naming ``where``) if ``step`` is not newer than every
    rank's newest; ``stop_step``, the step a preemption notice was answered at, adds a hint
    when the caller saves it twice. ``metrics`` are checked on each process
    (:func:`~tiered_ckpt.format.metrics.metrics_of`); the leader's are the step's.
    """

    def mine() -> tuple[tuple[FlatState, ...], SaveReport]:
        newest = checked.value
        recorded = metrics_of(metrics, step)
        local = _flatten(step, states, tuple(coordinator.local_ranks))
        return local, replace(_report(step, local, newest, coordinator.world_size), metrics=recorded)

    attempt = Attempt.run(mine)
    reports = gather(coordinator, "save", SaveReport, lambda: attempt.value[1])
    same_call([each.arguments for each in reports], "save")
    newest = max((each.newest for each in reports if each.newest is not None), default=None)
    if newest is not None and step <= newest:
        hint = (
            "; ask reached_preemption(step) before the step's regular save, so that the stop step is a new one"
            if stop_step == step == newest
            else ""
        )
        raise CheckpointExistsError(
            f"{where}: step {step} is not newer than the newest checkpoint, step {newest}{hint}"
        )
    shapes = [dict(rank_shapes) for each in reports for rank_shapes in each.shapes]
    dtypes = [dict(rank_dtypes) for each in reports for rank_dtypes in each.dtypes]
    flat = all(each.flat for each in reports)
    keys, numels = resolve_sharded_keys(shapes, sharded_keys, flat=flat, dtypes=dtypes)
    check_manifest_fits([size for each in reports for size in each.record_bytes], keys, step, reports[0].metrics)
    replicated = any(each.replicated for each in reports)
    return SavePlan(attempt.value[0], keys, tuple(numels), replicated, reports[0].metrics)
