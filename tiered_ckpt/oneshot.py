"""``save_sharded`` / ``load_sharded``: one checkpoint in one directory, synchronously.

These are the thin single-tier functions: one process holds
every rank's state, writes a shard file per rank in parallel and commits a manifest.
They are written on the local tier (:class:`~tiered_ckpt.tiers.local.LocalTier` over the
directory itself, ``single_step=True``): a save holds its lock, and every write checks it.
:class:`~tiered_ckpt.CheckpointManager` builds the tiered system on the same parts.

Which arrays are each rank's slice of a flat vector (the *sharded keys*) is the
flat-parameter rule of :mod:`tiered_ckpt.dist.sharding`; pass ``sharded_keys`` to say it
explicitly (e.g. when a replicated array is 1-D too).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tiered_ckpt.build import single_step_tier
from tiered_ckpt.dist.replicas import assign, offer, put_back
from tiered_ckpt.dist.sharding import dtype_summary, resolve_sharded_keys, sharding_summary
from tiered_ckpt.engine.shards import build_manifest, write_shards
from tiered_ckpt.errors import CheckpointError, CheckpointExistsError, UsageError
from tiered_ckpt.format.layout import MANIFEST_NAME
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.state import FlatState, flatten, flatten_into
from tiered_ckpt.format.validate import (
    check_into,
    check_manifest_fits,
    check_same_tensors,
    check_world_size,
    tensor_summary,
    validate_states,
    validate_step,
)
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.local import LocalTier

__all__ = ["save_sharded", "load_sharded", "write_checkpoint"]

logger = logging.getLogger("tiered_ckpt")

State = Mapping[Any, Any]


def write_checkpoint(
    tier: LocalTier,
    states_per_rank: Sequence[FlatState],
    step: int,
    *,
    sharded_keys: tuple[str, ...],
    numels: Sequence[int],
    max_workers: int | None = None,
) -> ShardManifest:
    """Write every rank's shard into ``step`` of ``tier`` (held locked) and commit the manifest last.

    The caller owns the step (it holds no manifest, and nobody else writes into it). Temp
    files an earlier crash left there are removed first.
    """
    world_size = len(states_per_rank)
    ranks = range(world_size)
    replicas = assign([offer(states_per_rank, ranks)])
    records = write_shards(
        tier,
        step,
        states_per_rank,
        ranks,
        world_size=world_size,
        numels=numels,
        max_workers=max_workers,
        replicas=replicas,
    )
    manifest = build_manifest(
        step, records, world_size=world_size, sharded_keys=sharded_keys, wall_clock_seconds=time.time()
    )
    tier.commit(manifest, agreed=None)  # one process holds every rank: no agreement to record
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
    committed checkpoint is never touched: :class:`CheckpointExistsError`; one another
    save holds: :class:`DirectoryInUseError`.
    """
    validate_states(states_per_rank, world_size)
    validate_step(step)
    flat = [flatten(state, f"rank {rank}") for rank, state in enumerate(states_per_rank)]
    check_same_tensors([tensor_summary(state) for state in flat])
    keys, numels = resolve_sharded_keys(
        [sharding_summary(s.arrays) for s in flat],
        sharded_keys,
        flat=all(s.structure.flat for s in flat),
        dtypes=[dtype_summary(s.arrays) for s in flat],
    )
    check_manifest_fits([s.record_bytes(len(flat)) for s in flat], keys, step)
    tier = single_step_tier(directory)
    with tier.lock():
        if tier.is_committed(step):
            raise CheckpointExistsError(f"{tier.root}: already holds a committed checkpoint ({MANIFEST_NAME})")
        try:
            return write_checkpoint(tier, flat, step, sharded_keys=keys, numels=numels, max_workers=max_workers)
        except BaseException:
            _discard_failed_save(tier, step)
            raise


def _discard_failed_save(tier: LocalTier, step: int) -> None:
    """Remove what a failed :func:`save_sharded` wrote (its directory held no committed checkpoint):
    the manifest first, if its rename happened before the failure, then the shard, record and
    temp files; the directory goes when the lock lets go, if the save made it and it is empty.
    Never raises: the save's own error is the one to see."""
    try:
        tier.delete_step(step)
    except (OSError, CheckpointError):  # e.g. the directory was replaced under the save
        logger.warning("could not remove what the failed save left in %s", tier.root, exc_info=True)


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
    :class:`WorldSizeMismatchError` and :class:`ChecksumMismatchError`; :class:`UsageError`
    for a manager's step that references earlier steps' files (restore it with the manager).
    """
    tier = single_step_tier(directory)
    manifest = tier.single_manifest()
    if any(record.references for record in manifest.shards):
        raise UsageError(
            f"{tier.root}: step {manifest.step} references arrays that earlier steps' files hold (an "
            "incremental save of a CheckpointManager): restore it with the manager on the directory above "
            f"(restore(step={manifest.step})), or export it (tiered-ckpt export)"
        )
    check_world_size(manifest, expected_world_size, str(tier.root))
    check_into(into, manifest)
    targets = [flatten_into(state, f"into[{rank}]").arrays for rank, state in enumerate(into)] if into else None
    step = manifest.step
    states = run_parallel(
        lambda record: tier.read_shard(step, record, verify, None if targets is None else targets[record.rank]),
        manifest.shards,
        max_workers,
    )
    found = {record.rank: state.arrays for record, state in zip(manifest.shards, states, strict=True)}
    for record, state in zip(manifest.shards, states, strict=True):
        put_back(state, record, manifest, found, targets[record.rank] if targets is not None else None, tier.root)
    return [state.unflatten() for state in states]
