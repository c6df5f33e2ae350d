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
naming both steps and the first unchanged arrays under ``runtime.must_change``),
``"error"`` (the save fails before anything is committed: a
:class:`~tiered_ckpt.SaveError`; a preemption's last step is only warned about), or
``"off"``. Arrays whose manifest records no digest (a shard of very many arrays), or that
moved to another rank, are never judged unchanged, and a step whose earlier step cannot be
read is not judged: the check never fails a save by itself. The digests of the step a
process last wrote are kept for the next save's comparison: only a save whose previous
step this process did not write (the first after a restart) reads that step's shard
headers.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import CheckpointError, InvalidStateError, UsageError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.format.selection import resolve_path
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Comparison", "StaleCheck", "judge"]

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


class StaleCheck:
    """The stale-save check of one writer: ``mode`` is ``runtime.stale_saves``, ``must`` the
    paths of ``runtime.must_change`` (tensor names, top-level keys or tuples of keys), resolved
    against each state saved (:func:`~tiered_ckpt.format.selection.resolve_path`)."""

    def __init__(self, mode: str = "warn", must: Sequence[str | Sequence[str | int]] = ()) -> None:
        self.mode = mode
        self.must = tuple(path if isinstance(path, str) else tuple(path) for path in must)
        self._kept: tuple[int, dict[int, dict[str, str]]] | None = None  # the last step written, its digests
        self._told: set[str] = set()  # the must_change paths said to match no array

    def compare(
        self,
        store: TieredStore,
        step: int,
        records: Sequence[ShardRecord],
        states: Mapping[int, FlatState],
        left: Mapping[int, Collection[str]],
    ) -> dict[str, Any]:
        """This process's shards of ``step`` (written, not committed: ``records``; ``states``, by
        rank, what they were written from, but the replicas ``left`` to other ranks' shards) compared with the
        newest step committed on the local disk before it, as :meth:`Comparison.to_dict` gives
        it to the write collective ({} when the check is off). A step that cannot be compared
        (its files unreadable, on other nodes' disks) is not judged: a check never fails a save."""
        if self.mode == "off":
            return {}
        now = {}
        for record in records:
            names = [name for name in states[record.rank].arrays if name not in left.get(record.rank, ())]
            now[record.rank] = _digests(record, names)
        kept, self._kept = self._kept, (step, now)
        previous = None
        try:
            earlier = [each for each in store.local.steps() if each < step]
            if not earlier:
                return Comparison().to_dict()
            previous = earlier[-1]
            if kept is not None and kept[0] == previous:
                before = kept[1]
            else:  # not written by this process (a restart): the step's headers say its arrays
                manifest = store.local.manifest(previous)
                held = set(store.local.held_ranks(previous, manifest))
                records_before = {record.rank: record for record in manifest.shards if record.rank in held}
                before = {rank: _read(store, previous, records_before[rank]) for rank in now if rank in records_before}
        except (CheckpointError, OSError) as exc:
            logger.info("step %d is not compared with step %s for stale saves: %s", step, previous, exc)
            return Comparison().to_dict()
        must = {rank: self._under(state) for rank, state in states.items()}
        return _compared(previous, now, before, must).to_dict()

    def _under(self, state: FlatState) -> frozenset[str]:
        """The arrays of ``state`` under the paths of ``runtime.must_change`` (by their places in
        its structure: list indices and escaped keys as saved); a path that names no array of
        it is said once (WARNING) and left out."""
        found: set[str] = set()
        for path in self.must:
            try:
                place = resolve_path(state.structure, path, "runtime.must_change")
            except UsageError as exc:
                place = None
                problem = str(exc)
            names = {name for name, at in state.structure.paths.items() if place and at[: len(place)] == place}
            if not names and place is not None:
                problem = f"runtime.must_change: paths: {path!r:.200} holds no array of the state saved"
            if not names and str(path) not in self._told:
                self._told.add(str(path))
                logger.warning("%s: no stale-save check for it", problem)
            found |= names
        return frozenset(found)

    def check(self, step: int, compared: Sequence[Mapping[str, Any]], leader: bool, refuse: bool = True) -> None:
        """After the write collective, before the commit: judge ``step`` by every process's
        comparison. Stale: a WARNING from the ``leader``, or under ``mode`` "error" (unless
        ``refuse`` is False: a preemption's last step is never refused) an
        :class:`InvalidStateError` on every process (nothing is committed)."""
        if self.mode == "off" or not all(compared):
            return
        problem = judge(step, [Comparison.from_dict(each) for each in compared])
        if problem is None:
            return
        if self.mode == "error" and refuse:
            raise InvalidStateError(f"{problem}; nothing was committed (runtime.stale_saves='error')")
        if leader:
            logger.warning("%s (runtime.stale_saves=%r)", problem, self.mode)


def _digests(record: ShardRecord, names: Sequence[str]) -> dict[str, str]:
    """Every array of ``record``'s shard (``names``) with the digest the record holds for it
    ("" where it holds none)."""
    recorded = record.digests_by_name(sorted(names))
    return {name: recorded.get(name, "") for name in names}


def _read(store: TieredStore, step: int, record: ShardRecord) -> dict[str, str]:
    """The digests ``step``'s manifest records for ``record``'s arrays, named by its shard's header (local)."""
    header, _tier = store.read_shard_header(step, record, later=())
    return _digests(record, list(header.arrays))


def _compared(
    previous: int,
    now: Mapping[int, Mapping[str, str]],
    before: Mapping[int, Mapping[str, str]],
    must: Mapping[int, Collection[str]],
) -> Comparison:
    arrays = compared = changed = must_count = must_compared = must_changed = 0
    unchanged: list[str] = []
    for rank, digests in now.items():
        arrays += len(digests)
        old = before.get(rank, {})
        for name, digest in digests.items():
            under = name in must[rank]
            must_count += under
            if not digest or not old.get(name) or old[name].partition(":")[0] != digest.partition(":")[0]:
                continue
            differs = old[name] != digest
            compared += 1
            changed += differs
            must_compared += under
            must_changed += under and differs
            if under and not differs and len(unchanged) < _NAMED:
                unchanged.append(f"rank {rank}: {name}")
    return Comparison(previous, arrays, compared, changed, must_count, must_compared, must_changed, tuple(unchanged))


def judge(step: int, comparisons: Sequence[Comparison]) -> str | None:
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
        named = [name for each in comparisons for name in each.must_unchanged][:_NAMED]
        more = must_total - len(named)
        listed = ", ".join(named) + (f" and {more} more" if more > 0 else "")
        return (
            f"step {step} may be stale: none of the {must_total} arrays under runtime.must_change "
            f"changed since step {earlier}: {listed}"
        )
    return None
