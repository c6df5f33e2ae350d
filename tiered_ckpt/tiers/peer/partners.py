"""Which rank holds each rank's shards in its memory: partners chosen from the nodes the ranks run on.

A partner is only worth its memory if it does not fail with the rank it protects, so a
rank's partner is always on another node (another failure domain). :func:`node_of` names
this process's node, from the first of:

1. an explicit mapping (``peer.nodes``: a node name per rank);
2. the launcher's ``GROUP_RANK`` (torchrun's node rank), or ``RANK // LOCAL_WORLD_SIZE``;
3. the host name.

:func:`choose_partners` then pairs the ranks: the nodes in the order of their first rank
form a ring, and the ``i``-th rank of a node is held by the ``i``-th rank (modulo its size)
of the next node. Every rank of a job of two or more nodes has a partner on another
node; with one node no rank has one, and the peer tier stays off.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tiered_ckpt.errors import UsageError, invalid_option

__all__ = ["Partners", "choose_partners", "node_of"]


def node_of(rank: int, nodes: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The name of the node ``rank`` runs on (see the module doc for where it comes from)."""
    env = os.environ if environ is None else environ
    if nodes is not None:
        if not 0 <= rank < len(nodes):
            raise invalid_option("peer.nodes", f"names {len(nodes)} ranks, but this process is rank {rank}")
        return str(nodes[rank])
    if env.get("GROUP_RANK", "").strip().isdigit():
        return f"group-rank-{int(env['GROUP_RANK'])}"
    local_size, global_rank = env.get("LOCAL_WORLD_SIZE", ""), env.get("RANK", "")
    if local_size.strip().isdigit() and int(local_size) > 0 and global_rank.strip().isdigit():
        return f"group-rank-{int(global_rank) // int(local_size)}"
    return socket.gethostname()


@dataclass(frozen=True)
class Partners:
    """The ranks' nodes (``nodes[rank]``) and each rank's partner, the rank holding its shards
    (``partner[rank]``, None when no rank is on another node)."""

    nodes: tuple[str, ...]
    partner: tuple[int | None, ...]

    @property
    def active(self) -> bool:
        """True if every rank has a partner (the job runs on two nodes or more)."""
        return all(partner is not None for partner in self.partner)

    def wards(self, rank: int) -> tuple[int, ...]:
        """The ranks whose shards ``rank`` holds, in order."""
        return tuple(ward for ward, partner in enumerate(self.partner) if partner == rank)


def choose_partners(nodes: Sequence[str]) -> Partners:
    """The partners of ranks running on ``nodes`` (``nodes[rank]``; see the module doc)."""
    if not nodes:
        raise UsageError("choosing partners needs the node of every rank, got none")
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    ring = list(by_node.values())
    if len(ring) < 2:
        return Partners(tuple(nodes), (None,) * len(nodes))
    partner: list[int | None] = [None] * len(nodes)
    for index, ranks in enumerate(ring):
        following = ring[(index + 1) % len(ring)]
        for position, rank in enumerate(ranks):
            partner[rank] = following[position % len(following)]
    return Partners(tuple(nodes), tuple(partner))
