"""A partial restore's reads (``restore(paths=...)``): of each saved rank's shard, the header
and the arrays under the selected paths, each verified, into the caller's arrays when given;
every rank's ``into`` is checked against its shard's header before any is filled.

Which saved ranks are read, the local step a shard read whole refills, and what is put back
and resharded afterwards are :class:`~tiered_ckpt.engine.shard_reads.ShardReader`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from tiered_ckpt.engine.restore_plan import Selection, ShardRead
from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.differences import into_difference
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.selection import prefixes, select
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.structure import Structure
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.shard_parts import ShardIndex
from tiered_ckpt.tiers.store import TieredStore, TierName

__all__ = ["read_selected"]


@dataclass(frozen=True)
class _Looked:
    """A partial restore's look at one shard before anything is filled: the selection's structure,
    the dtype and shape of each of its arrays the shard holds, and the shard's verified header,
    parsed (not read again for its parts), or, for a shard read whole, its cut state and tier."""

    structure: Structure
    kinds: Mapping[str, tuple[np.dtype, tuple[int, ...]]]
    index: ShardIndex | None = None
    whole: tuple[FlatState, TierName] | None = None


def _check_selected_into(index: int, looked: _Looked | None, target: FlatState) -> None:
    """Raise :class:`InvalidStateError` naming ``into[index]`` and its arrays unless ``target``
    holds exactly the selection ``looked`` at, each writable and C-contiguous where read into."""
    assert looked is not None  # every rank with a target was looked at
    expected = {**dict.fromkeys(looked.structure.kinds), **looked.kinds}
    problem = into_difference(expected, target.arrays, "the selected paths")
    if problem:
        raise InvalidStateError(f"into[{index}] does not hold the arrays of the selected paths: {problem}")
    for name in looked.kinds:
        array = target.arrays[name]
        if not (array.flags.c_contiguous and array.flags.writeable):
            raise InvalidStateError(f"into[{index}][{name!r}] must be writable and C-contiguous")


def read_selected(
    store: TieredStore,
    manifest: ShardManifest,
    reads: Sequence[ShardRead],
    paths: Selection,
    targets: Sequence[FlatState] | None,
    verify: Verify,
    max_workers: int | None = None,
) -> tuple[list[tuple[FlatState, TierName]], dict[int, tuple[str, ...]]]:
    """By index of ``reads`` (a partial restore's plan,
    :func:`~tiered_ckpt.engine.restore_plan.plan_selected_restore`), the selection of each
    one's shard under ``paths`` (:func:`~tiered_ckpt.format.selection.select`) and the tier it
    came from; and by saved rank, the names the paths start
    (:func:`~tiered_ckpt.format.selection.prefixes`).

    Each shard's header and the selected arrays are read through ``store``
    (:meth:`TieredStore.read_parts`, trying the read's tiers), each array verified; the
    shards of whole reads (records without per-array digests) are read whole, verified by
    their sha256, and cut (a copy read from memory lands on the local disk at once). Into
    ``targets``' arrays (by index of ``reads``) when given: every one is checked against its
    shard's header first, and an :class:`InvalidStateError` naming ``into[index]`` and the
    arrays that differ leaves all of them unfilled."""
    wanted = [read.rank for read in reads]
    whole = {read.rank for read in reads if read.whole}
    step = manifest.step
    starts: dict[int, tuple[str, ...]] = {}  # by saved rank: the names the paths start

    def cut_to(rank: int, what: str, structure: Structure) -> Structure:
        starts[rank] = prefixes(structure, paths, what)
        return select(structure, paths, what)

    def look(index: int) -> _Looked:
        """What rank ``wanted[index]``'s selection holds, nothing of the caller's filled: its
        header (the shard read whole, and cut, if its arrays have no digests of their own)."""
        record, later = manifest.shard(wanted[index]), reads[index].tiers
        what = f"rank {record.rank} shard {record.path}"
        if record.rank in whole:
            fetched = store.fetch_shard(step, record, verify=verify, later=later)
            if fetched.copy is not None:  # a copy from memory: on the disk before the step's refill is recorded
                store.land_copies(step, [fetched.copy])
            state, source = fetched.state, fetched.source
            structure = cut_to(record.rank, what, state.structure)
            arrays = {name: state.arrays[name] for name in structure.kinds if name in state.arrays}
            kinds = {name: (array.dtype, array.shape) for name, array in arrays.items()}
            return _Looked(structure, kinds, whole=(FlatState(arrays, structure), source))
        parsed, _source = store.read_shard_index(step, record, later=later)
        structure = cut_to(record.rank, what, parsed.structure)
        kinds = {n: (e.dtype, e.shape) for n, e in parsed.header.arrays.items() if n in structure.kinds}
        return _Looked(structure, kinds, index=parsed)

    def read(index: int, looked: _Looked | None) -> tuple[FlatState, TierName]:
        record, later = manifest.shard(wanted[index]), reads[index].tiers
        what = f"rank {record.rank} shard {record.path}"
        into = targets[index].arrays if targets is not None else {}
        if looked is not None and looked.whole is not None:
            state, source = looked.whole
            arrays = dict(state.arrays)
            for name, array in arrays.items():
                if name in into:  # checked to match by _check_selected_into
                    np.copyto(into[name], array)
                    arrays[name] = into[name]
            return FlatState(arrays, state.structure), source
        part = partial(cut_to, record.rank, what)
        parsed = looked.index if looked is not None else None
        return store.read_parts(step, record, part, later=later, into=into, verify=verify, index=parsed)

    # Into the caller's arrays: every rank's checked before any is filled, as a whole read does.
    looks: list[_Looked | None] = [None] * len(wanted)
    if targets is not None or whole:
        firsts = [index for index, rank in enumerate(wanted) if targets is not None or rank in whole]
        for index, looked in zip(firsts, run_parallel(look, firsts, max_workers), strict=True):
            looks[index] = looked
    for index, target_state in enumerate(targets or ()):
        _check_selected_into(index, looks[index], target_state)
    fetched = run_parallel(lambda index: read(index, looks[index]), range(len(wanted)), max_workers)
    return fetched, starts
