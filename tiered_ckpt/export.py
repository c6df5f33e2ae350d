"""Export one step as a Hugging Face style safetensors checkpoint, streamed tensor by tensor.

:func:`export_safetensors` writes ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes``), each file
of full tensors:

1. every rank's shard header is read and verified (its sha256 in the manifest), from the
   local disk or by ranged GETs from the bucket, and parsed once: they say where each
   array lies;
2. the tensors to write are planned from every rank's structure (``only``: the part under
   one path, e.g. ``"model"``; names are the keys below it joined by ``.``, as a state
   dict's): a DTensor from the chunks every rank's record lists (each checked against its
   shard's verified header, together an exact tiling of the tensor), a flat slice
   (``sharded_keys``) from every rank's slice in offset order (an empty tensor if every
   slice is empty), any other array from the first rank that holds it (a pipeline
   stage's layers from that stage's ranks);
3. each file is written through a temp file, fsynced and renamed: its header first (known
   from the plan), then each tensor in turn, assembled in one buffer of its full size from
   the verified parts read straight into it (each part checked against its own digest:
   a chunk's sha256, a plain array's xxh3-64; the reads planned and run as a restore's,
   :func:`~tiered_ckpt.engine.restore_plan.plan_parts` and
   :class:`~tiered_ckpt.engine.read_execution.ReadExecutor`). Peak extra memory is one tensor; smaller
   tensors are read in batches of up to 1 MiB (one read of each shard per batch).

The files' sha256s are computed as they are written and returned (:class:`ExportResult`).
Values that are not tensors (scalars, ``bytes``, complex arrays, which safetensors has no
dtype for) are left out, listed.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tiered_ckpt.build import open_store
from tiered_ckpt.engine.node_shards import step_holdings
from tiered_ckpt.engine.read_execution import ReadExecutor
from tiered_ckpt.engine.restore_plan import StepHoldings, plan_parts
from tiered_ckpt.errors import IncompleteCheckpointError, ManifestError, UsageError
from tiered_ckpt.format.manifest import ChunkRecord, ShardManifest
from tiered_ckpt.format.selection import check_paths, resolve_path, select
from tiered_ckpt.format.shardfile import DTYPE_CODES, DTYPES, ShardHeader, header_of
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.structure import COMPLEX_TAGS, Structure, decode_key
from tiered_ckpt.io.durable import atomic_write, fsync_directory, write_all
from tiered_ckpt.io.hashing import Hasher
from tiered_ckpt.options import LocalOptions, RemoteOptions, UploadOptions, resolve_options
from tiered_ckpt.tiers.shard_parts import ShardIndex
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["ExportResult", "ExportedFile", "export_safetensors", "export_step", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"
_BATCH_BYTES = 1 << 20  # tensors smaller than this are read together, up to this many bytes
_METADATA = {"format": "pt"}  # what transformers' from_pretrained asks of a safetensors file


@dataclass(frozen=True)
class ExportedFile:
    """One file written: its name in the directory, its size and the sha256 of its bytes."""

    name: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_step` wrote: ``files`` (safetensors files, then the index if any),
    ``tensors`` (their names, in file order), the ``skipped`` values that are not arrays (by
    path), and the size of the largest tensor (``largest_tensor_bytes``: the peak extra memory)."""

    step: int
    directory: Path
    files: tuple[ExportedFile, ...]
    tensors: tuple[str, ...]
    skipped: tuple[str, ...]
    largest_tensor_bytes: int


@dataclass(frozen=True)
class _Part:
    """Where some of a tensor's bytes come from: array ``name`` of ``rank``'s shard, filling the
    box at ``offsets`` of ``sizes`` in the full tensor."""

    rank: int
    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[_Part, ...]

    @functools.cached_property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].itemsize * math.prod(self.shape)


def export_safetensors(
    local: str | os.PathLike[str] | LocalOptions,
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    remote: str | RemoteOptions | None = None,
    upload: UploadOptions | None = None,
    only: str | Sequence[str | int] | None = None,
    max_shard_bytes: int = 5 * 10**9,
) -> ExportResult:
    """Export ``step`` (default: the newest committed on the local disk or in the bucket) of
    the checkpoints in ``local`` (and ``remote``, where the local disk lacks it) as a Hugging
    Face style safetensors checkpoint in ``directory``; see :func:`export_step`. Reads only:
    nothing is written to the local directory or the bucket, and no lock is taken."""
    options = resolve_options(local, remote, upload)
    store = open_store(options.local, options.remote, options.upload)
    if step is None:
        steps = sorted({*store.local.steps(), *store.remote_steps()})
        if not steps:
            raise IncompleteCheckpointError(f"{store.where()}: no committed step to export")
        step = steps[-1]
    return export_step(store, step, directory, only=only, max_shard_bytes=max_shard_bytes)


def export_step(
    store: TieredStore,
    step: int,
    directory: str | os.PathLike[str],
    *,
    only: str | Sequence[str | int] | None = None,
    max_shard_bytes: int = 5 * 10**9,
) -> ExportResult:
    """Write ``step`` of ``store`` into ``directory`` (see the module doc), every input verified.

    ``directory`` is created if needed. An earlier export's weight files and index there
    (``model.safetensors``, ``model-0000k-of-0000n.safetensors``, the index: matched by name)
    are removed first, then each file is written atomically; nothing else in it is touched.
    Raises :class:`UsageError` for an ``only`` not in the state, two paths that make one
    tensor name or a ``directory`` that is a file, :class:`ManifestError` for chunk records
    that do not match their shards or do not tile their tensor,
    :class:`IncompleteCheckpointError` if no tier holds the step, and the store's
    verification errors (naming the rank, file and array) if a part does not verify.
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise UsageError(f"export: max_shard_bytes must be an integer >= 1, got {max_shard_bytes!r:.60}")
    selected = None if only is None else check_paths([only], "export")
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise UsageError(f"export: {root} is not a directory")
    in_local = step in store.local.steps()
    in_remote = store.remote is not None and step in store.remote_steps()
    if not (in_local or in_remote):
        raise IncompleteCheckpointError(f"{store.where()}: step {step} is committed in no tier")
    manifest, _remote = store.manifests(step, in_local=in_local, in_remote=in_remote)
    committed = {store.remote.name: in_remote} if store.remote is not None else {}
    holdings = step_holdings(store, True, manifest, range(manifest.world_size), committed)
    later = holdings.later_for
    indexes = [store.read_shard_index(step, record, later=later(record.rank))[0] for record in manifest.shards]
    reads = _Reads(manifest, holdings, dict(enumerate(indexes)), ReadExecutor(store))
    headers = [index.whole_header(record) for index, record in zip(indexes, manifest.shards, strict=True)]
    structures = [index.structure for index in indexes]  # each parsed once, for every read of its parts
    cuts, prefix = _cuts(structures, selected, step)
    tensors, skipped = _plan(manifest, headers, structures, cuts, prefix)
    groups = _groups(tensors, max_shard_bytes)
    root.mkdir(parents=True, exist_ok=True)
    # Before the first file: a reader must never find an earlier export's index or files
    # beside a part of this one (an export that fails midway leaves no loadable mix).
    _remove_stale(root)
    files = []
    for index, group in enumerate(groups):
        name = "model.safetensors" if len(groups) == 1 else f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        files.append(_write_file(root / name, group, reads))
    if len(groups) > 1:
        weight_map = {tensor.name: file.name for group, file in zip(groups, files, strict=True) for tensor in group}
        index_document = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
        data = json.dumps(index_document, indent=2).encode()
        files.append(_write_small(root / INDEX_NAME, data))
    fsync_directory(root)
    largest = max((tensor.nbytes for tensor in tensors), default=0)
    return ExportResult(step, root, tuple(files), tuple(t.name for t in tensors), tuple(skipped), largest)


def _cuts(
    structures: list[Structure], selected: tuple[str | tuple[str | int, ...], ...] | None, step: int
) -> tuple[list[Structure | None], tuple[str | int, ...]]:
    """Each rank's part of its state under ``only`` (None: a rank without it, as a pipeline
    stage lacks the other stages' layers), and the path ``only`` stands for; the first
    rank's :class:`UsageError` if no rank has it."""
    if selected is None:
        return list(structures), ()
    cuts: list[Structure | None] = []
    errors: list[UsageError] = []
    prefix: tuple[str | int, ...] | None = None
    for rank, structure in enumerate(structures):
        what = f"step {step} rank {rank}"
        try:
            cuts.append(select(structure, selected, what))
            prefix = prefix or resolve_path(structure, selected[0], what)
        except UsageError as exc:
            cuts.append(None)
            errors.append(exc)
    if prefix is None:
        raise errors[0]
    return cuts, prefix


def _plan(
    manifest: ShardManifest,
    headers: list[ShardHeader],
    structures: list[Structure],
    cuts: list[Structure | None],
    prefix: tuple[str | int, ...],
) -> tuple[list[_Tensor], list[str]]:
    """The tensors to write, from every rank's part of its state (a tensor is planned at the
    first rank holding it), and the paths of what is not a tensor."""
    chunks = {(record.rank, chunk.name): chunk for record in manifest.shards for chunk in record.chunks}
    sharded = frozenset(manifest.sharded_keys)
    tensors: list[_Tensor] = []
    skipped: dict[str, None] = {}
    seen: dict[str, tuple[str | int, ...]] = {}
    planned: set[str] = set()
    for rank, cut in enumerate(cuts):
        if cut is None:
            continue
        left = dict(manifest.shard(rank).replicas)
        complex_leaves = _complex_leaves(cut.root)
        for array_name, path in cut.paths.items():
            dotted = ".".join(map(str, path))
            if cut.kinds[array_name] in ("bytes", "bytesio") or array_name in complex_leaves:
                skipped[dotted] = None
                continue
            if array_name in planned:
                continue
            name = ".".join(str(key) for key in path[len(prefix) :]) or str(path[-1])
            if name == "__metadata__":
                raise UsageError(f"export: {dotted} would be named __metadata__, the safetensors header's own key")
            if name in seen:
                raise UsageError(f"export: the paths {seen[name]} and {path} both make the tensor name {name!r}")
            seen[name] = path
            planned.add(array_name)
            writer = left.get(array_name, rank)  # its own shard's array, or the rank it was left to
            tensors.append(_tensor(name, array_name, writer, manifest, headers, structures, chunks, sharded))
        skipped.update(dict.fromkeys(_scalars(cut.root, ())))
    return tensors, list(skipped)


def _tensor(
    name: str,
    array: str,
    writer: int,
    manifest: ShardManifest,
    headers: list[ShardHeader],
    structures: list[Structure],
    chunks: dict[tuple[int, str], ChunkRecord],
    sharded: frozenset[str],
) -> _Tensor:
    """Where ``array``'s full tensor comes from: every distinct chunk the ranks' records list
    (each checked against the verified header of its shard, together an exact tiling of the
    tensor), every rank's flat slice, or ``writer``'s array."""
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], _Part] = {}
    global_shape: tuple[int, ...] | None = None
    for record in manifest.shards:
        chunk = chunks.get((record.rank, array))
        if chunk is None:
            continue
        placed = structures[record.rank].chunks.get(array)
        entry = headers[record.rank].arrays.get(array)
        header_box = None
        if entry is not None and placed:
            header_box = (placed.global_shape, placed.offsets, entry.shape)
        elif entry is not None:
            header_box = (entry.shape, (0,) * len(entry.shape), entry.shape)
        if header_box != (chunk.global_shape, chunk.offsets, chunk.sizes):
            raise ManifestError(
                f"export: rank {record.rank}'s record places {array!r} at {chunk.offsets} of {chunk.global_shape}, "
                f"not where its shard's verified header does"
            )
        if global_shape is not None and chunk.global_shape != global_shape:
            raise ManifestError(f"export: the ranks' records give {array!r} two shapes")
        global_shape = chunk.global_shape
        boxes.setdefault((chunk.offsets, chunk.sizes), _Part(record.rank, array, chunk.offsets, chunk.sizes))
    if global_shape is not None:
        parts = tuple(boxes.values())
        _check_tiling(array, global_shape, parts)
        return _Tensor(name, _code(headers, parts[0]), global_shape, parts)
    if array in sharded:
        parts = tuple(
            _Part(record.rank, array, (record.param_shard_offset,), (record.param_shard_numel,))
            for record in manifest.shards
            if record.param_shard_numel
        )  # none if the vector is empty on every rank: an empty tensor of the writer's dtype
        first = parts[0] if parts else _Part(writer, array, (0,), (0,))
        return _Tensor(name, _code(headers, first), (manifest.total_numel,), parts)
    shape = headers[writer].arrays[array].shape
    part = _Part(writer, array, (0,) * len(shape), shape)
    return _Tensor(name, _code(headers, part), shape, (part,))


def _check_tiling(array: str, shape: tuple[int, ...], parts: tuple[_Part, ...]) -> None:
    """Raise :class:`ManifestError` unless the boxes of ``parts`` tile ``shape`` exactly (inside
    it, no two overlapping, their volumes its volume): no byte of the export is left unread."""
    low = np.array([part.offsets for part in parts], dtype=np.int64).reshape(len(parts), len(shape))
    high = low + np.array([part.sizes for part in parts], dtype=np.int64).reshape(len(parts), len(shape))
    inside = bool((low >= 0).all() and (high <= np.array(shape, dtype=np.int64)).all())
    overlaps = np.all((low[:, None, :] < high[None, :, :]) & (low[None, :, :] < high[:, None, :]), axis=2)
    np.fill_diagonal(overlaps, False)
    volume = sum(math.prod(part.sizes) for part in parts)
    if not inside or overlaps.any() or volume != math.prod(shape):
        raise ManifestError(f"export: the saved chunks of {array!r} do not tile its tensor of shape {shape}")


def _code(headers: list[ShardHeader], part: _Part) -> str:
    return DTYPE_CODES[headers[part.rank].arrays[part.name].dtype]


def _complex_leaves(node: object) -> set[str]:
    """The names of the arrays that hold complex values as float pairs (not exported)."""
    if not isinstance(node, dict) or len(node) != 1:
        return set()
    ((tag, value),) = node.items()
    if tag in COMPLEX_TAGS:
        ((_kind, name),) = value.items()
        return {name[0] if isinstance(name, list) else name}
    if tag == "dict":
        return set().union(*(_complex_leaves(item) for _key, item in value))
    if tag in ("list", "tuple"):
        return set().union(*(_complex_leaves(item) for item in value))
    return set()


def _scalars(node: object, path: tuple[str | int, ...]) -> list[str]:
    """The paths of the values of a structure tree that are not arrays (not exported)."""
    if not isinstance(node, dict):
        return [".".join(map(str, path)) or "(root)"]
    ((tag, value),) = node.items()
    if tag == "dict":
        found = []
        for key, item in value:
            found += _scalars(item, (*path, decode_key(key)))
        return found
    if tag in ("list", "tuple"):
        return [entry for index, item in enumerate(value) for entry in _scalars(item, (*path, index))]
    if tag in ("int", "float"):
        return [".".join(map(str, path))]
    return []  # an array leaf


def _groups(tensors: list[_Tensor], max_shard_bytes: int) -> list[list[_Tensor]]:
    """The tensors in files of at most ``max_shard_bytes`` each (a larger tensor alone in one)."""
    groups: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return groups


@dataclass(frozen=True)
class _Reads:
    """How an export reads the parts of ``manifest``'s shards: planned from what the tiers hold
    (:func:`~tiered_ckpt.engine.restore_plan.plan_parts`), each shard's header read and parsed
    once (``indexes``, by rank), run by the one executor of restores."""

    manifest: ShardManifest
    holdings: StepHoldings
    indexes: Mapping[int, ShardIndex]
    executor: ReadExecutor

    def read(
        self, wanted: Mapping[int, Collection[str]], into: Mapping[int, Mapping[str, np.ndarray]] | None = None
    ) -> Mapping[int, FlatState]:
        """By rank, the arrays ``wanted`` of its shard, each verified, into ``into``'s when given."""
        reads = plan_parts(self.holdings, wanted)
        return self.executor.run(self.manifest, reads, into=into, indexes=self.indexes).states


def _write_file(path: Path, tensors: list[_Tensor], reads: _Reads) -> ExportedFile:
    def write(out: BinaryIO) -> tuple[int, str]:
        hasher = Hasher("full")
        header = header_of([(t.name, t.dtype, t.shape) for t in tensors], _METADATA)
        write_all(out, header)
        hasher.update(header)
        # One batch at a time: the peak is one tensor, or a batch of smaller ones read together.
        for batch in _groups(tensors, max(_BATCH_BYTES, max(tensor.nbytes for tensor in tensors))):
            data = _assembled(batch, reads)
            write_all(out, data)
            hasher.update(data)
            del data
        digest = hasher.digest()
        return digest.size_bytes, digest.sha256

    size, sha256 = atomic_write(path, write, sync_directory=False)
    return ExportedFile(path.name, size, sha256)


def _assembled(batch: list[_Tensor], reads: _Reads) -> memoryview:
    """The bytes of the tensors of ``batch`` whole, back to back as the file holds them, each
    part read (verified) straight into its place where that place is contiguous memory (one
    read of each rank's shard for all such parts of the batch), else into its own buffer, one
    at a time, and copied there."""
    data = np.empty(sum(tensor.nbytes for tensor in batch), np.uint8)
    ends = np.cumsum([0] + [tensor.nbytes for tensor in batch]).tolist()
    fulls = [
        data[begin:end].view(DTYPES[tensor.dtype]).reshape(tensor.shape)
        for tensor, begin, end in zip(batch, ends, ends[1:], strict=False)
    ]
    direct: dict[int, dict[str, np.ndarray]] = {}  # by rank: the places its parts are read into
    for tensor, full in zip(batch, fulls, strict=True):
        for part in tensor.parts:
            box: tuple[Any, ...] = (*(slice(o, o + n) for o, n in zip(part.offsets, part.sizes, strict=True)), ...)
            place = full[box]
            if place.flags.c_contiguous:
                direct.setdefault(part.rank, {})[part.name] = place.reshape(part.sizes)
                continue
            place[...] = reads.read({part.rank: {part.name}})[part.rank].arrays[part.name].reshape(part.sizes)
    if direct:
        reads.read({rank: into.keys() for rank, into in direct.items()}, into=direct)
    return data.data


_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def _remove_stale(root: Path) -> None:
    """Remove the weight files and index an earlier export left in ``root`` (by their names)."""
    for entry in os.scandir(root):
        if entry.name == INDEX_NAME or _WEIGHTS.fullmatch(entry.name):
            os.unlink(entry.path)


def _write_small(path: Path, data: bytes) -> ExportedFile:
    hasher = Hasher("full")
    hasher.update(data)
    atomic_write(path, lambda out: write_all(out, data), sync_directory=False)
    return ExportedFile(path.name, len(data), hasher.digest().sha256)
