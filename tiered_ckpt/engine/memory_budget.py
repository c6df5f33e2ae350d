"""The host memory a process's saves may hold for staging: ``runtime.host_memory_bytes``, or
a default that protects the node.

A save copies the caller's arrays into staging buffers so that the training loop may change
them while the write runs; on a node whose processes each hold hundreds of GB of state, a
copy of all of it is what runs the node out of memory. The staging holds at most the budget
(:class:`~tiered_ckpt.engine.staging.StagingBuffers`); what does not fit is written straight
from the caller's memory while the save call waits.

The default, :func:`default_host_memory_bytes`: a quarter of the node's memory (the smaller
of its RAM and its cgroup's limit), shared by the node's processes (``LOCAL_WORLD_SIZE``, as
``torchrun`` sets it; else one), and at least :data:`MIN_DEFAULT_BYTES`. Three quarters stay
with the training job, its data loaders and the page cache the writes go through; a state
smaller than the budget is staged whole, as it always was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["MIN_DEFAULT_BYTES", "NODE_SHARE", "default_host_memory_bytes", "node_memory_bytes"]

MIN_DEFAULT_BYTES = 256 << 20  # below this, staging buys little and a tiny node throttles every save
NODE_SHARE = 4  # the default is one quarter of the node's memory

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _cgroup_limit(paths: tuple[str, ...] = _CGROUP_LIMITS) -> int | None:
    """The memory limit of this process's cgroup (v2, else v1), None if it has none or none is readable."""
    for path in paths:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)  # v1 reports "no limit" as a huge number, which the RAM bound caps
        return None  # "max": no limit
    return None


def node_memory_bytes() -> int:
    """The memory this process's node gives it: its RAM, or its cgroup's limit if smaller."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit()
    return min(ram, limit) if limit is not None else ram


def default_host_memory_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The default staging budget of one process (see the module doc)."""
    environ = os.environ if environ is None else environ
    text = environ.get("LOCAL_WORLD_SIZE", "")
    processes = int(text) if text.isdigit() and int(text) > 0 else 1
    return max(MIN_DEFAULT_BYTES, node_memory_bytes() // NODE_SHARE // processes)
