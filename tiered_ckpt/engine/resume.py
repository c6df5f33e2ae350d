"""A replicator's start-up: what a crash left half-done between the first tier and its target.

:func:`resume_steps` is collective (every process of the job calls it, before any step is
submitted): the leader takes the run's lease on a shared target (see
:mod:`~tiered_ckpt.tiers.remote.leases`) and, unless another live run holds one there, aborts the
multipart uploads left open past the orphan age and removes the files kept for later steps that
no committed step references; every process names the local steps a
crash kept from their commit in the target (mending lost receipts on the way); the steps
every rank can resume are queued; and the leader removes the target's half-finished steps
that are not among them, unless another live run may be writing them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered_ckpt.dist.coordination import Attempt, Coordinator, gather, leader_decides
from tiered_ckpt.errors import RemoteError
from tiered_ckpt.tiers.abilities import leases_of, references_of
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.remote.leases import Lease
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["resume_steps", "other_runs"]

logger = logging.getLogger("tiered_ckpt")


@dataclass(frozen=True)
class _Listing:
    """The leader's listing of the target at start-up, and the other live runs writing there."""

    committed: tuple[int, ...]
    uncommitted: tuple[int, ...]
    other_runs: tuple[str, ...] = ()


@dataclass(frozen=True)
class _ResumeReport:
    """The local steps one process could resume."""

    steps: tuple[int, ...]


def other_runs(lease: Lease | None) -> list[str]:
    """The other live runs writing under the lease's URL now (their leases unreadable counts as
    one); none for a target without leases."""
    if lease is None:
        return []
    try:
        return [other.run_id for other in lease.others()]
    except RemoteError as exc:
        return [f"(leases unreadable: {exc})"]


def resume_steps(
    store: TieredStore,
    target: Tier,
    coordinator: Coordinator,
    lease: Lease | None,
    clock: Callable[[], float],
    takes: Callable[[int], bool] = lambda step: True,
) -> tuple[int | None, list[int]]:
    """The newest step committed in ``target`` and the local steps to queue for it, of those its
    cadence ``takes`` and those committed for every tier (a preemption's stop step; see the
    module doc)."""
    listing = leader_decides(coordinator, "resume: list", _Listing, lambda: _clean_and_list(target, lease, clock))
    newest = listing.committed[-1] if listing.committed else None
    resumable = Attempt.run(lambda: _ResumeReport(_resumable(store, target, listing.committed, newest, takes)))
    reports = gather(coordinator, "resume", _ResumeReport, lambda: resumable.value)
    resumed = sorted(set(reports[0].steps).intersection(*(report.steps for report in reports[1:])))
    for step in sorted(set(resumable.value.steps) - set(resumed)):
        logger.warning("step %d is committed locally but not on every rank: it cannot be uploaded", step)
    leftover = [step for step in listing.uncommitted if step not in resumed]
    if coordinator.is_leader and leftover:
        others = list(listing.other_runs) or other_runs(lease)  # asked again: one may have started since
        if others:
            logger.warning(
                "half-uploaded steps %s stay in %s: run(s) %s may be uploading them",
                leftover,
                target.url,
                ", ".join(others),
            )
        for step in [] if others else leftover:
            logger.warning("removing half-uploaded step %d from %s", step, target.url)
            target.delete_step(step)
    for step in resumed:
        logger.warning("resuming the upload of step %d to %s", step, target.url)
    return newest, resumed


def _clean_and_list(target: Tier, lease: Lease | None, clock: Callable[[], float]) -> _Listing:
    """Leader, while every process waits for it (so no replication of this job is running): take
    the lease; unless another live run holds one, abort the multipart uploads a failed or
    killed upload left open past the orphan age; then list the target."""
    others = lease.hold() if lease is not None else []
    leased = leases_of(target)
    if others == [] and lease is not None and leased is not None:
        leased.abort_orphans(lease.policy.orphan_age_seconds, now=clock())
    referencing = references_of(target)
    if others == [] and referencing is not None:  # no upload runs: the files a crashed one landed go too
        for step in referencing.collect_unreferenced(all_steps=True):
            logger.info("removed the files of step %d no committed step references from %s", step, target.url)
    committed, uncommitted = target.list_steps()
    runs = ("(leases unreadable)",) if others is None else tuple(other.run_id for other in others)
    return _Listing(tuple(committed), tuple(uncommitted), runs)


def _resumable(
    store: TieredStore, target: Tier, committed: Sequence[int], newest: int | None, takes: Callable[[int], bool]
) -> tuple[int, ...]:
    """Local steps whose commit in ``target`` a crash prevented (lost receipts are mended on the
    way). A target that is not durable lost what it held with the job: only the newest local
    step is worth sending it again."""
    resumed = []
    for step in store.local.steps():
        if store.receipted(step, target):
            continue
        if step in committed and store.mend_receipt(step, target):  # committed there, the receipt lost
            continue
        if (newest is None or step > newest) and (takes(step) or store.local.for_every_tier(step)):
            if store.sendable(step, target):
                resumed.append(step)
            else:
                logger.warning(
                    "step %d is not sent to %s: it references earlier steps' files (an incremental save of a "
                    "job without that tier), which %s does not keep; the next save sends a whole step",
                    *(step, target.url, target.name),
                )
    return tuple(resumed if target.capabilities.durable else resumed[-1:])
