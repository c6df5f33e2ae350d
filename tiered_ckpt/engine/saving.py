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
from tiered_ckpt.errors import CheckpointExistsError, InvalidStateError, SaveError, UploadError, restated
from tiered_ckpt.format.manifest import record_bytes_bound
from tiered_ckpt.format.metrics import GivenMetrics, Metrics, metrics_of
from tiered_ckpt.format.state import FlatState, State, flatten
from tiered_ckpt.format.validate import (
    TensorSummary,
    check_manifest_fits,
    check_same_tensors,
    tensor_summary,
    validate_states,
    validate_step,
)

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
    dtypes of its 1-D arrays per rank (a flat vector's slices have one), its metrics, and the
    dtype and global shape of each DTensor per rank (every rank's chunks of one have the same)."""

    arguments: str
    newest: int | None
    shapes: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    flat: bool
    record_bytes: tuple[int, ...]
    replicated: bool = True
    dtypes: tuple[tuple[tuple[str, str], ...], ...] = ()
    metrics: Metrics = ()
    tensors: tuple[TensorSummary, ...] = ()


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


def _report(step: int, local: Sequence[FlatState], newest: int | None, world_size: int, replicated: bool) -> SaveReport:
    shapes = tuple(tuple((key, tuple(shape)) for key, shape in sharding_summary(s.arrays).items()) for s in local)
    flat = all(s.structure.flat for s in local)
    # A data-parallel rank's record may list any of its arrays as left to another rank's shard.
    sizes = tuple(
        max(s.record_bytes(world_size), record_bytes_bound((n, a.ndim) for n, a in s.arrays.items()))
        if replicated
        else s.record_bytes(world_size)
        for s in local
    )
    dtypes = tuple(tuple(dtype_summary(s.arrays).items()) for s in local)
    has_replicas = any(s.replicated for s in local)
    tensors = tuple(tensor_summary(s) for s in local)
    return SaveReport(json.dumps({"step": step}), newest, shapes, flat, sizes, has_replicas, dtypes, tensors=tensors)


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
    replicated: bool = False,
) -> SavePlan:
    """Check a save of ``states`` (this process's ranks) as ``step`` on every rank (see the module doc).

    ``checked`` is the caller's own checks, giving this process's newest committed step.
    Raises on every rank, whichever rank's input or directory is at fault:
    :class:`InvalidStateError` for bad input or arguments that differ between ranks, and
    :class:`CheckpointExistsError` (naming ``where``) if ``step`` is not newer than every
    rank's newest; ``stop_step``, the step a preemption notice was answered at, adds a hint
    when the caller saves it twice. ``metrics`` are checked on each process
    (:func:`~tiered_ckpt.format.metrics.metrics_of`); the leader's are the step's.
    ``replicated=True`` (a data-parallel state) makes every array but a DTensor's and the sharded
    keys named by ``sharded_keys`` a replicated one (:attr:`FlatState.replicated`): one written once
    by one of the ranks that hold identical copies of it, and put back on each at restore.
    """

    def mine() -> tuple[tuple[FlatState, ...], SaveReport]:
        newest = checked.value
        if not isinstance(replicated, bool):
            raise InvalidStateError(f"replicated must be True or False, got {replicated!r:.80}")
        recorded = metrics_of(metrics, step)
        local = _flatten(step, states, tuple(coordinator.local_ranks))
        report = _report(step, local, newest, coordinator.world_size, replicated)
        arguments = json.dumps({"step": step} | ({"replicated": True} if replicated else {}))
        return local, replace(report, arguments=arguments, metrics=recorded)

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
    check_same_tensors([rank_tensors for each in reports for rank_tensors in each.tensors])
    keys, numels = resolve_sharded_keys(shapes, sharded_keys, flat=flat and not replicated, dtypes=dtypes)
    check_manifest_fits([size for each in reports for size in each.record_bytes], keys, step, reports[0].metrics)
    local = attempt.value[0]
    if replicated:
        local = tuple(_replicas_of(state, keys) for state in local)
    replicas = replicated or any(each.replicated for each in reports)
    return SavePlan(local, keys, tuple(numels), replicas, reports[0].metrics)


def _replicas_of(state: FlatState, sharded: Sequence[str]) -> FlatState:
    """``state`` of a data-parallel save: every array but a DTensor's and the sharded keys is replicated."""
    plain = {name for name, kind in state.structure.kinds.items() if kind != "dtensor"} - set(sharded)
    return replace(state, replicated=state.replicated | plain)
