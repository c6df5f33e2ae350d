"""The one place where the two tiers meet.

A :class:`TieredStore` composes a :class:`~tiered_ckpt.tiers.local.LocalTier` and, optionally,
a :class:`~tiered_ckpt.tiers.remote.RemoteTier`; neither tier knows the other. Reading a
shard is a chain, in this order:

1. the local copy, if its size and sha256 (or xxh3-64) match the manifest;
2. else the remote object, hashed while it streams into a temp file in the local step,
   renamed into place only if it matches (so the local tier is refilled), then read as
   in 1; tried twice;
3. else an error naming the step, the rank and every copy tried.

The store also answers what each tier holds (:meth:`TieredStore.status`), verifies
steps (:meth:`TieredStore.verify`), fills the local tier from the bucket
(:meth:`TieredStore.pull`) and applies retention to either tier. Writing needs the
local directory's lock (``store.local.lock()``), which a manager holds for its whole run
and the CLI for one command.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, NoReturn, TypeVar

import numpy as np

from tiered_ckpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    ManifestError,
    RemoteError,
    ShardFormatError,
    UsageError,
)
from tiered_ckpt.format.manifest import RemoteManifest, ShardManifest, ShardRecord
from tiered_ckpt.format.shardfile import read_header
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.structure import structure_of
from tiered_ckpt.io.hashing import Verify, copy_and_hash
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.owners import live_owners
from tiered_ckpt.tiers.remote import RemoteTier
from tiered_ckpt.tiers.retention import RetentionPolicy, awaiting_upload, protected_locally, retainable

__all__ = ["TieredStore", "StepStatus", "ShardCheck", "Lag", "Source"]

logger = logging.getLogger("tiered_ckpt")

Source = Literal["local", "remote"]
T = TypeVar("T")
_LOCAL_FAILURES = (IncompleteCheckpointError, ChecksumMismatchError, ShardFormatError)


@dataclass(frozen=True)
class StepStatus:
    """What each tier holds of one step.

    ``local``: "committed", "staged" (being written, or left by a crash) or "-";
    ``remote``: "committed", "uploading" (committed locally, not yet remotely),
    "partial" (objects but no remote manifest) or "-". ``manifest`` is the local one if
    it validates, else the remote one (None if neither tier committed the step);
    ``held_ranks`` the ranks whose shards the local step holds (None if not committed).
    ``problem`` says why no manifest of a committed step could be read (a damaged one), else None.
    """

    step: int
    local: str
    remote: str
    manifest: ShardManifest | None
    held_ranks: tuple[int, ...] | None
    problem: str | None = None


class Unknown:
    """The type of :data:`UNKNOWN`: a value the caller does not know (None being a value)."""


UNKNOWN = Unknown()


@dataclass(frozen=True)
class Lag:
    """How far the bucket is behind the local disk, for dashboards and alerts.

    ``newest_local`` / ``newest_remote``: the newest step committed in each tier (None:
    none). ``waiting``: the steps committed locally and waiting for their remote commit, as
    ``(step, bytes)``, oldest first; ``waiting_seconds``: how long ago the oldest of them
    was committed locally (None: nothing waits). ``upload_bytes_per_second``: the rate of
    the last remote commits, and ``last_error`` / ``last_error_at`` (Unix time) the last
    upload failure (each failed try included), as the running manager saw them (None from
    a process that uploads nothing, such as the CLI). ``retrying_step``: the step whose
    upload is being tried again after a transient failure (the bucket is unreachable or
    failing; None: none is), ``retry_tries`` the requests tried for it so far.
    """

    newest_local: int | None
    newest_remote: int | None
    waiting: tuple[tuple[int, int], ...]
    waiting_seconds: float | None
    upload_bytes_per_second: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    retrying_step: int | None = None
    retry_tries: int = 0

    @property
    def steps_behind(self) -> int:
        """Steps committed locally and not yet remotely."""
        return len(self.waiting)

    def to_dict(self) -> dict[str, Any]:
        return {
            "newest_local": self.newest_local,
            "newest_remote": self.newest_remote,
            "steps_behind": self.steps_behind,
            "waiting": [{"step": step, "bytes": size} for step, size in self.waiting],
            "waiting_seconds": self.waiting_seconds,
            "upload_bytes_per_second": self.upload_bytes_per_second,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "retrying_step": self.retrying_step,
            "retry_tries": self.retry_tries,
        }


@dataclass(frozen=True)
class ShardCheck:
    """One shard of one tier checked: ``status`` is "ok", "failed" (``problem`` says why) or
    "elsewhere" (a node of a multi-process job: held by another node's disk by design).
    ``rank`` is None for a step whose manifest in that tier is damaged (no shard could be checked)."""

    step: int
    tier: Source
    rank: int | None
    status: str
    problem: str | None = None


def _checked(step: int, tier: Source, record: ShardRecord, problem: str | None) -> ShardCheck:
    return ShardCheck(step, tier, record.rank, "ok" if problem is None else "failed", problem)


class TieredStore:
    """Steps and shards across ``local`` and, if given, ``remote``."""

    def __init__(self, local: LocalTier, remote: RemoteTier | None = None) -> None:
        self.local = local
        self.remote = remote
        self._retention_lock = threading.Lock()  # the writer's and the uploader's passes never interleave

    def __repr__(self) -> str:
        return f"TieredStore({self.local!r}, {self.remote!r})"

    def where(self) -> str:
        """Both tiers' locations, for messages."""
        return str(self.local.root) + (f" and {self.remote.url}" if self.remote is not None else "")

    # -- what each tier holds -------------------------------------------------------------

    def remote_steps(self) -> list[int]:
        """Steps committed remotely, oldest first (empty without a remote tier)."""
        return self.remote.steps() if self.remote is not None else []

    def receipted(self, step: int) -> bool:
        """True if the local step records its remote commit at this store's URL."""
        return self.remote is not None and self.local.has_receipt(step, self.remote.url)

    def manifests(self, step: int, *, in_local: bool, in_remote: bool) -> tuple[ShardManifest, RemoteManifest | None]:
        """The step's manifest (the local one if it validates, else the remote one) and its remote manifest.

        Raises :class:`ManifestError` if the two describe different checkpoints.
        """
        remote = self.remote.read_manifest(step) if in_remote and self.remote is not None else None
        if not in_local:
            if remote is None:
                raise IncompleteCheckpointError(f"{self.where()}: step {step} is committed in no tier")
            return remote.manifest, remote
        try:
            local = self.local.manifest(step)
        except ManifestError:
            if remote is None:
                raise
            logger.warning("the local manifest of step %d is damaged; using the remote one", step)
            return remote.manifest, remote
        if remote is not None and remote.manifest.shards != local.shards:
            raise ManifestError(f"the local and remote manifests of step {step} describe different checkpoints")
        return local, remote

    def _any_manifest(self, step: int, in_local: bool, in_remote: bool) -> ShardManifest | None:
        """The step's local manifest if it validates, else its remote one (one read, not both)."""
        if in_local:
            try:
                return self.local.manifest(step)
            except ManifestError:
                if not in_remote:
                    raise
        return self.remote.read_manifest(step).manifest if in_remote and self.remote is not None else None

    def status(self) -> list[StepStatus]:
        """Every step either tier knows of, oldest first.

        Safe beside a running job: a step its retention deletes between the listing and
        the reading of its manifest is left out (or shown only in the tier still holding it).
        """
        committed = set(self.local.steps())
        staged = set(self.local.uncommitted_steps())
        remote_committed, remote_partial = self.remote.list_steps() if self.remote is not None else ([], [])
        rows = []
        for step in sorted(committed | staged | set(remote_committed) | set(remote_partial)):
            listed = step in committed, step in remote_committed
            others = step in staged, step in remote_partial
            try:
                rows.append(self._step_status(step, *listed, *others))
            except (IncompleteCheckpointError, ManifestError, RemoteError) as exc:
                still = self._still_committed(step, *listed)
                if still == listed:  # still committed where it was: the failure is not a deletion
                    if not isinstance(exc, ManifestError):
                        raise
                    # one damaged step is shown as such; the others are still listed
                    rows.append(StepStatus(step, *self._tier_states(step, *listed, *others), None, None, str(exc)))
                elif any(still) or any(others):
                    rows.append(self._step_status(step, *still, *others))
        return rows

    def _tier_states(self, step: int, in_local: bool, in_remote: bool, staged: bool, partial: bool) -> tuple[str, str]:
        """(local, remote) state names of a step, from what the listings say of it."""
        if in_remote:
            remote_state = "committed"
        elif in_local and self.remote is not None and not self.receipted(step):
            remote_state = "uploading"
        else:
            remote_state = "partial" if partial else "-"
        return "committed" if in_local else "staged" if staged else "-", remote_state

    def _step_status(self, step: int, in_local: bool, in_remote: bool, staged: bool, partial: bool) -> StepStatus:
        manifest = self._any_manifest(step, in_local, in_remote)
        held = tuple(self.local.held_ranks(step, manifest)) if manifest and in_local else None
        return StepStatus(step, *self._tier_states(step, in_local, in_remote, staged, partial), manifest, held)

    def _still_committed(self, step: int, in_local: bool, in_remote: bool) -> tuple[bool, bool]:
        """Whether ``step`` is still committed in each tier that listed it (a running job's
        retention may have deleted it since): a failure to read a step that is gone is no error."""
        local = in_local and step in self.local.steps()
        remote = in_remote and self.remote is not None and step in self.remote.steps()
        return local, remote

    def lag(
        self, pending: Collection[int] = (), newest_remote: int | None | Unknown = UNKNOWN, now: float | None = None
    ) -> Lag:
        """How far the bucket is behind: ``pending`` are the steps queued for upload, and
        ``newest_remote`` the newest remote commit if the caller knows it (by default the
        bucket is listed). The running manager adds its upload rate and last error. A step
        retention deletes while this runs is not counted."""
        steps = self.local.steps()
        if self.remote is None:
            return Lag(steps[-1] if steps else None, None, (), None)
        if isinstance(newest_remote, Unknown):
            remote_steps = self.remote_steps()
            newest_remote = remote_steps[-1] if remote_steps else None
        receipted = {step for step in steps if self.receipted(step)}
        waiting = []
        for step in sorted(awaiting_upload(steps, receipted, pending)):
            try:
                manifest = self.local.manifest(step)
            except (IncompleteCheckpointError, ManifestError):
                if self._still_committed(step, True, False)[0]:
                    raise
                continue  # deleted by retention since the listing: no longer waiting
            waiting.append((step, manifest.total_bytes, manifest.wall_clock_seconds))
        now = time.time() if now is None else now
        oldest = round(now - waiting[0][2], 3) if waiting else None
        return Lag(steps[-1] if steps else None, newest_remote, tuple((s, b) for s, b, _ in waiting), oldest)

    # -- reading shards ---------------------------------------------------------------------

    def download_shard(self, step: int, record: ShardRecord) -> None:
        """Stream ``record``'s remote object into the local step, landing it only if it verifies."""
        if self.remote is None:
            raise UsageError("downloading a shard needs a remote tier")

        def land(source: BinaryIO) -> None:
            self.local.land_shard(step, record, ShardSource(write=lambda out: copy_and_hash(source, out)))

        self.remote.open_shard(step, record, land)

    def fetch_shard(
        self,
        step: int,
        record: ShardRecord,
        *,
        verify: Verify = "full",
        into: Mapping[str, np.ndarray] | None = None,
        use_remote: bool = True,
    ) -> tuple[FlatState, Source]:
        """One shard's verified state and the tier it came from (see the module doc for the chain).

        ``use_remote=False`` reads the local copy only (the step is not in the bucket).
        """

        def from_bucket() -> FlatState:
            self.download_shard(step, record)
            return self.local.read_shard(step, record, verify, into)

        return self._first_that_verifies(
            step, record, lambda: self.local.read_shard(step, record, verify, into), from_bucket, use_remote, True
        )

    def _first_that_verifies(
        self,
        step: int,
        record: ShardRecord,
        local: Callable[[], T],
        remote: Callable[[], T],
        use_remote: bool,
        refills: bool,
    ) -> tuple[T, Source]:
        """The chain of every read: ``local()``, else (with a bucket, and ``use_remote``) ``remote()``,
        tried twice; raises naming every copy tried if none verifies.

        A local copy that fails (missing, short, unreadable, not matching) is one more reason to
        read the bucket; a shard the local step should hold and is taken from the bucket is
        logged at WARNING with the local copy's problem (``refills``: ``remote()`` wrote a good
        copy back), one this node never held (a replaced node, a reshard) at INFO. Each failed
        try of the bucket is logged at WARNING.
        """
        try:
            return local(), "local"
        except _LOCAL_FAILURES as local_error:
            if self.remote is None or not use_remote:
                raise
            tried: list[tuple[str, CheckpointError]] = [(f"local {self.local.shard_path(step, record)}", local_error)]
        where = self.remote.location(step, record.path)
        for attempt in range(1, 3):
            try:
                found = remote()
            except (*_LOCAL_FAILURES, RemoteError) as remote_error:
                tried.append((f"remote {where}", remote_error))
                logger.warning("step %d rank %d: try %d of 2 of %s failed: %s", step, record.rank, attempt, where,
                               remote_error)  # fmt: skip
                continue
            if self._held_locally(step, record.rank):
                done = "repaired the local copy from" if refills else "read it instead from"
                logger.warning("step %d rank %d: %s %s; the local copy failed: %s", step, record.rank, done, where,
                               tried[0][1])  # fmt: skip
            else:
                logger.info("step %d rank %d: not on this node's disk; read from %s", step, record.rank, where)
            return found, "remote"
        return _no_copy_verifies(record, tried)

    def _held_locally(self, step: int, rank: int) -> bool:
        """True if the local tier committed ``step`` holding ``rank``'s shard (which then failed)."""
        try:
            return rank in self.local.held_ranks(step, self.local.manifest(step))
        except CheckpointError:  # not committed here, or its records are damaged (logged where they are read)
            return False

    def read_parts(
        self,
        step: int,
        record: ShardRecord,
        names: Collection[str],
        *,
        use_remote: bool = True,
        into: Mapping[str, np.ndarray] | None = None,
        verify: Verify = "full",
    ) -> tuple[FlatState, Source]:
        """Some arrays of ``record``'s shard (a state of DTensors), verified, and the tier they came from.

        Reads only the shard's header and those arrays' bytes, each checked against the
        sha256 the manifest records for it (``verify="fast"``: its xxh3-64, where the
        manifest records one; the header always by sha256): the local copy, else the
        remote object (tried twice). The state returned has the whole structure but only ``names``' arrays.
        An array named in ``into`` (C-contiguous, of its dtype and shape) is read into that
        memory rather than new memory; if no copy verifies, it holds unspecified values.
        Raises :class:`ChecksumMismatchError` or :class:`IncompleteCheckpointError`
        naming every copy tried.
        """
        targets = into or {}
        local_what = f"rank {record.rank} shard {self.local.shard_path(step, record)}"

        def from_disk() -> FlatState:
            with self.local.open_ranges(step, record) as read_into:
                return _read_parts(read_into, record, names, local_what, targets, verify)

        def from_bucket() -> FlatState:
            assert self.remote is not None
            remote_what = f"rank {record.rank} shard {self.remote.location(step, record.path)}"
            read_into = functools.partial(self.remote.read_range_into, step, record)
            return _read_parts(read_into, record, names, remote_what, targets, verify)

        return self._first_that_verifies(step, record, from_disk, from_bucket, use_remote, False)

    def verify(
        self,
        step: int | None = None,
        *,
        progress: Callable[[ShardCheck], None] | None = None,
        remote_only: bool = False,
    ) -> list[ShardCheck]:
        """Hash every shard of ``step`` (default: every committed step) in each tier that holds it.

        ``progress`` is called with each shard's result as soon as it is known. With
        ``remote_only``, only the bucket is checked, and an object whose remote manifest
        records the store's checksum is checked against it without a download.

        Safe beside a running job: a step whose manifest is gone from a tier when one of
        its shards (or its manifest) fails to read there was deleted by retention since the
        listing, and is skipped in that tier (its failure is not reported). A step whose
        manifest is still there and a shard missing is a failure.
        """
        local_steps = set(self.local.steps())
        remote_steps = set(self.remote_steps())
        steps = sorted(local_steps | remote_steps)
        if step is not None:
            if step not in steps:
                raise IncompleteCheckpointError(f"{self.where()}: step {step} is committed in no tier")
            steps = [step]
        checks: list[ShardCheck] = []

        def add(check: ShardCheck) -> None:
            checks.append(check)
            if progress is not None:
                progress(check)

        for each in steps:
            if each in local_steps and not remote_only:
                self._verify_in(each, "local", self._local_checks, add)
            if each in remote_steps and self.remote is not None:
                self._verify_in(each, "remote", functools.partial(self._remote_checks, remote_only=remote_only), add)
        return checks

    def _verify_in(
        self,
        step: int,
        tier: Source,
        checks: Callable[[int], Iterator[ShardCheck]],
        add: Callable[[ShardCheck], None],
    ) -> None:
        """Pass each of ``checks(step)`` to ``add``, unless the step was deleted from ``tier``
        since the listing: then from its first failure on, nothing (see :meth:`verify`)."""

        def gone() -> bool:
            return not any(self._still_committed(step, tier == "local", tier == "remote"))

        try:
            for check in checks(step):
                if check.status == "failed" and gone():
                    break
                add(check)
            else:
                return
        except (IncompleteCheckpointError, ManifestError, RemoteError) as exc:
            if not gone():
                if not isinstance(exc, ManifestError):
                    raise
                add(ShardCheck(step, tier, None, "failed", str(exc)))  # reported; the other steps still checked
                return
        logger.info("verify: step %d was deleted from the %s tier while it was checked; skipped", step, tier)

    def _local_checks(self, step: int) -> Iterator[ShardCheck]:
        manifest = self.local.manifest(step)
        held = set(self.local.held_ranks(step, manifest))
        for record in manifest.shards:
            if record.rank not in held:
                yield ShardCheck(step, "local", record.rank, "elsewhere")
            else:
                yield _checked(step, "local", record, self.local.check_shard(step, record))

    def _remote_checks(self, step: int, *, remote_only: bool) -> Iterator[ShardCheck]:
        assert self.remote is not None
        remote = self.remote.read_manifest(step)
        for record in remote.manifest.shards:
            kept = remote.store_checksums.get(record.path) if remote_only else None
            problem = (
                self.remote.check_store_checksum(step, record, kept)
                if kept is not None
                else self.remote.check_shard(step, record)
            )
            yield _checked(step, "remote", record, problem)

    # -- writing the local tier from the bucket ----------------------------------------------

    def record_refill(
        self, manifest: ShardManifest, remote: RemoteManifest | None, fetched: Collection[int], was_committed: bool
    ) -> None:
        """After shards of ``fetched`` ranks were read into the local step: record what it holds,
        commit it locally if it was not committed here before, and record its remote commit
        (``remote``) if the step has no receipt. Nothing is rewritten that is already right."""
        step = manifest.step
        if not was_committed:
            self.local.commit(manifest, held=fetched)
        else:
            held: set[int] | None
            try:
                held = set(self.local.held_ranks(step, manifest))
            except ManifestError:
                logger.warning("step %d: the record of held shards is damaged; rewriting it", step, exc_info=True)
                held = None
            if held is None or not held >= set(fetched):
                self.local.record_held(step, manifest, (held or set()) | set(fetched))
        if remote is not None and self.remote is not None and not self.receipted(step):
            self.local.write_receipt(step, self.remote.url, remote)

    def pull(
        self,
        step: int | None = None,
        *,
        max_workers: int | None = None,
        progress: Callable[[ShardRecord, Source], None] | None = None,
    ) -> tuple[int, dict[int, Source]]:
        """Fill the local tier with remote ``step`` (default: the newest) without loading it.

        Local shards that verify are kept; the others are streamed from the bucket and
        verified. Returns the step and, per rank, the tier each shard on disk came from.
        ``progress`` is called with each shard and where it came from once it is on disk.
        """
        if self.remote is None:
            raise UsageError("pull needs a remote tier (remote_url)")
        remote_steps = self.remote_steps()
        step = remote_steps[-1] if step is None and remote_steps else step
        if step is None or step not in remote_steps:
            raise IncompleteCheckpointError(f"{self.remote.url}: step {step} is not committed remotely")
        remote = self.remote.read_manifest(step)
        self.local.new_step_dir(step)

        def fetch(record: ShardRecord) -> Source:
            source: Source = "local"
            if self.local.check_shard(step, record) is not None:
                self.download_shard(step, record)
                source = "remote"
            if progress is not None:
                progress(record, source)
            return source

        was_committed = step in self.local.steps()
        sources = run_parallel(fetch, remote.manifest.shards, max_workers)
        self.record_refill(remote.manifest, remote, range(remote.manifest.world_size), was_committed)
        return step, dict(enumerate(sources))

    # -- retention ----------------------------------------------------------------------

    def local_to_delete(
        self, policy: RetentionPolicy, pending_uploads: Collection[int] = (), *, complete: int | None = None
    ) -> list[int]:
        """Local steps ``policy`` deletes now: only steps older than one every rank can restore
        (``complete``, a step the caller knows every rank committed; a step committed in the
        bucket; a step this directory holds every rank's shard of), never one still waiting
        for its remote commit (beyond ``policy.max_awaiting_upload`` of them)."""
        return self._local_plan(policy, pending_uploads, complete)[0]

    def _newest_complete(self, steps: list[int], receipted: Collection[int], complete: int | None) -> int | None:
        """The newest of ``steps`` every rank can restore (None: none is known to be): ``complete``
        (the caller knows every rank committed it), the newest step with a receipt of its remote
        commit (every shard is in the bucket), or a step this directory holds every rank's shard of."""
        known = [step for step in (complete, max(receipted, default=None)) if step is not None]
        floor = max(known, default=None)
        for step in reversed(steps):
            if floor is not None and step <= floor:
                break
            try:
                manifest = self.local.manifest(step)
                if set(self.local.held_ranks(step, manifest)) >= set(range(manifest.world_size)):
                    return step
            except (IncompleteCheckpointError, ManifestError):  # deleted meanwhile, or damaged: no proof
                continue
        return floor

    def local_unproven(
        self, policy: RetentionPolicy, pending_uploads: Collection[int] = (), *, complete: int | None = None
    ) -> list[int]:
        """Local steps ``policy`` would delete now, were every step known complete on every rank,
        but keeps because no newer step is known to be (see :meth:`local_to_delete`): in one
        rank's directory of a multi-process job, only the job's own retention (once its ranks
        agreed on a newer commit) or a bucket holding a newer step proves one."""
        if policy.keeps_everything:
            return []
        proven = set(self._local_plan(policy, pending_uploads, complete)[0])
        assumed = self._local_plan(policy, pending_uploads, complete, assume_complete=True)[0]
        return [step for step in assumed if step not in proven]

    def _local_plan(
        self,
        policy: RetentionPolicy,
        pending_uploads: Collection[int],
        complete: int | None,
        *,
        assume_complete: bool = False,
    ) -> tuple[list[int], set[int]]:
        """The local steps ``policy`` deletes now, and the local steps waiting for their upload
        (``assume_complete``: as if every step were known complete on every rank)."""
        steps = self.local.steps()
        receipted = {step for step in steps if self.receipted(step)} if self.remote is not None else set()
        newest = max(steps, default=None) if assume_complete else self._newest_complete(steps, receipted, complete)
        candidates = retainable(steps, newest)
        if self.remote is None:
            return policy.to_delete(candidates), set()
        protected = protected_locally(steps, receipted, pending_uploads, policy.max_awaiting_upload)
        return policy.to_delete(candidates, protected), awaiting_upload(steps, receipted, pending_uploads)

    def retain_local(
        self, policy: RetentionPolicy, pending_uploads: Collection[int] = (), *, complete: int | None = None
    ) -> list[int]:
        """Delete the local steps :meth:`local_to_delete` names; return them."""
        if policy.keeps_everything:
            return []
        with self._retention_lock:
            deleted, never_uploaded = self._local_plan(policy, pending_uploads, complete)
            for step in deleted:
                self.local.delete_step(step)
                if step in never_uploaded:
                    logger.warning(
                        "retention: deleted step %d from %s before it reached %s: more than max_awaiting_upload=%s "
                        "steps are waiting for upload (is the bucket reachable?)",
                        step, self.local.root, self.remote.url if self.remote else None, policy.max_awaiting_upload,
                    )  # fmt: skip
                else:
                    logger.info("retention: deleted step %d from %s", step, self.local.root)
        return deleted

    def remote_to_delete(self, policy: RetentionPolicy) -> list[int]:
        return policy.to_delete(self.remote_steps()) if self.remote is not None else []

    def retain_remote(self, policy: RetentionPolicy) -> list[int]:
        """Delete the remote steps ``policy`` deletes (manifest first); return them."""
        if self.remote is None or policy.keeps_everything:
            return []
        deleted = self.remote_to_delete(policy)
        for step in deleted:
            self.remote.delete_step(step)
            logger.info("remote retention: deleted step %d from %s", step, self.remote.url)
        return deleted

    def prune(
        self,
        local: RetentionPolicy,
        remote: RetentionPolicy | None,
        *,
        dry_run: bool = False,
        orphans_older_than: float = 3600.0,
    ) -> dict[str, list[Any]]:
        """Apply both tiers' retention now, and abort the bucket's unfinished multipart uploads
        started ``orphans_older_than`` seconds ago or earlier (younger ones may belong to a
        running job; none while a run's lease on the URL is live); return the steps deleted
        (or, with ``dry_run``, to delete), the uploads aborted, and (``local_kept_unproven``)
        the local steps the policy would delete but keeps, none newer being known complete
        on every rank (:meth:`local_unproven`)."""
        remote = remote or RetentionPolicy()
        unproven = self.local_unproven(local)
        if dry_run:
            return {
                "local": self.local_to_delete(local),
                "remote": self.remote_to_delete(remote),
                "aborted": [],
                "local_kept_unproven": unproven,
            }
        aborted = []
        if self.remote is not None:
            others = live_owners(self.remote, time.time())
            if others:  # an open upload does not say whose it is: a live run's may be among them
                logger.warning(
                    "unfinished uploads left alone: run(s) %s write under %s",
                    [o.run_id for o in others],
                    self.remote.url,
                )
            else:
                aborted = self.remote.abort_orphans(orphans_older_than)
        return {
            "local": self.retain_local(local),
            "remote": self.retain_remote(remote),
            "aborted": aborted,
            "local_kept_unproven": unproven,
        }


def _no_copy_verifies(record: ShardRecord, tried: list[tuple[str, CheckpointError]]) -> NoReturn:
    mismatch = any(isinstance(error, ChecksumMismatchError) for _copy, error in tried)
    error_type = ChecksumMismatchError if mismatch else IncompleteCheckpointError
    listing = "; ".join(f"{copy}: {error}" for copy, error in tried)
    raise error_type(f"rank {record.rank}: no copy verifies; tried {listing}") from tried[-1][1]


def _read_parts(
    read_into: Callable[[int, memoryview, Verify], str],
    record: ShardRecord,
    names: Collection[str],
    what: str,
    into: Mapping[str, np.ndarray],
    verify: Verify,
) -> FlatState:
    """Read and verify a shard's header, then each of ``names``' arrays, through ``read_into(offset, buffer)``.

    Each array is copied straight into its memory (``into``'s, else new) and hashed
    piece by piece while each piece is in cache, with no copy through Python bytes.
    """
    if not record.header_bytes:
        raise ShardFormatError(f"{what}: the manifest records no digest of its header: it can only be read whole")
    raw = bytearray(record.header_bytes)
    if read_into(0, memoryview(raw), "full") != record.header_sha256:
        raise ChecksumMismatchError(f"{what}: its header's sha256 is not the one the manifest records")
    header = read_header(bytes(raw), record.size_bytes, what)
    recorded = {chunk.name: chunk for chunk in record.chunks}
    arrays = {}
    for name in names:
        entry, chunk = header.arrays.get(name), recorded.get(name)
        if entry is None or chunk is None or entry.shape != chunk.sizes:
            raise ShardFormatError(f"{what}: the array {name!r} is not in the shard as the manifest records it")
        array = into[name] if name in into else np.empty(entry.shape, dtype=entry.dtype)
        if array.shape != entry.shape or array.dtype != entry.dtype or not array.flags.c_contiguous:
            raise UsageError(f"{what}: into[{name!r}] is not a C-contiguous {entry.dtype} array of {entry.shape}")
        fast = verify == "fast" and bool(chunk.xxh3_64)
        expected = chunk.xxh3_64 if fast else chunk.sha256
        if read_into(entry.begin, memoryview(array.reshape(-1).view(np.uint8)), "fast" if fast else "full") != expected:
            kind = "xxh3-64" if fast else "sha256"
            raise ChecksumMismatchError(f"{what}: the bytes of {name!r} do not match the {kind} the manifest records")
        arrays[name] = array
    elsewhere = [name for name, _holder in record.replicas]
    return FlatState(arrays, structure_of(header.metadata, header.arrays, what, elsewhere))
