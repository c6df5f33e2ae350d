"""The end of a restore's reads, with no I/O: the states a process read made into its result.

:class:`ShardsRead` is what a process's reads of a step gave
(:meth:`~tiered_ckpt.engine.shard_reads.ShardReader.load`); :func:`assemble` makes the result
from it and the arrays other processes sent, if any (the restorer's collective,
:func:`~tiered_ckpt.dist.replicas.share`):

1. the arrays the shards read left to other ranks are put back, from the writers' shards
   read here or from what their processes sent (:func:`~tiered_ckpt.dist.replicas.put_back`);
2. the states are resharded for another world size, or the chunks of the caller's DTensors
   filled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from tiered_ckpt.dist.replicas import put_back
from tiered_ckpt.dist.reshard import ChunkPlan, check_data_parallel, fill_chunks, reshard_flat, reshard_rank
from tiered_ckpt.engine.refill import Refill
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.tiers.store import TierName
from tiered_ckpt.torch.device_copies import Placed

__all__ = ["ShardsRead", "assemble"]


@dataclass(frozen=True)
class ShardsRead:
    """A process's reads of ``manifest``'s step, done (a partial restore's manifest keeps only
    the replicated arrays and sharded keys inside its selection), for its ``ranks``
    (``one_process``: every rank of the job) restored on ``target`` ranks.

    ``read``: by saved rank, the verified states read (whole shards, or the parts needed),
    from the tiers in ``sources``, ``bytes_read`` bytes in all (the writers' parts in
    ``found`` included). ``from_peers``: the arrays its shards left to other ranks come from
    the processes holding them (the restorer's collective), else ``found`` holds them, by
    writer rank. ``into``: the caller's arrays by saved rank. ``chunks``: for a restore into
    states of DTensors (``targets``), per rank of this process, what fills its state.
    ``refills``: what the reads left to land on this node's disk after the restore.
    ``to_device``: copies the arrays filled for CUDA tensors of ``into`` to them (once the
    whole restore succeeded: no unverified byte reaches a tensor) and lets go of them;
    returns which tensor each such array stood in for.
    ``where``: the local step directory, named in errors."""

    manifest: ShardManifest
    target: int
    ranks: tuple[int, ...]
    one_process: bool
    read: Mapping[int, FlatState]
    sources: Mapping[int, TierName]
    bytes_read: int
    from_peers: bool
    where: str
    found: Mapping[int, Mapping[str, np.ndarray]] = field(default_factory=dict)
    into: Mapping[int, Mapping[str, np.ndarray]] = field(default_factory=dict)
    chunks: tuple[ChunkPlan, ...] = ()
    targets: tuple[FlatState, ...] = ()
    refills: tuple[Refill, ...] = ()
    to_device: Callable[[], Placed] | None = None


def assemble(done: ShardsRead, received: Mapping[int, Mapping[str, np.ndarray]]) -> RestoreResult:
    """The result of ``done``'s reads (see the module doc), with ``received``: by writer rank,
    the verified arrays other processes sent (empty unless ``done.from_peers``). Raises
    :class:`ManifestError`, :class:`ShardFormatError` or :class:`InvalidStateError` as
    :func:`~tiered_ckpt.dist.replicas.put_back` does."""
    manifest, step = done.manifest, done.manifest.step
    sources = dict(done.sources)
    if done.chunks:
        read = dict(done.read)
        for writer, arrays in received.items():
            base = read.get(writer, read[done.chunks[0].plain_source])
            read[writer] = FlatState({**base.arrays, **arrays} if writer in read else dict(arrays), base.structure)
        states = [fill_chunks(plan, read, state) for plan, state in zip(done.chunks, done.targets, strict=True)]
        unflattened = [state.unflatten() for state in states]
        return RestoreResult(step, unflattened, sources, done.ranks, manifest, tuple(states), done.bytes_read)
    found = {**done.found, **received}
    for rank, state in done.read.items():
        put_back(state, manifest.shard(rank), manifest, found, done.into.get(rank), done.where)
    ranks = done.ranks
    if manifest.world_size == done.target:
        states = [done.read[rank] for rank in ranks]
    elif done.one_process and len(done.read) == manifest.world_size:  # every saved rank read: each one checked
        check_data_parallel(manifest)
        states = reshard_flat([done.read[rank] for rank in range(manifest.world_size)], manifest, done.target)
        ranks = tuple(range(done.target))
    else:  # each new rank from the saved ranks it needs (rank 0's, for a state without sharded keys)
        check_data_parallel(manifest)
        ranks = tuple(range(done.target)) if done.one_process else ranks
        states = [reshard_rank(done.read, manifest, done.target, rank) for rank in ranks]
    unflattened = [state.unflatten() for state in states]
    return RestoreResult(step, unflattened, sources, ranks, manifest, tuple(states), done.bytes_read)
