"""``save_sharded`` / ``load_sharded``: one checkpoint in one directory, synchronously.

These are the thin single-tier functions of the original lesson: one process holds
every rank's state, writes a shard file per rank in parallel and commits a manifest.
:class:`~tiered_ckpt.CheckpointManager` builds the two-tier system on the same parts.

The flat-parameter rule: the *sharded keys* are the arrays that are each rank's slice
of a flat vector (ZeRO parameters, master weights, optimizer moments). By default they
are the keys whose array is 1-D on every rank; every sharded array of a rank must have
the same length, and that length is the rank's ``param_shard_numel``. Rank ``r``'s
``param_shard_offset`` is the sum of the lengths of ranks ``0..r-1``. Every other key
is replicated. Pass ``sharded_keys`` to say it explicitly (e.g. when a replicated
array is 1-D too).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tiered_ckpt.dist.replicas import assign, offer, put_back, written
from tiered_ckpt.errors import CheckpointExistsError, InvalidStateError, WorldSizeMismatchError
from tiered_ckpt.format.layout import MANIFEST_NAME, shard_name
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord, manifest_problem
from tiered_ckpt.format.state import FlatState, flatten, flatten_into, sharded_names
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.tiers.local import (
    commit_manifest,
    directory_lock,
    fsync_directory,
    is_committed,
    read_manifest,
    read_shard_file,
    remove_temp_files,
    write_shard_file,
)

__all__ = [
    "save_sharded",
    "load_sharded",
    "write_checkpoint",
    "resolve_sharded_keys",
    "sharding_summary",
    "write_shards",
    "validate_states",
    "validate_step",
    "MAX_STEP",
    "check_manifest_fits",
    "check_world_size",
    "check_into",
    "run_parallel",
    "default_workers",
]

logger = logging.getLogger("tiered_ckpt")

State = Mapping[Any, Any]
T = TypeVar("T")
R = TypeVar("R")


def default_workers(tasks: int) -> int:
    """Threads for ``tasks`` file writes or reads.

    Twice the cores: while one thread waits on the disk (fsync, a cold read) another
    hashes, which keeps every core and the disk busy.
    """
    return max(1, min(tasks, 2 * (os.cpu_count() or 1)))


def run_parallel(function: Callable[[T], R], items: Sequence[T], max_workers: int | None) -> list[R]:
    """Apply ``function`` to every item on a thread pool; return results in order.

    The first failure (in item order) is raised once every started call has ended, so
    no thread is still writing when the caller sees the error.
    """
    if not items:
        return []
    with ThreadPoolExecutor(max_workers or default_workers(len(items)), thread_name_prefix="tiered-ckpt") as pool:
        futures = [pool.submit(function, item) for item in items]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def sharding_summary(state: State) -> dict[str, list[int]]:
    """The shape of every array of a rank's state: what :func:`resolve_sharded_keys` needs of it."""
    return {key: [int(n) for n in np.shape(array)] for key, array in state.items()}


def resolve_sharded_keys(
    summaries: Sequence[Mapping[str, Sequence[int]]],
    sharded_keys: Iterable[str | Sequence[str | int]] | None,
    *,
    flat: bool = True,
) -> tuple[tuple[str, ...], list[int]]:
    """Return the sharded keys (tensor names, sorted) and each rank's ``param_shard_numel``.

    ``summaries`` holds each rank's :func:`sharding_summary` (shapes by tensor name), in
    rank order; ``sharded_keys`` names tensors or paths (:func:`~tiered_ckpt.state.sharded_names`).
    Without them, the 1-D arrays are the sharded keys if every rank's state is ``flat``
    (a dict of arrays), and no array is otherwise. Raises :class:`InvalidStateError`
    naming the rank and key if the states do not follow the flat-parameter rule.
    """
    if sharded_keys is None:
        common = set(summaries[0]).intersection(*summaries[1:]) if summaries and flat else set()
        keys = sorted(k for k in common if all(len(summary[k]) == 1 for summary in summaries))
    else:
        keys = sorted(set(sharded_names(sharded_keys, summaries[0] if summaries else ())))
        for rank, summary in enumerate(summaries):
            for key in keys:
                if key not in summary:
                    raise InvalidStateError(f"rank {rank}: sharded key {key!r} is missing")
                if len(summary[key]) != 1:
                    raise InvalidStateError(
                        f"rank {rank}: sharded key {key!r} has shape {tuple(summary[key])}, not 1-D"
                    )
    numels = []
    for rank, summary in enumerate(summaries):
        lengths = {key: summary[key][0] for key in keys}
        if len(set(lengths.values())) > 1:
            raise InvalidStateError(
                f"rank {rank}: sharded arrays must have one length, got {lengths}; "
                "pass sharded_keys= to name the flat-parameter slices explicitly"
            )
        numels.append(next(iter(lengths.values()), 0))
    return tuple(keys), numels


def validate_states(states_per_rank: Sequence[State], world_size: int | None) -> int:
    """Check the shape of a save's input (a list of one dict per rank); return the world size."""
    if isinstance(states_per_rank, Mapping) or not isinstance(states_per_rank, Sequence):
        raise InvalidStateError("states_per_rank must be a list with one dict of arrays per rank")
    if not states_per_rank:
        raise InvalidStateError("states_per_rank is empty: a checkpoint needs at least one rank")
    if world_size is not None and world_size != len(states_per_rank):
        raise InvalidStateError(f"world_size is {world_size} but {len(states_per_rank)} rank states were given")
    for rank, state in enumerate(states_per_rank):
        if not isinstance(state, Mapping):
            raise InvalidStateError(f"rank {rank}: state is a {type(state).__name__}, not a dict of arrays")
    return len(states_per_rank)


# A step names a directory (step-<digits>: a file name of at most 255 bytes) and is a JSON
# integer every reader parses: an int64, as any training loop's counter is.
MAX_STEP = 2**63 - 1


def validate_step(step: int) -> None:
    """Raise :class:`InvalidStateError` unless ``step`` is an integer in ``[0, MAX_STEP]``."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidStateError(f"step must be an integer from 0 to 2**63 - 1, got {step!r:.80}")


def check_manifest_fits(record_bytes: Sequence[int], sharded_keys: Sequence[str], step: int) -> None:
    """Raise :class:`InvalidStateError` if the manifest of ``step``, whose ranks' records take at most
    ``record_bytes`` (:meth:`FlatState.record_bytes`), might be over the size a reader accepts."""
    problem = manifest_problem(record_bytes, sharded_keys)
    if problem is not None:
        raise InvalidStateError(
            f"step {step}: the manifest of its {len(record_bytes)} ranks (a record of every array of a state of "
            f"DTensors) {problem}: save fewer, larger arrays"
        )


def write_shards(
    directory: Path,
    states: Sequence[FlatState],
    ranks: Sequence[int],
    step: int,
    *,
    world_size: int,
    numels: Sequence[int],
    max_workers: int | None = None,
    left_out: Mapping[int, Mapping[str, int]] | None = None,
) -> list[ShardRecord]:
    """Durably write the shards of ``ranks`` (``states[i]`` is rank ``ranks[i]``'s) into ``directory``,
    each with its structure document.

    ``left_out[rank]`` maps the arrays that rank's shard leaves out to the rank whose
    shard holds them (:func:`~tiered_ckpt.replicas.leave_out`); its record lists them as
    replicas. The caller owns ``directory``; temp files an earlier crash left there are
    removed first. Returns the shards' records, in the order of ``ranks``.
    """
    remove_temp_files(directory)

    def write(index: int) -> ShardRecord:
        rank = ranks[index]
        name = shard_name(rank, world_size)
        others = (left_out or {}).get(rank, {})
        state = written(states[index], others)
        metadata = {
            "tiered_ckpt.rank": str(rank),
            "tiered_ckpt.world_size": str(world_size),
            "tiered_ckpt.step": str(step),
            **state.metadata(),
        }
        chunked = bool(state.structure.chunks)  # a state of DTensors: each array readable alone
        digest = write_shard_file(directory / name, state.arrays, metadata, part_digests=chunked)
        return ShardRecord(
            rank=rank,
            path=name,
            sha256=digest.sha256,
            xxh3_64=digest.xxh3_64,
            size_bytes=digest.size_bytes,
            param_shard_offset=sum(numels[:rank]),
            param_shard_numel=numels[rank],
            chunks=state.chunk_records(digest.arrays) if chunked else (),
            header_bytes=digest.header_bytes,
            header_sha256=digest.header_sha256,
            replicas=tuple(sorted(others.items())),
        )

    records = run_parallel(write, range(len(ranks)), max_workers)
    fsync_directory(directory)
    return records


def write_checkpoint(
    directory: Path,
    states_per_rank: Sequence[FlatState],
    step: int,
    *,
    sharded_keys: tuple[str, ...],
    numels: Sequence[int],
    max_workers: int | None = None,
) -> ShardManifest:
    """Write every rank's shard into ``directory`` and commit the manifest last.

    The caller owns ``directory`` (it exists, holds no manifest, and nobody else writes
    into it). Temp files an earlier crash left there are removed first.
    """
    world_size = len(states_per_rank)
    ranks = range(world_size)
    left_out = assign([offer(states_per_rank, ranks)])
    records = write_shards(
        directory, states_per_rank, ranks, step, world_size=world_size, numels=numels, max_workers=max_workers,
        left_out=left_out,
    )  # fmt: skip
    manifest = ShardManifest(
        world_size=world_size,
        step=step,
        wall_clock_seconds=time.time(),
        sharded_keys=sharded_keys,
        shards=tuple(records),
    )
    commit_manifest(directory, manifest)
    return manifest


def save_sharded(
    states_per_rank: Sequence[State],
    directory: str | os.PathLike[str],
    step: int,
    *,
    world_size: int | None = None,
    sharded_keys: Iterable[str | Sequence[str | int]] | None = None,
    max_workers: int | None = None,
) -> ShardManifest:
    """Save one checkpoint of ``len(states_per_rank)`` ranks into ``directory`` and commit it.

    Guarantees, once it returns: every shard file and the manifest are durable, and
    the checkpoint loads byte-for-byte. If it raises, what it wrote is removed (its
    shard files, temp files and the directory if it made it); if the process dies at
    any point, ``directory`` holds no manifest and so no checkpoint (temp files it left
    are removed by the next save into ``directory``). A directory that already holds a
    committed checkpoint is never touched: :class:`CheckpointExistsError`.
    """
    validate_states(states_per_rank, world_size)
    validate_step(step)
    flat = [flatten(state, f"rank {rank}") for rank, state in enumerate(states_per_rank)]
    keys, numels = resolve_sharded_keys(
        [sharding_summary(s.arrays) for s in flat], sharded_keys, flat=all(s.structure.flat for s in flat)
    )
    check_manifest_fits([s.record_bytes() for s in flat], keys, step)
    directory = Path(directory)
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    with directory_lock(directory):
        if is_committed(directory):
            raise CheckpointExistsError(f"{directory}: already holds a committed checkpoint ({MANIFEST_NAME})")
        try:
            return write_checkpoint(directory, flat, step, sharded_keys=keys, numels=numels, max_workers=max_workers)
        except BaseException:
            _discard_failed_save(directory, len(flat), made)
            raise


def _discard_failed_save(directory: Path, world_size: int, made: bool) -> None:
    """Remove what a failed :func:`save_sharded` wrote into ``directory`` (held locked; it
    held no committed checkpoint): the manifest first, if its rename happened before the
    failure, then every rank's shard file and temp file, then ``directory`` if the save
    ``made`` it and it is empty. Never raises: the save's own error is the one to see."""
    try:
        if (directory / MANIFEST_NAME).exists():  # invisible first, durably, as a deletion is
            (directory / MANIFEST_NAME).unlink()
            fsync_directory(directory)
        for rank in range(world_size):
            (directory / shard_name(rank, world_size)).unlink(missing_ok=True)
        remove_temp_files(directory)
        if made and not any(directory.iterdir()):
            directory.rmdir()
            fsync_directory(directory.parent)
        else:
            fsync_directory(directory)
    except OSError:
        logger.warning("could not remove what the failed save left in %s", directory, exc_info=True)


def check_world_size(manifest: ShardManifest, expected_world_size: int, where: str) -> None:
    """Raise :class:`WorldSizeMismatchError` unless the manifest has ``expected_world_size`` ranks."""
    if manifest.world_size != expected_world_size:
        raise WorldSizeMismatchError(
            f"{where}: checkpoint of step {manifest.step} was saved by {manifest.world_size} ranks, "
            f"but {expected_world_size} are loading it; reshard it explicitly to change the world size"
        )


def check_into(into: Sequence[State] | None, manifest: ShardManifest) -> None:
    """Raise :class:`InvalidStateError` unless ``into`` is None or holds one dict per rank."""
    if into is not None and len(into) != manifest.world_size:
        raise InvalidStateError(f"into holds {len(into)} rank states, the checkpoint has {manifest.world_size} ranks")


def load_sharded(
    directory: str | os.PathLike[str],
    expected_world_size: int,
    *,
    verify: Verify = "full",
    into: Sequence[State] | None = None,
    max_workers: int | None = None,
) -> list[dict[Any, Any]]:
    """Load the committed checkpoint in ``directory``: each rank's state as it was saved
    (nested dicts, lists, tuples and scalars included), its arrays as numpy arrays.

    With ``into`` (one state per rank, e.g. the training job's own arrays or CPU
    tensors), the arrays are filled in place instead of allocated; their paths, dtypes
    and shapes must match the shards exactly (scalars in ``into`` are not filled: they
    come back in the returned state). If loading raises, arrays in ``into`` may hold
    unspecified values.

    Every shard is checked against the manifest (size, then sha256, or xxh3-64 with
    ``verify="fast"``) before any array is returned. Raises
    :class:`IncompleteCheckpointError` (no manifest, shard missing or short),
    :class:`ManifestError` / :class:`ShardCountMismatchError` (bad manifest),
    :class:`WorldSizeMismatchError` and :class:`ChecksumMismatchError`.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_world_size(manifest, expected_world_size, str(directory))
    check_into(into, manifest)
    targets = [flatten_into(state, f"into[{rank}]").arrays for rank, state in enumerate(into)] if into else None
    states = run_parallel(
        lambda record: read_shard_file(directory, record, verify, None if targets is None else targets[record.rank]),
        manifest.shards,
        max_workers,
    )
    found = {record.rank: state.arrays for record, state in zip(manifest.shards, states, strict=True)}
    for record, state in zip(manifest.shards, states, strict=True):
        put_back(state, record, manifest, found, targets[record.rank] if targets is not None else None, directory)
    return [state.unflatten() for state in states]
