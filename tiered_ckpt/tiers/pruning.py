"""Each tier's retention, applied: which steps go now, and which stay for the tiers fed from them.

The policies are data the store holds (:attr:`TieredStore.retention`, by tier name); the
rules are :mod:`~tiered_ckpt.tiers.retention`'s pure functions. What a tier protects:

- the first tier (this node's disk) feeds every later tier: it keeps the steps queued for
  any of them (``pending``, by tier name: a step is never deleted under its replication),
  and for the bucket, whose commits have receipts, also the steps newer than its newest
  receipt (beyond ``max_awaiting_upload`` of those the policy decides); it weighs only steps
  no newer than one every rank can restore (see :func:`~tiered_ckpt.tiers.retention.retainable`);
- a later tier feeds none: its policy alone decides.

Every tier keeps the steps the store holds (:attr:`TieredStore.held`: those a framework's
checkpoint pointers name, until it removes them). A policy with ``keep_best`` ranks the steps
it weighs by the metric their manifests recorded (:class:`~tiered_ckpt.tiers.step_metrics.StepMetrics`),
and keeps a step whose manifest cannot be read now.

Whatever a policy deletes, a file a retained step references stays (reachability, not step
numbers: the tier's ``delete_step`` keeps it), and goes with the last step referencing it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Mapping

from tiered_ckpt.errors import IncompleteCheckpointError, ManifestError
from tiered_ckpt.tiers.abilities import references_of
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.retention import awaiting, protected, retainable
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["to_delete", "unproven", "retain", "Pending"]

logger = logging.getLogger("tiered_ckpt")

Pending = Mapping[str, Collection[int]]
"""The steps queued for each later tier (by its name), not yet committed there."""


def _newest_complete(
    store: TieredStore, steps: list[int], receipted: Collection[int], complete: int | None
) -> int | None:
    """The newest of ``steps`` every rank can restore (None: none is known to be): ``complete``
    (the caller knows every rank committed it), the newest of ``receipted`` (steps with a receipt
    of the bucket's commit: every shard is there), or a step this directory holds every rank's shard of."""
    known = [step for step in (complete, max(receipted, default=None)) if step is not None]
    floor = max(known, default=None)
    for step in reversed(steps):
        if floor is not None and step <= floor:
            break
        try:
            manifest = store.local.manifest(step)
            if set(store.local.held_ranks(step, manifest)) >= set(range(manifest.world_size)):
                return step
        except (IncompleteCheckpointError, ManifestError):  # deleted meanwhile, or damaged: no proof
            continue
    return floor


def _owed(store: TieredStore, step: int, upload_every: int) -> bool:
    """Whether the bucket takes local ``step``: its cadence does, or every tier does (a preemption's),
    and the bucket may hold it (:meth:`TieredStore.sendable`)."""
    owed = step % upload_every == 0 or store.local.for_every_tier(step)
    return owed and store.remote is not None and store.sendable(step, store.remote)


def _plan(
    store: TieredStore, tier: Tier, pending: Pending, complete: int | None, *, assume_complete: bool = False
) -> tuple[list[int], set[int]]:
    """The steps of ``tier`` its policy deletes now, and those of them the bucket still waits
    for (``assume_complete``: as if every step were known complete on every rank)."""
    policy = store.policy(tier)
    if tier is not store.local:
        steps = tier.steps()
        scores, unknown = _scores(store, tier, steps)
        return policy.to_delete(steps, store.held | unknown, scores), set()
    steps = store.local.steps()
    receipted = {step for step in steps if store.receipted(step)} if store.remote is not None else set()
    newest = max(steps, default=None) if assume_complete else _newest_complete(store, steps, receipted, complete)
    kept = {step for queued in pending.values() for step in queued}.intersection(steps) | store.held
    waited: set[int] = set()
    if store.remote is not None:
        queued = pending.get(store.remote.name, ())
        uploaded = [step for step in steps if _owed(store, step, policy.upload_every) or step in queued]
        kept |= protected(uploaded, receipted, queued, policy.max_awaiting_upload)
        waited = awaiting(uploaded, receipted, queued)
    weighed = retainable(steps, newest)
    scores, unknown = _scores(store, tier, weighed)
    return policy.to_delete(weighed, kept | unknown, scores), waited


def _scores(store: TieredStore, tier: Tier, steps: list[int]) -> tuple[dict[int, float | None], set[int]]:
    """The values of ``tier``'s keep-best metric for ``steps``, and the steps it must keep for
    want of theirs (none without keep-best)."""
    metric = store.policy(tier).best_metric
    return store.step_metrics.scores(tier, steps, metric) if metric is not None else ({}, set())


def to_delete(
    store: TieredStore, tier: Tier, pending: Pending | None = None, *, complete: int | None = None
) -> list[int]:
    """The steps of ``tier`` its retention deletes now (see the module doc); ``complete`` is a
    step the caller knows every rank committed."""
    return _plan(store, tier, pending or {}, complete)[0]


def unproven(store: TieredStore, pending: Pending | None = None, *, complete: int | None = None) -> list[int]:
    """Local steps the first tier's policy would delete now, were every step known complete on
    every rank, but keeps because no newer step is known to be: in one rank's directory of a
    multi-process job, only the job's own retention (once its ranks agreed on a newer commit)
    or a bucket holding a newer step proves one."""
    if store.policy(store.local).keeps_everything:
        return []
    proven = set(_plan(store, store.local, pending or {}, complete)[0])
    assumed = _plan(store, store.local, pending or {}, complete, assume_complete=True)[0]
    return [step for step in assumed if step not in proven]


def retain(store: TieredStore, tier: Tier, pending: Pending | None = None, *, complete: int | None = None) -> list[int]:
    """Delete the steps :func:`to_delete` names (each commit first); return them."""
    policy = store.policy(tier)
    if policy.keeps_everything:
        return []
    # The first tier's passes (the writer's, each replicator's) never interleave; a later
    # tier's deletes, which may be retried for minutes, hold up none of them.
    with store.retention_lock if tier is store.local else contextlib.nullcontext():
        deleted, waited = _plan(store, tier, pending or {}, complete)
        for step in deleted:
            tier.delete_step(step)
            store.step_metrics.forget(tier, step)
            if step in waited:
                bucket = store.remote.url if store.remote else None
                logger.warning(
                    "retention: deleted step %d from %s before it reached %s: more than max_awaiting_upload=%s "
                    "steps are waiting for upload (is the bucket reachable?)",
                    *(step, tier.url, bucket, policy.max_awaiting_upload),
                )
            elif tier is store.local:
                logger.info("retention: deleted step %d from %s", step, tier.url)
            else:
                logger.info("%s retention: deleted step %d from %s", tier.name, step, tier.url)
        referencing = references_of(tier)
        if deleted and referencing is not None:  # the files only the deleted steps referenced go too
            for step in referencing.collect_unreferenced():
                logger.info("retention: removed step %d's files no retained step references from %s", step, tier.url)
    return deleted
