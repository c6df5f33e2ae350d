"""Filling this node's disk with a step the bucket committed, without loading it (``tiered-ckpt pull``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tiered_ckpt.errors import IncompleteCheckpointError, UsageError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.store import Source, TieredStore

__all__ = ["PullResult", "pull"]


@dataclass(frozen=True)
class PullResult:
    """What :func:`pull` did: the ``step`` pulled and, per rank, the name of the tier its shard
    now on disk came from (the first tier's: it was there and verified)."""

    step: int
    sources: Mapping[int, Source]


def pull(
    store: TieredStore,
    step: int | None = None,
    *,
    max_workers: int | None = None,
    progress: Callable[[ShardRecord, Source], None] | None = None,
) -> PullResult:
    """Fill ``store``'s local tier with its bucket's ``step`` (default: the newest) without loading it.

    Local shards that verify are kept; the others are streamed from the bucket and verified
    (:meth:`TieredStore.download_shard`), then the step is committed locally with the bucket's
    receipt. A pull that fails leaves the local tier as it was: a step directory it created is
    removed, with the shards it landed. Returns the step and, per rank, the name of the tier each shard on disk came
    from. ``progress`` is called with each shard and where it came from once it is on disk.
    """
    remote_tier = store.remote
    if remote_tier is None:
        raise UsageError("pull needs a remote tier (remote.url)")
    remote_steps = remote_tier.steps()
    step = remote_steps[-1] if step is None and remote_steps else step
    if step is None or step not in remote_steps:
        raise IncompleteCheckpointError(f"{remote_tier.url}: step {step} is not committed remotely")
    remote = remote_tier.read_manifest(step)
    created = not store.local.step_dir(step).is_dir()
    store.local.new_step_dir(step)

    def fetch(record: ShardRecord) -> Source:
        source = store.local.name
        if store.local.check_shard(step, record) is not None:
            store.download_shard(step, record, remote_tier)
            source = remote_tier.name
        if progress is not None:
            progress(record, source)
        return source

    was_committed = step in store.local.steps()
    try:
        sources = run_parallel(fetch, remote.manifest.shards, max_workers)
        store.record_refill(remote.manifest, remote, range(remote.manifest.world_size), was_committed)
    except BaseException:
        if created:  # a step directory without a manifest would be listed as a step being written
            store.local.discard_uncommitted(step)
        raise
    return PullResult(step, MappingProxyType(dict(enumerate(sources))))
