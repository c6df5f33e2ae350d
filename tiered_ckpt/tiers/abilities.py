"""A tier's optional abilities: each declared by a flag of its :class:`~tiered_ckpt.tiers.base.Capabilities`.

A tier whose capabilities set a flag speaks that ability's words besides the protocol's;
the engine asks for them here, by the flag, never by the tier's type or by probing for a
method:

- ``receipts`` (:class:`ReceiptedTier`): its commits are recorded in the first tier's step
  (receipts), and a lost receipt is mended from the commit's record, read back;
- ``leases`` (:class:`LeasedTier`): a run holds a lease on its storage
  (:class:`~tiered_ckpt.tiers.remote.leases.Lease`), and the uploads a failed run left open
  there are aborted past an age;
- ``retries`` (:class:`RetryingTier`): its storage fails transiently; its requests are
  retried under its own policy, whose backoff a step's whole retries follow too, and it
  tells how they are failing now.
"""

from __future__ import annotations

from typing import Protocol, cast

from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.remote.leases import OwnerRecords
from tiered_ckpt.tiers.remote.requests import Trouble
from tiered_ckpt.tiers.remote.retry import RetryPolicy

__all__ = ["LeasedTier", "ReceiptedTier", "RetryingTier", "leases_of", "receipts_of", "retries_of"]


class ReceiptedTier(Tier, Protocol):
    """A tier with ``capabilities.receipts``: :meth:`Tier.commit` returns the commit's record."""

    def read_manifest(self, step: int) -> RemoteManifest:
        """The record of committed ``step``'s commit, as :meth:`Tier.commit` returned it, strictly validated."""
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


def receipts_of(tier: Tier) -> ReceiptedTier | None:
    """``tier``'s receipts, if its capabilities say it has them."""
    return cast(ReceiptedTier, tier) if tier.capabilities.receipts else None


def leases_of(tier: Tier) -> LeasedTier | None:
    """``tier``'s leases, if its capabilities say it has them."""
    return cast(LeasedTier, tier) if tier.capabilities.leases else None


def retries_of(tier: Tier) -> RetryingTier | None:
    """``tier``'s retries, if its capabilities say its storage fails transiently."""
    return cast(RetryingTier, tier) if tier.capabilities.retries else None
