"""The factory: the tiers, the store and the replication policies the options describe.

The options (:mod:`tiered_ckpt.options`) are plain data; this is the one module that turns
them into running tiers, for :mod:`~tiered_ckpt.compose` (a manager's parts), the CLI,
export, and ``save_sharded``/``load_sharded`` (one step's directory). Nothing here starts a
background stage: building in order and closing in reverse is compose's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from tiered_ckpt.dist.coordination import Coordinator
from tiered_ckpt.engine.replication_policy import ReplicationPolicy
from tiered_ckpt.options import LocalOptions, PeerOptions, RemoteOptions, TierOptions, UploadOptions
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.peer.setup import open_peer_tier
from tiered_ckpt.tiers.peer.tier import PeerTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.store import TieredStore

__all__ = [
    "open_remote_tier",
    "peer_tier",
    "tiered_store",
    "open_store",
    "single_step_tier",
    "replication_policy",
    "peer_policy",
    "tier_policy",
]


def open_remote_tier(remote: RemoteOptions, upload: UploadOptions, *, check_bucket: bool = True) -> RemoteTier:
    """The remote tier ``remote`` describes, making its requests as ``upload`` says.

    Its bucket is checked first (one request, see
    :meth:`~tiered_ckpt.tiers.remote.tier.RemoteTier.check_bucket`): a missing or unlistable bucket
    raises :class:`~tiered_ckpt.RemoteError` naming it here, not at the first upload.
    """
    storage_options = dict(remote.storage_options)
    if remote.endpoint_url is not None:
        storage_options["endpoint_url"] = remote.endpoint_url
    tier = RemoteTier(
        remote.url,
        storage_options,
        retry=upload.retry,
        part_bytes=upload.part_bytes,
        part_concurrency=upload.part_concurrency,
        layout=remote.layout,
        compression=remote.compression,
    )
    if check_bucket:
        tier.check_bucket()
    return tier


def peer_tier(peer: PeerOptions, coordinator: Coordinator, local_dir: Path) -> PeerTier | None:
    """This process's peer tier as ``peer`` describes it (a collective: see
    :mod:`~tiered_ckpt.tiers.peer.setup`), or None if it protects nothing."""
    return open_peer_tier(
        coordinator,
        local_dir=local_dir,
        memory_dir=peer.memory_dir,
        max_bytes=peer.max_bytes,
        timeout_seconds=peer.timeout_seconds,
        nodes=peer.nodes,
    )


def tiered_store(
    local: LocalOptions,
    remote: RemoteOptions | None,
    remote_tier: Tier | None,
    peer: Tier | None = None,
    tiers: Sequence[TierOptions] = (),
) -> TieredStore:
    """The store over the local tier ``local`` describes, then ``peer``, the caller's ``tiers`` (in
    their order) and ``remote_tier``, those given (nearest first), each with its retention (a
    partner's memory keeps what its budget holds)."""
    local_tier = LocalTier(local.dir)
    retention = {local_tier.name: local.retention}
    if remote_tier is not None and remote is not None:
        retention[local_tier.name] = dataclasses.replace(local.retention, upload_every=remote.every)
        retention[remote_tier.name] = remote.retention
    retention |= {each.tier.name: each.retention for each in tiers}
    later = [tier for tier in (peer, *(each.tier for each in tiers), remote_tier) if tier is not None]
    return TieredStore([local_tier, *later], retention)


def open_store(
    local: LocalOptions, remote: RemoteOptions | None = None, upload: UploadOptions | None = None
) -> TieredStore:
    """The store of one node's disk and the bucket (none without ``remote``), as a process that
    runs no job sees them (the CLI, export); the bucket is checked (see :func:`open_remote_tier`)."""
    tier = open_remote_tier(remote, upload or UploadOptions()) if remote is not None else None
    return tiered_store(local, remote, tier)


def single_step_tier(directory: str | os.PathLike[str]) -> LocalTier:
    """The local tier over one step's own directory (``save_sharded``, ``load_sharded``)."""
    return LocalTier(directory, single_step=True)


def replication_policy(upload: UploadOptions, every: int = 1) -> ReplicationPolicy:
    """The uploader's policy: its queue, concurrency and deadline from ``upload``, every ``every``-th
    step; a step's tries back off as the bucket's requests do (``upload.retry``)."""
    return ReplicationPolicy(
        upload.concurrency, upload.max_pending, upload.when_behind, upload.deadline_seconds, every=every
    )


def tier_policy(tier: TierOptions) -> ReplicationPolicy:
    """How the replicator of a caller's ``tier`` sends steps: every ``tier.every``-th step, tried
    again after transient failures until ``tier.deadline_seconds``, each failure raised by the
    manager unless ``tier.best_effort``."""
    return ReplicationPolicy(deadline_seconds=tier.deadline_seconds, every=tier.every, best_effort=tier.best_effort)


def peer_policy(peer: PeerOptions) -> ReplicationPolicy:
    """How the peer tier's replicator sends steps: one shard per process at a time, every
    ``peer.every``-th step, each failure logged rather than raised (never retried: the next step's
    copy is the retry), no deadline beyond the link's timeout."""
    return ReplicationPolicy(concurrency=1, max_pending=2, deadline_seconds=None, every=peer.every, best_effort=True)
