"""What the tiers hold of a step, as this process sees it before reading: the input of a
restore's plan (:class:`~tiered_ckpt.engine.restore_plan.StepHoldings`).

Without a bucket, a process reads only the shards on its own node's disk (or what a later
tier of each node's own, such as a partner's memory, holds): the plan refuses a restore that
needs others' shards, to reshard or after ranks moved between nodes, up front with what
would restore it, rather than failing shard by shard. ``one_process``: the process holds
every rank of the job (its directory's records say which ranks it holds); else it holds its
own (a shard it should hold and lacks is a damaged disk, which the chain names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tiered_ckpt.engine.restore_plan import StepHoldings, TierHolding
from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["step_holdings"]


def step_holdings(
    store: TieredStore,
    one_process: bool,
    manifest: ShardManifest,
    ranks: Sequence[int],
    committed: Mapping[str, bool | None],
) -> StepHoldings:
    """What ``store``'s tiers hold of ``manifest``'s step for a read of ``ranks``' shards. A
    tier every node sees and a later run resumes from (``shared`` and ``durable``: a bucket)
    holds every shard if it committed the step (``committed[name]``, from its listing), none
    it can be counted on for if it could not be listed (None, or not in ``committed``: still
    tried), and is not read if it did not commit it; any other later tier is not listed first
    (any shard may be there). This node's disk is looked at only when no later tier is known
    to hold every one of ``ranks``."""
    step, local = manifest.step, store.local
    everything = frozenset(range(manifest.world_size))
    later = []
    for tier in store.later:
        state = committed.get(tier.name)
        if not (tier.capabilities.shared and tier.capabilities.durable):
            later.append(TierHolding(tier.name, None))
        elif state is None:
            later.append(TierHolding(tier.name, frozenset(), unlisted=True))
        elif state:
            later.append(TierHolding(tier.name, everything))
    held: frozenset[int] | None = None
    if not all(any(tier.counts_on(rank) for tier in later) for rank in ranks):
        held = _held_here(store, one_process, manifest, ranks)
    return StepHoldings(str(local.step_dir(step)), (TierHolding(local.name, held), *later))


def _held_here(
    store: TieredStore, one_process: bool, manifest: ShardManifest, ranks: Sequence[int]
) -> frozenset[int] | None:
    """Which of ``ranks``' shards this node's disk holds (None: its records are damaged, and the
    reads name what is wrong)."""
    local, step = store.local, manifest.step
    if one_process:
        try:
            return frozenset(local.held_ranks(step, manifest)) if step in local.steps() else frozenset()
        except CheckpointError:
            return None
    return frozenset(rank for rank in ranks if local.shard_path(step, manifest.shard(rank)).is_file())
