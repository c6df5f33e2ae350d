"""The small JSON records a local step directory holds beside its shards and manifest: the
ranks whose shards it holds, whether every rank agreed its commit, whether every tier takes it
whatever its cadence, and a later tier's receipt (names in :mod:`tiered_ckpt.format.layout`).

Each is written durably before the manifest it qualifies (or, for an agreement and a receipt,
after it, by the tier's owner). Records are untrusted input: held ranks that do not validate
raise :class:`ManifestError` naming the file; the others read as absent, their safe default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path

from tiered_ckpt.errors import CheckpointError, IncompleteCheckpointError, ManifestError
from tiered_ckpt.format.layout import AGREEMENT_NAME, EVERY_TIER_NAME, HELD_NAME, RECEIPT_NAME
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES
from tiered_ckpt.io.durable import fsync_directory, write_bytes
from tiered_ckpt.io.files import read_small

__all__ = [
    "RECORD_NAMES",
    "agreement",
    "for_every_tier",
    "has_receipt",
    "held_ranks",
    "write_agreement",
    "write_every_tier",
    "write_held",
    "write_receipt",
]

RECORD_NAMES = frozenset({HELD_NAME, AGREEMENT_NAME, EVERY_TIER_NAME, RECEIPT_NAME})


def _read(path: Path) -> object:
    """The JSON document at ``path``, or None if it is missing or unreadable."""
    try:
        return json.loads(read_small(path, MAX_MANIFEST_BYTES))
    except (CheckpointError, OSError, ValueError):
        return None


def _write(path: Path, document: dict[str, object]) -> None:
    write_bytes(path, json.dumps(document).encode())


def held_ranks(directory: Path, world_size: int) -> list[int]:
    """The ranks whose shards ``directory`` holds: every rank without a record; a record that
    does not name ranks below ``world_size`` raises :class:`ManifestError` naming the file."""
    path = directory / HELD_NAME
    if not os.path.lexists(path):
        return list(range(world_size))
    try:
        document = json.loads(read_small(path, MAX_MANIFEST_BYTES))
    except (IncompleteCheckpointError, OSError, ValueError) as exc:
        raise ManifestError(f"{path}: not a readable JSON record of held shards: {exc}") from exc
    ranks = document.get("ranks") if isinstance(document, dict) and set(document) == {"ranks"} else None
    if not (isinstance(ranks, list) and all(type(rank) is int and rank in range(world_size) for rank in ranks)):
        raise ManifestError(f'{path}: expected {{"ranks": [ranks below {world_size}]}}, got {document!r}')
    return sorted(set(ranks))


def write_held(directory: Path, ranks: Collection[int], world_size: int) -> None:
    """Durably record that ``directory`` holds ``ranks``' shards (every rank: no record)."""
    path = directory / HELD_NAME
    if set(ranks) >= set(range(world_size)):
        if path.exists():
            path.unlink()
            fsync_directory(directory)
        return
    _write(path, {"ranks": sorted(set(ranks))})


def agreement(directory: Path, step: int) -> bool | None:
    """Whether every rank agreed ``step``'s commit; None if no valid record says."""
    document = _read(directory / AGREEMENT_NAME)
    if not isinstance(document, dict) or document.get("step") != step or type(document.get("agreed")) is not bool:
        return None
    return bool(document["agreed"])


def write_agreement(directory: Path, step: int, agreed: bool) -> None:
    _write(directory / AGREEMENT_NAME, {"step": step, "agreed": agreed})


def for_every_tier(directory: Path, step: int) -> bool:
    """True if ``step`` goes to every tier whatever its cadence (a preemption's stop step)."""
    document = _read(directory / EVERY_TIER_NAME)
    return isinstance(document, dict) and document.get("step") == step and document.get("every_tier") is True


def write_every_tier(directory: Path, step: int) -> None:
    _write(directory / EVERY_TIER_NAME, {"step": step, "every_tier": True})


def has_receipt(directory: Path, url: str) -> bool:
    """True if ``directory`` holds a receipt of its step's commit at ``url``."""
    document = _read(directory / RECEIPT_NAME)
    return isinstance(document, dict) and document.get("url") == url


def write_receipt(directory: Path, url: str, step: int, committed_at: float) -> None:
    _write(directory / RECEIPT_NAME, {"url": url, "step": step, "committed_at": committed_at})
