"""Replicated arrays of a state of DTensors: written once, put back on every rank that had them.

A state of DTensors (FSDP2, tensor parallelism) holds arrays that several ranks have
identical copies of: plain tensors (an optimizer's ``step``, buffers) and DTensor chunks
on a replicated mesh dimension (:attr:`FlatState.replicated`). A save writes each such
array once, by one rank: its *writer*.

1. every rank fingerprints its replicated arrays: name, dtype, shape, place in the global
   tensor, and xxh3-128 of the bytes (:func:`offer`); equal fingerprints are taken as equal
   bytes (a chance collision of xxh3-128 is 2**-64 even over 2**32 arrays);
2. one collective exchanges the offers and :func:`assign` gives each group of identical
   copies to one of the ranks that have it, its writer (the one with the fewest bytes so far,
   then the lowest rank), the same way on every process (:func:`choose_writers` runs both steps);
3. the other ranks leave the array out of their shard (:func:`written`) and their manifest
   record lists it with its writer among its *replicas* (``ShardRecord.replicas``); the writer's record has it
   among its chunks, with its sha256.

A restore puts the replicas back (:func:`put_back`) from the writer's shard when this process
read it whole, else from the writer's process (:func:`share`: the writer broadcasts what it
read and verified, each receiver checks the sha256 the manifest records), else by a
partial read of the writer's shard, verified the same way (the store's ``read_parts``).
Arrays that differ between ranks (an RNG state) have different fingerprints and stay in
every rank's shard.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from tiered_ckpt.dist.coordination import Coordinator, gather
from tiered_ckpt.errors import ChecksumMismatchError, InvalidStateError, ManifestError, ShardFormatError
from tiered_ckpt.format.manifest import ChunkRecord, ShardManifest, ShardRecord
from tiered_ckpt.format.shardfile import DTYPES, dtype_code
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.structure import Chunk, path_text

__all__ = ["Offer", "offer", "assign", "choose_writers", "written", "missing", "put_back", "share"]


@dataclass(frozen=True)
class Offer:
    """One process's replicated arrays, as ``(rank, name, fingerprint, bytes)``, and each of its
    ranks' bytes in arrays no other rank could have (what crosses the collective)."""

    arrays: tuple[tuple[int, str, str, int], ...]
    own_bytes: tuple[tuple[int, int], ...]


def _bytes_of(array: np.ndarray) -> memoryview:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def _fingerprint(state: FlatState, name: str) -> str:
    array = state.arrays[name]
    chunk = state.structure.chunks.get(name, Chunk(tuple(array.shape), (0,) * array.ndim))
    digest = xxhash.xxh3_128_hexdigest(_bytes_of(array))
    return f"{dtype_code(array)}|{list(array.shape)}|{list(chunk.global_shape)}|{list(chunk.offsets)}|{digest}"


def offer(states: Sequence[FlatState], ranks: Sequence[int]) -> Offer:
    """This process's offer: the fingerprints of ``states``' replicated arrays (``states[i]`` is rank ``ranks[i]``'s)."""
    arrays, own = [], []
    for rank, state in zip(ranks, states, strict=True):
        replicated = sorted(state.replicated & set(state.arrays))
        arrays += [(rank, name, _fingerprint(state, name), state.arrays[name].nbytes) for name in replicated]
        own.append((rank, sum(a.nbytes for n, a in state.arrays.items() if n not in state.replicated)))
    return Offer(tuple(arrays), tuple(own))


def assign(offers: Iterable[Offer]) -> dict[int, dict[str, int]]:
    """Per rank, its replicas: the arrays it leaves out, each with the rank that writes it instead.

    Every group of ranks offering the same name and fingerprint has one writer: largest
    arrays first, each goes to the rank having it with the fewest bytes so far (ties: the lowest
    rank). Deterministic, so every process computes the same answer from the same offers.
    """
    load: dict[int, int] = {}
    groups: dict[tuple[str, str], list[int]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for one in offers:
        for rank, nbytes in one.own_bytes:
            load[rank] = load.get(rank, 0) + nbytes
        for rank, name, fingerprint, nbytes in one.arrays:
            groups.setdefault((name, fingerprint), []).append(rank)
            sizes[(name, fingerprint)] = nbytes
    replicas: dict[int, dict[str, int]] = {}
    for key in sorted(groups, key=lambda key: (-sizes[key], key)):
        having = sorted(groups[key])
        writer = min(having, key=lambda rank: (load.get(rank, 0), rank))
        load[writer] = load.get(writer, 0) + sizes[key]
        for rank in having:
            if rank != writer:
                replicas.setdefault(rank, {})[key[0]] = writer
    return replicas


def choose_writers(coordinator: Coordinator, states: Sequence[FlatState]) -> dict[int, dict[str, int]]:
    """Collective (every process calls it at the same point of a save): :func:`assign` over
    every process's :func:`offer` for ``states`` (this process's ranks, in order)."""
    ranks = tuple(coordinator.local_ranks)
    return assign(gather(coordinator, "replicas", Offer, lambda: offer(states, ranks)))


def written(state: FlatState, replicas: Collection[str]) -> FlatState:
    """``state`` without its ``replicas`` (written by other ranks): what its shard stores."""
    if not replicas:
        return state
    return FlatState({name: a for name, a in state.arrays.items() if name not in replicas}, state.structure)


def missing(records: Iterable[ShardRecord]) -> dict[int, set[str]]:
    """Per writer rank, the replicas of ``records``' shards that its shard stores."""
    needed: dict[int, set[str]] = {}
    for record in records:
        for name, writer in record.replicas:
            needed.setdefault(writer, set()).add(name)
    return needed


def _written_chunk(manifest: ShardManifest, writer: int, name: str) -> ChunkRecord:
    return next(chunk for chunk in manifest.shard(writer).chunks if chunk.name == name)


def put_back(
    state: FlatState,
    record: ShardRecord,
    manifest: ShardManifest,
    found: Mapping[int, Mapping[str, np.ndarray]],
    into: Mapping[str, np.ndarray] | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> None:
    """Add to ``state`` (rank ``record.rank``'s, as its shard holds it) the arrays its shard
    leaves out (its replicas), copied from ``found[writer][name]`` (verified arrays) into ``into``'s arrays
    when given, else into new ones. ``directory`` (where the shards were read) is named in errors.

    Raises :class:`ManifestError` naming the shard file, the rank and the array if the
    manifest leaves an array to a writer whose shard does not store it, or to another rank
    while the rank's own shard holds it (a manifest that does not describe its shards);
    :class:`ShardFormatError` if the rank's structure places an array elsewhere in its
    tensor than the writer's chunk, and :class:`InvalidStateError` if ``into``'s array has
    another dtype or shape.
    """

    def shard_file(rank: int) -> str:
        name = manifest.shard(rank).path
        return str(Path(directory) / name) if directory is not None else name

    for name, writer in record.replicas:
        if name in state.arrays:
            raise ManifestError(
                f"manifest of step {manifest.step}: rank {record.rank}'s record lists {name!r:.200} as written by "
                f"rank {writer}, but rank {record.rank}'s shard {shard_file(record.rank)} stores it itself"
            )
        if name not in found.get(writer, {}):
            raise ManifestError(
                f"manifest of step {manifest.step}: rank {record.rank}'s record lists {name!r:.200} as written by "
                f"rank {writer}, but rank {writer}'s shard {shard_file(writer)} does not store it"
            )
        chunk = _written_chunk(manifest, writer, name)
        mine = state.structure.chunks.get(name, Chunk(chunk.sizes, (0,) * len(chunk.sizes)))
        if (mine.global_shape, mine.offsets) != (chunk.global_shape, chunk.offsets):
            raise ShardFormatError(
                f"rank {record.rank}: {path_text(state.structure.paths[name])} is at {mine.offsets} of "
                f"{mine.global_shape}, but the copy rank {writer} wrote is at {chunk.offsets} of {chunk.global_shape}"
            )
        source = found[writer][name]
        target = into.get(name) if into is not None else None
        if target is None:
            target = np.empty_like(source)
        elif target.dtype != source.dtype or target.shape != source.shape:
            raise InvalidStateError(
                f"into[{name!r}] is {target.dtype} {target.shape}, the checkpoint holds {source.dtype} {source.shape}"
            )
        np.copyto(target, source)
        state.arrays[name] = target


def share(
    coordinator: Coordinator, manifest: ShardManifest, own: Mapping[str, np.ndarray]
) -> dict[int, dict[str, np.ndarray]]:
    """Collective (every process, same point, same ``manifest``): each writer broadcasts the
    replicas of other ranks its shard stores; return, by writer, this process's rank's replicas.

    ``own`` are this process's verified arrays (its rank's shard, read whole or in part).
    Every broadcast runs on every process even after a problem, so that none waits for a
    collective the others skipped; then :class:`ChecksumMismatchError` names each array
    whose bytes did not match the sha256 the writer's record has for it.
    """
    (rank,) = coordinator.local_ranks
    wanted = dict(manifest.shard(rank).replicas)
    received: dict[int, dict[str, np.ndarray]] = {}
    problems = []
    for writer, names in sorted(missing(manifest.shards).items()):
        for name in sorted(names):
            chunk = _written_chunk(manifest, writer, name)
            buffer = _buffer(chunk, own.get(name) if writer == rank else None)
            coordinator.broadcast_array(buffer, writer)
            if wanted.get(name) != writer:
                continue
            if hashlib.sha256(_bytes_of(buffer)).hexdigest() != chunk.sha256:
                problems.append(f"{name!r} from rank {writer}")
            received.setdefault(writer, {})[name] = buffer
    if problems:
        raise ChecksumMismatchError(
            f"rank {rank}: arrays received from their writers do not match their recorded sha256: "
            + ", ".join(problems)
        )
    return received


def _buffer(chunk: ChunkRecord, mine: np.ndarray | None) -> np.ndarray:
    """What a rank sends (its array) or receives into (new memory of the chunk's dtype and sizes).

    A writer that lacks the array sends zeros of the right size: the receivers' sha256 check
    then fails loudly instead of a collective hanging.
    """
    empty = np.zeros(chunk.sizes, dtype=DTYPES[chunk.dtype])
    if mine is None or mine.shape != empty.shape or mine.dtype != empty.dtype:
        return empty
    return np.ascontiguousarray(mine)
