"""What the manager and the ``tiered-ckpt`` command both do to a store beside saving and restoring.

:func:`pull` fills this node's disk with a step the bucket committed, :func:`push` uploads
the local steps the bucket lacks, :func:`prune` applies every tier's retention now, and
:func:`lag` says how far the later tiers are behind the disk. The CLI runs them on the store
a config describes; :class:`~tiered_ckpt.CheckpointManager` on its own store and uploader,
with one process holding every rank (:func:`check_one_process`).

It sits at the top of the package, beside the manager and the CLI, rather than under
``tiers/``: :func:`push` drives the engine's uploader, and :func:`prune` reads how long the
remote options let an unfinished upload live.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tiered_ckpt.engine.replication import Replicator
from tiered_ckpt.errors import CheckpointError, IncompleteCheckpointError, UsageError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.options import RemoteOptions
from tiered_ckpt.tiers import survey
from tiered_ckpt.tiers.abilities import leases_of
from tiered_ckpt.tiers.pruning import retain, to_delete, unproven
from tiered_ckpt.tiers.remote.leases import OwnershipPolicy, live_owners
from tiered_ckpt.tiers.store import TieredStore, TierName
from tiered_ckpt.tiers.survey import Lag

__all__ = ["PullResult", "PushResult", "PruneResult", "check_one_process", "pull", "push", "prune", "lag"]

logger = logging.getLogger("tiered_ckpt")

_POLL_SECONDS = 0.1  # how often a push with progress looks at what the uploader has left


@dataclass(frozen=True)
class PullResult:
    """What :func:`pull` did: the ``step`` pulled and, per rank, the name of the tier its shard
    now on disk came from (the first tier's: it was there and verified)."""

    step: int
    sources: Mapping[int, TierName]


@dataclass(frozen=True)
class PushResult:
    """What :func:`push` did: the ``steps`` it uploaded, oldest first."""

    steps: tuple[int, ...]


@dataclass(frozen=True)
class PruneResult:
    """What :func:`prune` did (or, with ``dry_run``, would do): ``deleted`` maps each tier's
    name, in the store's order, to the steps deleted there; ``aborted`` names the shared
    tier's unfinished multipart uploads aborted; ``kept_unproven`` the first tier's steps
    :func:`~tiered_ckpt.tiers.pruning.unproven` names (kept: no commit shows they are safe elsewhere)."""

    deleted: Mapping[str, tuple[int, ...]]
    aborted: tuple[str, ...]
    kept_unproven: tuple[int, ...]
    dry_run: bool = False


def check_one_process(operation: str, ranks: int, world_size: int) -> None:
    """Raise :class:`UsageError` unless this process holds every rank (``ranks`` of ``world_size``):
    ``operation`` (pull, push, prune) moves whole steps, as the CLI runs it."""
    if ranks != world_size:
        raise UsageError(
            f"{operation} is a maintenance operation of one process holding every rank (as the CLI runs it); "
            "saves of one process per rank upload and prune by themselves"
        )


def pull(
    store: TieredStore,
    step: int | None = None,
    *,
    max_workers: int | None = None,
    progress: Callable[[ShardRecord, TierName], None] | None = None,
) -> PullResult:
    """Fill ``store``'s local tier with its bucket's ``step`` (default: the newest) without loading it.

    Local shards that verify are kept; the others are streamed from the bucket and verified
    (:meth:`TieredStore.download_shard`), and so are the earlier files they reference (an
    incremental save's, :meth:`TieredStore.download_referenced`), then the step is committed
    locally with the bucket's receipt. A pull that fails leaves the local tier as it was: a step directory it created is
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

    def fetch(record: ShardRecord) -> TierName:
        source = store.local.name
        if store.local.check_shard(step, record) is not None:
            store.download_shard(step, record, remote_tier)
            source = remote_tier.name
        for ref in record.references:  # the earlier files it references, which the disk keeps with it
            if store.local.check_shard(ref.step, ref.file) is not None:
                store.download_referenced(ref.step, ref.file, remote_tier)
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


def push(
    store: TieredStore,
    uploader: Replicator | None,
    step: int | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> PushResult:
    """Upload ``step`` (default: every local step without a receipt of ``uploader``'s tier) and
    wait until each is committed there or failed; a step that has a receipt is not uploaded again.

    Every step is queued at once (the uploader goes through them as it does after an outage),
    so one that fails does not stop the others: its :class:`UploadError` waits in the
    uploader's error box for the caller, and it is not among the steps returned.
    ``progress`` (steps done, steps queued) is called while they go up. Raises
    :class:`IncompleteCheckpointError` if ``step`` is not committed locally, :class:`UsageError`
    without an uploader (no remote tier).
    """
    if uploader is None:
        raise UsageError("push needs a remote tier (remote.url)")
    local = store.local.steps()
    if step is not None and step not in local:
        raise IncompleteCheckpointError(f"{store.local.root}: step {step} is not committed locally")
    unreceipted = [each for each in local if not store.receipted(each, uploader.target)]
    target = uploader.target
    wanted = [each for each in ([step] if step is not None else unreceipted) if each in unreceipted]
    if wanted and target.capabilities.receipts:  # committed there, the receipt lost in a crash: mended
        there = set(target.steps())
        for each in (each for each in wanted if each in there):
            try:
                if store.mend_receipt(each, target):
                    unreceipted.remove(each)
            except CheckpointError as exc:  # left to its upload, which reports it with the step
                logger.warning("step %d: reading its commit in %s: %s", each, target.url, exc)
    queued = [each for each in wanted if each in unreceipted]  # less the mended
    if progress is not None:  # none is up yet: said before an upload can finish
        progress(0, len(queued))
    for each in queued:
        if each not in uploader.pending():
            uploader.submit(each, bounded=False)
    if progress is None:
        uploader.wait()
    else:
        while pending := uploader.pending():  # a step leaves the queue committed or failed
            progress(len(queued) - len(pending), len(queued))
            time.sleep(_POLL_SECONDS)
        progress(len(queued), len(queued))
    committed = set(uploader.target.steps())  # retention may have deleted a step's local copy since
    return PushResult(tuple(each for each in queued if each in committed))


def prune(store: TieredStore, remote: RemoteOptions | None = None, *, dry_run: bool = False) -> PruneResult:
    """Apply every tier's retention now, and abort each leased tier's (the bucket's) unfinished multipart uploads
    at least ``remote.orphan_age_seconds`` old (younger ones may belong to a running job; none
    while a run's lease on the URL is live)."""
    kept = tuple(unproven(store))
    if dry_run:
        planned = {tier.name: tuple(to_delete(store, tier)) for tier in store.tiers}
        return PruneResult(MappingProxyType(planned), (), kept, dry_run=True)
    aborted: list[str] = []
    for leased in (leases_of(tier) for tier in store.later):
        if leased is None:
            continue
        others = live_owners(leased, time.time())
        if others:  # an open upload does not say whose it is: a live run's may be among them
            logger.warning(
                "unfinished uploads left alone: run(s) %s write under %s", [o.run_id for o in others], leased.url
            )
        else:
            ownership = remote.ownership if remote is not None else OwnershipPolicy()
            aborted += leased.abort_orphans(ownership.orphan_age_seconds)
    deleted = {tier.name: tuple(retain(store, tier)) for tier in store.tiers}
    return PruneResult(MappingProxyType(deleted), tuple(aborted), kept)


def lag(
    store: TieredStore,
    uploader: Replicator | None = None,
    peer: Replicator | None = None,
    refill_error: str | None = None,
) -> Lag:
    """The store's lag (:func:`~tiered_ckpt.tiers.survey.lag`), with what the running stages know:
    the ``uploader``'s pending steps, newest commit, rate, last failure and retry (without it the
    bucket is listed), and the ``peer`` tier's last failure, why it stopped, and the restorer's
    last ``refill_error`` from a partner's memory."""
    if uploader is None:
        found = survey.lag(store)
    else:
        failed = uploader.last_failure()
        retrying = uploader.retrying()
        found = dataclasses.replace(
            survey.lag(store, uploader.pending(), uploader.newest_committed),
            upload_bytes_per_second=uploader.upload_rate(),
            last_error=failed[1] if failed else None,
            last_error_at=failed[0] if failed else None,
            retrying_step=retrying[0] if retrying else None,
            retry_tries=retrying[1] if retrying else 0,
        )
    if peer is None:
        return found
    copied = peer.last_error
    return dataclasses.replace(
        found, peer_error=copied[1] if copied else None, peer_off=peer.given_up, refill_error=refill_error
    )
