"""Contracts a tier or a backend written outside this repository proves itself against (as zarr
ships ``zarr.testing.store.StoreTests``): subclass one in a test file, give it its fixtures, and
pytest runs every property on it.

- :class:`tiered_ckpt.testing.tier.TierContract`: what every tier guarantees.
- :class:`tiered_ckpt.testing.backend.BackendContract`: what every store under the object-store
  tier guarantees.

They need pytest, which the package does not: nothing imports this subpackage but a test suite,
and importing it imports pytest only once a contract is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiered_ckpt.testing.backend import BackendContract
    from tiered_ckpt.testing.tier import TierContract

__all__ = ["BackendContract", "TierContract"]


def __getattr__(name: str) -> Any:
    if name == "TierContract":
        from tiered_ckpt.testing.tier import TierContract

        return TierContract
    if name == "BackendContract":
        from tiered_ckpt.testing.backend import BackendContract

        return BackendContract
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
