"""The host memory a process's saves may hold for staging: ``runtime.host_memory_bytes``, or
a default that protects the node.

A save copies the caller's arrays into staging buffers so that the training loop may change
them while the write runs; on a node whose processes each hold hundreds of GB of state, a
copy of all of it is what runs the node out of memory. The staging holds at most the budget
(:class:`~tiered_ckpt.engine.staging.StagingBuffers`); what does not fit is written straight
from the caller's memory while the save call waits.

The default, :func:`default_host_memory_bytes`: a quarter of the node's memory (the smaller
of its RAM and its cgroup's limit), shared by the node's processes (``LOCAL_WORLD_SIZE``, as
``torchrun`` sets it, or Slurm's, Open MPI's or MPICH's word for it; else one), and at least
:data:`MIN_DEFAULT_BYTES`. Three quarters stay with the training job, its data loaders and
the page cache the writes go through; a state smaller than the budget is staged whole, as
it always was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "MIN_DEFAULT_BYTES",
    "NODE_SHARE",
    "cgroup_limit",
    "default_host_memory_bytes",
    "local_processes",
    "node_memory_bytes",
    "spilled_text",
    "throttled_text",
]

MIN_DEFAULT_BYTES = 256 << 20  # below this, staging buys little and a tiny node throttles every save
NODE_SHARE = 4  # the default is one quarter of the node's memory

# The launchers' words for "processes of this job on this node": torchrun's first, then
# Slurm's ("8", or "8(x2)" for several nodes alike), Open MPI's, MPICH's and MVAPICH's.
_LOCAL_SIZES = (
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)


def _limit_in(path: Path) -> int | None:
    """The number a cgroup memory limit file holds (None: "max", absent or unreadable)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_limit(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest memory limit over this process's cgroup and its ancestors, in bytes (None:
    none). Both hierarchies are read: v2's ``memory.max`` under ``root`` and v1's
    ``memory.limit_in_bytes`` under ``root/memory`` (whose "no limit" is a huge number, which
    the node's RAM caps), each from the process's own cgroup (``cgroups``, as
    ``/proc/self/cgroup`` lists it) up to the hierarchy's root."""
    found: list[int] = []
    try:
        lines = Path(cgroups).read_text().splitlines()
    except OSError:
        lines = []
    for line in [*lines, "0::/", "1:memory:/"]:  # the roots too: a namespace shows its own as "/"
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _number, controllers, where = parts
        if controllers == "":
            base, name = Path(root), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = Path(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        directory = base / where.strip("/")
        while True:
            limit = _limit_in(directory / name)
            if limit is not None:
                found.append(limit)
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return min(found, default=None)


def node_memory_bytes() -> int:
    """The memory this process's node gives it: its RAM, or its cgroup's limit if smaller."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_limit()
    return min(ram, limit) if limit is not None else ram


def local_processes(environ: Mapping[str, str]) -> int:
    """How many processes of this job share the node, as its launcher says (1 if none says)."""
    for name in _LOCAL_SIZES:
        text = environ.get(name, "").split("(")[0].split(",")[0].strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def default_host_memory_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The default staging budget of one process (see the module doc)."""
    processes = local_processes(os.environ if environ is None else environ)
    return max(MIN_DEFAULT_BYTES, node_memory_bytes() // NODE_SHARE // processes)


def throttled_text(step: int, staged: int, direct: int, waited: float, budget: int | None) -> str:
    """The WARNING that saves wait for the budget: step ``step``'s ``direct`` bytes past it
    (beside ``staged``) were written from the caller's memory while ``save()`` waited ``waited`` s."""
    total = staged + direct
    return (
        f"saves are throttled by runtime.host_memory_bytes={budget or 0}: step {step}'s state is {total} bytes, "
        f"and the {direct} bytes past the budget ({100 * direct / max(total, 1):.0f}%) were written straight from "
        f"the caller's memory while save() waited {waited:.3f} s longer; a budget of {total} bytes lets save() "
        "return once the state is copied (logged once)"
    )


def spilled_text(step: int, rank: int, size: int, budget: int | None, root: Path) -> str:
    """The WARNING that a step kept in memory only went to the local disk (rank ``rank``'s shard of ``size`` bytes)."""
    return (
        f"step {step} is kept in memory only, but rank {rank}'s shard ({size} bytes) does not fit what "
        f"runtime.host_memory_bytes={budget or 0} leaves beside the staging buffers: it was written to an "
        f"unnamed file in {root} for its copy to a partner, and such shards will be (logged once)"
    )
