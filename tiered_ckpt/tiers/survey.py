"""What each tier of a store holds: per-step states, the lag of the shared tier, and verification.

Read-only, and safe beside a running job: a step a job's retention deletes between a
listing and the reading of its manifest is left out (or shown only in the tiers still
holding it), never reported as a failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from tiered_ckpt.errors import IncompleteCheckpointError, ManifestError, RemoteError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.retention import awaiting
from tiered_ckpt.tiers.store import TieredStore

__all__ = [
    "StepStatus",
    "TierState",
    "ShardCheck",
    "CheckStatus",
    "VerifyResult",
    "Lag",
    "UNKNOWN",
    "Unknown",
    "step_statuses",
    "lag",
    "verify",
]

logger = logging.getLogger("tiered_ckpt")
_GONE_OR_DAMAGED = (IncompleteCheckpointError, ManifestError, RemoteError)


TierState = Literal["committed", "staged", "uploading", "partial", "-"]
CheckStatus = Literal["ok", "failed", "elsewhere"]


@dataclass(frozen=True)
class StepStatus:
    """What each tier holds of one step.

    ``states`` maps each tier's name, in the store's order, to its state of the step. The
    first tier's: "committed", "staged" (being written, or left by a crash) or "-"; a later
    tier's: "committed", "uploading" (committed in the first tier and, the later tier being
    durable, not yet in it), "partial" (shards but no commit) or "-". ``manifest`` is the
    nearest tier's that validates (None if no tier committed the step); ``held_ranks`` the
    ranks whose shards the local step holds (None if not committed there). ``problem`` says
    why no manifest of a committed step could be read (a damaged one), else None. ``bucket``
    names the bucket's tier (None: the store has none).
    """

    step: int
    states: Mapping[str, TierState]
    manifest: ShardManifest | None
    held_ranks: tuple[int, ...] | None
    problem: str | None = None
    bucket: str | None = None

    @property
    def local(self) -> TierState:
        """The first tier's (this node's disk) state of the step."""
        return next(iter(self.states.values()))

    @property
    def remote(self) -> TierState:
        """The bucket's state of the step ("-" without a bucket)."""
        return self.states[self.bucket] if self.bucket is not None else "-"


class Unknown:
    """The type of :data:`UNKNOWN`: a value the caller does not know (None being a value)."""


UNKNOWN = Unknown()


@dataclass(frozen=True)
class Lag:
    """How far the shared tier (the bucket) is behind the local disk, for dashboards and alerts.

    ``newest``: each tier's name, in the store's order, and the newest step committed there
    (None: none). ``waiting``: the steps committed locally and waiting for their commit in the
    shared tier, as ``(step, bytes)``, oldest first; ``waiting_seconds``: how long ago the
    oldest of them was committed locally (None: nothing waits). ``upload_bytes_per_second``:
    the rate of the last remote commits, and ``last_error`` / ``last_error_at`` (Unix time) the
    last upload failure (each failed try included), as the running manager saw them (None
    from a process that uploads nothing, such as the CLI). ``retrying_step``: the step whose
    upload is being tried again after a transient failure (the bucket is unreachable or
    failing; None: none is), ``retry_tries`` the requests tried for it so far. ``bucket`` names
    the bucket's tier (None: the store has none). ``peer_error`` is the last failure of a
    copy to a partner's memory (None: none, or no peer tier), ``peer_off`` why copies to the
    partner stopped for the run (a partner that gave no answer in time; None: they go on), and
    ``refill_error`` the last failure to land on this node's disk a step restored from a
    partner's memory (the step stays readable there; None: none failed).
    """

    newest: Mapping[str, int | None]
    waiting: tuple[tuple[int, int], ...]
    waiting_seconds: float | None
    upload_bytes_per_second: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    retrying_step: int | None = None
    retry_tries: int = 0
    bucket: str | None = None
    peer_error: str | None = None
    peer_off: str | None = None
    refill_error: str | None = None

    @property
    def newest_local(self) -> int | None:
        """The newest step committed on this node's disk (the first tier)."""
        return next(iter(self.newest.values()), None)

    @property
    def newest_remote(self) -> int | None:
        """The newest step committed in the bucket (None: none, or no bucket)."""
        return self.newest.get(self.bucket) if self.bucket is not None else None

    @property
    def steps_behind(self) -> int:
        """Steps committed locally and not yet in the shared tier."""
        return len(self.waiting)

    def to_dict(self) -> dict[str, Any]:
        """A JSON document: ``newest_local`` and ``newest_remote`` (the first tier's and the bucket's,
        null without one), ``newest_<name>`` of every other tier, then the fields above."""
        return {
            "newest_local": self.newest_local,
            "newest_remote": self.newest_remote,
            **{f"newest_{name}": step for name, step in self.newest.items()},
            "steps_behind": self.steps_behind,
            "waiting": [{"step": step, "bytes": size} for step, size in self.waiting],
            "waiting_seconds": self.waiting_seconds,
            "upload_bytes_per_second": self.upload_bytes_per_second,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "retrying_step": self.retrying_step,
            "retry_tries": self.retry_tries,
            "peer_error": self.peer_error,
            "peer_off": self.peer_off,
            "refill_error": self.refill_error,
        }


@dataclass(frozen=True)
class ShardCheck:
    """One shard of one tier checked: ``status`` is "ok", "failed" (``problem`` says why) or
    "elsewhere" (a node of a multi-process job: held by another node's disk by design).
    ``tier`` is the tier's name; ``rank`` is None for a step whose manifest in that tier is
    damaged (no shard could be checked)."""

    step: int
    tier: str
    rank: int | None
    status: CheckStatus
    problem: str | None = None


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify` found: every shard ``checks``, in the order checked."""

    checks: tuple[ShardCheck, ...]

    @property
    def failed(self) -> tuple[ShardCheck, ...]:
        """The checks that failed (empty: every copy checked verifies)."""
        return tuple(check for check in self.checks if check.status == "failed")

    @property
    def ok(self) -> bool:
        """True if no copy checked failed."""
        return not self.failed


def _is_bucket(tier: Tier) -> bool:
    """Whether ``tier`` is the store's shared, durable one (the bucket)."""
    return tier.capabilities.shared and tier.capabilities.durable


def _bucket(store: TieredStore) -> str | None:
    return store.remote.name if store.remote is not None else None


def _listing(tier: Tier) -> tuple[set[int], set[int]]:
    committed, uncommitted = tier.list_steps()
    return set(committed), set(uncommitted)


def _still_committed(store: TieredStore, step: int, listed: Mapping[str, bool]) -> dict[str, bool]:
    """Whether ``step`` is still committed in each tier that listed it (a running job's
    retention may have deleted it since): a failure to read a step that is gone is no error."""
    return {tier.name: listed[tier.name] and step in tier.steps() for tier in store.tiers}


def _any_manifest(store: TieredStore, step: int, listed: Mapping[str, bool]) -> ShardManifest | None:
    """The step's manifest in the nearest tier that committed it and where it validates (one read if it does)."""
    holders = [tier for tier in store.tiers if listed[tier.name]]
    for index, tier in enumerate(holders):
        try:
            return tier.manifest(step)
        except ManifestError:
            if index == len(holders) - 1:
                raise
    return None


def _states(
    store: TieredStore, step: int, listed: Mapping[str, bool], partial: Mapping[str, bool]
) -> dict[str, TierState]:
    first = store.local.name
    states: dict[str, TierState] = {first: "committed" if listed[first] else "staged" if partial[first] else "-"}
    for tier in store.later:
        if listed[tier.name]:
            states[tier.name] = "committed"
        elif listed[first] and tier.capabilities.durable and not store.receipted(step, tier):
            states[tier.name] = "uploading"
        else:
            states[tier.name] = "partial" if partial[tier.name] else "-"
    return states


def _step_status(store: TieredStore, step: int, listed: Mapping[str, bool], partial: Mapping[str, bool]) -> StepStatus:
    manifest = _any_manifest(store, step, listed)
    in_local = listed[store.local.name]
    held = tuple(store.local.held_ranks(step, manifest)) if manifest and in_local else None
    return StepStatus(step, _states(store, step, listed, partial), manifest, held, bucket=_bucket(store))


def step_statuses(store: TieredStore) -> list[StepStatus]:
    """Every step any tier of ``store`` knows of, oldest first (see the module doc)."""
    listings = {tier.name: _listing(tier) for tier in store.tiers}
    rows = []
    for step in sorted(set().union(*(committed | partial for committed, partial in listings.values()))):
        listed = {name: step in committed for name, (committed, _partial) in listings.items()}
        partial = {name: step in uncommitted for name, (_committed, uncommitted) in listings.items()}
        try:
            rows.append(_step_status(store, step, listed, partial))
        except _GONE_OR_DAMAGED as exc:
            still = _still_committed(store, step, listed)
            if still == listed:  # still committed where it was: the failure is not a deletion
                if not isinstance(exc, ManifestError):
                    raise
                # one damaged step is shown as such; the others are still listed
                rows.append(
                    StepStatus(step, _states(store, step, listed, partial), None, None, str(exc), _bucket(store))
                )
            elif any(still.values()) or any(partial.values()):
                rows.append(_step_status(store, step, still, partial))
    return rows


def lag(
    store: TieredStore,
    pending: Collection[int] = (),
    newest_remote: int | None | Unknown = UNKNOWN,
    now: float | None = None,
) -> Lag:
    """How far ``store``'s shared tier is behind: ``pending`` are the steps queued for it, and
    ``newest_remote`` its newest commit if the caller knows it (by default it is listed; the
    tiers between, if any, are always listed). The running manager adds its upload rate and
    last error. A step retention deletes while this runs is not counted."""
    steps = store.local.steps()
    newest: dict[str, int | None] = {store.local.name: steps[-1] if steps else None}
    for tier in store.later:
        if _is_bucket(tier) and not isinstance(newest_remote, Unknown):
            newest[tier.name] = newest_remote
        else:
            committed = tier.steps()
            newest[tier.name] = committed[-1] if committed else None
    if store.remote is None:
        return Lag(newest, (), None)
    bucket = store.remote.name
    receipted = {step for step in steps if store.receipted(step)}
    waiting = []
    for step in sorted(awaiting(steps, receipted, pending)):
        try:
            manifest = store.local.manifest(step)
        except (IncompleteCheckpointError, ManifestError):
            if step in store.local.steps():
                raise
            continue  # deleted by retention since the listing: no longer waiting
        waiting.append((step, manifest.total_bytes, manifest.wall_clock_seconds))
    now = time.time() if now is None else now
    oldest = round(now - waiting[0][2], 3) if waiting else None
    return Lag(newest, tuple((s, b) for s, b, _ in waiting), oldest, bucket=bucket)


def verify(
    store: TieredStore,
    step: int | None = None,
    *,
    progress: Callable[[ShardCheck], None] | None = None,
    later_only: bool = False,
) -> VerifyResult:
    """Hash every shard of ``step`` (default: every committed step) in each tier that holds it.

    ``progress`` is called with each shard's result as soon as it is known. With
    ``later_only``, the first tier is not checked, and an object whose remote manifest
    records the store's checksum is checked against it without a download.

    Safe beside a running job: a step whose manifest is gone from a tier when one of
    its shards (or its manifest) fails to read there was deleted by retention since the
    listing, and is skipped in that tier (its failure is not reported). A step whose
    manifest is still there and a shard missing is a failure.
    """
    tiers = store.later if later_only else store.tiers
    held = {tier.name: set(tier.steps()) for tier in tiers}
    steps = sorted(set().union(*held.values()))
    if step is not None:
        if step not in steps:
            where = " and ".join(tier.url for tier in tiers)
            raise IncompleteCheckpointError(f"{where}: step {step} is committed in no tier checked")
        steps = [step]
    checks: list[ShardCheck] = []

    def add(check: ShardCheck) -> None:
        checks.append(check)
        if progress is not None:
            progress(check)

    files: dict[str, dict[tuple[int, str], str | None]] = {tier.name: {} for tier in tiers}
    for each in steps:
        for tier in tiers:
            if each in held[tier.name]:
                _verify_in(tier, each, _checks(store, tier, later_only, files[tier.name]), add)
    return VerifyResult(tuple(checks))


def _checks(
    store: TieredStore, tier: Tier, kept_sums: bool, files: dict[tuple[int, str], str | None]
) -> Callable[[int], Iterator[ShardCheck]]:
    """The checks of one step in ``tier``: the shards it holds are hashed, each with the earlier
    files it references (each file once: ``files`` holds, by step and name, those checked already)
    (``kept_sums``, on a tier whose storage keeps checksums: checked against those where its
    manifest records them, without a download); those of ranks another node holds are "elsewhere"."""

    def referenced(record: ShardRecord) -> str | None:
        for ref in record.references:
            key = (ref.step, ref.file.path)
            if key not in files:
                problem = tier.check_shard(ref.step, ref.file)
                files[key] = None if problem is None else f"{problem} (referenced by this shard)"
            if files[key] is not None:
                return files[key]
        return None

    def checked(step: int, record: ShardRecord, problem: str | None) -> ShardCheck:
        return ShardCheck(step, tier.name, record.rank, "ok" if problem is None else "failed", problem)

    def held(step: int) -> Iterator[ShardCheck]:
        manifest = tier.manifest(step)
        ranks = set(tier.held_ranks(step, manifest))
        for record in manifest.shards:
            if record.rank not in ranks:
                yield ShardCheck(step, tier.name, record.rank, "elsewhere")
            else:
                yield checked(step, record, tier.check_shard(step, record) or referenced(record))

    def by_kept_sums(step: int) -> Iterator[ShardCheck]:
        # the store's checksums are the bucket's own words (see tiers/base.py)
        bucket = cast(RemoteTier, tier)
        remote = bucket.read_manifest(step)
        for record in remote.manifest.shards:
            kept = remote.store_checksums.get(record.path)
            if kept is None:
                yield checked(step, record, bucket.check_shard(step, record))
            else:
                yield checked(step, record, bucket.check_store_checksum(step, record, kept))

    return by_kept_sums if kept_sums and tier.capabilities.store_checksums else held


def _verify_in(
    tier: Tier, step: int, checks: Callable[[int], Iterator[ShardCheck]], add: Callable[[ShardCheck], None]
) -> None:
    """Pass each of ``checks(step)`` to ``add``, unless the step was deleted from ``tier``
    since the listing: then from its first failure on, nothing (see :func:`verify`)."""

    def gone() -> bool:
        return step not in tier.steps()

    try:
        for check in checks(step):
            if check.status == "failed" and gone():
                break
            add(check)
        else:
            return
    except _GONE_OR_DAMAGED as exc:
        if not gone():
            if not isinstance(exc, ManifestError):
                raise
            add(ShardCheck(step, tier.name, None, "failed", str(exc)))  # reported; the other steps still checked
            return
    logger.info("verify: step %d was deleted from the %s tier while it was checked; skipped", step, tier.name)
