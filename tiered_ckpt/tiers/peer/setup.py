"""Opening the peer tier of a running job: partners chosen, memory checked, links built (collective).

:func:`open_peer_tier`, on every process at once:

1. each process names its node (:func:`~tiered_ckpt.tiers.peer.partners.node_of`) and checks its
   memory folder against ``peer.max_bytes``; the names and any refusal are gathered (one
   collective: a refusal on one rank fails every rank, naming it);
2. partners are chosen from the nodes; with one node, or without one process per rank
   under ``torch.distributed``, the tier protects nothing: a WARNING says so and it stays off;
3. the two links (saves, restores) are built: each a gloo group of its own, and this
   process's folder of copies is opened (:func:`memory_folder`).
"""

from __future__ import annotations

import logging
import re
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.dist.coordination import Attempt, Coordinator, Done, gather
from tiered_ckpt.errors import invalid_option
from tiered_ckpt.tiers.peer.link import PeerLink
from tiered_ckpt.tiers.peer.memory import PeerMemory
from tiered_ckpt.tiers.peer.partners import choose_partners, node_of
from tiered_ckpt.tiers.peer.tier import PeerTier

__all__ = ["MEMORY_ID", "memory_folder", "open_peer_tier"]

MEMORY_ID = "peer-memory-id"  # in the local directory: names its folder of copies
_ID = re.compile(r"[0-9a-f]{32}")
_OWNER = "owner"  # in a folder of copies: the local directory it belongs to

logger = logging.getLogger("tiered_ckpt")


@dataclass(frozen=True)
class _Node:
    """The node one process runs on."""

    name: str


def memory_folder(memory_dir: Path, local_dir: Path) -> Path:
    """The folder of ``memory_dir`` holding this process's copies, named by an id kept in its
    local directory (made on first use).

    A restarted rank on the same directory finds what it held; a directory deleted and made
    again (a fresh start, a replaced node) gets a new id, so no copy of an earlier run is ever
    restored into it, and the folders of the directory's earlier lives are removed.
    """
    local_dir.mkdir(parents=True, exist_ok=True)
    path = local_dir / MEMORY_ID
    try:
        with open(path, "x") as out:  # exclusive: two processes never make two ids
            out.write(secrets.token_hex(16))
    except FileExistsError:
        pass
    name = path.read_text()[:64].strip()
    if not _ID.fullmatch(name):
        raise invalid_option("local.dir", f"holds {path}, which is not an id this library wrote; remove it")
    folder = memory_dir / name
    owner = str(local_dir.absolute())
    memory_dir.mkdir(parents=True, exist_ok=True)
    for other in memory_dir.iterdir():
        if other != folder and other.is_dir() and _owner(other) == owner:
            logger.info("removing %s: copies held for an earlier life of %s", other, local_dir)
            shutil.rmtree(other, ignore_errors=True)
    folder.mkdir(exist_ok=True)
    (folder / _OWNER).write_text(owner)
    return folder


def _owner(folder: Path) -> str | None:
    try:
        return (folder / _OWNER).read_text()[:4096]
    except OSError:
        return None


def _check_budget(memory_dir: Path, max_bytes: int | None) -> None:
    """Refuse a budget the memory file system cannot hold (a :class:`~tiered_ckpt.ConfigError`
    naming ``peer.max_bytes``)."""
    memory_dir.mkdir(parents=True, exist_ok=True)
    capacity = shutil.disk_usage(memory_dir).total
    if max_bytes is not None and max_bytes > capacity:
        raise invalid_option(
            "peer.max_bytes",
            f"is {max_bytes} bytes, more than the {capacity} bytes of the memory file system "
            f"holding {memory_dir} (peer.memory_dir)",
        )


def open_peer_tier(
    coordinator: Coordinator,
    *,
    local_dir: Path,
    memory_dir: Path,
    max_bytes: int | None,
    timeout_seconds: float,
    nodes: Sequence[str] | None,
) -> PeerTier | None:
    """The peer tier of this process (see the module doc; the arguments are ``peer.*``'s, and
    ``local.dir``), or None if it protects nothing."""
    rank = getattr(coordinator, "rank", None)
    if len(coordinator.local_ranks) != 1 or not hasattr(coordinator, "new_group") or rank is None:
        logger.warning(
            "the peer tier needs one process per rank under torch.distributed (TorchDistributedCoordinator); "
            "with %r it protects nothing and stays off",
            coordinator,
        )
        return None
    if nodes is not None and len(nodes) < coordinator.world_size:  # the same on every rank: they agreed on it
        named_ranks = f"{len(nodes)} rank{'' if len(nodes) == 1 else 's'}"
        raise invalid_option("peer.nodes", f"names the node of {named_ranks}, but the job has {coordinator.world_size}")

    def named() -> _Node:
        _check_budget(memory_dir, max_bytes)
        return _Node(node_of(rank, nodes))

    names = [node.name for node in gather(coordinator, "peer: nodes", _Node, named)]
    partners = choose_partners(names)
    if not partners.active:
        logger.warning(
            "the peer tier stays off: every rank runs on node %r, and a partner on the same node fails with it "
            "(name the nodes with peer.nodes, or launch with torchrun's GROUP_RANK)",
            names[0],
        )
        return None
    opened = Attempt.run(lambda: PeerMemory(memory_folder(memory_dir, local_dir), max_bytes))
    gather(coordinator, "peer: memory", Done, opened.done)  # one rank's failure fails every rank here
    memory = opened.value
    save_link = PeerLink(coordinator, timeout_seconds)
    restore_link = PeerLink(coordinator, timeout_seconds)
    holder = partners.partner[rank]
    logger.info("peer tier: rank %d's shards are held by rank %s on node %s", rank, holder, names[holder or 0])
    return PeerTier(memory, partners, rank, save_link, restore_link, spool=local_dir)
