"""A tier's optional abilities: each declared by a flag of its :class:`~tiered_ckpt.tiers.base.Capabilities`.

A tier whose capabilities set a flag speaks that ability's words besides the protocol's;
the engine asks for them here, by the flag, never by the tier's type or by probing for a
method:

- ``receipts`` (:class:`ReceiptedTier`): its commits are recorded in the first tier's step
  (receipts), and a lost receipt is mended from the commit's record, read back;
- ``leases`` (:class:`LeasedTier`): a run holds a lease on its storage
  (:class:`~tiered_ckpt.tiers.remote.leases.Lease`), and the uploads a failed run left open
  there are aborted past an age;
- the first tier of a store (:class:`WritingTier`), where a running job writes its steps
  before any other tier sees them: no flag, since a store's first tier always is one;
- ``retries`` (:class:`RetryingTier`): its storage fails transiently; its requests are
  retried under its own policy, whose backoff a step's whole retries follow too, and it
  tells how they are failing now;
- ``references`` (:class:`ReferencingTier`): it keeps the files of deleted steps that its
  committed steps reference, and removes them once none does;
- ``confirms`` (:class:`ConfirmingTier`): the objects landed are checked once more right
  before the commit, each process checking its own, the commit handed what they found.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, cast

from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.io.hashing import ShardDigest
from tiered_ckpt.tiers.base import Confirmed, Landed, ShardSource, Tier
from tiered_ckpt.tiers.remote.leases import OwnerRecords
from tiered_ckpt.tiers.remote.requests import Trouble
from tiered_ckpt.tiers.remote.retry import RetryPolicy

__all__ = [
    "ConfirmingTier",
    "LeasedTier",
    "ReceiptedTier",
    "ReferencingTier",
    "RetryingTier",
    "WritingTier",
    "confirms_of",
    "leases_of",
    "receipts_of",
    "references_of",
    "retries_of",
]


class ReceiptedTier(Tier, Protocol):
    """A tier with ``capabilities.receipts``: :meth:`Tier.commit` returns the commit's record."""

    def read_manifest(self, step: int, *, once: bool = False) -> RemoteManifest:
        """The record of committed ``step``'s commit, as :meth:`Tier.commit` returned it, strictly
        validated (``once``: one try, one request)."""
        ...

    def list_steps(self, *, once: bool = False, expect: int | None = None) -> tuple[list[int], list[int]]:
        """:meth:`Tier.list_steps`; ``expect``: a step whose record the caller reads next, read
        beside the listing (tried once) and kept for :meth:`take_expected` if found."""
        ...

    def take_expected(self, step: int | None) -> RemoteManifest | None:
        """The record of ``step`` the last listing expecting it read, handed over once (None: it
        read none of that step); as current as that listing. Whatever ``step`` is (None: only
        let go), the record is let go."""
        ...

    def look_up(self, step: int, record: ShardRecord) -> None:
        """Learn where ``record``'s copy of committed ``step`` is kept unless known here (its
        :meth:`Tier.shard_location` names it then): the records of commits it reads say so."""
        ...


class LeasedTier(Tier, OwnerRecords, Protocol):
    """A tier with ``capabilities.leases``: it keeps the runs' owner records (see
    :mod:`~tiered_ckpt.tiers.remote.leases`) and aborts uploads left open."""

    def abort_orphans(self, older_than_seconds: float = 0.0, *, now: float | None = None) -> list[str]:
        """Abort the uploads left open at least ``older_than_seconds`` before ``now``; their locations."""
        ...


class RetryingTier(Tier, Protocol):
    """A tier with ``capabilities.retries``: its requests are retried under :attr:`retry`."""

    retry: RetryPolicy

    def trouble(self) -> Trouble | None:
        """Its tries that failed for a transient reason since it last answered one (None: it answers)."""
        ...


class ConfirmingTier(Tier, Protocol):
    """A tier with ``capabilities.confirms``: between the landings and the commit, every process
    calls :meth:`confirm` with what its own landings returned (a collective), and the commit is
    handed what every process confirmed."""

    def confirm(self, manifest: ShardManifest, landed: Sequence[Landed], deadline: float | None = None) -> Confirmed:
        """Check once more the objects of ``manifest``'s step that ``landed`` names, as the commit
        would; never raises for an object changed (its problem is returned, and the commit
        refuses the step)."""
        ...

    def commit(
        self,
        manifest: ShardManifest,
        *,
        landed: Sequence[Landed] = (),
        deadline: float | None = None,
        confirmed: Sequence[Confirmed] = (),
    ) -> RemoteManifest | None:
        """:meth:`Tier.commit`, checking only the objects no process ``confirmed``, and refusing the
        step if a confirmation found a problem."""
        ...


class ReferencingTier(Tier, Protocol):
    """A tier with ``capabilities.references``: ``delete_step`` keeps the files of the step that
    committed steps reference, as a kept step's."""

    def kept_steps(self) -> list[int]:
        """Deleted (or never committed) steps whose files committed steps reference, oldest first."""
        ...

    def collect_unreferenced(self, *, all_steps: bool = False) -> list[int]:
        """Remove the kept files no committed step references any more; the steps none is left of.
        ``all_steps``: also those of steps newer than every committed one, which an upload running
        may be landing (only where none runs: a start-up)."""
        ...


class WritingTier(Tier, Protocol):
    """A store's first tier: steps are written here, a shard at a time, before any other tier sees them."""

    def new_step_dir(self, step: int) -> Path:
        """The directory of ``step``, created (and made durable) if needed."""
        ...

    def clear_temp_files(self, step: int) -> list[str]:
        """Remove what a crashed write left in ``step``; return the names."""
        ...

    def write_shard(self, step: int, name: str, source: ShardSource, *, sync_directory: bool = True) -> ShardDigest:
        """Write a new shard as the file ``name`` in ``step``, atomically; its digest, to build its record from."""
        ...


def receipts_of(tier: Tier) -> ReceiptedTier | None:
    """``tier``'s receipts, if its capabilities say it has them."""
    return cast(ReceiptedTier, tier) if tier.capabilities.receipts else None


def leases_of(tier: Tier) -> LeasedTier | None:
    """``tier``'s leases, if its capabilities say it has them."""
    return cast(LeasedTier, tier) if tier.capabilities.leases else None


def references_of(tier: Tier) -> ReferencingTier | None:
    """``tier``'s kept files, if its capabilities say it keeps the files its steps reference."""
    return cast(ReferencingTier, tier) if tier.capabilities.references else None


def retries_of(tier: Tier) -> RetryingTier | None:
    """``tier``'s retries, if its capabilities say its storage fails transiently."""
    return cast(RetryingTier, tier) if tier.capabilities.retries else None


def confirms_of(tier: Tier) -> ConfirmingTier | None:
    """``tier``'s confirmations, if its capabilities say each process confirms its own landings."""
    return cast(ConfirmingTier, tier) if tier.capabilities.confirms else None
