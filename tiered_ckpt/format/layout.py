"""Names on storage: step directories, shard files, manifests and temp files.

Pure functions, no I/O. The layout of one checkpoint directory::

    step-000000001200/
      rank-00000-of-00004.safetensors
      ...
      manifest.json
      held-shards.json     (a node of a multi-process job: the ranks whose shards it holds)
      commit-agreement.json  (whether every rank is known to have committed the step)
      remote-commit.json   (the receipt of the step's remote commit)

and under a remote URL the same step directories (shards, then ``manifest.json``, the
remote manifest), ``latest``, a pointer to the newest remote commit, and
``owners/<run id>.json``, the lease of each run writing under the URL (see
:mod:`~tiered_ckpt.tiers.remote.leases`).

Temp names (``.<final name>.<random hex>.tmp``) are the durable writes' own
(:func:`~tiered_ckpt.io.durable.temp_name`); no plain name here starts with their dot.
"""

from __future__ import annotations

import re

from tiered_ckpt.errors import UsageError

__all__ = [
    "shard_world_size",
    "MANIFEST_NAME",
    "HELD_NAME",
    "AGREEMENT_NAME",
    "EVERY_TIER_NAME",
    "RECEIPT_NAME",
    "KEPT_NAME",
    "KEPT_PREFIX",
    "LATEST_NAME",
    "OWNERS_DIR",
    "SHARD_SUFFIX",
    "step_dir_name",
    "parse_step_dir_name",
    "shard_name",
    "is_shard_name",
    "is_plain_name",
    "owner_name",
    "parse_owner_name",
]

MANIFEST_NAME = "manifest.json"
HELD_NAME = "held-shards.json"
AGREEMENT_NAME = "commit-agreement.json"
EVERY_TIER_NAME = "every-tier.json"
RECEIPT_NAME = "remote-commit.json"
KEPT_NAME = "kept-for-later-steps.json"  # a deleted step's directory that keeps files later steps reference
KEPT_PREFIX = "kept-"  # then moved to "kept-step-…", which no clean-up of step directories touches
LATEST_NAME = "latest"
OWNERS_DIR = "owners"
SHARD_SUFFIX = ".safetensors"

_STEP_DIR = re.compile(r"step-(\d{12,})")
_OWNER = re.compile(r"(?P<run>[0-9a-f]{16,64})\.json")
_SHARD = re.compile(r"rank-\d{5,}-of-(?P<world>\d{5,})" + re.escape(SHARD_SUFFIX))


def step_dir_name(step: int) -> str:
    """Return the directory name of ``step``; names of steps below 10**12 sort as numbers."""
    if step < 0:
        raise UsageError(f"step must be >= 0, got {step}")
    return f"step-{step:012d}"


def parse_step_dir_name(name: str) -> int | None:
    """Return the step a step directory name stands for, or None if it is not one."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def shard_name(rank: int, world_size: int) -> str:
    """Return the file name of ``rank``'s shard in a checkpoint of ``world_size`` ranks."""
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is outside 0..{world_size - 1}")
    return f"rank-{rank:05d}-of-{world_size:05d}{SHARD_SUFFIX}"


def shard_world_size(name: str) -> int | None:
    """The world size a shard's file name (:func:`shard_name`) says, None for another name."""
    found = _SHARD.fullmatch(name)
    return int(found["world"]) if found is not None else None


def is_shard_name(name: str) -> bool:
    """True if ``name`` is a shard's file name (:func:`shard_name` of some rank and world size)."""
    return _SHARD.fullmatch(name) is not None


def is_plain_name(name: str) -> bool:
    """True if ``name`` is a committed file name that stays inside its directory.

    Plain names are non-empty, contain no path separator or NUL, are not ``.`` or
    ``..``, do not start with a dot (which temp names and hidden files do), and take at
    most 255 bytes in UTF-8 (what file systems allow; a lone surrogate has no UTF-8 form).
    """
    if not name or name.startswith(".") or any(ch in name for ch in "/\\\0"):
        return False
    try:
        return len(name.encode("utf-8")) <= 255
    except UnicodeEncodeError:
        return False


def owner_name(run_id: str) -> str:
    """Return the object name, inside ``OWNERS_DIR``, of the owner record of run ``run_id``."""
    name = f"{run_id}.json"
    if _OWNER.fullmatch(name) is None:
        raise UsageError(f"run id must be 16 to 64 lowercase hex digits, got {run_id!r:.80}")
    return name


def parse_owner_name(name: str) -> str | None:
    """Return the run id an owner record's object name stands for, or None if it is not one."""
    match = _OWNER.fullmatch(name)
    return match.group("run") if match else None
