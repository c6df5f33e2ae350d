"""The options every rank of a job must share, compared by one collective when a manager starts.

Ranks whose options differ in what decides their collectives (which tiers are on, each
tier's cadence, the partners' nodes) would make different collectives at different steps:
one rank would wait out the coordinator's whole timeout while another went on; ranks that
differ in which arrays are flat-parameter slices would each commit another manifest of
the same step. The usual cause is an environment variable (``TIERED_CKPT_LOCAL_EVERY``...)
set on some nodes only. (Ranks uploading to different URLs are not compared here: the
leader confirms every rank's objects in its own bucket before a remote commit, so such
ranks never get a step committed there, as with a rank whose bucket fails.)

:func:`agree_on_options` is a manager's first collective: every rank sends :class:`Shared`,
its value of each option of :data:`SHARED`, and every rank raises the same
:class:`~tiered_ckpt.ConfigError` naming each option that differs and the ranks holding
each value. Resolving each rank's options, and their checks that need the job's shape,
run inside it too, so that a rank refusing its own options fails every rank at once
rather than leaving the others waiting for it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.dist.coordination import Attempt, Coordinator, gather
from tiered_ckpt.engine.restore_result import rank_ranges
from tiered_ckpt.environment import ENV_PREFIX
from tiered_ckpt.errors import invalid_option
from tiered_ckpt.options import Options

__all__ = ["SHARED", "Shared", "agree_on_options", "check_process_layout"]

# "remote" and "peer" say whether the group is given; its fields are compared where it is;
# "tiers" names the caller's tiers and their cadence.
SHARED = (
    "local.every",
    "remote",
    "remote.every",
    "peer",
    "peer.every",
    "peer.nodes",
    "runtime.sharded_keys",
    "tiers",
)
_LONGEST_SHOWN = 120  # characters of a value's JSON; a longer one is compared and shown by its sha256


def _values(options: Options) -> dict[str, Any]:
    """This rank's value of each option of :data:`SHARED` (a group's fields only where it is given)."""
    values: dict[str, Any] = {"local.every": options.local.every}
    values["remote"] = "on" if options.remote is not None else "off"
    if options.remote is not None:
        values["remote.every"] = options.remote.every
    values["peer"] = "on" if options.peer is not None else "off"
    if options.peer is not None:
        values |= {"peer.every": options.peer.every, "peer.nodes": options.peer.nodes}
    values["tiers"] = [[each.tier.name, each.every] for each in options.tiers]  # each tier's replicator, cadence
    keys = options.runtime.sharded_keys
    values["runtime.sharded_keys"] = None if keys is None else sorted(keys, key=json.dumps)  # a set of keys
    return values


def _text(value: Any) -> str:
    text = json.dumps(value)
    if len(text) <= _LONGEST_SHOWN:
        return text
    return f"a value of {len(text)} characters with sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class Shared:
    """One rank's value of each option of :data:`SHARED`: (name, its value as JSON text)."""

    values: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, options: Options) -> Shared:
        return cls(tuple((name, _text(value)) for name, value in _values(options).items()))


def _differences(shared: Sequence[Shared]) -> dict[str, str]:
    """Each option the ranks (``shared[rank]``) differ in, with its values and the ranks holding
    each ("1 on ranks 0-2, 2 on rank 3"); a group's fields are left out where the group itself differs."""
    by_rank = [dict(each.values) for each in shared]
    names = [name for name in SHARED if len({values.get(name) for values in by_rank}) > 1]
    found = {}
    for name in names:
        if name.partition(".")[0] in names and "." in name:
            continue
        holders: dict[str | None, list[int]] = {}
        for rank, values in enumerate(by_rank):
            holders.setdefault(values.get(name), []).append(rank)
        found[name] = ", ".join(
            f"{value} on {'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}"
            for value, ranks in holders.items()
        )
    return found


def check_process_layout(options: Options, one_process: bool) -> None:
    """Raise :class:`ConfigError` for options one process per rank cannot run: ``when_behind='skip'``
    (ranks could skip different steps). The error names the option, ``upload.when_behind``
    (which :meth:`~tiered_ckpt.CheckpointManager.from_config` names with its file or variable)."""
    if one_process or options.upload.when_behind != "skip":
        return
    problem = (
        "is 'skip', which needs one process holding every rank "
        "(with one process per rank, ranks could skip different steps); use 'wait'"
    )
    raise invalid_option("upload.when_behind", problem)


def agree_on_options(coordinator: Coordinator, resolved: Attempt[Options]) -> Options:
    """This rank's options (``resolved``: resolving them, run on this rank), once every rank's
    resolved, fit the job's shape (:func:`check_process_layout`) and agree on :data:`SHARED`
    (one collective, ``options``).

    Raises on every rank: the error of a rank whose options failed (resolving or its checks),
    as that rank raised it, or a :class:`~tiered_ckpt.ConfigError` whose ``field`` is the first
    option that differs, naming each such option with its values and the ranks holding each.
    """
    one_process = len(coordinator.local_ranks) == coordinator.world_size

    def mine() -> Shared:
        check_process_layout(resolved.value, one_process)
        return Shared.of(resolved.value)

    differences = _differences(gather(coordinator, "options", Shared, mine))
    if not differences:
        return resolved.value
    (first, values), *others = differences.items()
    listed = "".join(f"; {name} is {text}" for name, text in others)
    variable = f"{ENV_PREFIX}{first.replace('.', '_').upper()}" + ("" if "." in first else "_*")
    problem = (
        f"is {values}{listed}: every rank must be given the same, as it decides which collectives each "
        f"rank makes and what it writes (an environment variable such as {variable} set on some nodes only "
        "is the usual cause)"
    )
    raise invalid_option(first, problem)
