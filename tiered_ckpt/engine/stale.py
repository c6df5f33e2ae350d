"""Stale saves: a step whose arrays did not change since the step before it.

A checksum proves a shard's bytes arrived; it cannot say they are this step's. A save that
keeps writing the same bytes (an optimizer whose state is saved from a copy taken once, a
state dict captured before the training loop) looks healthy until a restore. So each save
compares, before its commit, every array it wrote with the same array (rank and tensor
name) of the newest step committed on this disk before it, by the digests the two
manifests record for each array (:meth:`~tiered_ckpt.format.manifest.ShardRecord.digests_by_name`:
each chunk's sha256 in a state of DTensors, each array's xxh3-64 in a shard of plain
arrays), and judges across every process (:func:`judge`):

* no array changed, every array of the step compared: stale;
* the arrays under ``runtime.must_change`` (e.g. ``["optim"]``): stale when none of them
  changed (an array there that may have changed, or was not compared, clears it), so that
  a frozen part of the optimizer's state raises no alarm.

``runtime.stale_saves`` says what a stale step does: ``"warn"`` (the default: a WARNING
naming both steps and the unchanged paths), ``"error"`` (the save fails before anything is
committed: a :class:`~tiered_ckpt.SaveError`), or ``"off"``. Arrays whose manifest records
no digest (a shard of very many arrays) are never judged unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.format.selection import selects
from tiered_ckpt.format.structure import leaf_name
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Comparison", "check_stale", "compare_with_previous", "judge", "must_change_names"]

logger = logging.getLogger("tiered_ckpt")

_NAMED = 8  # unchanged arrays named in a message; the rest are counted


@dataclass(frozen=True)
class Comparison:
    """One process's arrays of a step compared with those of ``previous`` (None: no earlier
    step on its disk): ``arrays`` written, ``compared`` (both steps recorded a digest),
    ``changed``; of those under ``runtime.must_change``, ``must`` written, ``must_compared``,
    ``must_changed``, and ``must_unchanged`` named ("rank 0: optim/m", a few)."""

    previous: int | None = None
    arrays: int = 0
    compared: int = 0
    changed: int = 0
    must: int = 0
    must_compared: int = 0
    must_changed: int = 0
    must_unchanged: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The comparison as JSON fields, to cross the write collective."""
        return {**self.__dict__, "must_unchanged": list(self.must_unchanged)}

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> Comparison:
        """What :meth:`to_dict` made (a collective payload, from this library's own processes)."""
        return cls(**{**document, "must_unchanged": tuple(document["must_unchanged"])})


def must_change_names(paths: Sequence[str | Sequence[str | int]] | None) -> tuple[str, ...]:
    """The tensor-name prefixes of ``runtime.must_change``: a top-level key or a tensor name
    as it is, a tuple of keys as the tensor name it makes."""
    return tuple(path if isinstance(path, str) else leaf_name(tuple(path)) for path in paths or ())


def compare_with_previous(
    store: TieredStore, step: int, records: Sequence[ShardRecord], must: Sequence[str], mode: str = "warn"
) -> dict[str, Any]:
    """This process's shards of ``step`` (written, not committed: ``records``) compared with the
    newest step committed on the local disk before it (see the module doc), as
    :meth:`Comparison.to_dict` gives it to the write collective ({} for ``mode`` "off").
    Reads the two steps' shard headers (a few KB each) and the earlier manifest."""
    return {} if mode == "off" else _compared(store, step, records, must).to_dict()


def _compared(store: TieredStore, step: int, records: Sequence[ShardRecord], must: Sequence[str]) -> Comparison:
    local = store.local
    earlier = [each for each in local.steps() if each < step]
    if not earlier:
        return Comparison()
    previous = earlier[-1]
    before = {record.rank: record for record in local.manifest(previous).shards}
    arrays = compared = changed = must_count = must_compared = must_changed = 0
    unchanged: list[str] = []
    for record in records:
        now = _digests(store, step, record)
        arrays += len(now)
        old = _digests(store, previous, before[record.rank]) if record.rank in before else {}
        for name, digest in now.items():
            under = selects(must, name)
            must_count += under
            if not digest or not old.get(name) or old[name].partition(":")[0] != digest.partition(":")[0]:
                continue
            differs = old[name] != digest
            compared += 1
            changed += differs
            must_compared += under
            must_changed += under and differs
            if under and not differs and len(unchanged) < _NAMED:
                unchanged.append(f"rank {record.rank}: {name}")
    return Comparison(previous, arrays, compared, changed, must_count, must_compared, must_changed, tuple(unchanged))


def _digests(store: TieredStore, step: int, record: ShardRecord) -> dict[str, str]:
    """By name, the digest ``step``'s manifest records for each array of ``record``'s shard
    ("" where it records none); the names from the shard's header, on the local disk."""
    header, _tier = store.read_shard_header(step, record, later=())
    names = sorted(header.arrays)
    recorded = record.digests_by_name(names)
    return {name: recorded.get(name, "") for name in names}


def judge(step: int, comparisons: Sequence[Comparison], must: Sequence[str]) -> str | None:
    """Whether ``step`` is stale by every process's comparison (see the module doc): why, in a
    sentence naming both steps, or None."""
    previous = {each.previous for each in comparisons}
    if len(previous) != 1 or None in previous:
        return None  # a process with no earlier step, or another one: nothing to hold against
    (earlier,) = previous
    arrays = sum(each.arrays for each in comparisons)
    if arrays and all(each.compared == each.arrays and not each.changed for each in comparisons):
        return f"step {step} may be stale: none of its {arrays} arrays changed since step {earlier}"
    must_total = sum(each.must for each in comparisons)
    if must_total and all(each.must_compared == each.must and not each.must_changed for each in comparisons):
        named = [name for each in comparisons for name in each.must_unchanged]
        more = must_total - len(named)
        listed = ", ".join(named) + (f" and {more} more" if more > 0 else "")
        return (
            f"step {step} may be stale: none of the {must_total} arrays under runtime.must_change "
            f"({', '.join(must)}) changed since step {earlier}: {listed}"
        )
    return None


def check_stale(step: int, compared: Sequence[Mapping[str, Any]], mode: str, must: Sequence[str], leader: bool) -> None:
    """After the write collective, before the commit: judge ``step`` by every process's
    comparison (:func:`compare_with_previous`). Stale: a WARNING from the ``leader``, or under
    ``mode`` "error" an :class:`InvalidStateError` on every process (nothing is committed)."""
    if mode == "off" or not all(compared):
        return
    problem = judge(step, [Comparison.from_dict(each) for each in compared], must)
    if problem is None:
        return
    if mode == "error":
        raise InvalidStateError(f"{problem}; nothing was committed (runtime.stale_saves='error')")
    if leader:
        logger.warning("%s (runtime.stale_saves='warn')", problem)
