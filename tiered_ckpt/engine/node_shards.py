"""Whether this process can read a step's shards when no bucket holds the step.

Without a bucket, a process reads only the shards on its own node's disk (or what a later
tier of each node's own, such as a partner's memory, holds). A restore that needs others'
shards, to reshard or after ranks moved between nodes, is refused up front with what would
restore it, rather than failing shard by shard. ``one_process``: the process holds every
rank of the job (its directory's records say which ranks it holds); else it holds its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiered_ckpt.errors import CheckpointError, IncompleteCheckpointError, WorldSizeMismatchError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["check_on_this_node", "check_reshardable_here"]


def check_on_this_node(store: TieredStore, one_process: bool, manifest: ShardManifest, ranks: Sequence[int]) -> None:
    """Raise :class:`IncompleteCheckpointError` naming the step directory and the ranks unless
    this node can read every shard of ``ranks`` (see :func:`_not_on_this_node`)."""
    problem = _not_on_this_node(store, one_process, manifest, ranks)
    if problem is not None:
        raise IncompleteCheckpointError(problem)


def check_reshardable_here(
    store: TieredStore, one_process: bool, manifest: ShardManifest, target: int, ranks: Sequence[int]
) -> None:
    """A restore on ``target`` ranks, another world size, without ``reshard``, of a step no bucket
    holds, needing ``ranks``' shards: if the disk could not serve the reshard either, raise
    :class:`WorldSizeMismatchError` saying what would restore it, not only to reshard."""
    problem = _not_on_this_node(store, one_process, manifest, ranks)
    if problem is not None:
        raise WorldSizeMismatchError(
            f"{problem}; to restore it on {target} rank{'' if target == 1 else 's'}, give the job a bucket "
            f"holding step {manifest.step} "
            "(remote.url) and restore with reshard=True (--reshard)"
        )


def _not_on_this_node(
    store: TieredStore, one_process: bool, manifest: ShardManifest, ranks: Sequence[int]
) -> str | None:
    """What keeps this process from reading ``ranks``' shards of a step no bucket holds (None: nothing).

    With one process per rank, each node's disk holds its own ranks' shards; one process
    holding every rank can be given one node's directory too, whose records say which ranks
    it holds (a shard it should hold and lacks is a damaged disk, which the chain names)."""
    if any(tier is not store.remote for tier in store.later):
        return None  # the chain tries that tier, and names every copy it tried if none verifies
    local, step = store.local, manifest.step
    if one_process:
        try:
            held = set(local.held_ranks(step, manifest)) if step in local.steps() else set()
        except CheckpointError:
            return None  # a damaged record: the reads name what is wrong
        absent = [rank for rank in ranks if rank not in held]
    else:
        absent = [rank for rank in ranks if not local.shard_path(step, manifest.shard(rank)).is_file()]
    if not absent:
        return None
    return (
        f"{local.step_dir(step)}: step {step} was saved by {manifest.world_size} ranks; "
        f"the shards of ranks {absent} are not on this node's disk and no remote tier holds the step; "
        "reading another node's shards (to reshard, or after ranks moved between nodes) needs a bucket "
        "(remote.url) holding it"
    )
